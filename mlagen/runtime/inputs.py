"""Argument checks for the torch-facing op, all made before any launch.

`check_inputs` looks only at metadata (dtype, device, shape, stride, alignment): no device
reads, so it is cheap and safe under CUDA graph capture. `check_values` reads page ids and
lengths back to the host; it runs when the caller asks (an argument, or MLAGEN_CHECK_VALUES=1
in the environment when mlagen is imported: read once, since an environment lookup on every
call costs host time; `CHECK_VALUES_DEFAULT` holds it and may be set at run time).
Kernels never read or write outside the tensors they are given either way: lengths are
clamped to what the block table addresses and page ids outside the cache read as zeros.

The metadata checks depend only on what `signature` gathers, so the runtime runs them once per
signature and afterwards checks only what changes from call to call (data-pointer alignment).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, NoReturn

import torch

from ..dsl.kv_layout import DS_MLA_ROW_BYTES, LATENT_DIM, ROW_DIM
from ..dsl.spec import MAX_SEQLEN_Q, Dtype, KVFormatName, QFormatName

DTYPES: dict[torch.dtype, Dtype] = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_ALIGN_BYTES = 16    # kernels move rows in 16-byte chunks
# A cache of another dtype than q's is FP8 (mlagen.runtime.kv_formats): its Problem.kv_format.
FP8_KV_FORMATS: dict[torch.dtype, KVFormatName] = {torch.float8_e4m3fn: "e4m3", torch.uint8: "ds_mla"}
CHECK_VALUES_DEFAULT: bool = os.environ.get("MLAGEN_CHECK_VALUES", "") not in ("", "0")


class InputError(ValueError):
    """A bad argument: names it, says what it got and what was expected."""


class Shapes(NamedTuple):   # no tensors: the runtime keeps one per argument signature
    batch: int
    seqlen_q: int
    heads: int
    head_dim: int
    dl: int
    num_pages: int
    page_size: int
    max_pages: int
    dtype: Dtype
    kv_strides: tuple[int, int]     # (page, row) strides of the cache as [num_pages, page_size, D]
    mask_strides: tuple[int, int]   # (request, query row) of tree_mask: request 0 if shared, (0, 0) if none
    kv_format: KVFormatName = "dtype"   # Problem.kv_format: "dtype", or an FP8 cache's "e4m3" / "ds_mla"
    q_format: QFormatName = "dtype"     # Problem.q_format: "dtype", or "e4m3" queries (dtype: the output's)
    topk: int = 0                   # gathered keys (indices [B, S, topk]): slots per query token; 0: paged keys


def fail(name: str, got: object, expected: str) -> NoReturn:
    """Raise the InputError every argument check raises: the argument, what it got, what was
    expected."""
    raise InputError(f"{name}: got {got}, expected {expected}")


def tensor_arg(name: str, x: object, device: torch.device | None = None) -> torch.Tensor:
    """`x`, checked to be a tensor, on `device` (q's) where given."""
    if not isinstance(x, torch.Tensor):
        fail(name, type(x).__name__, "a torch.Tensor")
    if device is not None and x.device != device:
        fail(name, f"a tensor on {x.device}", f"a tensor on {device}, where q is")
    return x


def _aligned_rows(name: str, x: torch.Tensor, row_dims: tuple[int, ...]) -> None:
    stride, shape = x.stride(), x.shape     # fetched once: this runs on every call
    if stride[-1] != 1:
        fail(f"{name}.stride()", tuple(stride), "the last dim contiguous (stride 1)")
    align = _ALIGN_BYTES // x.element_size()
    for d in row_dims:
        if shape[d] > 1 and stride[d] % align:
            fail(f"{name}.stride()", tuple(stride),
                  f"strides that are multiples of {align} elements (16-byte rows)")
    if x.data_ptr() % 16:
        fail(f"{name}.data_ptr()", hex(x.data_ptr()), "a 16-byte aligned address")


def output_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The output's dtype: q's, or with e4m3 queries a 16-bit cache's (bf16 over an FP8 cache), the
    rule of `Problem.with_formats` on torch dtypes."""
    if q_dtype != torch.float8_e4m3fn:
        return q_dtype
    return kv_dtype if kv_dtype in DTYPES else torch.bfloat16


class _Rows(NamedTuple):
    """What q's and the cache's checks find (`_check_rows`)."""

    q: torch.Tensor
    kv: torch.Tensor                # the cache as [num_pages, page_size, row]
    kv_format: KVFormatName
    q_format: QFormatName
    dtype: Dtype                    # the output's


def _check_rows(q: object, kv_cache: object, head_dim_v: int) -> _Rows:
    """q [B, S, H, D] and the cache's rows: dtypes, shapes, 16-byte rows. Raises InputError."""
    q = tensor_arg("q", q)
    if q.dtype not in DTYPES and q.dtype != torch.float8_e4m3fn:
        fail("q.dtype", q.dtype, "torch.bfloat16, torch.float16 or torch.float8_e4m3fn (with q_scale)")
    q_format: QFormatName = "dtype" if q.dtype in DTYPES else "e4m3"
    if q.dim() != 4:
        fail("q.shape", tuple(q.shape), "[B, S, H, Dl+Dr] (4 dims)")
    B, S, H, D = q.shape
    if not (0 < head_dim_v <= D):
        fail("head_dim_v", head_dim_v, f"0 < head_dim_v <= q.shape[-1]={D}")
    if S < 1:
        fail("q.shape[1]", S, "S >= 1 draft tokens")
    _aligned_rows("q", q, (0, 1, 2))

    kv_cache = tensor_arg("kv_cache", kv_cache, q.device)
    kv_format: KVFormatName
    kv_format, row = "dtype", D
    out_dtype = output_dtype(q.dtype, kv_cache.dtype)
    if kv_cache.dtype != out_dtype:
        if kv_cache.dtype not in FP8_KV_FORMATS:
            fail("kv_cache.dtype", kv_cache.dtype, f"q's dtype {q.dtype}, torch.float8_e4m3fn (e4m3 rows) or "
                  "torch.uint8 (DeepSeek's 656-byte ds_mla rows)")
        kv_format = FP8_KV_FORMATS[kv_cache.dtype]
    if (kv_format != "dtype" or q_format != "dtype") and (D, head_dim_v) != (ROW_DIM, LATENT_DIM):
        fp8 = f"a {kv_format} cache" if kv_format != "dtype" else "e4m3 queries"
        fail("q.shape[-1] and head_dim_v", (D, head_dim_v),
              f"({ROW_DIM}, {LATENT_DIM}) with {fp8} (DeepSeek's MLA rows)")
    if kv_format == "ds_mla":
        row = DS_MLA_ROW_BYTES
    if kv_cache.dim() == 4 and kv_cache.size(2) == 1:
        kv = kv_cache[:, :, 0]
    elif kv_cache.dim() == 3:
        kv = kv_cache
    else:
        fail("kv_cache.shape", tuple(kv_cache.shape),
              f"[num_pages, page_size, {row}] or [num_pages, page_size, 1, {row}]")
    if kv.size(-1) != row:
        fail("kv_cache.shape[-1]", kv.size(-1), f"q.shape[-1]={D}" if kv_format == "dtype"
              else f"{row} (a {kv_format} row)")
    if kv.size(0) < 1:
        fail("kv_cache.shape[0]", kv.size(0), "at least one page")
    _aligned_rows("kv_cache", kv, (0, 1))
    return _Rows(q, kv, kv_format, q_format, DTYPES[out_dtype])


def _check_softmax_scale(softmax_scale: object) -> None:
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and softmax_scale == softmax_scale
                                          and abs(softmax_scale) != float("inf")):
        fail("softmax_scale", softmax_scale, "a finite float or None")


def check_inputs(q: object, kv_cache: object, block_table: object, cache_seqlens: object,
                 tree_mask: object, head_dim_v: int, softmax_scale: float | None) -> Shapes:
    """Metadata checks (every tensor on q's device; the caller requires that to be CUDA);
    returns the problem's sizes. Raises InputError."""
    q, kv, kv_format, q_format, dtype = _check_rows(q, kv_cache, head_dim_v)
    B, S = q.shape[:2]
    block_table = tensor_arg("block_table", block_table, q.device)
    if block_table.dtype != torch.int32:
        fail("block_table.dtype", block_table.dtype, "torch.int32")
    if block_table.dim() != 2 or block_table.size(0) != B or block_table.size(1) < 1:
        fail("block_table.shape", tuple(block_table.shape), f"[B={B}, max_pages >= 1]")
    if block_table.stride(1) != 1:
        fail("block_table.stride()", tuple(block_table.stride()), "the last dim contiguous")

    cache_seqlens = tensor_arg("cache_seqlens", cache_seqlens, q.device)
    if cache_seqlens.dtype != torch.int32:
        fail("cache_seqlens.dtype", cache_seqlens.dtype, "torch.int32")
    if tuple(cache_seqlens.shape) != (B,) or (B > 1 and cache_seqlens.stride(0) != 1):
        fail("cache_seqlens.shape", tuple(cache_seqlens.shape), f"a contiguous [B={B}]")

    mask = None
    if tree_mask is not None:
        mask = tensor_arg("tree_mask", tree_mask, q.device)
        if mask.dtype not in (torch.bool, torch.uint8):
            fail("tree_mask.dtype", mask.dtype, "torch.bool (or torch.uint8)")
        if S > MAX_SEQLEN_Q:
            fail("q.shape[1]", S, f"at most {MAX_SEQLEN_Q} draft tokens with a tree mask")
        if tuple(mask.shape) not in ((S, S), (B, S, S)):
            fail("tree_mask.shape", tuple(mask.shape), f"[S, S]=[{S}, {S}] or [B, S, S]=[{B}, {S}, {S}]")
        if mask.stride(-1) != 1:
            fail("tree_mask.stride()", tuple(mask.stride()), "the last dim contiguous")

    _check_softmax_scale(softmax_scale)

    mask_strides = (0, 0)
    if mask is not None:
        mask_strides = (mask.stride(0) if mask.dim() == 3 else 0, mask.stride(-2))
    return Shapes(batch=B, seqlen_q=S, heads=q.size(2), head_dim=q.size(3), dl=head_dim_v,
                  num_pages=kv.size(0), page_size=kv.size(1), max_pages=block_table.size(1),
                  dtype=dtype, kv_strides=(kv.stride(0), kv.stride(1)), mask_strides=mask_strides,
                  kv_format=kv_format, q_format=q_format)


def check_sparse_inputs(q: object, kv_cache: object, indices: object, topk_length: object, head_dim_v: int,
                        softmax_scale: float | None) -> Shapes:
    """Metadata checks of a call with gathered keys (sparse verify): q and the cache as for
    paged keys, indices int32 [B, S, topk >= 1] with its last dim contiguous, topk_length None
    or a contiguous int32 [B]. Returns the problem's sizes (max_pages 0, topk set). Raises
    InputError."""
    q, kv, kv_format, q_format, dtype = _check_rows(q, kv_cache, head_dim_v)
    B, S = q.shape[:2]
    indices = tensor_arg("indices", indices, q.device)
    if indices.dtype != torch.int32:
        fail("indices.dtype", indices.dtype, "torch.int32")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, S) or indices.size(2) < 1:
        fail("indices.shape", tuple(indices.shape), f"[B={B}, S={S}, topk >= 1]")
    if indices.stride(2) != 1 and indices.size(2) > 1:
        fail("indices.stride()", tuple(indices.stride()), "the last dim contiguous")
    if topk_length is not None:
        topk_length = tensor_arg("topk_length", topk_length, q.device)
        if topk_length.dtype != torch.int32:
            fail("topk_length.dtype", topk_length.dtype, "torch.int32")
        if tuple(topk_length.shape) != (B,) or (B > 1 and topk_length.stride(0) != 1):
            fail("topk_length.shape", tuple(topk_length.shape), f"a contiguous [B={B}]")
    _check_softmax_scale(softmax_scale)
    return Shapes(batch=B, seqlen_q=S, heads=q.size(2), head_dim=q.size(3), dl=head_dim_v,
                  num_pages=kv.size(0), page_size=kv.size(1), max_pages=0, dtype=dtype,
                  kv_strides=(kv.stride(0), kv.stride(1)), mask_strides=(0, 0), kv_format=kv_format,
                  q_format=q_format, topk=indices.size(2))


# The torch dtype of each Shapes.dtype.
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def check_out(out: object, q: torch.Tensor, shapes: Shapes) -> None:
    """A caller-provided output: [B, S, H, Dl], the output's dtype (q's, or with e4m3 queries the
    cache's 16-bit dtype, bf16 over an FP8 cache), q's device, 16-byte rows."""
    out = tensor_arg("out", out, q.device)
    if out.dtype != TORCH_DTYPES[shapes.dtype]:
        fail("out.dtype", out.dtype, f"q's dtype {q.dtype}" if shapes.q_format == "dtype"
              else f"{TORCH_DTYPES[shapes.dtype]} (the output of e4m3 queries)")
    expected = (shapes.batch, shapes.seqlen_q, shapes.heads, shapes.dl)
    if tuple(out.shape) != expected:
        fail("out.shape", tuple(out.shape), f"[B, S, H, Dl]={list(expected)}")
    _aligned_rows("out", out, (0, 1, 2))


def check_q_counts(q_counts: object, batch: int, seqlen_q: int, device: torch.device, values: bool) -> None:
    """Ragged rows' counts: int32 [B], contiguous (the kernels read q_counts[b] at b), on q's
    device; with `values` (a device read), each in 0..S."""
    counts = tensor_arg("q_counts", q_counts, device)
    if counts.dtype != torch.int32 or tuple(counts.shape) != (batch,):
        fail("q_counts", f"{counts.dtype} {tuple(counts.shape)}", f"int32 [B]=[{batch}]")
    if batch > 1 and counts.stride(0) != 1:
        fail("q_counts.stride()", tuple(counts.stride()), "(1,): contiguous")
    if values:
        for b, c in enumerate(counts.tolist()):
            if not 0 <= c <= seqlen_q:
                fail(f"q_counts[{b}]", c, f"0..S={seqlen_q} (request b's real query rows)")


def key_bound(max_seqlen_k: object) -> int | None:
    """max_seqlen_k checked (None, or an int >= 0) and rounded up to a quarter octave, at least
    one 64-key tile: at most 19% over it, so a bound that grows call by call re-plans a few
    times per doubling of the keys rather than at every page."""
    if max_seqlen_k is None:
        return None
    if not isinstance(max_seqlen_k, int) or isinstance(max_seqlen_k, bool) or max_seqlen_k < 0:
        fail("max_seqlen_k", repr(max_seqlen_k), "None or an int >= 0 (a host bound on cache_seqlens)")
    if max_seqlen_k <= 64:
        return 64
    return max(max_seqlen_k, math.ceil(2 ** (math.ceil(4 * math.log2(max_seqlen_k)) / 4)))


def values_requested(flag: bool | None) -> bool:
    """`flag`, or when None the default read from MLAGEN_CHECK_VALUES at import."""
    return CHECK_VALUES_DEFAULT if flag is None else flag


def signature(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
              cache_seqlens: torch.Tensor, tree_mask: torch.Tensor | None, out: torch.Tensor | None,
              head_dim_v: int, softmax_scale: float | None) -> tuple:
    """Everything `check_inputs` and `check_out` look at except data pointers: calls with equal
    signatures pass or fail those checks alike, and have the same Shapes. The type is part of
    it so that only tensors (which passed the isinstance checks) can match. Raises
    AttributeError, TypeError or RuntimeError for arguments that are not (strided) tensors;
    the full checks name those."""
    # Written out, not a per-tensor helper: this runs on every call and each frame costs.
    return (type(q), q.shape, q.stride(), q.dtype, q.device,
            type(kv_cache), kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
            type(block_table), block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
            type(cache_seqlens), cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype,
            cache_seqlens.device,
            None if tree_mask is None else (type(tree_mask), tree_mask.shape, tree_mask.stride(), tree_mask.dtype,
                                            tree_mask.device),
            None if out is None else (type(out), out.shape, out.stride(), out.dtype, out.device),
            head_dim_v, softmax_scale)


def _refuse_capture() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise InputError("check_values: cannot read values back while a CUDA graph is being "
                         "captured; check outside the capture or pass check_values=False")


def check_values(shapes: Shapes, block_table: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """Device reads: lengths within what block_table addresses, used page ids within the cache."""
    _refuse_capture()
    lengths = cache_seqlens.tolist()
    capacity = shapes.max_pages * shapes.page_size
    for b, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            fail(f"cache_seqlens[{b}]", n,
                  f"0..{capacity} (block_table has {shapes.max_pages} pages of {shapes.page_size})")
    used = torch.tensor([-(-n // shapes.page_size) for n in lengths])
    cols = torch.arange(shapes.max_pages)[None, :] < used[:, None]
    pages = block_table.cpu()[cols]
    bad = (pages < 0) | (pages >= shapes.num_pages)
    if bool(bad.any()):
        fail("block_table", f"page id {int(pages[bad][0])} in use",
              f"page ids in 0..{shapes.num_pages - 1} for the pages each request uses")


def check_sparse_values(shapes: Shapes, indices: torch.Tensor, topk_length: torch.Tensor | None) -> None:
    """Device reads of gathered keys: every row id -1 or a row of the cache, every topk_length
    within 0..topk. (Unchecked, a row id outside the cache is dropped by the kernels, never read.)"""
    _refuse_capture()
    check_listed_values("", indices, topk_length, shapes.num_pages * shapes.page_size)


def check_listed_values(prefix: str, indices: torch.Tensor, topk_length: torch.Tensor | None, rows: int) -> None:
    """Device reads of one key set (the op's, the sparse reference's; `prefix` "extra_" names an
    extra cache's): every row id in indices [B, S, topk] -1 or one of the cache's `rows`, every
    topk_length within 0..topk. Raises InputError naming the first bad value."""
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < -1 or high >= rows:
            fail(f"{prefix}indices", f"a row id {low if low < -1 else high}",
                 f"-1 or a row of the cache, 0..{rows - 1} (num_pages x page_size)")
    if topk_length is not None and topk_length.numel():
        topk = indices.size(2)
        short, long = int(topk_length.min()), int(topk_length.max())
        if short < 0 or long > topk:
            fail(f"{prefix}topk_length", f"a length {short if short < 0 else long}", f"0..topk={topk}")
