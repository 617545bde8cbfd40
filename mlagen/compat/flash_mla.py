"""FlashMLA's decode API on mlagen kernels, dense and sparse: change one import to switch.

    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from mlagen.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache

    sched_meta, _ = get_mla_metadata()                  # one per configuration
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, sched_meta, causal=True)
    sparse_meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, fp8_rows, None, None, 512, sparse_meta, is_fp8_kvcache=True,
                                      indices=indices, topk_length=topk_length, attn_sink=attn_sink)

Same argument layouts, defaults and results as FlashMLA's functions of these names, on every
GPU mlagen targets (sm_80, sm_89, sm_90, sm_120):

- q [B, S, H_q, 576] bf16/fp16; k_cache [num_blocks, page_block_size, H_kv, 576] in q's dtype
  (or [num_blocks, page_block_size, 576] for one KV head); H_q a multiple of H_kv, query head h
  reading KV head h // (H_q / H_kv); head_dim_v 512. Dense calls take any power-of-two page size.
- FP8 caches (`is_fp8_kvcache=True`): FlashMLA's 656-byte rows (512 e4m3 latent dims, four
  fp32 scales, 64 bf16 rope dims) in a uint8, int8 or float8_e4m3fn tensor, as FlashMLA takes
  them; mlagen reads them as uint8 (`mlagen.quantize_kv(..., "ds_mla")` makes the same bytes).
  They run on mlagen's mma tiles that dequantize each KV tile in shared memory (slower than
  bf16 today; docs/performance.md). FlashMLA's d_qk 512 layout (448 e4m3 and 64 bf16 rope dims
  with e8m0 scales, 584-byte rows) raises NotImplementedError.
- Sparse attention (`indices` [B, S, topk] int32, flat row ids page * page_block_size + offset,
  -1 for an unused slot; `topk_length` [B] int32 or None): query token s of request b attends to
  the rows indices[b, s, :topk_length[b]] lists, with block_table, cache_seqlens and causal
  left None / False. FlashMLA takes it on its FP8 cache only; mlagen takes bf16 and fp16
  caches too. The extra cache (`extra_k_cache`, `extra_indices_in_kvcache`,
  `extra_topk_length`) is attended in the same softmax: mlagen runs each cache's keys and
  merges the two results by their lse.
- Both metadata forms: `get_mla_metadata()` gives a `FlashMLASchedMeta` and None, as FlashMLA
  does; `get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...)` gives
  placeholder tensors of the metadata's types. mlagen schedules each launch itself, so neither
  carries a schedule; a `FlashMLASchedMeta` records the configuration of its first call and
  refuses a call of another (as FlashMLA's does).
- Attention sinks (`attn_sink`, [H_q] fp32): each output row is scaled by
  exp(lse) / (exp(lse) + exp(attn_sink[h])); lse is unchanged. (FlashMLA applies sinks this
  way on its sparse path and refuses them on its dense one; mlagen takes them on both.)
- A row that sees no key: out 0, lse +inf (FlashMLA's convention; mlagen's own is -inf).

For draft-tree masks, which FlashMLA lacks, call `mlagen.verify_attention(..., tree_mask=...)`
directly. One mlagen extension, keyword-only so FlashMLA's positional calls are unchanged:
`flash_mla_with_kvcache(..., max_seqlen_k=n)`, a host bound on `cache_seqlens` that plans a
dense call's kernel for n keys instead of the block table's capacity.

Calls go through the `mlagen::verify_attention` custom op (one call per KV head), with the
sink applied by torch ops: no host syncs, so they trace under torch.compile and run in CUDA
graphs.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from ..dsl.kv_layout import DS_MLA_ROW_BYTES
from ..runtime.inputs import InputError
from ..runtime.ops import verify_attention_op
from ..runtime.sinks import check_attn_sink

# FlashMLA's tile-scheduler metadata rows hold 8 int32 fields each.
_METADATA_FIELDS = 8

# The extra cache of FlashMLA's sparse attention: the op's extra_kv_cache, extra_indices and
# extra_topk_length, which only a sparse call takes.
_EXTRA_ARGUMENTS = ("extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length")

# The dtypes FlashMLA takes an FP8 cache in; mlagen reads the same bytes as uint8.
_FP8_CACHE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)

# FlashMLA's d_qk 512 FP8 row: 448 e4m3 dims, 64 bf16 rope dims, 7 e8m0 scales and a pad byte.
_D512_ROW_BYTES = 448 + 64 * 2 + 7 + 1


def _unsupported(what: str) -> None:
    raise NotImplementedError(f"mlagen.compat.flash_mla: {what} is not supported by mlagen; use FlashMLA for it")


def _fail(name: str, got: object, expected: str) -> None:
    raise InputError(f"{name}: got {got}, expected {expected}")


@dataclasses.dataclass(frozen=True)
class SchedConfig:
    """What a `FlashMLASchedMeta` is bound to by its first call (FlashMLA's field names)."""

    b: int                   # batch size, q.shape[0]
    s_q: int                 # query tokens per request, q.shape[1]
    h_q: int                 # query heads, q.shape[2]
    page_block_size: int     # k_cache.shape[1]
    h_k: int                 # KV heads, k_cache.shape[2]
    causal: bool
    is_fp8_kvcache: bool
    topk: int | None         # slots per query token, indices.shape[-1]; None for dense attention


_CONFIG_NAMES = {"b": "batch size (q.shape[0])", "s_q": "seq_len_q (q.shape[1])", "h_q": "num_heads_q (q.shape[2])",
                 "page_block_size": "page_block_size (k_cache.shape[1])", "h_k": "num_heads_k (k_cache.shape[2])",
                 "causal": "causal", "is_fp8_kvcache": "is_fp8_kvcache", "topk": "topk (indices.shape[-1])"}


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduling-metadata object `get_mla_metadata()` returns, with FlashMLA's fields.

    mlagen plans each launch itself, so `tile_scheduler_metadata` and `num_splits` stay None.
    The first `flash_mla_with_kvcache` call records its configuration in `config` (a
    `SchedConfig`); a later call with another batch size, seq_len_q, num_heads_q,
    page_block_size, num_heads_k, causal, is_fp8_kvcache or topk raises InputError naming what
    changed, as FlashMLA does. Unlike FlashMLA's, the object stays valid when the values of
    cache_seqlens or topk_length change.
    """

    have_initialized: bool = False
    config: SchedConfig | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def _placeholder_metadata(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    num_heads_q: int | None = None,
    is_fp8_kvcache: bool = False,
    topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata tensors of `get_mla_metadata`'s call with arguments (see there)."""
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
        _fail("topk", repr(topk), "None or an int >= 1 (indices.shape[-1] of sparse attention)")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
        _fail("cache_seqlens", getattr(cache_seqlens, "shape", type(cache_seqlens).__name__),
              "a [B] int32 torch.Tensor")
    if not isinstance(num_heads_k, int) or isinstance(num_heads_k, bool) or num_heads_k < 1:
        _fail("num_heads_k", repr(num_heads_k), "an int >= 1")
    if num_heads_q is not None and (not isinstance(num_heads_q, int) or isinstance(num_heads_q, bool)
                                    or num_heads_q < 1 or num_heads_q % num_heads_k):
        _fail("num_heads_q", repr(num_heads_q), f"None or a positive multiple of num_heads_k={num_heads_k}")
    device = cache_seqlens.device
    metadata = torch.zeros(1, _METADATA_FIELDS, dtype=torch.int32, device=device)
    num_splits = torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=device)
    return metadata, num_splits


_PLACEHOLDER_SIGNATURE = inspect.signature(_placeholder_metadata)


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None] | tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduling metadata, in either of its forms; mlagen schedules each launch
    itself, so neither carries a schedule.

    `get_mla_metadata()`: (a fresh `FlashMLASchedMeta`, None). Use one object per
    configuration (batch size, seq_len_q, num_heads_q, page_block_size, num_heads_k, causal,
    is_fp8_kvcache, topk).

    `get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
    is_fp8_kvcache=False, topk=None)`, positional or by keyword:
        cache_seqlens: [B] int32, as passed to `flash_mla_with_kvcache`.
        num_q_tokens_per_head_k: S * H_q / H_kv (unused).
        num_heads_k: KV heads (H_kv), an int >= 1.
        num_heads_q: None or H_q, a multiple of num_heads_k.
        is_fp8_kvcache: accepted (the cache's format shows in `flash_mla_with_kvcache`'s call).
        topk: None, or the slots per query token of sparse attention, an int >= 1 (unused).
    returns (tile_scheduler_metadata [1, 8] int32, num_splits [B+1] int32), zeros on
    cache_seqlens' device. Arguments that fit neither form raise TypeError; bad values,
    mlagen.InputError.

    Neither form carries a length bound: the tensors live on cache_seqlens' device, and reading
    one back in every layer's call would be a host sync, which neither FlashMLA nor mlagen does.
    Pass the bound to `flash_mla_with_kvcache(..., max_seqlen_k=)` instead.
    """
    if not args and not kwargs:
        return FlashMLASchedMeta(), None
    try:
        bound = _PLACEHOLDER_SIGNATURE.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"get_mla_metadata: {e}; expected no arguments, or (cache_seqlens, "
                        "num_q_tokens_per_head_k, num_heads_k, num_heads_q=None, is_fp8_kvcache=False, "
                        "topk=None)") from None
    return _placeholder_metadata(*bound.args, **bound.kwargs)


def _check_metadata(tile_scheduler_metadata: object, num_splits: object, config: SchedConfig) -> None:
    """Either metadata form (or None); a FlashMLASchedMeta is bound to `config` on first use."""
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        first = tile_scheduler_metadata.config
        if first is None:
            tile_scheduler_metadata.config = config
            tile_scheduler_metadata.have_initialized = True
        else:
            # Field by field, not the dataclass's ==: under torch.compile a size may be symbolic.
            changed = [f"{_CONFIG_NAMES[name]} {getattr(first, name)} -> {getattr(config, name)}"
                       for name in _CONFIG_NAMES if getattr(first, name) != getattr(config, name)]
            if changed:
                raise InputError("tile_scheduler_metadata: got a FlashMLASchedMeta first used with another "
                                 "configuration (" + ", ".join(changed) + "), expected one object per "
                                 "configuration: call get_mla_metadata() for each")
    elif tile_scheduler_metadata is not None and not isinstance(tile_scheduler_metadata, torch.Tensor):
        _fail("tile_scheduler_metadata", type(tile_scheduler_metadata).__name__,
              "what mlagen.compat.flash_mla.get_mla_metadata returns (a FlashMLASchedMeta or a tensor), or None")
    _check_num_splits(num_splits, config)


def _check_num_splits(num_splits: object, config: SchedConfig) -> None:
    if num_splits is None:
        return
    if not isinstance(num_splits, torch.Tensor):
        _fail("num_splits", type(num_splits).__name__, "None or get_mla_metadata's num_splits tensor")
    if tuple(num_splits.shape) != (config.b + 1,):
        _fail("num_splits.shape", tuple(num_splits.shape),
              f"[batch_size + 1]=[{config.b + 1}] (get_mla_metadata's for this batch), or None")


def _fp8_rows(q: torch.Tensor, k_cache: torch.Tensor, name: str = "k_cache") -> torch.Tensor:
    """k_cache (the argument `name`) as FlashMLA's FP8 cache of 656-byte rows, viewed as uint8
    (mlagen's ds_mla rows)."""
    if k_cache.dtype in _FP8_CACHE_DTYPES and (q.shape[-1] == 512 or k_cache.shape[-1] == _D512_ROW_BYTES):
        _unsupported(f"FlashMLA's d_qk 512 FP8 layout (q.shape[-1]={q.shape[-1]}, {name} rows of "
                     f"{k_cache.shape[-1]} bytes: 448 e4m3 and 64 bf16 rope dims with e8m0 scales); mlagen takes "
                     f"d_qk 576 with FP8 rows of {DS_MLA_ROW_BYTES} bytes (512 e4m3 latent dims, four fp32 scales, "
                     "64 bf16 rope dims)")
    if k_cache.dtype not in _FP8_CACHE_DTYPES or k_cache.shape[-1] != DS_MLA_ROW_BYTES:
        _fail(name, f"{k_cache.dtype} {tuple(k_cache.shape)}", f"uint8 rows of {DS_MLA_ROW_BYTES} bytes "
              "(FlashMLA's FP8 cache: 512 e4m3 latent dims, four fp32 scales, 64 bf16 rope dims; int8 or "
              "float8_e4m3fn bytes too) with is_fp8_kvcache=True")
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def _check_sparse_call(indices: object, block_table: object, cache_seqlens: object, causal: bool,
                       max_seqlen_k: int | None) -> None:
    """A call with indices: none of the dense call's key arguments; raises InputError naming one."""
    if not isinstance(indices, torch.Tensor):
        _fail("indices", type(indices).__name__, "an int32 torch.Tensor [B, S, topk] or None")
    for name, value in (("block_table", block_table), ("cache_seqlens", cache_seqlens),
                        ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            _fail(name, type(value).__name__, "None with indices (sparse attention reads the rows indices lists)")
    if causal:
        _fail("causal", causal, "False with indices (sparse attention has no mask)")


def _kv_heads(cache: torch.Tensor) -> int:
    """A cache's KV heads: dim 2 of [blocks, page, H_kv, D], 1 for [blocks, page, D]."""
    return cache.shape[2] if cache.dim() == 4 else 1


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta | torch.Tensor | None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    max_seqlen_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's decode attention, dense or sparse, computed by mlagen.

    Args:
        q: [B, S, H_q, 576] bf16/fp16 (S query tokens per request; in a dense call the last S
            keys of each request are theirs), last dim contiguous.
        k_cache: [num_blocks, page_block_size, H_kv, 576] in q's dtype (or FP8 rows with
            is_fp8_kvcache), or [num_blocks, page_block_size, 576] for one KV head; last dim
            contiguous. H_q must be a multiple of H_kv: query head h reads KV head
            h // (H_q / H_kv). With H_kv > 1, each KV head runs as one call on its group of
            H_q / H_kv query heads (strided views of q and k_cache, no copies), and the groups'
            results are joined into one out and lse.
        block_table: dense: [B, max_blocks] int32; entries past a request's pages are never
            read. Sparse: None.
        cache_seqlens: dense: [B] int32, keys per request including the S query tokens.
            Sparse: None.
        head_dim_v: value width, 512.
        tile_scheduler_metadata: from `get_mla_metadata`: a `FlashMLASchedMeta` (checked
            against the configuration of its first call) or its placeholder tensor; None is
            accepted too.
        num_splits: None, or the placeholder tensor of `get_mla_metadata`'s call with
            arguments ([B+1]).
        softmax_scale: default q.shape[-1] ** -0.5, as FlashMLA. A bool is refused (it is
            `causal` passed one position early).
        causal: FlashMLA's default False (every valid key visible); True (dense only): query i
            sees the prefix and query tokens 0..i.
        is_fp8_kvcache: True: k_cache holds FlashMLA's FP8 rows of 656 bytes (512 e4m3 latent
            dims, four fp32 scales, 64 bf16 rope dims) as uint8, int8 or float8_e4m3fn, read as
            uint8 (`mlagen.quantize_kv(..., "ds_mla")` makes them). FlashMLA's d_qk 512 rows
            (q.shape[-1] 512 or 584-byte rows) raise NotImplementedError.
        indices: None (dense), or sparse attention's [B, S, topk] int32 on q's device, last dim
            contiguous: flat row ids page * page_block_size + offset of k_cache's rows, -1 for an
            unused slot. Query token s of request b attends to rows indices[b, s, :topk_length[b]]
            that are not -1; a row listed twice counts twice. Needs block_table, cache_seqlens
            and max_seqlen_k None and causal False.
        attn_sink: None or [H_q] fp32 on q's device: each output row (b, i, h) is scaled by
            exp(lse) / (exp(lse) + exp(attn_sink[h])) (`mlagen.runtime.sinks`); +inf gives 0,
            -inf changes nothing; lse is returned unscaled.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: with indices, FlashMLA's extra
            cache of sparse attention: a second cache in k_cache's format (its own page size),
            whose rows extra_indices_in_kvcache [B, S, extra_topk] lists, attended in the same
            softmax (mlagen runs the two caches' keys as two launches and merges them by lse).
            Without indices they must be None.
        topk_length: with indices, None (every slot used) or [B] int32 contiguous: slots at or
            past topk_length[b] are unused. Without indices it must be None.
        max_seqlen_k: mlagen's extension, keyword-only, for dense calls: optional host int, a
            bound on cache_seqlens (engines keep one per step; FlashMLA has no such argument).
            The kernel, its split and its table entry are then chosen for that many keys
            (rounded up: at most 19% more, at least 64) instead of for the block table's
            capacity, block_table.shape[1] * page_block_size, which engines size for the
            longest context. A request longer than the bound still runs correctly, on a plan
            made for fewer keys. Not an int >= 0: mlagen.InputError, before anything is launched.

    Returns:
        (out [B, S, H_q, head_dim_v] in q's dtype, lse [B, H_q, S] fp32, natural log).
        FlashMLA's convention for a row that sees no key: out 0, lse +inf.

    Bad arguments raise mlagen.InputError naming the argument, before anything is launched.
    """
    if not isinstance(q, torch.Tensor):
        _fail("q", type(q).__name__, "a torch.Tensor")
    if not isinstance(k_cache, torch.Tensor):
        _fail("k_cache", type(k_cache).__name__, "a torch.Tensor")
    if q.dim() != 4:
        _fail("q.shape", tuple(q.shape), "[B, S, H_q, 576] (4 dims)")
    if is_fp8_kvcache:
        k_cache = _fp8_rows(q, k_cache)
    elif k_cache.dtype in _FP8_CACHE_DTYPES and k_cache.shape[-1] in (DS_MLA_ROW_BYTES, _D512_ROW_BYTES):
        _fail("is_fp8_kvcache", False, f"True for a {k_cache.dtype} k_cache of FlashMLA's FP8 rows "
              f"({k_cache.shape[-1]} bytes)")
    elif k_cache.dtype not in (torch.bfloat16, torch.float16):
        _unsupported(f"a {k_cache.dtype} KV cache (FlashMLA's FP8 cache is rows of {DS_MLA_ROW_BYTES} bytes "
                     "with is_fp8_kvcache=True; a flat e4m3 cache with a kv_scale runs through "
                     "mlagen.verify_attention)")
    sparse = indices is not None
    for name, value in zip(_EXTRA_ARGUMENTS, (extra_k_cache, extra_indices_in_kvcache, extra_topk_length),
                           strict=True):
        if value is not None and not sparse:
            _fail(name, type(value).__name__, "None without indices (the extra cache adds sparse attention's keys)")
    if is_fp8_kvcache and isinstance(extra_k_cache, torch.Tensor):
        extra_k_cache = _fp8_rows(q, extra_k_cache, "extra_k_cache")
    if sparse:
        _check_sparse_call(indices, block_table, cache_seqlens, causal, max_seqlen_k)
    elif topk_length is not None:
        _fail("topk_length", type(topk_length).__name__, "None without indices (it limits sparse attention's slots)")
    if k_cache.dim() not in (3, 4):
        _fail("k_cache.shape", tuple(k_cache.shape),
              "[num_blocks, page_block_size, H_kv, 576] (or 3 dims for one KV head)")
    heads_q = q.shape[2]
    heads_k = _kv_heads(k_cache)
    if heads_k < 1 or heads_q % heads_k:
        _fail("q.shape[2]", heads_q, f"a multiple of k_cache.shape[2]={heads_k} (query heads per KV head)")
    if isinstance(extra_k_cache, torch.Tensor) and _kv_heads(extra_k_cache) != heads_k:
        _fail("extra_k_cache.shape", tuple(extra_k_cache.shape), f"k_cache's {heads_k} KV head(s) at dim 2 "
              "(both caches' keys serve the same query heads)")
    if isinstance(softmax_scale, bool):
        _fail("softmax_scale", softmax_scale, "a float or None (a bool here is causal passed one position early)")
    if attn_sink is not None:
        check_attn_sink(attn_sink, heads_q, q.device)
    _check_metadata(tile_scheduler_metadata, num_splits,
                    SchedConfig(int(q.shape[0]), int(q.shape[1]), int(heads_q), int(k_cache.shape[1]), int(heads_k),
                                bool(causal), bool(is_fp8_kvcache), int(indices.shape[-1]) if sparse else None))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kwargs = dict(softmax_scale=scale, causal=causal, return_lse=True, head_dim_v=head_dim_v)
    if sparse:
        kwargs.update(indices=indices, topk_length=topk_length, extra_indices=extra_indices_in_kvcache,
                      extra_topk_length=extra_topk_length)
    else:
        kwargs.update(max_seqlen_k=max_seqlen_k)
    if extra_k_cache is not None:
        kwargs.update(extra_kv_cache=extra_k_cache)
    if heads_k == 1:
        out, lse = verify_attention_op(q, k_cache, block_table, cache_seqlens, attn_sink=attn_sink, **kwargs)
    else:
        group = heads_q // heads_k
        parts = [verify_attention_op(q[:, :, g * group:(g + 1) * group], k_cache[:, :, g], block_table,
                                     cache_seqlens, attn_sink=attn_sink[g * group:(g + 1) * group]
                                     if attn_sink is not None else None,
                                     **kwargs | ({"extra_kv_cache": extra_k_cache[:, :, g]}
                                                 if isinstance(extra_k_cache, torch.Tensor) else {}))
                 for g in range(heads_k)]
        out = torch.cat([o for o, _ in parts], dim=2)
        lse = torch.cat([s for _, s in parts], dim=1)
    # mlagen marks an empty row with lse = -inf; FlashMLA with +inf.
    return out, lse.masked_fill(lse == -math.inf, math.inf)
