"""FlashMLA's dense-decode API on mlagen kernels: change one import to switch.

    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from mlagen.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache

    sched_meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, sched_meta, causal=True)

Same argument layouts, defaults and results as FlashMLA's functions of these names, on every
GPU mlagen targets (sm_80, sm_89, sm_90, sm_120):

- q [B, S, H_q, 576] bf16/fp16; k_cache [num_blocks, page_block_size, H_kv, 576] in q's dtype
  (or [num_blocks, page_block_size, 576] for one KV head) with any power-of-two page size;
  H_q a multiple of H_kv, query head h reading KV head h // (H_q / H_kv); head_dim_v 512.
- Both metadata forms: `get_mla_metadata()` gives a `FlashMLASchedMeta` and None, as FlashMLA
  does; `get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, ...)` gives
  placeholder tensors of the metadata's types. mlagen schedules each launch itself, so neither
  carries a schedule; a `FlashMLASchedMeta` records the configuration of its first call and
  refuses a call of another (as FlashMLA's does).
- Attention sinks (`attn_sink`, [H_q] fp32): each output row is scaled by
  exp(lse) / (exp(lse) + exp(attn_sink[h])); lse is unchanged. (FlashMLA applies sinks this
  way on its sparse path and refuses them on its dense one.)

- FP8 caches (`is_fp8_kvcache=True`): FlashMLA's 656-byte uint8 rows, run on mlagen's mma
  tiles that dequantize each KV tile in shared memory (slower than bf16 today; docs/performance.md).

Sparse attention (`indices`, `extra_k_cache`, `extra_indices_in_kvcache`, `topk_length`,
`extra_topk_length`, `topk`) raises NotImplementedError. For draft-tree
masks, which FlashMLA lacks, call `mlagen.verify_attention(..., tree_mask=...)` directly. One
mlagen extension, keyword-only so FlashMLA's positional calls are unchanged:
`flash_mla_with_kvcache(..., max_seqlen_k=n)`, a host bound on `cache_seqlens` that plans the
kernel for n keys instead of the block table's capacity.

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

# The sparse-attention arguments of flash_mla_with_kvcache, none of which mlagen supports.
_SPARSE_ARGUMENTS = ("indices", "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length")


def _unsupported(what: str) -> None:
    raise NotImplementedError(f"mlagen.compat.flash_mla: {what} is not supported by mlagen "
                              "(dense KV in bf16, fp16 or FlashMLA's FP8 rows only); use FlashMLA for it")


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


_CONFIG_NAMES = {"b": "batch size (q.shape[0])", "s_q": "seq_len_q (q.shape[1])", "h_q": "num_heads_q (q.shape[2])",
                 "page_block_size": "page_block_size (k_cache.shape[1])", "h_k": "num_heads_k (k_cache.shape[2])",
                 "causal": "causal"}


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduling-metadata object `get_mla_metadata()` returns, with FlashMLA's fields.

    mlagen plans each launch itself, so `tile_scheduler_metadata` and `num_splits` stay None.
    The first `flash_mla_with_kvcache` call records its configuration in `config` (a
    `SchedConfig`); a later call with another batch size, seq_len_q, num_heads_q,
    page_block_size, num_heads_k or causal raises InputError naming what changed, as FlashMLA
    does. Unlike FlashMLA's, the object stays valid when cache_seqlens' values change.
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
    if topk is not None:
        _unsupported(f"sparse attention (topk={topk})")
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
    configuration (batch size, seq_len_q, num_heads_q, page_block_size, num_heads_k, causal).

    `get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
    is_fp8_kvcache=False, topk=None)`, positional or by keyword:
        cache_seqlens: [B] int32, as passed to `flash_mla_with_kvcache`.
        num_q_tokens_per_head_k: S * H_q / H_kv (unused).
        num_heads_k: KV heads (H_kv), an int >= 1.
        num_heads_q: None or H_q, a multiple of num_heads_k.
        is_fp8_kvcache: accepted (the cache's format shows in `flash_mla_with_kvcache`'s call).
        topk: sparse attention raises NotImplementedError.
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


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
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
    """FlashMLA's dense decode attention, computed by mlagen.

    Args:
        q: [B, S, H_q, 576] bf16/fp16 (S query tokens per request; the last S keys of each
            request are theirs), last dim contiguous.
        k_cache: [num_blocks, page_block_size, H_kv, 576] in q's dtype (or uint8 [..., 656] with
            is_fp8_kvcache), or [num_blocks, page_block_size, 576] for one KV head; last dim
            contiguous. H_q must be a multiple
            of H_kv: query head h reads KV head h // (H_q / H_kv). With H_kv > 1, each KV head
            runs as one call on its group of H_q / H_kv query heads (strided views of q and
            k_cache, no copies), and the groups' results are joined into one out and lse.
        block_table: [B, max_blocks] int32. Entries past a request's pages are never read.
        cache_seqlens: [B] int32, keys per request including the S query tokens.
        head_dim_v: value width, 512.
        tile_scheduler_metadata: from `get_mla_metadata`: a `FlashMLASchedMeta` (checked
            against the configuration of its first call) or its placeholder tensor; None is
            accepted too.
        num_splits: None, or the placeholder tensor of `get_mla_metadata`'s call with
            arguments ([B+1]).
        softmax_scale: default q.shape[-1] ** -0.5, as FlashMLA. A bool is refused (it is
            `causal` passed one position early).
        causal: FlashMLA's default False (every valid key visible); True: query i sees the
            prefix and query tokens 0..i.
        is_fp8_kvcache: True: k_cache holds FlashMLA's FP8 rows, uint8 [..., 656] (512 e4m3
            latent dims, four fp32 scales, 64 bf16 rope dims; `mlagen.quantize_kv(..., "ds_mla")`
            makes them), run on mlagen's mma tiles, which dequantize each KV tile in shared memory.
        attn_sink: None or [H_q] fp32 on q's device: each output row (b, i, h) is scaled by
            exp(lse) / (exp(lse) + exp(attn_sink[h])) (`mlagen.runtime.sinks`); +inf gives 0,
            -inf changes nothing; lse is returned unscaled.
        indices, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length:
            FlashMLA's sparse attention; any of them not None raises NotImplementedError.
        max_seqlen_k: mlagen's extension, keyword-only: optional host int, a bound on
            cache_seqlens (engines keep one per step; FlashMLA has no such argument). The
            kernel, its split and its table entry are then chosen for that many keys (rounded
            up: at most 19% more, at least 64) instead of for the block table's capacity,
            block_table.shape[1] * page_block_size, which engines size for the longest context.
            A request longer than the bound still runs correctly, on a plan made for fewer
            keys. Not an int >= 0: mlagen.InputError, before anything is launched.

    Returns:
        (out [B, S, H_q, head_dim_v] in q's dtype, lse [B, H_q, S] fp32, natural log).
        FlashMLA's convention for a row that sees no key: out 0, lse +inf.

    Bad arguments raise mlagen.InputError naming the argument, before anything is launched.
    """
    if not isinstance(q, torch.Tensor):
        _fail("q", type(q).__name__, "a torch.Tensor")
    if not isinstance(k_cache, torch.Tensor):
        _fail("k_cache", type(k_cache).__name__, "a torch.Tensor")
    if is_fp8_kvcache:
        if k_cache.dtype != torch.uint8 or k_cache.shape[-1] != DS_MLA_ROW_BYTES:
            _fail("k_cache", f"{k_cache.dtype} {tuple(k_cache.shape)}", f"uint8 rows of {DS_MLA_ROW_BYTES} bytes "
                  "(FlashMLA's FP8 cache: 512 e4m3 latent dims, four fp32 scales, 64 bf16 rope dims) "
                  "with is_fp8_kvcache=True")
    elif k_cache.dtype == torch.uint8:
        _fail("is_fp8_kvcache", False, f"True for a uint8 k_cache ({DS_MLA_ROW_BYTES}-byte FP8 rows)")
    elif k_cache.dtype not in (torch.bfloat16, torch.float16):
        _unsupported(f"a {k_cache.dtype} KV cache (FlashMLA's FP8 cache is uint8 rows of {DS_MLA_ROW_BYTES} bytes "
                     "with is_fp8_kvcache=True; a flat e4m3 cache with a kv_scale runs through "
                     "mlagen.verify_attention)")
    for name, value in zip(_SPARSE_ARGUMENTS, (indices, extra_k_cache, extra_indices_in_kvcache, topk_length,
                                               extra_topk_length), strict=True):
        if value is not None:
            _unsupported(f"sparse attention ({name})")
    if q.dim() != 4:
        _fail("q.shape", tuple(q.shape), "[B, S, H_q, 576] (4 dims)")
    if k_cache.dim() not in (3, 4):
        _fail("k_cache.shape", tuple(k_cache.shape),
              "[num_blocks, page_block_size, H_kv, 576] (or 3 dims for one KV head)")
    heads_q = q.shape[2]
    heads_k = k_cache.shape[2] if k_cache.dim() == 4 else 1
    if heads_k < 1 or heads_q % heads_k:
        _fail("q.shape[2]", heads_q, f"a multiple of k_cache.shape[2]={heads_k} (query heads per KV head)")
    if isinstance(softmax_scale, bool):
        _fail("softmax_scale", softmax_scale, "a float or None (a bool here is causal passed one position early)")
    if attn_sink is not None:
        check_attn_sink(attn_sink, heads_q, q.device)
    _check_metadata(tile_scheduler_metadata, num_splits,
                    SchedConfig(int(q.shape[0]), int(q.shape[1]), int(heads_q), int(k_cache.shape[1]), int(heads_k),
                                bool(causal)))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    kwargs = dict(softmax_scale=scale, causal=causal, return_lse=True, head_dim_v=head_dim_v,
                  max_seqlen_k=max_seqlen_k)
    if heads_k == 1:
        out, lse = verify_attention_op(q, k_cache, block_table, cache_seqlens, attn_sink=attn_sink, **kwargs)
    else:
        group = heads_q // heads_k
        parts = [verify_attention_op(q[:, :, g * group:(g + 1) * group], k_cache[:, :, g], block_table,
                                     cache_seqlens, attn_sink=attn_sink[g * group:(g + 1) * group]
                                     if attn_sink is not None else None, **kwargs) for g in range(heads_k)]
        out = torch.cat([o for o, _ in parts], dim=2)
        lse = torch.cat([s for _, s in parts], dim=1)
    # mlagen marks an empty row with lse = -inf; FlashMLA with +inf.
    return out, lse.masked_fill(lse == -math.inf, math.inf)
