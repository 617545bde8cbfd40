"""The `mlagen` command line: emit, list, show, check."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mlagen.arch import ARCHS, CI_ARCHS
from mlagen.presets import DEFAULT_EMIT_ARCHS, DEFAULT_PRESET, PRESETS, get_preset
from mlagen.spec import parse_variant
from mlagen.validate import SpecError, validate

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="mlagen: generate, compile and run MLA verify-attention kernels.")
console = Console(soft_wrap=True)


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _archs(arch: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(arch) if arch else default
    for a in chosen:
        if a not in ARCHS:
            _fail(f"--arch: got {a!r}, expected one of {', '.join(ARCHS)}")
    return chosen


@app.command()
def emit(
    preset: str = typer.Option(DEFAULT_PRESET, help=f"one of: {', '.join(PRESETS)}"),
    arch: list[str] | None = typer.Option(None, help="target(s); default sm_90 and sm_120"),
    variant: list[str] | None = typer.Option(
        None, help="variant name(s) to emit instead of the preset's "
        "(e.g. flash_ht8_qt8_bn32_w8_st2_spa_sm90)"),
    out: Path = typer.Option(Path("generated"), help="output folder"),
) -> None:
    """Write standalone .cu files plus JSON manifests into OUT/<preset>/<arch>/."""
    from mlagen.emit import emit_one, emit_preset

    try:
        p = get_preset(preset)
        if variant:
            vs = [parse_variant(name) for name in variant]
            written = [emit_one(p.problem, v, out / p.name / v.arch) for v in vs]
        else:
            written = emit_preset(p, _archs(arch, DEFAULT_EMIT_ARCHS), out)
    except (ValueError, SpecError) as e:
        _fail(str(e))
    changed = sum(e.changed for e in written)
    for e in written:
        console.print(f"{'wrote' if e.changed else 'same '} {e.source}")
    console.print(f"{len(written)} kernels files for preset {preset}, {changed} changed")


@app.command("list")
def list_() -> None:
    """Presets, their problems and the variants emitted for each arch."""
    table = Table(title="mlagen presets")
    for col in ("preset", "problem", "description", "variants (sm_90)"):
        table.add_column(col)
    for p in PRESETS.values():
        table.add_row(p.name, p.problem.name, p.description,
                      "\n".join(v.name for v in p.variants("sm_90")))
    console.print(table)


@app.command()
def show(
    variant: str = typer.Argument(..., help="variant name, e.g. flash_ht8_qt8_bn32_w8_st2_spa_sm90"),
    preset: str = typer.Option(DEFAULT_PRESET, help="the problem to show it for"),
    source: bool = typer.Option(False, help="print the generated CUDA source"),
    compile_: bool = typer.Option(False, "--compile", help="compile and show ptxas's report"),
) -> None:
    """A variant's plan (derived constants), and optionally its source and resources."""
    try:
        p = get_preset(preset)
        plan = validate(p.problem, parse_variant(variant))
    except (ValueError, SpecError) as e:
        _fail(str(e))
    table = Table(title=plan.name)
    table.add_column("field")
    table.add_column("value")
    for k, v in asdict(plan).items():
        if k not in ("problem", "variant", "arch"):
            table.add_row(k, str(v))
    console.print(table)
    if source:
        from mlagen.codegen import render

        console.print(render(plan), markup=False, highlight=False)
    if compile_:
        from mlagen.build import build

        built = build(p.problem, plan.variant)
        for name, r in built.module.resources.items():
            console.print(f"{name}: {r}")


@app.command()
def check(
    arch: list[str] | None = typer.Option(None, help="targets; default sm_80 sm_89 sm_90 sm_120"),
    preset: list[str] | None = typer.Option(None, help="presets; default all"),
) -> None:
    """Compile every preset variant for each arch; fail on compile errors or spills."""
    from mlagen.build import build
    from mlagen.compiler import CompileError

    archs = _archs(arch, CI_ARCHS)
    presets = [get_preset(n) for n in preset] if preset else list(PRESETS.values())
    jobs = [(p, v) for p in presets for a in archs for v in p.variants(a)]
    table = Table(title="mlagen check")
    for col in ("preset", "variant", "kernel", "regs", "smem", "spills"):
        table.add_column(col)
    bad = 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("compiling", total=len(jobs))
        for p, v in jobs:
            try:
                built = build(p.problem, v)
            except (CompileError, SpecError) as e:
                bad += 1
                table.add_row(p.name, v.name, "-", "-", "-", f"[red]{e}[/red]")
                progress.advance(task)
                continue
            for name, r in built.module.resources.items():
                spill = r.spill_stores + r.spill_loads
                bad += spill > 0
                role = "combine" if name.endswith("_combine") else "main"
                table.add_row(p.name, v.name, role, str(r.registers), str(built.plan.smem_bytes),
                              f"[red]{spill}[/red]" if spill else "0")
            progress.advance(task)
    console.print(table)
    if bad:
        _fail(f"{bad} kernels failed to compile or spill")
    console.print(f"{len(jobs)} variants compiled for {', '.join(archs)}: no spills")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
