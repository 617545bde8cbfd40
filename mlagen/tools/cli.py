"""The `mlagen` command line: emit, list, show, check, bench, tune, fuzz (`main`, the console
script; the checkout's cli.py calls it too).

A mistake in the arguments gets one line on stderr, naming the option, what it got and what it
expected, and exit status 2; so does an output folder that cannot be made or written to. bench,
tune and fuzz check their arguments before they look for a GPU.
Results go to stdout, tables whole: where stdout is no terminal (a pipe, a file, a CI log) a table
takes the width it needs, and in a terminal a cell too long for its column folds, never cut short.
`--help` is click's plain text: paragraphs wrapped to the terminal, flags without a value placeholder.

emit, list, show and check need no torch: this module imports only the layers below the runtime
at the top, and the runtime's modules (and torch) inside bench, tune and fuzz, which tell a user
without torch to install mlagen's runtime extra.
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.progress import Progress
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from mlagen.codegen.compiler import Resources
from mlagen.dispatch.presets import DEFAULT_EMIT_ARCHS, DEFAULT_PRESET, PRESETS, Preset
from mlagen.dsl.arch import ARCHS, CI_ARCHS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import DTYPES, KEYS, KV_FORMATS, MASKS, Q_FORMATS, Variant, parse_variant
from mlagen.plan.mma_plan import TRANSPOSED_STACK
from mlagen.plan.validate import KernelPlan, validate
from mlagen.tools.tables import text_table

try:        # recent typer carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

console = Console(soft_wrap=True)                       # results
err_console = Console(stderr=True, soft_wrap=True)      # errors; progress and notes beside a markdown or json result

EXAMPLE_VARIANT = "flash_ht8_qt8_bn32_w8_st2_spa_sm90"
FORMATS = ("table", "markdown", "json")     # what `--format` of bench, tune and fuzz accepts
RUNTIME_EXTRA = "pip install 'mlagen[runtime]'"


def _error(message: str) -> None:
    err_console.print(Text.assemble(("error:", "red"), " ", message))


def _fail(message: str) -> NoReturn:
    """A mistake in the arguments: one line on stderr, exit status 2."""
    _error(message)
    raise typer.Exit(2)


def _usage_message(e: click_errors.UsageError, argv: list[str], command: str) -> str:
    """Click's message for a usage error as one line, in this CLI's words where it can be; command:
    the command line's command ('mlagen emit'), for the pointer to its help."""
    message = e.format_message().removesuffix(".")
    param = getattr(e, "param", None)
    kind = re.search(r"valid (integer|number|float)", message)
    if isinstance(e, click_errors.BadParameter) and param is not None and param.opts and kind:
        parse = int if kind[1] == "integer" else float
        bad = [v for v in _values(argv, param.opts) if not _parses(parse, v)]
        if bad:
            expected = "an integer" if parse is int else "a number"
            message = f"{max(param.opts, key=len)}: got {bad[0]!r}, expected {expected}"
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        command = " ".join(["mlagen", *ctx.command_path.split()[1:]])
    return f"{message} (see '{command} --help')"


def _values(argv: list[str], names: list[str]):
    """The values the command line gives an option of these names ('--x V' or '--x=V')."""
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                yield argv[i + 1]
            elif arg.startswith(name + "="):
                yield arg[len(name) + 1:]


def _parses(parse, text: str) -> bool:
    try:
        parse(text)
        return True
    except ValueError:
        return False


class _Group(TyperGroup):
    """Click's own usage errors (an unknown option or command, a count that is not a number, a
    missing argument) as one line too, with click's exit status 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                                **extra)
        argv = list(args) if args is not None else sys.argv[1:]
        try:
            code = super().main(args=argv, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                                **extra)
        except getattr(click_errors, "NoArgsIsHelpError", ()) as e:    # `mlagen` alone: its help, on stdout
            _write(e.format_message())
            sys.exit(e.exit_code)
        except click_errors.UsageError as e:
            command = " ".join(["mlagen", *argv[:1]]) if argv[:1] and argv[0] in self.commands else "mlagen"
            _error(_usage_message(e, argv, command))
            sys.exit(2)
        except click_errors.ClickException as e:
            _error(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            _error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, rich_markup_mode=None)


def _version() -> str:
    """The package's version (`mlagen.__version__`, which pyproject.toml reads too)."""
    import mlagen

    return mlagen.__version__


def _print_version(show: bool) -> None:
    if show:
        console.print(f"mlagen {_version()}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _app(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print mlagen's version and exit."),
) -> None:
    """mlagen: generate, compile, check, benchmark and tune MLA verify-attention kernels.

    Verify attention: the draft tokens of speculative decoding attend to a paged KV cache.
    """


def _print_table(table: Table, con: Console = console) -> None:
    """Every cell whole: in a terminal a cell too long for its column folds onto more lines;
    elsewhere (a pipe, a file, a CI log: rich would assume 80 columns) the table takes the width it needs."""
    for column in table.columns:
        column.overflow = "fold"
    if not con.is_terminal:
        width = Measurement.get(con, con.options.update_width(1 << 16), table).maximum
        if width > con.width:
            con = Console(file=con.file, width=width)
    con.print(table, soft_wrap=False)       # the caption wraps at the table's width


def _progress(con: Console) -> Progress:
    """A progress bar on `con` while it is a terminal; none in a pipe, a file or a CI log."""
    return Progress(console=con, transient=True, disable=not con.is_terminal)


def _say(con: Console, text: str) -> None:
    """A line of plain text (never read as markup)."""
    con.print(text, markup=False, highlight=False)


def _write(text: str) -> None:
    """Text to stdout as it is (a CUDA source, markdown, json)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ---- argument checks: each fails with one line naming the option

def _choice(option: str, got: str, choices) -> str:
    if got not in choices:
        _fail(f"{option}: got {got!r}, expected one of {', '.join(choices)}")
    return got


def _preset(name: str) -> Preset:
    return PRESETS[_choice("--preset", name, PRESETS)]


def _archs(arch: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(arch)) if arch else default
    for a in chosen:
        _choice("--arch", a, ARCHS)
    return chosen


def _variant(name: str, option: str) -> Variant:
    try:
        v = parse_variant(name)
    except ValueError as e:
        _fail(f"{option}: {e}")
    if v.arch not in ARCHS:
        _fail(f"{option}: got {name!r} (arch {v.arch}), expected an arch among {', '.join(ARCHS)}")
    return v


def _variants(names: list[str] | None, option: str = "--variant") -> tuple[Variant, ...]:
    """The names parsed, in order, repeats dropped; a bad name fails here, before any GPU work."""
    return tuple(dict.fromkeys(_variant(name, option) for name in names or []))


def _plan(preset: Preset, v: Variant, option: str) -> KernelPlan:
    try:
        return validate(preset.problem, v)
    except SpecError as e:
        _fail(f"{option}: {v.name} does not fit preset {preset.name} ({e})")


def _folder(given: Path, option: str, target: Path | None = None, expected: str = "a folder") -> None:
    """`target` (default `given`), a folder to write into, must be one or become one: it, or the
    nearest of its parents that exists, is a folder this user may write to. It is made here, with
    its missing parents, so that one that cannot be made (under /proc, on a read-only disk) fails
    now, with the others, not after the work."""
    folder = target or given
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = "it" if existing == given else str(existing)
    if not existing.is_dir():
        _fail(f"{option}: got '{given}', expected {expected} ({where} is a file)")
    if not os.access(existing, os.W_OK | os.X_OK):
        _fail(f"{option}: got '{given}', expected {expected} you may write to ({where} is not writable)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"{option}: got '{given}', expected {expected} you may write to "
              f"(making {folder} failed: {e.strerror or e})")


def _table_file(path: Path) -> None:
    """--table: a table file `mlagen tune` wrote, or a new one, in a folder this user may write to."""
    from mlagen.dispatch.tables import load_table

    if path.exists():
        if path.is_dir():
            _fail(f"--table: got '{path}', expected a table file (it is a folder)")
        try:
            load_table(path)
        except (OSError, ValueError, KeyError) as e:
            reason = str(e).removeprefix(f"{path}: ")
            _fail(f"--table: got '{path}', expected a table file that mlagen tune wrote, or a new file; {reason}")
    _folder(path, "--table", path.parent, "a file in a folder")


def _format(fmt: str) -> str:
    return _choice("--format", fmt, FORMATS)


def _info(fmt: str) -> Console:
    """Where progress and notes go: stdout beside a table; stderr beside markdown or json (stdout holds the result)."""
    return console if fmt == "table" else err_console


def _rows(grid: list[str] | None, row: list[str] | None, default: list[str]):
    from mlagen.tools.grids import select_rows

    try:
        return select_rows((grid or []) if grid or row else default, row or [])
    except ValueError as e:
        _fail(str(e))


def _page_size(option: str, page_size: int) -> None:
    if page_size < 1 or page_size & (page_size - 1):
        _fail(f"{option}: got {page_size}, expected a power of two (1, 2, 4, ... 64, 128, ...)")


def _problem_options(page_size: int, masks: list[str], dtype: str) -> None:
    _page_size("--page-size", page_size)
    for m in masks:
        _choice("--mask", m, MASKS)
    _choice("--dtype", dtype, DTYPES)


def _at_least(option: str, got: float | None, least: float, strict: bool = False) -> None:
    if got is not None and not (math.isfinite(got) and (got > least if strict else got >= least)):
        _fail(f"{option}: got {got}, expected {'a finite number ' if not math.isfinite(got) else ''}"
              f"{'>' if strict else '>='} {least}")


def _need_runtime(command: str) -> None:
    """bench, tune and fuzz run kernels through mlagen's runtime, which needs torch (the runtime extra)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        _fail(f"{command} runs kernels through mlagen's runtime, which needs torch, and torch is not installed "
              f"here; install mlagen's runtime extra: {RUNTIME_EXTRA}")


def _need_gpu(command: str, why: str = "times kernels") -> None:
    _need_runtime(command)
    import torch

    if not torch.cuda.is_available():
        _fail(f"{command} {why} and needs a CUDA GPU; none is visible here")


# ---- the commands

DTYPE_HELP = f"the data type of q, the KV cache and the output: one of {', '.join(DTYPES)}"
PRESET_HELP = f"the model's attention shape: one of {', '.join(PRESETS)}"
FORMAT_HELP = ("table (default), markdown (a GitHub table) or json (for scripts); markdown and json go to stdout "
               "alone, with progress and notes on stderr")
GRID_HELP = ("a named set of shapes (repeatable): seed (64 heads, one request, S 9 and 33, 256 to 64K cached keys) "
             "or serving (batched shapes that have published FlashMLA times)")
ROW_HELP = ("a shape of your own (repeatable): H,B,S,prefix = heads, requests, draft tokens per request (1 to 64), "
            "cached keys before them; e.g. 64,1,9,4096")


@app.command()
def emit(
    preset: str = typer.Option(DEFAULT_PRESET, metavar="NAME", help=PRESET_HELP),
    arch: list[str] | None = typer.Option(
        None, "--arch", metavar="ARCH",
        help=f"a GPU arch to write kernels for (repeatable): one of {', '.join(ARCHS)}; "
             f"default {' and '.join(DEFAULT_EMIT_ARCHS)}"),
    variant: list[str] | None = typer.Option(
        None, metavar="NAME", help=f"a variant to write instead of the preset's (repeatable; e.g. "
        f"{EXAMPLE_VARIANT}); its name ends with its arch, so not with --arch"),
    out: Path = typer.Option(Path("generated"), metavar="FOLDER", help="the folder to write into (made if missing)"),
    launcher: bool = typer.Option(False, "--launcher",
                                  help="also write a C++ header per kernel that launches it from host code"),
) -> None:
    """Write standalone CUDA kernels (.cu) and their JSON manifests.

    They go into the --out folder, under PRESET/ARCH/: the variants the dispatcher picks for the
    preset's shapes, or those --variant names. Each file is named after its kernel: a variant
    whose KV split is chosen at launch (_spa, _sp2) shares it with the variants that differ only
    in the split, and its name leaves the split out. Each line names a file and says whether it
    was written or was unchanged (it already held that text; it is left as it was), and a
    kernel's line names the variants it serves. Kernels an earlier emit wrote there that the
    preset no longer has are removed; other files stay.
    """
    from mlagen.tools.emit import Emitted, emit_one, emit_preset

    p = _preset(preset)
    archs = _archs(arch, DEFAULT_EMIT_ARCHS)
    if variant and arch:
        _fail("--arch: not used with --variant (a variant's name ends with its arch); give one or the other")
    vs = _variants(variant)
    for v in vs:
        _plan(p, v, "--variant")
    for a in {v.arch for v in vs} or archs:
        _folder(out, "--out", out / p.name / a)
    removed: list[Path] = []
    try:
        if vs:
            emitted = [emit_one(p.problem, v, out / p.name / v.arch, launcher) for v in vs]
        else:
            done = emit_preset(p, archs, out, launcher)
            emitted, removed = done.kernels, done.removed
    except OSError as e:
        _error(f"writing into {out}: {e}")
        raise typer.Exit(1) from None
    kernels: dict[Path, list[Emitted]] = {}             # the variants that share a file, by its source
    for e in emitted:
        kernels.setdefault(e.source, []).append(e)
    written = set().union(*(e.written for e in emitted))
    for same in kernels.values():
        names = ", ".join(e.variant.name for e in same)
        for path in same[0].files:
            status = "written" if path in written else "unchanged"
            which = f"  (variant{'s' if len(same) > 1 else ''} {names})" if path == same[0].source else ""
            _say(console, f"{status:<9}  {path}{which}")
    for path in removed:
        _say(console, f"{'removed':<9}  {path}  (a kernel the preset no longer has)")
    files = {path for same in kernels.values() for path in same[0].files}
    its = "its" if len(kernels) == 1 else "their"
    _say(console, f"{_plural(len(kernels), 'kernel file')} for preset {p.name}, with "
                  f"{its} {'manifests and launchers' if launcher else 'manifests'}: {len(written)} of "
                  f"{_plural(len(files), 'file')} written, {len(files - written)} unchanged"
                  + (f", {_plural(len(removed), 'stale file')} removed" if removed else ""))


@app.command("list")
def list_(
    arch: list[str] | None = typer.Option(
        None, "--arch", metavar="ARCH",
        help=f"the arch whose variants to list (repeatable): one of {', '.join(ARCHS)}; "
             f"default {' and '.join(DEFAULT_EMIT_ARCHS)}, as emit"),
) -> None:
    """List the presets and the kernel variants emit writes for each.

    A preset is a model's attention shape. Each line holds a variant's name, whole, to pass to
    show, emit --variant or bench --variant, and beside it the name of its kernel, which names the
    file emit writes it into: mlagen_KERNEL_PROBLEM.cu. The two differ where the variant's KV
    split is chosen at launch (_spa, _sp2): variants that differ only in it share one kernel,
    whose name leaves the split out.
    """
    archs = _archs(arch, DEFAULT_EMIT_ARCHS)
    _print_table(text_table("mlagen presets", ("preset", "heads", "problem", "description"),
                            [[p.name, str(p.problem.heads), p.problem.name, p.description] for p in PRESETS.values()]))
    _say(console, "\nEach variant is listed beside its kernel, which names the file emit writes it into "
                  "(mlagen_KERNEL_PROBLEM.cu). A KV split chosen at launch (_spa, _sp2) is no part of the kernel, so "
                  "the kernel's name leaves it out.")
    for p in PRESETS.values():
        for a in archs:
            vs = p.variants(a)
            _say(console, f"\n{p.name} on {a}: {_plural(len(vs), 'variant')}, in files "
                          f"mlagen_KERNEL_{p.problem.name}.cu")
            width = max((len(v.name) for v in vs), default=0)
            for v in vs:
                _say(console, f"  {v.name:<{width}}  kernel {v.code_name}")


@app.command()
def show(
    variant: str = typer.Argument(..., metavar="VARIANT",
                                  help=f"a variant name, e.g. {EXAMPLE_VARIANT} (mlagen list lists some)"),
    preset: str = typer.Option(DEFAULT_PRESET, metavar="NAME", help=PRESET_HELP),
    source: bool = typer.Option(
        False, "--source", help="print the kernel's CUDA source to stdout, alone: the plan and any report go to "
        "stderr, so 'mlagen show VARIANT --source > kernel.cu' writes just the source"),
    compile_: bool = typer.Option(False, "--compile", help="compile it and print a table of each kernel's registers, "
                                  "shared memory, stack and spills"),
    sass: bool = typer.Option(False, "--sass", help="print the main kernel's machine code, SASS (needs nvdisasm)"),
    opcodes: bool = typer.Option(False, "--opcodes", help="count the main kernel's SASS instructions per opcode"),
) -> None:
    """Show a variant's plan, and optionally its CUDA source, compile report and SASS.

    The plan holds the tile sizes, threads, shared memory and the other constants the kernel is
    built with for the preset's shape.
    """
    p = _preset(preset)
    plan = _plan(p, _variant(variant, "VARIANT"), "VARIANT")
    side = err_console if source else console
    table = Table(title=plan.name)
    table.add_column("field")
    table.add_column("value")
    for k, v in asdict(plan).items():
        if k in ("problem", "variant", "arch"):
            continue
        for name, value in (((f"{k}.{kk}", vv) for kk, vv in v.items()) if isinstance(v, dict) else [(k, v)]):
            table.add_row(name, Text(str(value)))
    _print_table(table, side)
    if source:
        from mlagen.codegen.render import render

        _write(render(plan))
    if compile_ or sass or opcodes:
        from mlagen.codegen.build import build

        built = build(p.problem, plan.variant)
        _print_table(_resources_table(built.plan, built.module.resources), side)
    if sass or opcodes:
        _show_sass(built.module.cubin, plan.main_kernel, plan.arch.name, sass, opcodes, side)


def _resources_table(plan: KernelPlan, resources: dict[str, Resources]) -> Table:
    """ptxas's report on `plan`'s kernels, a row per kernel, with the spills that `check` allows."""
    from mlagen.plan.schedules import stack_budget

    budget = stack_budget(plan.variant)
    rows = [[name.removeprefix(plan.name + "_"), str(r.registers), str(r.shared_static), str(plan.smem_bytes),
             str(r.stack_frame), str(r.spill_stores), str(r.spill_loads), _spill_verdict(r, budget)[1]]
            for name, r in resources.items()]
    return text_table(f"{plan.name} on {plan.arch.name}",
                      ("kernel", "registers", "static smem", "dynamic smem", "stack", "spill stores", "spill loads",
                       "spills (check)"), rows, right=lambda col: col not in ("kernel", "spills (check)"),
                      caption=ALLOWED_SPILLS)


def _show_sass(cubin: bytes, kernel: str, arch: str, listing: bool, counts: bool, con: Console) -> None:
    from mlagen.tools.sass import SassError, disassemble
    from mlagen.tools.sass import opcodes as count_opcodes

    try:
        text = disassemble(cubin, kernel, arch)
    except SassError as e:
        _fail(f"--sass/--opcodes: {e}")
    if listing:
        if con is console:
            _write(text)
        else:
            con.print(text, markup=False, highlight=False, end="")
    if counts:
        found = count_opcodes(text)
        _print_table(text_table(f"{kernel}: {sum(found.values())} instructions (static)", ("opcode", "count"),
                                [[op, str(n)] for op, n in found.most_common()], right=lambda col: col == "count"),
                     con)


# What check allows, as its output and --help say it (tests/test_cli.py holds it to stack_budget).
ALLOWED_SPILLS = (f"Spills fail check, but for one allowance: a transposed tile (_tr) of more than 32 query rows "
                  f"(q_tile x head_tile) may keep up to {TRANSPOSED_STACK} bytes of stack: its output accumulators "
                  "fill the registers, so ptxas spills a few dozen bytes (TRANSPOSED_STACK in "
                  "mlagen/plan/mma_plan.py).")


def _spill_verdict(r: Resources, budget: int) -> tuple[str, Text]:
    """What check makes of a kernel's spills, given the stack it may keep (`budget` bytes):
    ("none", "0"), ("allowed", the bytes and the allowance) or ("fails", the bytes and why)."""
    spill = r.spill_stores + r.spill_loads
    if budget and r.stack_frame > budget:
        return "fails", Text(f"fails: {spill} bytes, stack {r.stack_frame} > {budget} allowed", style="red")
    if spill and not budget:
        return "fails", Text(f"fails: {spill} bytes (no spills allowed)", style="red")
    if spill:
        return "allowed", Text(f"{spill} bytes: allowed (transposed tile, stack {r.stack_frame} <= {budget})",
                               style="yellow")
    return "none", Text("0")


@app.command()
def check(
    arch: list[str] | None = typer.Option(
        None, "--arch", metavar="ARCH",
        help=f"an arch to compile for (repeatable): one of {', '.join(ARCHS)}; default {' '.join(CI_ARCHS)}"),
    preset: list[str] | None = typer.Option(
        None, metavar="NAME", help=f"a preset to compile (repeatable): one of {', '.join(PRESETS)}; default all"),
) -> None:
    """Compile every preset's kernels for each arch, without a GPU, and check them.

    Lists each kernel's registers, shared memory and spills. Exits with 1 if a kernel does not
    compile or spills registers to memory, but for the one allowance: a transposed tile of more
    than 32 query rows may keep a little stack (its output accumulators fill the registers), and
    its spills cell says so.
    """
    from mlagen.codegen.build import build
    from mlagen.codegen.compiler import CompileError
    from mlagen.plan.schedules import stack_budget

    archs = _archs(arch, CI_ARCHS)
    presets = [_preset(n) for n in dict.fromkeys(preset)] if preset else list(PRESETS.values())
    jobs = [(p, v) for p in presets for a in archs for v in p.variants(a)]
    bad = allowed = 0
    rows: list[list[str | Text]] = []
    with _progress(console) as progress:
        task = progress.add_task("compiling", total=len(jobs))
        for p, v in jobs:
            try:
                built = build(p.problem, v)
            except (CompileError, SpecError) as e:
                bad += 1
                rows.append([p.name, v.name, "-", "-", "-", Text(str(e), style="red")])
                progress.advance(task)
                continue
            for name, r in built.module.resources.items():
                status, verdict = _spill_verdict(r, stack_budget(v))
                bad += status == "fails"
                allowed += status == "allowed"
                rows.append([p.name, v.name, name.removeprefix(built.plan.name + "_"), str(r.registers),
                             str(built.plan.smem_bytes), verdict])
            progress.advance(task)
    _print_table(text_table("mlagen check", ("preset", "variant", "kernel", "regs", "smem", "spills"), rows,
                            caption=ALLOWED_SPILLS))
    if bad:
        _error(f"{_plural(bad, 'kernel')} failed to compile or spilled")
        raise typer.Exit(1)
    spilled = "no spills"
    if allowed:
        spilled = (f"{_plural(allowed, 'kernel')} {'spills' if allowed == 1 else 'spill'} within the transposed "
                   "tile's allowance, none beyond it")
    _say(console, f"{_plural(len(jobs), 'variant')} compiled for {', '.join(archs)}: {spilled}")


def _comma_choices(option: str, given: list[str] | None, choices, default: list[str]) -> tuple[str, ...]:
    """An option's values, each a comma list, in order, repeats dropped; `default` when not given."""
    names = [m.strip() for text in given or default for m in text.split(",")]
    for m in names:
        _choice(option, m, choices)
    return tuple(dict.fromkeys(names))


@app.command()
def bench(
    grid: list[str] | None = typer.Option(None, metavar="NAME", help=GRID_HELP + "; default seed"),
    row: list[str] | None = typer.Option(None, metavar="H,B,S,PREFIX", help=ROW_HELP),
    page_size: int = typer.Option(64, metavar="N", help="KV cache rows (keys) per page: a power of two"),
    mask: list[str] | None = typer.Option(
        None, "--mask", metavar="MASK[,MASK...]",
        help="the draft tokens' masks (comma-separated, or the option repeated): causal, none, tree (one random "
        "draft tree for the batch) or tree-per-request (one per request). The first is the base, under which "
        "every column is timed; each further one times the dispatcher's pick alone, on the same inputs, in a column "
        "dispatch:MASK with its ratio over the base's (e.g. tree/causal). Default causal"),
    dtype: str = typer.Option("bf16", "--dtype", metavar="DTYPE", help=DTYPE_HELP),
    target_ms: float = typer.Option(15.0, metavar="MS", help="GPU time in ms of each timed batch of calls; more "
                                    "gives steadier figures and a longer run"),
    variant: list[str] | None = typer.Option(
        None, metavar="NAME", help="a variant to time on every shape too, in a column after the families "
        "(repeatable; e.g. mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a). It counts toward 'dispatch vs best'; where it "
        "does not fit a shape, its cell says why"),
    batch_invariant: bool = typer.Option(
        False, "--batch-invariant", help="also time the pick of batch-invariant mode (verify_attention("
        "batch_invariant=True)) under the base mask, in a column 'invariant' with its ratio over dispatch"),
    fp8: list[str] | None = typer.Option(
        None, "--fp8", metavar="CASE[,CASE...]",
        help="also time the dispatcher's pick on the same inputs in FP8 (comma-separated, or the option repeated): "
        "e4m3 (a flat e4m3 cache with bf16/fp16 queries), ds_mla (DeepSeek's 656-byte rows) or e4m3-q (e4m3 "
        "queries over an e4m3 cache), under the base mask, in a column fp8:CASE against a floor of its "
        "own bytes and matrix rate, with its ratio over dispatch"),
    flashmla: Path | None = typer.Option(
        None, metavar="DIR", help="a FlashMLA checkout built with benchmarks/build_flashmla.py, timed live on the "
        "same inputs (bf16, causal or no mask; with --sparse its sparse FP8 decode); default $MLAGEN_FLASHMLA, else "
        "./third_party/FlashMLA. Without a build, the FlashMLA column holds the stored figures where they apply"),
    sparse: bool = typer.Option(
        False, "--sparse", help="time sparse verify instead (DeepSeek Sparse Attention: each token over its own "
        "topk 2048 rows of a ds_mla cache): H 64 and 128, S 1, 2 and 4, B 1 to 128, against the floor and "
        "FlashMLA's sparse kernel; writes sparse.json and sparse.md. Takes --variant, --flashmla, --target-ms, "
        "--out and --format"),
    out: Path = typer.Option(Path("benchmarks/latest"), metavar="FOLDER",
                             help="the folder for bench.json, bench.md and bench.png (with --sparse: "
                                  "sparse.json and sparse.md)"),
    format_: str = typer.Option("table", "--format", metavar="FORMAT", help=FORMAT_HELP),
) -> None:
    """Time the kernels on this GPU, shape by shape, against PyTorch eager and the floor.

    Per shape: each kernel family, the dispatcher's pick and PyTorch eager, in µs per call and as
    a multiple of the floor (the least time the GPU's measured memory bandwidth and matmul rate
    allow); the dispatcher's pick under each further --mask, batch-invariant mode's pick with
    --batch-invariant, and on FP8 inputs with --fp8. Writes bench.json, bench.md and bench.png into
    the --out folder too.
    """
    _need_runtime("bench")
    from mlagen.tools.workload import FP8_CASES
    from mlagen.tools.workload import MASKS as BENCH_MASKS

    fmt = _format(format_)
    if sparse:
        dense = [name for name, given in (("--grid", grid), ("--row", row), ("--mask", mask), ("--fp8", fp8),
                                          ("--batch-invariant", batch_invariant)) if given]
        dense += [f"--page-size {page_size}"] * (page_size != 64) + [f"--dtype {dtype}"] * (dtype != "bf16")
        if dense:
            _fail(f"--sparse: expected no dense-grid options with it (its rows are fixed, ds_mla over 64-key "
                  f"pages, bf16 queries), got {', '.join(dense)}")
        _bench_sparse(variant, flashmla, target_ms, out, fmt)
        return
    rows = _rows(grid, row, ["seed"])
    masks = _comma_choices("--mask", mask, BENCH_MASKS, ["causal"])
    fp8_cases = _comma_choices("--fp8", fp8, FP8_CASES, [])
    _page_size("--page-size", page_size)
    _choice("--dtype", dtype, DTYPES)
    extra = _bench_checks(variant, flashmla, target_ms, out)
    from mlagen.tools import report
    from mlagen.tools.bench import BenchConfig, run_bench
    from mlagen.tools.timing import TimingConfig

    config = BenchConfig(page_size=page_size, masks=masks, dtype=dtype, timing=TimingConfig(target_ms=target_ms),
                         extra=extra, batch_invariant=batch_invariant, fp8=fp8_cases, flashmla=flashmla)
    _run_bench(fmt, out, lambda progress: run_bench(rows, config, progress), report.rich_table, report.markdown,
               report.to_json, report.write_all)


def _bench_checks(variant: list[str] | None, flashmla: Path | None, target_ms: float, out: Path) -> tuple[Variant, ...]:
    """The checks `bench` and `bench --sparse` share, then that a GPU is there; the named variants."""
    _at_least("--target-ms", target_ms, 0, strict=True)
    extra = _variants(variant)
    _folder(out, "--out")
    if flashmla is not None and not (flashmla / "flash_mla" / "__init__.py").is_file():
        _fail(f"--flashmla {flashmla}: expected a FlashMLA checkout (a folder holding flash_mla/__init__.py)")
    _need_gpu("bench")
    return extra


def _run_bench(fmt: str, out: Path, run, table, markdown, to_json, write_all) -> None:
    """A bench run under a progress display, its result printed as `fmt` asks and written into `out`."""
    info = _info(fmt)
    with _progress(info) as progress:
        result = run(progress)
    if fmt == "table":
        _print_table(table(result))
    else:
        _write(markdown(result) if fmt == "markdown" else to_json(result))
    try:
        paths = write_all(result, out)
    except OSError as e:
        _error(f"writing into {out}: {e}")
        raise typer.Exit(1) from None
    for path in paths:
        _say(info, f"wrote {path}")


def _bench_sparse(variant: list[str] | None, flashmla: Path | None, target_ms: float, out: Path, fmt: str) -> None:
    """`mlagen bench --sparse`: the sparse grid, its tables and files."""
    extra = _bench_checks(variant, flashmla, target_ms, out)
    from mlagen.tools import sparse_bench
    from mlagen.tools.timing import TimingConfig

    config = sparse_bench.SparseConfig(timing=TimingConfig(target_ms=target_ms), extra=extra, flashmla=flashmla)
    _run_bench(fmt, out, lambda progress: sparse_bench.run_sparse(sparse_bench.sparse_grid(), config, progress),
               sparse_bench.rich_table, sparse_bench.markdown, lambda result: result.to_json(), sparse_bench.write_all)


@app.command()
def tune(
    grid: list[str] | None = typer.Option(None, metavar="NAME", help=GRID_HELP + "; default both"),
    row: list[str] | None = typer.Option(None, metavar="H,B,S,PREFIX", help=ROW_HELP),
    mask: list[str] | None = typer.Option(
        None, "--mask", metavar="MASK",
        help=f"a mask to tune for (repeatable): one of {', '.join(MASKS)}; default causal"),
    page_size: int = typer.Option(64, metavar="N", help="KV cache rows (keys) per page: a power of two"),
    dtype: str = typer.Option("bf16", "--dtype", metavar="DTYPE", help=DTYPE_HELP),
    kv: str = typer.Option("dtype", "--kv", metavar="FORMAT",
                           help="the KV cache's format: dtype (--dtype's), e4m3 or ds_mla (FP8 caches: the inputs "
                           "quantized, the winners under keys of their own)"),
    q: str = typer.Option("dtype", "--q", metavar="FORMAT",
                          help="the queries' format: dtype, or e4m3 (with --kv e4m3: e4m3 queries, the winners under "
                          "keys of their own)"),
    max_candidates: int = typer.Option(24, metavar="N", help="variants timed per shape and mask, at most"),
    split_top: int = typer.Option(3, metavar="N", help="how many of the fastest variants are timed again with each "
                                  "fixed number of KV splits (a request's keys shared among thread blocks)"),
    retimes: int = typer.Option(2, metavar="N", help="how many more times the fastest 3 are timed at the end (they "
                                "rank by the median)"),
    workers: int | None = typer.Option(None, metavar="N", help="processes compiling candidates; default one per CPU"),
    table: Path | None = typer.Option(None, metavar="FILE", help="the table file to merge the winners into; default "
                                      "this user's table for this GPU, which the dispatcher reads"),
    write_default: bool = typer.Option(
        False, "--write-default", help="merge into the table shipped with mlagen (mlagen/dispatch/tables/) instead"),
    format_: str = typer.Option("table", "--format", metavar="FORMAT", help=FORMAT_HELP),
) -> None:
    """Find the fastest variant per shape on this GPU and save it for the dispatcher.

    The winners go into a table file that the dispatcher reads from then on. A shape's earlier
    pick in the table is timed with the candidates and stays unless one beats it.
    """
    fmt = _format(format_)
    rows = _rows(grid, row, ["seed", "serving"])
    masks = mask or ["causal"]
    _problem_options(page_size, masks, dtype)
    _choice("--kv", kv, KV_FORMATS)
    _choice("--q", q, Q_FORMATS)
    if q != "dtype" and kv != "e4m3":
        _fail(f"--q {q}: expected --kv e4m3 with it (e4m3 queries are tuned over an e4m3 cache), got --kv {kv}")
    _at_least("--max-candidates", max_candidates, 1)
    _at_least("--split-top", split_top, 0)
    _at_least("--retimes", retimes, 0)
    _at_least("--workers", workers, 1)
    if table is not None and write_default:
        _fail("--table and --write-default: expected one of them, not both")
    if table is not None:
        _table_file(table)
    if write_default:
        from mlagen.dispatch.tables import SHIPPED_DIR

        _folder(SHIPPED_DIR, "--write-default")
    _need_gpu("tune")
    from mlagen.tools.report import tune_json, tune_markdown, tune_table
    from mlagen.tools.tune import TuneConfig
    from mlagen.tools.tune import tune as run_tune

    info = _info(fmt)
    config = TuneConfig(page_size=page_size, masks=tuple(dict.fromkeys(masks)), dtype=dtype, kv_format=kv,
                        q_format=q, max_candidates=max_candidates, split_top=split_top, retimes=retimes,
                        workers=workers)
    with _progress(info) as progress:
        path, results = run_tune([r for r, _ in rows], config, table, write_default, progress)
    if fmt == "table":
        _print_table(tune_table(results))
    else:
        _write(tune_markdown(path, results) if fmt == "markdown" else tune_json(path, results))
    _say(info, f"wrote {path}")


# FuzzSpace's fields as fuzz's options, for its errors and the replay line.
_FUZZ_OPTIONS = {"heads": "--heads", "max_batch": "--max-batch", "max_seqlen_q": "--max-seqlen-q",
                 "max_prefix": "--max-prefix", "page_sizes": "--page-size", "masks": "--mask", "dtypes": "--dtype",
                 "kv_formats": "--kv", "q_formats": "--q", "keys": "--keys"}
MAX_SEED = 1 << 62
DEFAULT_FUZZ_CASES = 200


@app.command()
def fuzz(
    cases: int | None = typer.Option(
        None, metavar="N", help=f"shapes to draw (shape i comes from seed SEED+i); default {DEFAULT_FUZZ_CASES}, "
        "or with --minutes as many as the time allows"),
    seed: int = typer.Option(0, metavar="N", help="the first seed (--seed N --cases 1 replays shape N)"),
    minutes: float | None = typer.Option(None, "--minutes", metavar="MINUTES",
                                         help="stop drawing shapes after this many minutes"),
    variant: list[str] | None = typer.Option(
        None, metavar="NAME",
        help="a variant to check on every shape it fits, besides the dispatcher's pick (repeatable)"),
    dispatch: bool = typer.Option(True, "--dispatch/--no-dispatch", help="check the dispatcher's pick"),
    any_variant: bool = typer.Option(False, "--any-variant", help="also check a random variant per shape, any that "
                                     "this GPU runs (each compiles on first use: seconds a shape)"),
    heads: list[int] | None = typer.Option(None, metavar="H",
                                           help="head counts to draw from (repeatable); default 8 16 32 64 128"),
    max_batch: int = typer.Option(8, metavar="B", help="requests per batch, at most"),
    max_seqlen_q: int = typer.Option(64, metavar="S", help="draft tokens per request (S), at most"),
    max_prefix: int = typer.Option(20000, metavar="KEYS", help="cached keys before a request's draft, at most"),
    page_size: list[int] | None = typer.Option(None, metavar="N",
                                               help="page sizes to draw from (repeatable); default 1 16 64 128"),
    mask: list[str] | None = typer.Option(None, "--mask", metavar="MASK",
                                          help="masks to draw from (repeatable); default causal, tree, none"),
    dtype: list[str] | None = typer.Option(None, "--dtype", metavar="DTYPE",
                                           help="dtypes to draw from (repeatable); default bf16, fp16"),
    kv: list[str] | None = typer.Option(None, "--kv", metavar="FORMAT",
                                        help="KV cache formats to draw from (repeatable): dtype (q's), e4m3, "
                                        "ds_mla; default dtype"),
    q: list[str] | None = typer.Option(None, "--q", metavar="FORMAT",
                                       help="query formats to draw from (repeatable): dtype (bf16/fp16), e4m3 (with "
                                       "a q_scale); default dtype"),
    keys: list[str] | None = typer.Option(None, "--keys", metavar="KEYS",
                                          help="keys to draw (repeatable): paged (a request's prefix and drafts), "
                                          "gathered (sparse verify: each token's listed rows); default paged"),
    format_: str = typer.Option("table", "--format", metavar="FORMAT", help=FORMAT_HELP),
) -> None:
    """Check the kernels on random shapes on this GPU against a float64 reference.

    Shapes vary batches (ragged, some requests empty), draft lengths, head counts, page sizes,
    masks, dtypes, KV cache and query formats (with --kv and --q), paged or gathered keys (with
    --keys) and lse; each runs into an
    output filled with garbage first. Exits with 1 if a check failed, and prints the command that
    replays each failure.
    """
    _need_runtime("fuzz")
    from mlagen.tools.fuzz import FuzzSpace, Outcome
    from mlagen.tools.fuzz import fuzz as run_fuzz

    fmt = _format(format_)
    for h in heads or []:
        _at_least("--heads", h, 1)
    for size in page_size or []:
        _page_size("--page-size", size)
    for m in mask or []:
        _choice("--mask", m, MASKS)
    for d in dtype or []:
        _choice("--dtype", d, DTYPES)
    for f in kv or []:
        _choice("--kv", f, KV_FORMATS)
    for f in q or []:
        _choice("--q", f, Q_FORMATS)
    for k in keys or []:
        _choice("--keys", k, KEYS)
    given = {"heads": heads, "max_batch": max_batch, "max_seqlen_q": max_seqlen_q, "max_prefix": max_prefix,
             "page_sizes": page_size, "masks": mask, "dtypes": dtype, "kv_formats": kv, "q_formats": q,
             "keys": keys}
    defaults = FuzzSpace()
    changed = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}
    changed = {k: v for k, v in changed.items() if v != getattr(defaults, k)}
    try:
        space = FuzzSpace(**changed)
    except ValueError as e:
        field_name, _, rest = str(e).partition(":")
        _fail(f"{_FUZZ_OPTIONS.get(field_name, field_name)}:{rest}")
    _at_least("--cases", cases, 1)
    until_time = cases is None and minutes is not None     # draw shapes until the time runs out
    if cases is None:
        cases = MAX_SEED - max(seed, 0) if until_time else DEFAULT_FUZZ_CASES
    if not 0 <= seed <= MAX_SEED - cases:
        _fail(f"--seed: got {seed}, expected 0 <= seed and seed + cases <= 2**62")
    _at_least("--minutes", minutes, 0, strict=True)
    variants: list[Variant | None] = [None] if dispatch else []
    variants += _variants(variant)
    if not variants and not any_variant:
        _fail("--no-dispatch: expected --variant or --any-variant to check then")
    _need_gpu("fuzz", "runs kernels")
    from mlagen.dsl.arch import runs_on
    from mlagen.runtime.op import device_info
    from mlagen.tools.report import fuzz_json, fuzz_markdown, fuzz_table

    device_arch = device_info(0)[0]
    for v in variants:
        if v is not None and not runs_on(v.arch, device_arch):
            _fail(f"--variant: got {v.name}, built for {v.arch}, expected a variant this {device_arch} GPU runs")

    flags = " ".join(f"{_FUZZ_OPTIONS[k]} {x}" for k, v in changed.items()
                     for x in (v if isinstance(v, tuple) else [v]))

    def replay(o: Outcome) -> str:
        which = "" if o.variant == "dispatch" else f" --no-dispatch --variant {o.variant}"
        return f"mlagen fuzz --seed {o.shape.seed} --cases 1{which}{' ' + flags if flags else ''}"

    info = _info(fmt)
    with _progress(info) as progress:
        task = progress.add_task("fuzz", total=None if until_time else cases * (len(variants) + any_variant))

        def show(o: Outcome) -> None:
            progress.advance(task)
            if o.status == "fail":
                progress.console.print(Text.assemble(("FAIL", "red"), f" seed {o.shape.seed} {o.shape} {o.variant}: "
                                                     f"{o.message}\n     replay: {replay(o)}"))

        report = run_fuzz(range(seed, seed + cases), variants, space, any_variant=device_arch if any_variant else None,
                          budget_s=minutes * 60 if minutes is not None else None, on_outcome=show)
    last = max((o.shape.seed for o in report.outcomes), default=seed)
    title = f"mlagen fuzz: seeds {seed}..{last} on {device_arch}"
    if fmt == "table":
        _print_table(fuzz_table(report, title))
        _say(console, report.summary())
        if report.stopped:
            _say(console, f"stopped early: {report.stopped}")
    elif fmt == "markdown":
        _write(fuzz_markdown(report, title, replay))
    else:
        _write(fuzz_json(report, {"first_seed": seed, "last_seed": last, "arch": device_arch}, replay))
    if report.failures:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
