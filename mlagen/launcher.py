"""C++ host launchers for emitted kernels (`mlagen emit --launcher`).

For a validated plan, `emit_launcher` writes `<plan.name>_launch.h` beside the kernel's .cu: a
header-only C++ launcher in namespace `mlagen::<variant and problem>` with the kernel's
constants, `grid`, `combine_grid`, `workspace_bytes`, `default_num_splits` and `launch`, which
takes raw pointers, strides, sizes and a cudaStream_t, fills the parameter block and launches
the main kernel and (with num_splits > 1) the combine kernel through cudaLaunchKernel.

The header is meant for a different translation unit than the .cu (see the header's comment):
it declares its own twin of the parameter block, rendered from the same field list
(`mlagen.params.FIELDS`), and the kernels as extern "C" symbols, so
`nvcc -c kernel.cu engine.cu` builds and links, and the .cu still compiles alone under NVRTC.
The launch geometry and split heuristic are rendered from the plan and `mlagen.dispatch`.
"""

from __future__ import annotations

from pathlib import Path

from . import __version__, dispatch
from .codegen import _environment
from .emit import _write_if_changed
from .launch import _DEFAULT_SMEM_LIMIT
from .params import FIELDS, PARAMS_SIZE, Field
from .validate import COMBINE_WARPS, MAX_SEQLEN_Q, KernelPlan

_LOG2E = "1.4426950408889634f"

# How `launch` fills each field of the parameter block from its arguments; every field of
# mlagen.params.FIELDS needs an entry (checked when rendering).
_ASSIGN: dict[str, str] = {
    "q": "q", "kv": "kv_cache", "block_table": "block_table", "seqlens": "cache_seqlens",
    "tree_mask": "kTreeMask ? tree_mask : nullptr", "out": "out", "lse": "kWritesLse ? lse : nullptr",
    "part_o": "part_o", "part_ml": "part_ml",
    "q_stride_b": "q_stride_b", "q_stride_s": "q_stride_s", "q_stride_h": "q_stride_h",
    "kv_stride_page": "kv_stride_page", "kv_stride_row": "kv_stride_row", "bt_stride_b": "bt_stride_b",
    "mask_stride_b": "kTreeMask ? mask_stride_b : 0", "mask_stride_q": "kTreeMask ? mask_stride_q : 0",
    "out_stride_b": "out_stride_b", "out_stride_s": "out_stride_s", "out_stride_h": "out_stride_h",
    "batch": "batch", "seqlen_q": "seqlen_q", "max_pages": "max_pages", "num_pages": "num_pages",
    "num_splits": "num_splits", "scale_log2": f"softmax_scale * {_LOG2E}",
}


def header_name(plan: KernelPlan) -> str:
    """File name of `plan`'s launcher header."""
    return f"{plan.name}_launch.h"


def namespace(plan: KernelPlan) -> str:
    """The C++ namespace inside `mlagen::` that holds `plan`'s launcher."""
    return plan.name.removeprefix("mlagen_")


def _host_field(f: Field) -> Field:
    # The host twin has no elem_t (bf16 and fp16 headers may share one translation unit).
    return Field(f.name, f.ctype.replace("elem_t", "void"), f.fmt, f.doc)


def _grid(plan: KernelPlan) -> tuple[str, str, str]:
    """`plan.grid` as C expressions of batch, seqlen_q and num_splits."""
    if plan.variant.family == "naive":
        return (str(plan.problem.heads), "seqlen_q", "batch")
    qt = plan.variant.q_tile
    return (f"((seqlen_q + {qt} - 1) / {qt}) * {plan.head_tiles}", "num_splits", "batch")


def render_launcher(plan: KernelPlan) -> str:
    """The launcher header's text for `plan`."""
    missing = {f.name for f in FIELDS} - set(_ASSIGN)
    if missing:
        raise KeyError(f"launcher: no assignment for parameter fields {sorted(missing)}")
    return _environment().get_template("launcher.h.j2").render(
        plan=plan, version=__version__, short_name=namespace(plan),
        fields=[_host_field(f) for f in FIELDS], params_size=PARAMS_SIZE, assign=_ASSIGN,
        grid=_grid(plan), combine_warps=COMBINE_WARPS,
        max_seqlen_q=MAX_SEQLEN_Q,
        combine_tiles=repr(dispatch.COMBINE_TILES), split_tiles_per_row=repr(dispatch.SPLIT_TILES_PER_ROW),
        max_splits=dispatch.MAX_SPLITS,
        default_smem=_DEFAULT_SMEM_LIMIT,
    )


def emit_launcher(plan: KernelPlan, folder: Path) -> Path:
    """Write `plan`'s launcher header into `folder` (beside its .cu); rewritten only when its
    text changes. Returns the header's path."""
    path = Path(folder) / header_name(plan)
    _write_if_changed(path, render_launcher(plan))
    return path
