"""`mlagen emit`: standalone .cu files and their JSON manifests for C++ engines.

Each file is one kernel of a (problem, variant): self-contained CUDA C++ (it includes only CUDA's
own cuda_bf16.h / cuda_fp16.h) that NVRTC or nvcc compiles alone. The manifest beside it lists
its kernels with their launch geometry, shared memory and the parameter block's layout.
Files are rewritten only when their text changes.

A file is named after its kernels' C symbols, `KernelPlan.name`: mlagen_<Variant.code_name>_<Problem.name>.
A variant's name holds its KV split (`_spa` adaptive, `_sp2` two splits, `_spb` balanced), but a
counted or adaptive split is a launch parameter (`Variant.split_compiled_in`): the variants that
differ only in it run one kernel, which leaves the split out of its name. So variant
mma_ht64_qt1_bn64_w8_st2_spa_sm90 lands in mlagen_mma_ht64_qt1_bn64_w8_st2_sm90_<problem>.cu,
as does its _sp2 twin, and the file and its manifest are the same whichever of them is emitted
(both describe `Variant.code_variant`). `mlagen list` prints each variant beside its kernel's
name, and `mlagen emit` prints the variants each file it writes serves.
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
from .launcher import header_name, render_launcher


@dataclass(frozen=True)
class Emitted:
    """One kernel's files as `emit_one` left them: its .cu source, its JSON manifest and, if asked
    for, its C++ launcher header. `written` holds those whose text changed, which were written;
    the others already held their text and were left as they were."""

    variant: Variant
    source: Path
    manifest: Path
    written: frozenset[Path]
    launcher: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        """The source, the manifest and the launcher header if any, in that order."""
        return tuple(p for p in (self.source, self.manifest, self.launcher) if p is not None)

    @property
    def changed(self) -> bool:
        """Whether any of the files was written."""
        return bool(self.written)


@dataclass(frozen=True)
class PresetEmitted:
    """What `emit_preset` did: each variant's files, in the preset's order, and the stale mlagen
    files it removed."""

    kernels: list[Emitted]
    removed: list[Path]


def manifest(plan: KernelPlan) -> dict:
    """What a host needs to launch the kernels of `plan`'s file."""
    kernels = [{
        "name": plan.main_kernel,
        "role": "main",
        "grid": list(plan.grid_expr()),
        "block": [plan.launch_threads, 1, 1],
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
            "part_o": (f"{plan.problem.dtype} [partial_rows, Dl], each row divided by its sum" if plan.split.part16
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
    """`folder`/<name>.cu and <name>.json, plus the C++ launcher header <name>_launch.h if asked;
    <name> is the kernel's (`KernelPlan.name`). `variant` is validated as given (a SpecError names
    what does not fit); the files describe its kernel, `Variant.code_variant`."""
    validate(problem, variant)
    plan = validate(problem, variant.code_variant)
    texts = {folder / f"{plan.name}.cu": render(plan),
             folder / f"{plan.name}.json": json.dumps(manifest(plan), indent=2) + "\n"}
    if launcher:
        texts[folder / header_name(plan)] = render_launcher(plan)
    written = frozenset(path for path, text in texts.items() if write_if_changed(path, text))
    source, meta, *header = texts
    return Emitted(variant=variant, source=source, manifest=meta, written=written,
                   launcher=header[0] if header else None)


def emit_preset(preset: Preset, archs: tuple[str, ...], out: Path, launcher: bool = False) -> PresetEmitted:
    """Every variant of `preset` for each arch into out/<preset>/<arch>/. The folder then holds
    exactly the preset's kernels: mlagen files left there by an earlier emit whose variant the
    preset no longer picks are removed (files not named mlagen_* are left alone)."""
    emitted, removed = [], []
    for arch in archs:
        folder = out / preset.name / arch
        mine = [emit_one(preset.problem, v, folder, launcher) for v in preset.variants(arch)]
        keep = {p for e in mine for p in e.files}
        for stale in sorted(folder.glob("mlagen_*")):
            if stale.suffix in (".cu", ".json", ".h") and stale not in keep:
                stale.unlink()
                removed.append(stale)
        emitted += mine
    return PresetEmitted(kernels=emitted, removed=removed)
