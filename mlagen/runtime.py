"""The torch-facing op: `verify_attention`.

Flow per call: check the arguments (metadata only) -> build the Problem -> pick the variant
(given, or dispatched for the shape on this GPU) -> load it (compiled once, cached on disk)
-> allocate outputs and, with more than one split, the workspace from torch's allocator ->
launch on torch's current stream. Nothing synchronizes the host, so the op can be captured
in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import inputs
from .arch import arch_for_capability, get_arch
from .dispatch import choose_variant, num_splits
from .launch import Loaded, launch, load
from .params import pack
from .spec import Problem, Variant

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


@dataclass(frozen=True)
class _Prepared:
    """Everything about a call that its shape decides, computed once per shape."""

    loaded: Loaded
    splits: int
    grid: tuple[int, int, int]
    combine_grid: tuple[int, int, int] | None     # None: one split, no combine launch
    workspace_rows: int                           # splits * B * S * H when split, else 0


@functools.lru_cache(maxsize=4096)
def _prepare(heads: int, dl: int, dr: int, dtype: str, page_size: int, mask: str, lse: bool,
             batch: int, seqlen_q: int, max_pages: int, device: int,
             variant: Variant | None) -> _Prepared:
    """Problem, variant (given or dispatched), loaded kernels, split and grids of a shape:
    memoized on plain values, since a serving step repeats the same shapes and each piece
    costs host time."""
    problem = Problem(heads=heads, dl=dl, dr=dr, dtype=dtype, page_size=page_size, mask=mask, lse=lse)
    device_arch, sm_count = device_info(device)
    kv_capacity = max_pages * page_size
    if variant is None:
        variant = choose_variant(problem, seqlen_q, batch, kv_capacity, device_arch, device_name(device))
    elif not _runs_on(variant.arch, device_arch):
        raise inputs.InputError(f"variant.arch: got {variant.arch!r}, expected a target that runs "
                                f"on this {device_arch} device (e.g. {device_arch!r})")
    loaded = load(problem, variant, device)
    splits = num_splits(variant, heads, batch, seqlen_q, kv_capacity, sm_count, loaded.blocks_per_sm)
    split = splits > 1
    return _Prepared(loaded=loaded, splits=splits, grid=loaded.plan.grid(batch, seqlen_q, splits),
                     combine_grid=loaded.plan.combine_grid(batch, seqlen_q) if split else None,
                     workspace_rows=splits * batch * seqlen_q * heads if split else 0)


def _runs_on(arch: str, device_arch: str) -> bool:
    a, d = get_arch(arch), get_arch(device_arch)
    if arch == "sm_90a":
        return d.capability == 90
    return a.capability // 10 == d.capability // 10 and a.capability <= d.capability


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Variant | None = None,
    head_dim_v: int = 512,
    check_values: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA verify attention over a paged latent KV cache.

    Args:
        q: [B, S, H, Dl+Dr] bf16/fp16 CUDA tensor; the first Dl dims are q_nope @ W_UK.
        kv_cache: [num_pages, page_size, Dl+Dr] or [num_pages, page_size, 1, Dl+Dr], q's dtype.
        block_table: [B, max_pages] int32, page ids of each request in order.
        cache_seqlens: [B] int32, valid keys per request including its S draft tokens, which
            sit at positions cache_seqlens[b]-S .. cache_seqlens[b]-1.
        softmax_scale: multiplies q.k; default 1/sqrt(Dl+Dr).
        causal: query i sees every prefix key and draft tokens 0..i (ignored with tree_mask).
        tree_mask: bool [S, S] or [B, S, S]; tree_mask[.., i, k]: query i sees draft token k.
            Prefix keys are always visible. S <= 64.
        return_lse: also return lse [B, H, S] fp32 (natural log; -inf for a row with no key).
        variant: the kernel to run; default: chosen for the shape and this GPU.
        head_dim_v: Dl, the value width (512 for DeepSeek-V3 / Kimi K2).
        check_values: read lengths and page ids back to check them (a host sync); default from
            MLAGEN_CHECK_VALUES. Unchecked bad values never make a kernel leave its tensors.
        out: optional preallocated [B, S, H, Dl] output in q's dtype (last dim contiguous),
            written in place and returned.

    Returns:
        out [B, S, H, Dl] in q's dtype, and lse if return_lse. A row that sees no key gives
        out = 0 and lse = -inf.
    """
    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise inputs.InputError(f"q.device: got {getattr(q, 'device', type(q).__name__)}, "
                                "expected a CUDA tensor")
    shapes = inputs.check_inputs(q, kv_cache, block_table, cache_seqlens, tree_mask,
                                 head_dim_v, softmax_scale)
    if inputs.values_requested(check_values):
        inputs.check_values(shapes, block_table, cache_seqlens)
    B, S, H = shapes.batch, shapes.seqlen_q, shapes.heads
    mask = "tree" if tree_mask is not None else ("causal" if causal else "none")
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    prep = _prepare(H, shapes.dl, shapes.head_dim - shapes.dl, shapes.dtype, shapes.page_size, mask,
                    return_lse, B, S, shapes.max_pages, device, variant)

    if out is None:
        out = torch.empty(B, S, H, shapes.dl, dtype=q.dtype, device=q.device)
    else:
        inputs.check_out(out, q, shapes)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device) if return_lse else None
    if B == 0:
        return (out, lse) if return_lse else out

    part_o = part_ml = 0
    if prep.workspace_rows:
        # One allocation holds part_o [splits, B, S, H, Dl] then part_ml [splits, B, S, H, 2]
        # (fp32; part_o's size is a multiple of 8 bytes, so part_ml stays float2-aligned).
        workspace = torch.empty(prep.workspace_rows * (shapes.dl + 2), dtype=torch.float32, device=q.device)
        part_o = workspace.data_ptr()
        part_ml = part_o + prep.workspace_rows * shapes.dl * 4
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(shapes.head_dim)
    kv, tm = shapes.kv, shapes.tree_mask
    params = pack({
        "q": q.data_ptr(), "kv": kv.data_ptr(), "block_table": block_table.data_ptr(),
        "seqlens": cache_seqlens.data_ptr(), "tree_mask": tm.data_ptr() if tm is not None else 0,
        "out": out.data_ptr(), "lse": lse.data_ptr() if lse is not None else 0,
        "part_o": part_o, "part_ml": part_ml,
        "q_stride_b": q.stride(0), "q_stride_s": q.stride(1), "q_stride_h": q.stride(2),
        "kv_stride_page": kv.stride(0), "kv_stride_row": kv.stride(1),
        "bt_stride_b": block_table.stride(0),
        "mask_stride_b": tm.stride(0) if tm is not None and tm.dim() == 3 else 0,
        "mask_stride_q": tm.stride(-2) if tm is not None else 0,
        "out_stride_b": out.stride(0), "out_stride_s": out.stride(1), "out_stride_h": out.stride(2),
        "batch": B, "seqlen_q": S, "max_pages": shapes.max_pages, "num_pages": shapes.num_pages,
        "num_splits": prep.splits, "scale_log2": scale * LOG2E,
    })
    # The raw handle of torch's current stream, without building a torch.cuda.Stream object.
    if torch.cuda.current_device() == device:
        launch(prep.loaded, prep.grid, prep.combine_grid, torch._C._cuda_getCurrentRawStream(device), params)
    else:   # kernels load into, and launch in, the context of q's device
        with torch.cuda.device(device):
            launch(prep.loaded, prep.grid, prep.combine_grid, torch._C._cuda_getCurrentRawStream(device),
                   params)
    return (out, lse) if return_lse else out
