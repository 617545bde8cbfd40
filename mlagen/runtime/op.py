"""The torch-facing op: `verify_attention`.

Flow per call: check the arguments (metadata only) -> build the Problem -> pick the variant
(given, or dispatched for the shape on this GPU) -> load it (compiled once, cached on disk)
-> allocate outputs from torch's allocator and, with more than one split, take the stream's
workspace (`mlagen.runtime.workspace`) -> launch one kernel on torch's current stream. Nothing
synchronizes the host, so the op can be captured in a CUDA graph.

A serving loop repeats the same argument metadata call after call, so everything that the
metadata decides (checks, Problem, variant, kernels, grids, the parameter block's strides and
sizes) is computed once per argument signature (`mlagen.runtime.inputs.signature` plus the op's
flags) and remembered; a repeat call builds the signature, does one dict lookup, checks the
data pointers' alignment and launches.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import torch
from typing_extensions import Unpack, overload

from ..dispatch.policy import (
    BALANCED_LIST_POSITIONS,
    INVARIANT_SPLIT_KEYS_LOG2,
    DispatchPolicy,
    balanced_list_fits,
    batch_invariant_variant,
    choose_variant,
    covers,
    dependent_in_graphs,
    num_splits,
    policy_for,
)
from ..dsl.arch import arch_for_capability, runs_on
from ..dsl.spec import Dtype, Keys, KVFormatName, MaskKind, Problem, QFormatName, Variant
from ..plan.params import pointers, tail
from . import inputs, merge, sinks, tensormap, workspace
from .kv_formats import check_scale
from .launch import KernelLaunch, Loaded, kernel_launch, launch, load

LOG2E = 1.4426950408889634


@functools.cache
def device_info(index: int) -> tuple[str, int]:
    """(compile target, SM count) of CUDA device `index`."""
    props = torch.cuda.get_device_properties(index)
    return arch_for_capability(props.major, props.minor), props.multi_processor_count


@functools.cache
def device_name(index: int) -> str:
    """The name of CUDA device `index` (what tuned tables are keyed by)."""
    return torch.cuda.get_device_properties(index).name


def device_policy(index: int) -> DispatchPolicy:
    """The dispatch policy of CUDA device `index` (`policy.policy_for`): its SM count and the
    shared memory a block may opt into."""
    arch, sm_count = device_info(index)
    smem = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    return policy_for(arch, sm_count, smem or None)


@dataclass(frozen=True)
class _Prepared:
    """Everything about a call that its shape decides, computed once per shape."""

    loaded: Loaded
    kernel: KernelLaunch
    splits: int
    layout: workspace.Layout | None               # the split's workspace; None without one
    merge_blocks: int                             # per row group when split, else 0
    tma_rows: int = 0                             # rows of the kernel's TMA boxes (tma variants), else 0
    split_keys_log2: int = 0                      # batch-invariant mode's split size, else 0


def pick_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, table_capacity: int, arch: str,
                 gpu: str, variant: Variant | None, *, policy: DispatchPolicy, ragged_rows: bool = False) -> Variant:
    """The variant a call runs on a `gpu` of `arch` whose dispatch figures `policy` holds
    (`device_policy`): `variant` when given, checked against the device's `arch` and the block
    table, else the dispatcher's choice (`policy.choose_variant`) for requests of up to
    kv_capacity keys under a block table that addresses table_capacity. A given variant that
    cannot run every key the table addresses (a P exchange whose cluster holds fewer tiles) or
    whose balanced work list could not count the table's tiles over the batch
    (`policy.balanced_list_fits`, past ~2^37 keys) is refused. ragged_rows: the call says which
    rows are real (q_counts), for the dispatcher's choice."""
    if variant is None:
        return choose_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu, policy=policy,
                              table_capacity=table_capacity, ragged_rows=ragged_rows)
    if not runs_on(variant.arch, arch):
        raise inputs.InputError(f"variant.arch: got {variant.arch!r}, expected a target that runs "
                                f"on this {arch} device (e.g. {arch!r})")
    if not covers(variant, table_capacity):
        raise inputs.InputError(f"variant: got {variant.name!r}, a P exchange over {variant.kv_split} tiles of "
                                f"{variant.block_n} keys, expected a block_table that addresses at most "
                                f"{int(variant.kv_split) * variant.block_n} keys (it addresses {table_capacity})")
    if variant.kv_split == "balanced" and not balanced_list_fits(variant, batch, table_capacity):
        raise inputs.InputError(f"variant: got {variant.name!r}, a balanced split, whose work list counts at most "
                                f"{BALANCED_LIST_POSITIONS} KV tiles of {variant.block_n} keys over the batch; "
                                f"the block table addresses {table_capacity} keys for each of {batch} requests "
                                f"(expected a fixed or adaptive split, e.g. "
                                f"{variant.with_(kv_split='adaptive').name!r})")
    return variant


@functools.lru_cache(maxsize=4096)
def _prepare(heads: int, dl: int, dr: int, dtype: Dtype, page_size: int, mask: MaskKind, lse: bool,
             batch: int, seqlen_q: int, kv_capacity: int, table_capacity: int, device: int,
             variant: Variant | None, invariant: bool = False, kv_format: KVFormatName = "dtype",
             q_format: QFormatName = "dtype", ragged: bool = False, keys: Keys = "paged") -> _Prepared:
    """Problem, variant (given, batch-invariant, or dispatched), loaded kernels, split and grids
    of a shape, planned for requests of up to kv_capacity keys (of the table_capacity the block
    table addresses): memoized on plain values, since a serving step repeats the same shapes and
    each piece costs host time. ragged: the call passes q_counts (the dispatcher's balanced split
    then runs ragged rows). keys: "gathered" for calls with indices, whose kv_capacity and
    table_capacity are the slots a query token lists (topk)."""
    problem = Problem(heads=heads, dl=dl, dr=dr, dtype=dtype, page_size=page_size, mask=mask, lse=lse,
                      kv_format=kv_format, q_format=q_format, keys=keys)
    device_arch = device_info(device)[0]
    dispatch = device_policy(device)
    invariant = invariant and variant is None           # a named variant runs as given
    if invariant:
        variant = batch_invariant_variant(problem, seqlen_q, device_arch, dispatch)
    variant = pick_variant(problem, seqlen_q, batch, kv_capacity, table_capacity, device_arch, device_name(device),
                           variant, policy=dispatch, ragged_rows=ragged)
    loaded = load(problem, variant, device)
    splits = num_splits(variant, heads, batch, seqlen_q, kv_capacity, dispatch, loaded.blocks_per_sm)
    plan = loaded.plan
    split = plan.split.split_launch(splits)
    layout = workspace.Layout.of(plan.split.partial_rows(batch, seqlen_q, splits), dl * plan.split.part_elem_bytes,
                                 plan.split.row_groups(batch, seqlen_q)) if split else None
    in_graphs = dependent_in_graphs(variant, heads, seqlen_q, batch, kv_capacity, dispatch)
    return _Prepared(loaded=loaded, kernel=kernel_launch(loaded, plan.grid(batch, seqlen_q, splits), in_graphs),
                     splits=splits, layout=layout,
                     merge_blocks=plan.split.merge_blocks(batch, seqlen_q) if split else 0,
                     tma_rows=variant.block_n if variant.loads == "tma" else 0,
                     split_keys_log2=INVARIANT_SPLIT_KEYS_LOG2 if invariant and split else 0)


@dataclass(frozen=True, slots=True)
class _Call:
    """Everything about a call that its argument signature decides: checked and computed once."""

    shapes: inputs.Shapes
    kernel: KernelLaunch
    device: int
    torch_device: torch.device
    dtype: torch.dtype
    out_size: tuple[int, int, int, int]     # [B, S, H, Dl]
    lse_size: tuple[int, int, int]          # [B, H, S]
    layout: workspace.Layout | None         # None: one split, no workspace
    tma_rows: int                           # rows of a TMA box (tma variants: block_n), else 0
    tma_kind: str                           # the TMA descriptor's elements: the cache's dtype, or "e4m3"
    tail: tuple[int | float, ...]           # the parameter block after its pointers


# Signature -> _Call. Bounded: a serving loop has a handful of signatures per batch-size bucket;
# past the bound the dict starts over (rare, and cheaper than tracking recency on every call).
_calls: dict[tuple, _Call] = {}
_MAX_CALLS = 1024

# MLAGEN_BATCH_INVARIANT=1: every call that names no variant runs in batch-invariant mode.
BATCH_INVARIANT_DEFAULT: bool = os.environ.get("MLAGEN_BATCH_INVARIANT", "") not in ("", "0")


def _scale_key(scale: object) -> object:
    """A kv_scale's or q_scale's part of a call's key: a float's value (it goes into the
    parameter block), or a tensor's metadata (its pointer goes in at each launch)."""
    if isinstance(scale, torch.Tensor):
        return (type(scale), scale.shape, scale.dtype, scale.device)
    return scale


def _host_scale(scale: object) -> float:
    """A scale given as a host number, for the parameter block; 1 for a tensor (read on the
    device) or None."""
    return float(scale) if isinstance(scale, (int, float)) else 1.0


def _check_scale_arg(name: str, scale: object, taken: bool, refusal: str, device: torch.device,
                     check_values: bool) -> None:
    """`scale` (kv_scale or q_scale) checked where its input is e4m3 (`taken`), else it must be
    None: `refusal` says why. Raises InputError naming `name`."""
    if taken:
        check_scale(name, scale, device, check_values=check_values)
    elif scale is not None:
        raise inputs.InputError(f"{name}: got {type(scale).__name__}, expected None {refusal}")


def _lookup(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
            cache_seqlens: torch.Tensor | None,
            tree_mask: torch.Tensor | None, out: torch.Tensor | None, head_dim_v: int, softmax_scale: float | None,
            causal: bool, return_lse: bool, variant: Variant | None, bound: int | None, invariant: bool,
            kv_scale: float | torch.Tensor | None = None, q_scale: float | torch.Tensor | None = None,
            q_counts: torch.Tensor | None = None, indices: torch.Tensor | None = None,
            topk_length: torch.Tensor | None = None) -> tuple[tuple | None, _Call | None]:
    """(key, remembered _Call or None) for these arguments; the key is None for arguments that
    are not tensors or not hashable (the full checks name those). With gathered keys, indices
    and topk_length (or indices again without one) stand in the signature where block_table
    and cache_seqlens stand for paged keys, the key saying which."""
    try:
        if indices is not None:
            block_table, cache_seqlens = indices, topk_length if topk_length is not None else indices
        # (a None block_table or cache_seqlens raises AttributeError there: no key)
        key = (inputs.signature(q, kv_cache, block_table, cache_seqlens,  # type: ignore[arg-type]
                                tree_mask, out, head_dim_v, softmax_scale),
               causal, return_lse, variant, bound, invariant, _scale_key(kv_scale), _scale_key(q_scale),
               None if q_counts is None else (type(q_counts), q_counts.shape, q_counts.stride(), q_counts.dtype,
                                              q_counts.device),
               None if indices is None else topk_length is None)
        return key, _calls.get(key)           # (the get hashes the key: TypeError if it cannot be)
    except (AttributeError, TypeError, RuntimeError):
        return None, None


def _check_key_values(shapes: inputs.Shapes, block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None,
                      indices: torch.Tensor | None, topk_length: torch.Tensor | None) -> None:
    """The device reads of `check_values`: paged keys' lengths and page ids, or the row ids and
    lengths of gathered keys."""
    if indices is not None:
        inputs.check_sparse_values(shapes, indices, topk_length)
    else:
        assert block_table is not None and cache_seqlens is not None   # checked tensors
        inputs.check_values(shapes, block_table, cache_seqlens)


def _check_gathered_call(block_table: object, cache_seqlens: object, causal: bool, tree_mask: object,
                         q_counts: object, max_seqlen_k: object) -> None:
    """A call with indices takes none of the paged keys' arguments; raises InputError naming one."""
    for name, value, why in (
            ("block_table", block_table, "the keys are the rows indices lists"),
            ("cache_seqlens", cache_seqlens, "topk_length says how many slots each request uses"),
            ("tree_mask", tree_mask, "each query token attends to the rows it lists"),
            ("q_counts", q_counts, "every query token lists its own keys"),
            ("max_seqlen_k", max_seqlen_k, "the keys a row may see are its topk slots")):
        if value is not None:
            raise inputs.InputError(f"{name}: got {type(value).__name__}, expected None with indices ({why})")
    if causal:
        raise inputs.InputError("causal: got True (the default), expected causal=False with indices (each query "
                                "token attends to the rows it lists: the indexer chose them)")


def _with_extra_keys(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                     cache_seqlens: torch.Tensor | None, indices: torch.Tensor | None,
                     topk_length: torch.Tensor | None, extra_kv_cache: object, extra_indices: object,
                     extra_topk_length: torch.Tensor | None, *, return_lse: bool, out: torch.Tensor | None,
                     **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys of two caches in one softmax (`verify_attention`'s extra cache, its sinks
    applied by the caller): each cache's keys through the kernels with their lse, the first into
    `out` (checked there, before any launch), then the second merged into it
    (`merge.merge_states_`). Raises InputError for an extra cache without indices or without its
    own indices, or in another format than kv_cache's."""
    if indices is None:
        name, given = next((n, v) for n, v in (("extra_kv_cache", extra_kv_cache), ("extra_indices", extra_indices),
                                               ("extra_topk_length", extra_topk_length)) if v is not None)
        raise inputs.InputError(f"{name}: got a {type(given).__name__}, expected None without indices (an extra "
                                "cache adds gathered keys to those indices lists)")
    if not isinstance(extra_kv_cache, torch.Tensor) or not isinstance(extra_indices, torch.Tensor):
        raise inputs.InputError(f"extra_kv_cache, extra_indices: got {type(extra_kv_cache).__name__} and "
                                f"{type(extra_indices).__name__}, expected two tensors (an extra cache comes with "
                                "its indices)")
    if isinstance(kv_cache, torch.Tensor) and extra_kv_cache.dtype != kv_cache.dtype:
        raise inputs.InputError(f"extra_kv_cache.dtype: got {extra_kv_cache.dtype}, expected kv_cache's "
                                f"{kv_cache.dtype} (the extra cache holds rows of the same format)")
    parts = [verify_attention(q, cache, block_table, cache_seqlens, indices=listed, topk_length=length,
                              return_lse=True, out=into, **kwargs)
             for cache, listed, length, into in ((kv_cache, indices, topk_length, out),
                                                 (extra_kv_cache, extra_indices, extra_topk_length, None))]
    merged, lse = merge.merge_states_(*parts[0], *parts[1])
    return (merged, lse) if return_lse else merged


def _require_cuda(q: object) -> None:
    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise inputs.InputError(f"q.device: got {getattr(q, 'device', type(q).__name__)}, "
                                "expected a CUDA tensor")


def _checked_call(key: tuple | None, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                  cache_seqlens: torch.Tensor | None, tree_mask: torch.Tensor | None, out: torch.Tensor | None,
                  head_dim_v: int, softmax_scale: float | None, causal: bool, return_lse: bool,
                  variant: Variant | None, check_values: bool | None, bound: int | None, invariant: bool = False,
                  kv_scale: float | torch.Tensor | None = None, q_scale: float | torch.Tensor | None = None,
                  q_counts: torch.Tensor | None = None, indices: torch.Tensor | None = None,
                  topk_length: torch.Tensor | None = None) -> _Call:
    """Every check, in the op's order (each names the bad argument), then the _Call, which is
    remembered under `key` (from `_lookup`). bound: `inputs.key_bound(max_seqlen_k)`. With
    indices the keys are gathered: block_table, cache_seqlens, tree_mask, q_counts and bound
    are None (the caller checked)."""
    _require_cuda(q)
    if indices is not None:
        shapes = inputs.check_sparse_inputs(q, kv_cache, indices, topk_length, head_dim_v, softmax_scale)
    else:
        shapes = inputs.check_inputs(q, kv_cache, block_table, cache_seqlens, tree_mask, head_dim_v, softmax_scale)
    values = inputs.values_requested(check_values)
    _check_scale_arg("kv_scale", kv_scale, shapes.kv_format == "e4m3",
                     f"(only an e4m3 cache takes one; this cache is {shapes.kv_format}, whose rows hold their own "
                     "scales)" if shapes.kv_format == "ds_mla" else f"for a {shapes.dtype} cache", q.device, values)
    _check_scale_arg("q_scale", q_scale, shapes.q_format == "e4m3",
                     f"for {q.dtype} queries (only float8_e4m3fn queries take one)", q.device, values)
    if q_counts is not None:
        inputs.check_q_counts(q_counts, shapes.batch, shapes.seqlen_q, q.device, values)
    if values:
        _check_key_values(shapes, block_table, cache_seqlens, indices, topk_length)
    B, S, H, dl = shapes.batch, shapes.seqlen_q, shapes.heads, shapes.dl
    mask: MaskKind = "tree" if tree_mask is not None else ("causal" if causal else "none")
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    # Keys a query row may see: what the block table addresses, or the slots it lists.
    capacity = shapes.topk if indices is not None else shapes.max_pages * shapes.page_size
    prep = _prepare(H, dl, shapes.head_dim - dl, shapes.dtype, shapes.page_size, mask,
                    return_lse, B, S, capacity if bound is None else min(capacity, bound), capacity, device, variant,
                    invariant, shapes.kv_format, shapes.q_format, q_counts is not None,
                    "gathered" if indices is not None else "paged")
    if out is not None:
        inputs.check_out(out, q, shapes)
    out_size = (B, S, H, dl)
    # An allocated out is contiguous: torch's strides for that size, from a meta tensor.
    out_strides = (out if out is not None else torch.empty(out_size, device="meta")).stride()
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shapes.head_dim)
    q_strides = q.stride()
    call = _Call(
        shapes=shapes, kernel=prep.kernel, device=device, torch_device=q.device,
        dtype=inputs.TORCH_DTYPES[shapes.dtype],
        out_size=out_size, lse_size=(B, H, S),
        layout=prep.layout,
        tma_rows=prep.tma_rows,
        tma_kind=shapes.dtype if shapes.kv_format == "dtype" else shapes.kv_format,
        tail=tail({
            "q_stride_b": q_strides[0], "q_stride_s": q_strides[1], "q_stride_h": q_strides[2],
            "kv_stride_page": shapes.kv_strides[0], "kv_stride_row": shapes.kv_strides[1],
            "bt_stride_b": block_table.stride(0) if block_table is not None else 0,
            "idx_stride_b": indices.stride(0) if indices is not None else 0,
            "idx_stride_s": indices.stride(1) if indices is not None else 0, "topk": shapes.topk,
            "mask_stride_b": shapes.mask_strides[0], "mask_stride_q": shapes.mask_strides[1],
            "out_stride_b": out_strides[0], "out_stride_s": out_strides[1], "out_stride_h": out_strides[2],
            "split_keys_log2": prep.split_keys_log2,
            "kv_scale": _host_scale(kv_scale),
            "batch": B, "seqlen_q": S, "max_pages": shapes.max_pages, "num_pages": shapes.num_pages,
            "num_splits": prep.splits, "merge_blocks": prep.merge_blocks, "dependent": 0,
            # a host q_scale folds into the scores' scale; a tensor's is read at each launch
            "scale_log2": scale * LOG2E * _host_scale(q_scale),
        }))
    if key is not None:
        if len(_calls) >= _MAX_CALLS:
            _calls.clear()
        _calls[key] = call
    return call


class VerifyOptions(TypedDict, total=False):
    """The keyword arguments `verify_attention` and `verify_attention_varlen` share, but
    return_lse, which decides the return type (their docstrings say what each one does)."""

    softmax_scale: float | None
    causal: bool
    tree_mask: torch.Tensor | None
    variant: Variant | None
    head_dim_v: int
    check_values: bool | None
    max_seqlen_k: int | None
    attn_sink: torch.Tensor | None
    batch_invariant: bool | None
    kv_scale: float | torch.Tensor | None
    q_scale: float | torch.Tensor | None
    indices: torch.Tensor | None
    topk_length: torch.Tensor | None


class BatchOptions(VerifyOptions, total=False):
    """`verify_attention`'s keyword arguments beyond `VerifyOptions` (and return_lse)."""

    out: torch.Tensor | None
    q_counts: torch.Tensor | None
    extra_kv_cache: torch.Tensor | None
    extra_indices: torch.Tensor | None
    extra_topk_length: torch.Tensor | None


# The three calls, by return_lse: the output alone, the output and lse, either (a bool known at
# run time only). The implementation below spells out each keyword; the stubs take them as one.
@overload
def verify_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None = ...,
                     cache_seqlens: torch.Tensor | None = ..., *, return_lse: Literal[False] = ...,
                     **options: Unpack[BatchOptions]) -> torch.Tensor: ...
@overload
def verify_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None = ...,
                     cache_seqlens: torch.Tensor | None = ..., *, return_lse: Literal[True],
                     **options: Unpack[BatchOptions]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def verify_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None = ...,
                     cache_seqlens: torch.Tensor | None = ..., *, return_lse: bool = ...,
                     **options: Unpack[BatchOptions]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Variant | None = None,
    head_dim_v: int = 512,
    check_values: bool | None = None,
    out: torch.Tensor | None = None,
    max_seqlen_k: int | None = None,
    attn_sink: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    q_counts: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA verify attention over a paged latent KV cache: each request's prefix and draft
    tokens through its block table, or (sparse verify, DeepSeek Sparse Attention) the cache rows
    each query token lists in `indices`.

    Args:
        q: [B, S, H, Dl+Dr] bf16/fp16 CUDA tensor; the first Dl dims are q_nope @ W_UK. Or
            float8_e4m3fn queries (Dl+Dr = 576) with q_scale: out is then in the cache's
            16-bit dtype, bf16 over an FP8 cache. Over an e4m3 cache on sm_90a both products
            run on e4m3 tensor cores (schedule "fp8_mma", e4m3's accuracy: P keeps 3 mantissa
            bits); elsewhere the naive kernel runs.
        kv_cache: [num_pages, page_size, Dl+Dr] or [num_pages, page_size, 1, Dl+Dr] in q's dtype;
            or an FP8 cache of DeepSeek's rows (Dl+Dr = 576, head_dim_v 512;
            `mlagen.quantize_kv` makes one): float8_e4m3fn [.., 576] with kv_scale, or uint8
            [.., 656] (ds_mla: 512 e4m3 latent dims, four fp32 group scales, 64 bf16 rope
            dims). FP8 caches run on an mma tile that dequantizes each KV tile in shared memory
            (the naive kernel where none fits).
        block_table: [B, max_pages] int32, page ids of each request in order; None with indices.
        cache_seqlens: [B] int32, valid keys per request including its S draft tokens, which
            sit at positions cache_seqlens[b]-S .. cache_seqlens[b]-1; None with indices.
        softmax_scale: multiplies q.k; default 1/sqrt(Dl+Dr).
        causal: query i sees every prefix key and draft tokens 0..i (ignored with tree_mask).
            With indices, False: no mask applies to gathered keys.
        tree_mask: bool [S, S] or [B, S, S]; tree_mask[.., i, k]: query i sees draft token k.
            Prefix keys are always visible. S <= 64.
        return_lse: also return lse [B, H, S] fp32 (natural log; -inf for a row with no key).
        variant: the kernel to run; default: chosen for the shape and this GPU.
        head_dim_v: Dl, the value width (512 for DeepSeek-V3 / Kimi K2).
        check_values: read lengths and page ids back to check them (a host sync); default from
            MLAGEN_CHECK_VALUES. Unchecked bad values never make a kernel leave its tensors.
        out: optional preallocated [B, S, H, Dl] output in q's dtype (last dim contiguous),
            written in place and returned.
        max_seqlen_k: optional host int, a bound on cache_seqlens (as varlen attention APIs
            take). The variant, its split and its table entry are then chosen for that many keys
            (rounded up: at most 19% more, at least 64) instead of for the block table's
            capacity, which serving engines size for the longest context. A request longer than
            the bound still runs correctly, on a plan made for fewer keys.
        attn_sink: optional [H] fp32 attention sinks on q's device: row (b, i, h) of out is
            scaled by exp(lse) / (exp(lse) + exp(attn_sink[h])) (`mlagen.runtime.sinks`); lse
            is unchanged. Runs the lse variant of the kernel, then one elementwise pass over out.
        batch_invariant: a request's out and lse bits depend only on its own queries, keys and
            length, never on the batch around it, the block table's width or the GPU's SM count
            (`policy.batch_invariant_variant`: a kernel chosen from the problem and S alone, each
            request's keys in splits counted from its own length). Default from MLAGEN_BATCH_INVARIANT. A
            named `variant` runs as given.
        kv_scale: an e4m3 cache's scale (real value = stored value x kv_scale): a float, or a
            one-element fp32 tensor on q's device, which may change between calls and inside CUDA
            graphs. None for every other cache.
        q_scale: float8_e4m3fn queries' scale (real value = stored value x q_scale): a float
            (folded into the scores' scale) or a one-element fp32 tensor on q's device, read at
            each launch. None for 16-bit queries.
        q_counts: optional [B] int32 on q's device, for requests padded to S draft tokens at the
            front: request b's real query rows are its last q_counts[b] (0..S), and the rows
            before them are padding, whose out and lse are unspecified. The dispatcher's balanced
            split then runs only the real rows (`Variant.rows` "ragged");
            `verify_attention_varlen` passes its draft counts so. Read on the device (checked
            with check_values).
        indices: optional [B, S, topk] int32 on q's device, last dim contiguous: gathered keys
            (sparse verify). Query token i of request b attends to the cache rows
            indices[b, i, :topk_length[b]], each a flat row id page x page_size + offset; -1
            marks an unused slot, and a row listed twice counts twice. No mask applies (the
            indexer chose the rows): block_table, cache_seqlens, tree_mask, q_counts and
            max_seqlen_k stay None. Runs on a one-token mma tile where one fits (the naive
            kernel elsewhere, and in batch-invariant mode); with check_values, every id is
            checked to be -1 or a row of the cache, else a row id outside the cache is dropped,
            never read.
        topk_length: optional [B] int32 with indices: request b's tokens use their first
            topk_length[b] slots (0..topk); None: all topk.
        extra_kv_cache, extra_indices, extra_topk_length: with indices, a second cache (FlashMLA's
            extra cache) in kv_cache's format, whose rows extra_indices [B, S, extra_topk] lists
            as indices does for kv_cache (extra_topk_length as topk_length): each token attends
            to its rows of both caches in one softmax. The two caches' keys run as two launches
            whose results merge by their lse (`mlagen.merge_states`, fp32 math on each part's
            16-bit output), the sinks applied after.

    Returns:
        out [B, S, H, Dl] in q's dtype (e4m3 queries: see q), and lse if return_lse. A row that sees no key gives
        out = 0 and lse = -inf.
    """
    if attn_sink is not None:
        if q.dim() == 4:          # a q of another shape fails the op's own checks, which name it
            sinks.check_attn_sink(attn_sink, q.shape[2], q.device)
        result = verify_attention(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                                  causal=causal, tree_mask=tree_mask, return_lse=True, variant=variant,
                                  head_dim_v=head_dim_v, check_values=check_values, out=out,
                                  max_seqlen_k=max_seqlen_k, batch_invariant=batch_invariant, kv_scale=kv_scale,
                                  q_scale=q_scale, q_counts=q_counts, indices=indices, topk_length=topk_length,
                                  extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                                  extra_topk_length=extra_topk_length)
        sinks.apply_attn_sink_(result[0], result[1].transpose(1, 2), attn_sink)
        return result if return_lse else result[0]
    if extra_kv_cache is not None or extra_indices is not None or extra_topk_length is not None:
        return _with_extra_keys(
            q, kv_cache, block_table, cache_seqlens, indices, topk_length, extra_kv_cache, extra_indices,
            extra_topk_length, return_lse=return_lse, out=out, softmax_scale=softmax_scale, causal=causal,
            tree_mask=tree_mask, variant=variant, head_dim_v=head_dim_v, check_values=check_values,
            max_seqlen_k=max_seqlen_k, batch_invariant=batch_invariant, kv_scale=kv_scale, q_scale=q_scale,
            q_counts=q_counts)
    if indices is not None:
        _check_gathered_call(block_table, cache_seqlens, causal, tree_mask, q_counts, max_seqlen_k)
    bound = inputs.key_bound(max_seqlen_k) if max_seqlen_k is not None else None
    invariant = BATCH_INVARIANT_DEFAULT if batch_invariant is None else bool(batch_invariant)
    key, call = _lookup(q, kv_cache, block_table, cache_seqlens, tree_mask, out, head_dim_v, softmax_scale, causal,
                        return_lse, variant, bound, invariant, kv_scale, q_scale, q_counts, indices, topk_length)
    if call is not None:
        # Pointers change from call to call, so alignment is checked every time; a misaligned
        # one goes through the full checks, which name it.
        q_ptr, kv_ptr = q.data_ptr(), kv_cache.data_ptr()
        if (q_ptr | kv_ptr | (out.data_ptr() if out is not None else 0)) & 15:
            call = None
    if call is None:
        call = _checked_call(key, q, kv_cache, block_table, cache_seqlens, tree_mask, out, head_dim_v,
                             softmax_scale, causal, return_lse, variant, check_values, bound, invariant, kv_scale,
                             q_scale, q_counts, indices, topk_length)
        q_ptr, kv_ptr = q.data_ptr(), kv_cache.data_ptr()
    elif check_values or (check_values is None and inputs.CHECK_VALUES_DEFAULT):   # values_requested, inlined
        _check_key_values(call.shapes, block_table, cache_seqlens, indices, topk_length)
        for name, scale in (("kv_scale", kv_scale), ("q_scale", q_scale)):    # a tensor's value is new each call
            if isinstance(scale, torch.Tensor):
                check_scale(name, scale, q.device, check_values=True)
        if q_counts is not None:
            inputs.check_q_counts(q_counts, call.shapes.batch, call.shapes.seqlen_q, q.device, True)

    # Sizes as separate ints: torch.empty parses those faster than a tuple.
    if out is None:
        out = torch.empty(*call.out_size, dtype=call.dtype, device=call.torch_device)
    lse = torch.empty(*call.lse_size, dtype=torch.float32, device=call.torch_device) if return_lse else None
    if call.shapes.batch == 0:
        return (out, lse) if return_lse else out  # type: ignore[return-value]  # lse is a tensor with return_lse
    # The raw stream handle, without building a torch.cuda.Stream object.
    stream = torch._C._cuda_getCurrentRawStream(call.device)
    part_o = part_ml = counters = 0
    if call.layout is not None:   # `held` is referenced until the launch is queued on the stream
        held, part_o, counters = workspace.get(call.device, stream, call.layout, call.torch_device)
        part_ml = part_o + call.layout.part_ml_offset
    kv_map = (tensormap.device_map(call.device, kv_ptr, call.shapes.num_pages, call.shapes.page_size,
                                   call.shapes.head_dim, call.shapes.kv_strides, call.tma_kind, call.tma_rows)
              if call.tma_rows else 0)
    # kv_cache's pointer is the [num_pages, page_size, D] view's too (a 4-dim cache's index 0).
    pointer_values = pointers({
        "q": q_ptr, "kv": kv_ptr, "kv_map": kv_map,
        "block_table": block_table.data_ptr() if block_table is not None else 0,
        "seqlens": cache_seqlens.data_ptr() if cache_seqlens is not None else 0,
        "indices": indices.data_ptr() if indices is not None else 0,
        "topk_length": topk_length.data_ptr() if topk_length is not None else 0,
        "tree_mask": tree_mask.data_ptr() if tree_mask is not None else 0,
        "q_counts": q_counts.data_ptr() if q_counts is not None else 0, "out": out.data_ptr(),
        "lse": lse.data_ptr() if lse is not None else 0, "part_o": part_o, "part_ml": part_ml, "counters": counters,
        "kv_scale_ptr": kv_scale.data_ptr() if isinstance(kv_scale, torch.Tensor) else 0,
        "q_scale_ptr": q_scale.data_ptr() if isinstance(q_scale, torch.Tensor) else 0})
    # torch.cuda.current_device() without its lazy-init check: q is a CUDA tensor, so CUDA is up.
    if torch._C._cuda_getDevice() == call.device:
        launch(call.kernel, stream, pointer_values, call.tail)
    else:   # kernels load into, and launch in, the context of q's device
        with torch.cuda.device(call.device):
            launch(call.kernel, stream, pointer_values, call.tail)
    return (out, lse) if return_lse else out  # type: ignore[return-value]  # lse is a tensor with return_lse
