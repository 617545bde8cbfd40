"""`mlagen emit`: standalone .cu files and their JSON manifests for C++ engines.

Each file is one (problem, variant): self-contained CUDA C++ (it includes only CUDA's own
cuda_bf16.h / cuda_fp16.h) that NVRTC or nvcc compiles alone. The manifest beside it lists
its kernels with their launch geometry, shared memory and the parameter block's layout.
Files are rewritten only when their text changes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import __version__
from ..codegen.render import render
from ..dispatch.presets import Preset
from ..dsl.spec import Problem, Variant
from ..plan.params import FIELDS, PARAMS_SIZE
from ..plan.validate import KernelPlan, validate
from .files import write_if_changed
from .launcher import emit_launcher


@dataclass(frozen=True)
class Emitted:
    source: Path
    manifest: Path
    changed: bool
    launcher: Path | None = None


def manifest(plan: KernelPlan) -> dict:
    """What a host needs to launch the kernels of `plan`'s file."""
    kernels = [{
        "name": plan.main_kernel,
        "role": "main",
        "grid": list(plan.grid_expr()),
        "block": [plan.threads, 1, 1],
        "dynamic_shared_memory": plan.smem_bytes,
        "launch": "always; with num_splits > 1 the z slabs after the first B hold the merge blocks",
    }]
    return {
        "generator": f"mlagen {__version__}",
        "name": plan.name,
        "arch": plan.arch.name,
        "problem": asdict(plan.problem),
        "variant": asdict(plan.variant),
        "params": {
            "struct": "VerifyParams",
            "passed": "by value, the only kernel argument",
            "size": PARAMS_SIZE,
            "fields": [{"name": f.name, "type": f.ctype, "doc": f.doc} for f in FIELDS],
        },
        "workspace": {
            "when": "num_splits > 1, or a balanced split (the launcher's split_launch)",
            "part_o": (f"{plan.problem.dtype} [partial_rows, Dl], each row divided by its sum" if plan.part16
                       else "float32 [partial_rows, Dl], unnormalized"),
            "part_ml": "float32 [partial_rows, 2], (max, sum) in the log2 domain, after part_o",
            "partial_rows": "the launcher's partial_rows(B, S, num_splits)",
            "counters": ("uint32 [B * grid.x] (each row group's merge blocks wait on its counter); "
                         "zero before the first launch, every launch leaves them zero: zero once and reuse "
                         "on one stream"),
        },
        "kernels": kernels,
    }


def emit_one(problem: Problem, variant: Variant, folder: Path, launcher: bool = False) -> Emitted:
    """`folder`/<name>.cu and <name>.json, plus the C++ launcher header <name>_launch.h if asked."""
    plan = validate(problem, variant)
    source = folder / f"{plan.name}.cu"
    meta = folder / f"{plan.name}.json"
    changed = write_if_changed(source, render(plan))
    changed |= write_if_changed(meta, json.dumps(manifest(plan), indent=2) + "\n")
    header = None
    if launcher:
        header = emit_launcher(plan, folder)
    return Emitted(source=source, manifest=meta, changed=changed, launcher=header)


def emit_preset(preset: Preset, archs: tuple[str, ...], out: Path, launcher: bool = False) -> list[Emitted]:
    """Every variant of `preset` for each arch into out/<preset>/<arch>/. The folder then holds
    exactly the preset's kernels: mlagen files left there by an earlier emit whose variant the
    preset no longer picks are removed (files not named mlagen_* are left alone)."""
    emitted = []
    for arch in archs:
        folder = out / preset.name / arch
        mine = [emit_one(preset.problem, v, folder, launcher) for v in preset.variants(arch)]
        keep = {p for e in mine for p in (e.source, e.manifest, e.launcher) if p is not None}
        for stale in folder.glob("mlagen_*"):
            if stale.suffix in (".cu", ".json", ".h") and stale not in keep:
                stale.unlink()
        emitted += mine
    return emitted
