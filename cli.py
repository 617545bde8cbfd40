"""The `mlagen` command line: emit, list, show, check, bench, tune, fuzz."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mlagen.arch import ARCHS, CI_ARCHS
from mlagen.presets import DEFAULT_EMIT_ARCHS, DEFAULT_PRESET, PRESETS, get_preset
from mlagen.spec import DTYPES, MASKS, Variant, parse_variant
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
    launcher: bool = typer.Option(False, help="also write a C++ host launcher header per kernel"),
) -> None:
    """Write standalone .cu files plus JSON manifests into OUT/<preset>/<arch>/."""
    from mlagen.emit import emit_one, emit_preset

    try:
        p = get_preset(preset)
        if variant:
            vs = [parse_variant(name) for name in variant]
            written = [emit_one(p.problem, v, out / p.name / v.arch, launcher) for v in vs]
        else:
            written = emit_preset(p, _archs(arch, DEFAULT_EMIT_ARCHS), out, launcher)
    except (ValueError, SpecError) as e:
        _fail(str(e))
    changed = sum(e.changed for e in written)
    for e in written:
        console.print(f"{'wrote' if e.changed else 'same '} {e.source}")
        if e.launcher:
            console.print(f"      {e.launcher}")
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
    sass: bool = typer.Option(False, "--sass", help="print the main kernel's SASS (needs nvdisasm)"),
    opcodes: bool = typer.Option(False, "--opcodes", help="static count of the main kernel's SASS per opcode"),
) -> None:
    """A variant's plan (derived constants), and optionally its source, resources and SASS."""
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
    if compile_ or sass or opcodes:
        from mlagen.build import build

        built = build(p.problem, plan.variant)
        for name, r in built.module.resources.items():
            console.print(f"{name}: {r}")
    if sass or opcodes:
        _show_sass(built.module.cubin, plan.main_kernel, plan.arch.name, sass, opcodes)


def _show_sass(cubin: bytes, kernel: str, arch: str, listing: bool, counts: bool) -> None:
    from mlagen.sass import SassError, disassemble
    from mlagen.sass import opcodes as count_opcodes

    try:
        text = disassemble(cubin, kernel, arch)
    except SassError as e:
        _fail(str(e))
    if listing:
        console.print(text, markup=False, highlight=False, end="")
    if counts:
        found = count_opcodes(text)
        table = Table(title=f"{kernel}: {sum(found.values())} instructions (static)")
        table.add_column("opcode")
        table.add_column("count", justify="right")
        for op, n in found.most_common():
            table.add_row(op, str(n))
        console.print(table)


@app.command()
def check(
    arch: list[str] | None = typer.Option(None, help="targets; default sm_80 sm_89 sm_90 sm_120"),
    preset: list[str] | None = typer.Option(None, help="presets; default all"),
) -> None:
    """Compile every preset variant for each arch; fail on compile errors or spills (beyond the
    few a 72-row transposed tile is allowed: mma_plan.stack_budget)."""
    from mlagen.build import build
    from mlagen.compiler import CompileError
    from mlagen.mma_plan import stack_budget

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
            budget = stack_budget(v)
            for name, r in built.module.resources.items():
                spill = r.spill_stores + r.spill_loads
                over = r.stack_frame > budget or (spill > 0 and not budget)
                bad += over
                shown = f"[red]{spill}[/red]" if over else (f"[yellow]{spill} (allowed)[/yellow]" if spill else "0")
                table.add_row(p.name, v.name, name.removeprefix(built.plan.name + "_"), str(r.registers),
                              str(built.plan.smem_bytes), shown)
            progress.advance(task)
    console.print(table)
    if bad:
        _fail(f"{bad} kernels failed to compile or spill")
    console.print(f"{len(jobs)} variants compiled for {', '.join(archs)}: no spills beyond the allowed")


def _rows(grid: list[str] | None, row: list[str] | None, default: list[str]):
    from mlagen.grids import select_rows

    try:
        rows = select_rows((grid or []) if grid or row else default, row or [])
    except ValueError as e:
        _fail(str(e))
    return rows


def _problem_options(page_size: int, masks: list[str], dtype: str) -> None:
    if page_size < 1 or page_size & (page_size - 1):
        _fail(f"--page-size: got {page_size}, expected a power of two")
    for m in masks:
        if m not in MASKS:
            _fail(f"--mask: got {m!r}, expected one of {', '.join(MASKS)}")
    if dtype not in DTYPES:
        _fail(f"--dtype: got {dtype!r}, expected one of {', '.join(DTYPES)}")


def _variants(names: list[str] | None) -> tuple[Variant, ...]:
    """The --variant names parsed, in order, repeats dropped; a bad name fails here, before any GPU work."""
    variants: dict[Variant, None] = {}
    for name in names or []:
        try:
            v = parse_variant(name)
        except ValueError as e:
            _fail(f"--variant: {e}")
        if v.arch not in ARCHS:
            _fail(f"--variant: got {name!r} (arch {v.arch}), expected an arch among {', '.join(ARCHS)}")
        variants[v] = None
    return tuple(variants)


def _need_gpu(command: str, why: str = "times kernels") -> None:
    import torch

    if not torch.cuda.is_available():
        _fail(f"{command} {why} and needs a CUDA GPU; none is visible here")


@app.command()
def bench(
    grid: list[str] | None = typer.Option(None, help="seed and/or serving (repeatable); default seed"),
    row: list[str] | None = typer.Option(None, help="a custom row H,B,S,prefix (repeatable)"),
    page_size: int = typer.Option(64, help="KV rows per page"),
    mask: str = typer.Option("causal", help="causal, tree or none"),
    dtype: str = typer.Option("bf16", help="bf16 or fp16"),
    target_ms: float = typer.Option(15.0, help="device time of one graph replay to aim for"),
    variant: list[str] | None = typer.Option(
        None, help="a variant name to time on every row too, as an extra column after the families "
        "(repeatable; e.g. mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a). Named variants count toward "
        "'dispatch vs best'; on rows where one is invalid its cell fails with the reason"),
    out: Path = typer.Option(Path("benchmarks/latest"), help="folder for bench.json, bench.md, bench.png"),
) -> None:
    """Time every family, the dispatcher's pick and torch eager per row; compare with the floor."""
    rows = _rows(grid, row, ["seed"])
    _problem_options(page_size, [mask], dtype)
    if target_ms <= 0:
        _fail(f"--target-ms: got {target_ms}, expected > 0")
    extra = _variants(variant)
    _need_gpu("bench")
    from mlagen.bench import BenchConfig, run_bench
    from mlagen.report import rich_table, write_all
    from mlagen.timing import TimingConfig

    config = BenchConfig(page_size=page_size, mask=mask, dtype=dtype, timing=TimingConfig(target_ms=target_ms),
                         extra=extra)
    with Progress(console=console, transient=True) as progress:
        result = run_bench(rows, config, progress)
    console.print(rich_table(result))
    for path in write_all(result, out):
        console.print(f"wrote {path}")


@app.command()
def tune(
    grid: list[str] | None = typer.Option(None, help="seed and/or serving (repeatable); default both"),
    row: list[str] | None = typer.Option(None, help="a custom row H,B,S,prefix (repeatable)"),
    mask: list[str] | None = typer.Option(None, help="mask kinds to tune (repeatable); default causal"),
    page_size: int = typer.Option(64, help="KV rows per page"),
    dtype: str = typer.Option("bf16", help="bf16 or fp16"),
    max_candidates: int = typer.Option(24, help="variant structures timed per row and mask"),
    split_top: int = typer.Option(3, help="fastest structures whose fixed KV splits are also timed"),
    retimes: int = typer.Option(2, help="further timings of the fastest 3 at the end (ranked by their median)"),
    workers: int | None = typer.Option(None, help="compile processes; default one per CPU"),
    table: Path | None = typer.Option(None, help="table file to merge into; default the user's table"),
    write_default: bool = typer.Option(False, "--write-default",
                                       help="merge into the table shipped in the package (mlagen/tables/)"),
) -> None:
    """Search the variant space per shape on this GPU; save the winners where dispatch reads them.
    A row's pick already in the table is timed with the candidates and stays unless one beats it."""
    import math

    rows = _rows(grid, row, ["seed", "serving"])
    masks = mask or ["causal"]
    _problem_options(page_size, masks, dtype)
    if max_candidates < 1:
        _fail(f"--max-candidates: got {max_candidates}, expected >= 1")
    if split_top < 0:
        _fail(f"--split-top: got {split_top}, expected >= 0")
    if retimes < 0:
        _fail(f"--retimes: got {retimes}, expected >= 0")
    if workers is not None and workers < 1:
        _fail(f"--workers: got {workers}, expected >= 1")
    if table is not None and write_default:
        _fail("--table and --write-default: expected one of them, not both")
    _need_gpu("tune")
    from mlagen.tune import Trial, TuneConfig
    from mlagen.tune import tune as run_tune

    config = TuneConfig(page_size=page_size, masks=tuple(dict.fromkeys(masks)), dtype=dtype,
                        max_candidates=max_candidates, split_top=split_top, retimes=retimes, workers=workers)
    with Progress(console=console, transient=True) as progress:
        path, results = run_tune([r for r, _ in rows], config, table, write_default, progress)
    out = Table(title=f"mlagen tune: {len(results)} shapes")
    for col in ("H", "B", "S", "prefix", "mask", "heuristic µs", "table µs", "best µs", "gain", "best variant",
                "tried", "failed"):
        out.add_column(col)

    def us(trial: Trial | None) -> str:
        return f"{trial.us:.1f}" if trial and math.isfinite(trial.us) else "—"
    for r in results:
        h, best = r.heuristic, r.best
        gain = h.us / best.us if h and math.isfinite(h.us) and math.isfinite(best.us) else None
        out.add_row(str(r.row.heads), str(r.row.batch), str(r.row.seqlen_q), str(r.row.prefix), r.mask,
                    us(h), us(r.incumbent_trial),
                    f"{best.us:.1f}" if math.isfinite(best.us) else "[red]none ran[/red]",
                    f"{gain:.2f}×" if gain else "—", best.variant.name, str(len(r.trials)),
                    str(sum(not math.isfinite(t.us) for t in r.trials)))
    console.print(out)
    console.print(f"wrote {path}")


# FuzzSpace's fields as fuzz's options, for its errors and the replay line.
_FUZZ_OPTIONS = {"heads": "--heads", "max_batch": "--max-batch", "max_seqlen_q": "--max-seqlen-q",
                 "max_prefix": "--max-prefix", "page_sizes": "--page-size", "masks": "--mask", "dtypes": "--dtype"}


@app.command()
def fuzz(
    cases: int = typer.Option(200, help="shapes to draw; shape i comes from seed SEED+i"),
    seed: int = typer.Option(0, help="the first seed (--seed N --cases 1 replays shape N)"),
    minutes: float | None = typer.Option(None, help="stop drawing shapes after this long"),
    variant: list[str] | None = typer.Option(
        None, help="a variant to check on every shape it fits, besides the dispatcher's pick (repeatable)"),
    dispatch: bool = typer.Option(True, "--dispatch/--no-dispatch", help="check the dispatcher's pick"),
    any_variant: bool = typer.Option(False, "--any-variant", help="also check a random variant per shape, any that "
                                     "the DSL accepts for this GPU (each compiles on first use: seconds a shape)"),
    heads: list[int] | None = typer.Option(None, help="head counts to draw from (repeatable); default 8 16 32 64 128"),
    max_batch: int = typer.Option(8, help="requests per batch, at most"),
    max_seqlen_q: int = typer.Option(64, help="draft tokens per request (S), at most"),
    max_prefix: int = typer.Option(20000, help="cached keys before a request's draft, at most"),
    page_size: list[int] | None = typer.Option(None, help="page sizes to draw from (repeatable); default 1 16 64 128"),
    mask: list[str] | None = typer.Option(None, help="masks to draw from (repeatable); default causal, tree, none"),
    dtype: list[str] | None = typer.Option(None, help="dtypes to draw from (repeatable); default bf16, fp16"),
) -> None:
    """Check random shapes on this GPU against the fp64 reference: ragged batches with empty
    requests, draft lengths, heads, page sizes, masks, dtypes and lse, on poisoned outputs.
    Exits with 1 if any check failed, and prints the command that replays each failure."""
    from mlagen.fuzz import FuzzSpace, Outcome
    from mlagen.fuzz import fuzz as run_fuzz

    given = {"heads": heads, "max_batch": max_batch, "max_seqlen_q": max_seqlen_q, "max_prefix": max_prefix,
             "page_sizes": page_size, "masks": mask, "dtypes": dtype}
    defaults = FuzzSpace()
    changed = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    changed = {k: v for k, v in changed.items() if v != getattr(defaults, k)}
    try:
        space = FuzzSpace(**changed)
    except ValueError as e:
        field_name, _, rest = str(e).partition(":")
        _fail(f"{_FUZZ_OPTIONS[field_name]}:{rest}")
    if cases < 1:
        _fail(f"--cases: got {cases}, expected >= 1")
    if minutes is not None and minutes <= 0:
        _fail(f"--minutes: got {minutes}, expected > 0")
    variants: list[Variant | None] = [None] if dispatch else []
    variants += _variants(variant)
    if not variants and not any_variant:
        _fail("--no-dispatch: expected --variant or --any-variant to check then")
    _need_gpu("fuzz", "runs kernels")
    from mlagen.arch import runs_on
    from mlagen.runtime import device_info

    device_arch = device_info(0)[0]
    for v in variants:
        if v is not None and not runs_on(v.arch, device_arch):
            _fail(f"--variant: {v.name} is built for {v.arch}, which does not run on this {device_arch} GPU")

    flags = " ".join(f"{_FUZZ_OPTIONS[k]} {x}" for k, v in changed.items()
                     for x in (v if isinstance(v, tuple) else [v]))

    def replay(o: Outcome) -> str:
        which = "" if o.variant == "dispatch" else f" --no-dispatch --variant {o.variant}"
        return f"mlagen fuzz --seed {o.shape.seed} --cases 1{which}{' ' + flags if flags else ''}"

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("fuzz", total=cases * (len(variants) + any_variant))

        def show(o: Outcome) -> None:
            progress.advance(task)
            if o.status == "fail":
                progress.console.print(f"[red]FAIL[/red] seed {o.shape.seed} {o.shape} {o.variant}: {o.message}\n"
                                       f"     replay: {replay(o)}")

        report = run_fuzz(range(seed, seed + cases), variants, space, any_variant=device_arch if any_variant else None,
                          budget_s=minutes * 60 if minutes is not None else None, on_outcome=show)
    out = Table(title=f"mlagen fuzz: seeds {seed}..{seed + cases - 1} on {device_arch}")
    for col in ("kernel", "ok", "skipped", "failed"):
        out.add_column(col)
    for name in dict.fromkeys(o.kernel for o in report.outcomes):   # random variants in one row
        failed = report.count("fail", name)
        out.add_row(name, str(report.count("ok", name)), str(report.count("skip", name)),
                    f"[red]{failed}[/red]" if failed else "0")
    console.print(out)
    if report.stopped:
        console.print(f"stopped early: {report.stopped}")
    if report.failures:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
