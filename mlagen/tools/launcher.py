"""C++ host launchers for emitted kernels (`mlagen emit --launcher`).

For a validated plan, `emit_launcher` writes `<KernelPlan.name>_launch.h` beside the kernel's .cu: a
header-only C++ launcher in namespace `mlagen::<variant and problem>` with the kernel's
constants, `grid`, `row_groups`, `merge_blocks`, `workspace_bytes`, `counters_bytes`,
`default_num_splits` and `launch`, which takes raw pointers, strides, sizes, the workspace, the
split counters and a cudaStream_t, fills the parameter block and launches the kernel (whose grid
holds the merge blocks when num_splits > 1) through cudaLaunchKernel. A TMA variant's header
also has `make_kv_map`, which encodes the cache's tensor map (as mlagen/runtime/tensormap.py
does) into a device buffer that `launch` then takes, with the box and descriptor sizes of
`mlagen.plan.mma_plan` (TMA_BOX_DIMS, TENSOR_MAP_BYTES). `merge_blocks` and
`default_num_splits` are C++ twins of `SplitPlan.merge_blocks` and `policy.num_splits`;
tests/test_launcher.py compiles them and compares with the Python.

The header is meant for a different translation unit than the .cu (see the header's comment):
it declares its own twin of the parameter block, rendered from the same field list
(`mlagen.plan.params.FIELDS`), and the kernels as extern "C" symbols, so
`nvcc -c kernel.cu engine.cu` builds and links, and the .cu still compiles alone under NVRTC.
The launch geometry and split heuristic are rendered from the plan and `mlagen.dispatch.policy`:
the figures of `policy.H200` that hold on every device (the split model's costs, its largest
split count) as constants, the per-SM one (`pdl_tiles_per_sm`) times the SM count the header's
functions take, so the header dispatches as `policy.policy_for` does for the device it runs on.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import __version__
from ..codegen.render import environment
from ..dispatch import policy
from ..dsl.arch import nvcc_arch_flags
from ..dsl.spec import MAX_SEQLEN_Q
from ..plan.mma_plan import TENSOR_MAP_BYTES, TMA_BOX_DIMS
from ..plan.params import FIELDS, PARAMS_SIZE, Field
from ..plan.validate import MERGE_TARGET_BLOCKS, KernelPlan
from ..runtime.launch import DEFAULT_SMEM_LIMIT
from .files import write_if_changed

_LOG2E = "1.4426950408889634f"

# How `launch` fills each field of the parameter block from its arguments; every field of
# mlagen.plan.params.FIELDS needs an entry (checked when rendering).
_ASSIGN: dict[str, str] = {
    "q": "q", "kv": "kv_cache", "kv_map": "kUsesTma ? kv_map : nullptr", "block_table": "block_table",
    "seqlens": "cache_seqlens",
    "tree_mask": "kTreeMask ? tree_mask : nullptr", "q_counts": "q_counts",
    "indices": "kGathered ? indices : nullptr", "topk_length": "kGathered ? topk_length : nullptr", "out": "out",
    "lse": "kWritesLse ? lse : nullptr",
    "part_o": "part_o", "part_ml": "part_ml", "counters": "counters",
    "kv_scale_ptr": "kE4m3Cache ? kv_scale_ptr : nullptr", "q_scale_ptr": "kE4m3Q ? q_scale_ptr : nullptr",
    "q_stride_b": "q_stride_b", "q_stride_s": "q_stride_s", "q_stride_h": "q_stride_h",
    "kv_stride_page": "kv_stride_page", "kv_stride_row": "kv_stride_row", "bt_stride_b": "bt_stride_b",
    "mask_stride_b": "kTreeMask ? mask_stride_b : 0", "mask_stride_q": "kTreeMask ? mask_stride_q : 0",
    "idx_stride_b": "kGathered ? idx_stride_b : 0", "idx_stride_s": "kGathered ? idx_stride_s : 0",
    "topk": "kGathered ? topk : 0",
    "out_stride_b": "out_stride_b", "out_stride_s": "out_stride_s", "out_stride_h": "out_stride_h",
    "split_keys_log2": "0", "kv_scale": "kE4m3Cache ? kv_scale : 1.0f",
    "batch": "batch", "seqlen_q": "seqlen_q", "max_pages": "max_pages", "num_pages": "num_pages",
    "num_splits": "num_splits", "merge_blocks": "split ? merge_blocks(batch, seqlen_q) : 0",
    "scale_log2": f"softmax_scale * {_LOG2E}", "dependent": "kProgrammaticLaunch && programmatic ? 1 : 0",
}


def header_name(plan: KernelPlan) -> str:
    """File name of `plan`'s launcher header."""
    return f"{plan.name}_launch.h"


def namespace(plan: KernelPlan) -> str:
    """The C++ namespace inside `mlagen::` that holds `plan`'s launcher."""
    return plan.name.removeprefix("mlagen_")


# The kernels' element types, which the host twin of the parameter block spells void (bf16 and
# fp16 headers may share one translation unit).
_DEVICE_TYPES = re.compile(r"\b(elem_t|kv_t|q_t)\b")


def _host_field(f: Field) -> Field:
    return Field(f.name, _DEVICE_TYPES.sub("void", f.ctype), f.fmt, f.doc)


_CEIL = re.compile(r"ceil\((\w+) / (\d+)\)")
_NAMES = {"B": "batch", "S": "seqlen_q", "num_splits": "num_splits", "merge_blocks": "merge_blocks(batch, seqlen_q)"}
_C_EXPR = re.compile(r"[\w+\-*/()?:> ]*")


def _c_expr(expr: str) -> str:
    """One of `KernelPlan.grid_expr()`'s expressions (B, S, num_splits, merge_blocks, integers,
    `ceil(a / n)`, `a > b ? c : d`) as C integer arithmetic over the launcher's arguments batch,
    seqlen_q and num_splits (merge_blocks is the header's function of batch and seqlen_q).
    Raises ValueError for anything else, so a new form in grid_expr fails here, not in C."""
    c = _CEIL.sub(lambda m: f"(({m[1]} + {m[2]} - 1) / {m[2]})", expr)
    names = set(re.findall(r"[A-Za-z_]\w*", c))
    if not _C_EXPR.fullmatch(c) or not names <= set(_NAMES):
        raise ValueError(f"launcher: cannot translate grid expression {expr!r} to C "
                         f"(expected B, S, num_splits, merge_blocks, integers, + - * / > ?: and ceil(a / n))")
    return re.sub(r"[A-Za-z_]\w*", lambda m: _NAMES[m[0]], c)


def render_launcher(plan: KernelPlan) -> str:
    """The launcher header's text for `plan`."""
    missing = {f.name for f in FIELDS} - set(_ASSIGN)
    if missing:
        raise KeyError(f"launcher: no assignment for parameter fields {sorted(missing)}")
    return environment().get_template("launcher.h.j2").render(
        plan=plan, variant_name=plan.variant.name, version=__version__, short_name=namespace(plan),
        arch_flags=nvcc_arch_flags(plan.arch.name),
        fields=[_host_field(f) for f in FIELDS], params_size=PARAMS_SIZE, assign=_ASSIGN,
        grid=tuple(_c_expr(e) for e in plan.grid_expr()),
        max_seqlen_q=MAX_SEQLEN_Q, merge_target=MERGE_TARGET_BLOCKS,
        merge_tiles=repr(policy.H200.merge_tiles), split_tiles_per_row=repr(policy.H200.split_tiles_per_row),
        max_splits=policy.H200.max_splits, pdl_tiles_per_sm=policy.H200.pdl_tiles_per_sm,
        balanced_list_positions=policy.BALANCED_LIST_POSITIONS,
        default_smem=DEFAULT_SMEM_LIMIT, kv_map_bytes=TENSOR_MAP_BYTES, kv_box_dims=TMA_BOX_DIMS,
    )


def emit_launcher(plan: KernelPlan, folder: Path) -> Path:
    """Write `plan`'s launcher header into `folder` (beside its .cu); rewritten only when its
    text changes. Returns the header's path."""
    path = Path(folder) / header_name(plan)
    write_if_changed(path, render_launcher(plan))
    return path
