"""The CLI as a user meets it, without a GPU: argument errors (one line, exit 2, before any GPU
check), --version, whole variant names and table cells at any width, `show --source` on stdout
alone, and the table/markdown/json results of bench, tune and fuzz on synthetic results."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.text import Text
from typer.testing import CliRunner

from mlagen.codegen.compiler import Resources
from mlagen.codegen.render import render
from mlagen.dispatch.presets import DEFAULT_EMIT_ARCHS, PRESETS
from mlagen.dsl.spec import Variant, parse_variant
from mlagen.plan.mma_plan import TRANSPOSED_STACK
from mlagen.plan.schedules import stack_budget
from mlagen.plan.validate import validate
from mlagen.tools import cli
from mlagen.tools.bench import DISPATCH, EAGER, BenchResult, Cell, RowResult
from mlagen.tools.cli import app
from mlagen.tools.fuzz import Outcome, Report, draw
from mlagen.tools.grids import Row
from mlagen.tools.report import (
    fuzz_json,
    fuzz_markdown,
    fuzz_table,
    markdown,
    markdown_table,
    rich_table,
    text_table,
    to_json,
    tune_json,
    tune_markdown,
    tune_table,
)
from mlagen.tools.tune import RowTune, Trial

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
LONG = "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a"      # a long variant name


def _file(tmp_path: Path) -> str:
    path = tmp_path / "a_file"
    path.write_text("not a folder\n")
    return str(path)


def _table_file(tmp_path: Path) -> str:
    path = tmp_path / "bench.json"
    path.write_text('{"rows": []}\n')
    return str(path)


# (arguments, text the one error line holds); "{file}" is a file, "{json}" a JSON file that is no tuning table.
BAD = [
    (["emit", "--preset", "nope"], "--preset: got 'nope', expected one of kimi-k2, kimi-k2-tp8"),
    (["emit", "--arch", "sm_70"], "--arch: got 'sm_70', expected one of sm_80"),
    (["emit", "--variant", "mma_fast"], "--variant: variant name: got 'mma_fast', expected e.g."),
    (["emit", "--variant", "naive_w4_sm70"], "--variant: got 'naive_w4_sm70' (arch sm_70), expected an arch among"),
    (["emit", "--variant", "flash_ht7_qt4_bn64_w4_st3_spa_sm80"],
     "--variant: flash_ht7_qt4_bn64_w4_st3_spa_sm80 does not fit preset kimi-k2 (variant.head_tile: got 7"),
    (["emit", "--variant", "naive_w4_sm80", "--arch", "sm_90"], "--arch: not used with --variant"),
    (["emit", "--out", "{file}"], "--out: got '{file}', expected a folder (it is a file)"),
    (["emit", "--out", "{file}/sub"], "--out: got '{file}/sub', expected a folder ({file} is a file)"),
    (["emit", "--launcher", "yes"], "Got unexpected extra argument(s) (yes) (see 'mlagen emit --help')"),
    (["list", "--arch", "sm_7"], "--arch: got 'sm_7', expected one of"),
    (["list", "--bogus"], "No such option: --bogus (see 'mlagen list --help')"),
    (["show", "nope"], "VARIANT: variant name: got 'nope'"),
    (["show", "naive_w4_sm91"], "VARIANT: got 'naive_w4_sm91' (arch sm_91)"),
    (["show", "mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a", "--preset", "kimi-k2-tp8"],
     "VARIANT: mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a does not fit preset kimi-k2-tp8 (variant.head_tile: got 64"),
    (["show", "naive_w4_sm90", "--preset", "llama"], "--preset: got 'llama'"),
    (["show"], "Missing argument 'VARIANT' (see 'mlagen show --help')"),
    (["check", "--preset", "nope"], "--preset: got 'nope', expected one of kimi-k2"),
    (["check", "--preset", "kimi-k2", "--arch", "sm_75"], "--arch: got 'sm_75'"),
    (["bench", "--grid", "nope"], "--grid: got 'nope', expected one of seed, serving"),
    (["bench", "--row", "64,1,9"], "--row: got '64,1,9', expected H,B,S,prefix"),
    (["bench", "--row", "64,1,0,10"], "--row: got '64,1,0,10', expected H >= 1, B >= 1 and 1 <= S <= 64"),
    (["bench", "--page-size", "48"], "--page-size: got 48, expected a power of two"),
    (["bench", "--sparse", "--grid", "seed"], "--sparse: expected no dense-grid options with it (its rows are fixed, "
     "ds_mla over 64-key pages, bf16 queries), got --grid"),
    (["bench", "--sparse", "--dtype", "fp16"], "--sparse: expected no dense-grid options with it"),
    (["bench", "--sparse", "--page-size", "16", "--dtype", "fp16"], "bf16 queries), got --page-size 16, --dtype fp16"),
    (["bench", "--sparse", "--flashmla", "{file}"], "--flashmla {file}: expected a FlashMLA checkout"),
    (["bench", "--sparse", "--variant", "mma_fast"], "--variant: variant name: got 'mma_fast'"),
    (["bench", "--page-size", "abc"], "--page-size: got 'abc', expected an integer (see 'mlagen bench --help')"),
    (["bench", "--target-ms=fast"], "--target-ms: got 'fast', expected a number"),
    (["bench", "--target-ms", "-1"], "--target-ms: got -1.0, expected > 0"),
    (["bench", "--target-ms", "nan"], "--target-ms: got nan, expected a finite number > 0"),
    (["bench", "--mask", "diagonal"], "--mask: got 'diagonal', expected one of causal, none, tree, tree-per-request"),
    (["bench", "--mask", "causal,tree,diagonal"], "--mask: got 'diagonal', expected one of causal, none, tree,"),
    (["bench", "--mask", "causal", "--mask", "tree,,none"], "--mask: got '', expected one of causal, none, tree,"),
    (["bench", "--dtype", "fp8"], "--dtype: got 'fp8', expected one of bf16, fp16"),
    (["bench", "--format", "xml"], "--format: got 'xml', expected one of table, markdown, json"),
    (["bench", "--out", "{file}"], "--out: got '{file}', expected a folder (it is a file)"),
    (["bench", "--variant", "naive_w4_sm91"], "--variant: got 'naive_w4_sm91' (arch sm_91)"),
    (["tune", "--format", "html"], "--format: got 'html', expected one of table, markdown, json"),
    (["tune", "--max-candidates", "0"], "--max-candidates: got 0, expected >= 1"),
    (["tune", "--split-top", "-1"], "--split-top: got -1, expected >= 0"),
    (["tune", "--retimes", "-2"], "--retimes: got -2, expected >= 0"),
    (["tune", "--workers", "0"], "--workers: got 0, expected >= 1"),
    (["tune", "--workers", "many"], "--workers: got 'many', expected an integer"),
    (["tune", "--mask", "causal", "--mask", "zigzag"], "--mask: got 'zigzag'"),
    (["tune", "--table", "{json}"], "--table: got '{json}', expected a table file that mlagen tune wrote"),
    (["tune", "--table", "{dir}"], "--table: got '{dir}', expected a table file (it is a folder)"),
    (["tune", "--table", "{file}/t.json"],
     "--table: got '{file}/t.json', expected a file in a folder ({file} is a file)"),
    (["tune", "--table", "t.json", "--write-default"], "--table and --write-default: expected one of them"),
    (["fuzz", "--format", "yaml"], "--format: got 'yaml', expected one of table, markdown, json"),
    (["fuzz", "--cases", "0"], "--cases: got 0, expected >= 1"),
    (["fuzz", "--cases", "-5"], "--cases: got -5, expected >= 1"),
    (["fuzz", "--seed", "-1"], "--seed: got -1, expected 0 <= seed"),
    (["fuzz", "--minutes", "0"], "--minutes: got 0.0, expected > 0"),
    (["fuzz", "--minutes", "inf"], "--minutes: got inf, expected a finite number > 0"),
    (["fuzz", "--heads", "8", "--heads", "0"], "--heads: got 0, expected >= 1"),
    (["fuzz", "--page-size", "3"], "--page-size: got 3, expected a power of two"),
    (["fuzz", "--mask", "causal", "--mask", "x"], "--mask: got 'x', expected one of causal, tree, none"),
    (["fuzz", "--dtype", "fp8"], "--dtype: got 'fp8', expected one of bf16, fp16"),
    (["fuzz", "--max-batch", "0"], "--max-batch: got 0, expected >= 1"),
    (["fuzz", "--max-prefix", "-1"], "--max-prefix: got -1, expected >= 0"),
    (["fuzz", "--no-dispatch"], "--no-dispatch: expected --variant or --any-variant"),
    (["fuzz", "--variant", "flash_fast"], "--variant: variant name: got 'flash_fast'"),
    (["lst"], "No such command 'lst'. Did you mean 'list'?"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_mistake_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch):
    """Also on a machine with a GPU: the arguments are checked before the GPU is looked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    fill = {"{file}": _file(tmp_path), "{json}": _table_file(tmp_path), "{dir}": str(tmp_path)}
    for key, value in fill.items():
        args = [a.replace(key, value) for a in args]
        message = message.replace(key, value)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output


def test_a_folder_that_is_not_writable(tmp_path, monkeypatch):
    monkeypatch.setattr(cli.os, "access", lambda path, mode: Path(path) != tmp_path)
    for command in ("emit", "bench"):
        result = runner.invoke(app, [command, "--out", str(tmp_path / "new")])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert (f"error: --out: got '{tmp_path / 'new'}', expected a folder you may write to ({tmp_path} is not "
                "writable)") in result.stderr


@pytest.mark.parametrize("command", ["bench", "tune", "fuzz"])
@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_gpu_commands_accept_each_format_then_ask_for_a_gpu(command, fmt, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [command, "--format", fmt] + (["--row", "8,1,2,64"] if command != "fuzz" else [])
    result = runner.invoke(app, args + (["--out", str(tmp_path)] if command == "bench" else []))
    assert result.exit_code == 2 and "needs a CUDA GPU; none is visible here" in result.stderr
    assert result.stderr.count("\n") == 1


def test_no_arguments_prints_the_help():
    result = runner.invoke(app, [], prog_name="mlagen")
    assert "Usage: mlagen" in result.output and all(c in result.output for c in ("emit", "bench", "fuzz"))
    assert "error:" not in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"mlagen {importlib.metadata.version('mlagen')}\n"


def test_help_speaks_to_users():
    for command in ("", "emit", "list", "show", "check", "bench", "tune", "fuzz"):
        result = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        for jargon in ("mma_plan", "stack_budget", "72-row", "kernels files", "poisoned", "<bool>"):
            assert jargon not in result.output, (command, jargon)


def test_help_wraps_whole_paragraphs():
    """A docstring's paragraph reflows to the terminal's width: no line break where the source had one."""
    result = runner.invoke(app, ["emit", "--help"], env={"COLUMNS": "200"})
    assert "the variants that differ only in the split, and its name leaves the split out." in " ".join(
        result.output.split())
    paragraph = result.output.split("\n\n")[2].splitlines()     # wrapped where the width ends, not where the source
    assert all(len(a) + 1 + len(b.split()[0]) > 78 for a, b in zip(paragraph, paragraph[1:], strict=False))
    assert "--launcher  " in result.output and "--no-launcher" not in result.output      # a flag, no placeholder


def test_bench_help_names_every_mask_and_fp8_case():
    """bench's help names the choices in words (the module holding them needs torch)."""
    from mlagen.tools.workload import FP8_CASES, MASKS

    text = " ".join(runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output.split())
    for name in (*MASKS, *FP8_CASES):
        assert f" {name} (" in text or f" {name}," in text, name


def test_allowed_spills_say_what_check_allows():
    """The allowance that check prints is stack_budget's: a transposed tile of more than 32 rows,
    TRANSPOSED_STACK bytes; no other kernel may spill."""
    assert f"more than 32 query rows (q_tile x head_tile) may keep up to {TRANSPOSED_STACK} bytes" in cli.ALLOWED_SPILLS
    tile = Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=8, arch="sm_90a", schedule="transposed")
    assert stack_budget(tile) == 0 and stack_budget(tile.with_(q_tile=5)) == TRANSPOSED_STACK
    assert stack_budget(tile.with_(schedule="lockstep", q_tile=8)) == 0
    def spills(stack: int, spilled: int) -> Resources:
        return Resources(registers=255, shared_static=0, stack_frame=stack, spill_stores=spilled, spill_loads=spilled)
    assert cli._spill_verdict(spills(0, 0), 0)[0] == "none"
    assert cli._spill_verdict(spills(8, 4), 0) == ("fails", Text("fails: 8 bytes (no spills allowed)", style="red"))
    status, text = cli._spill_verdict(spills(48, 44), TRANSPOSED_STACK)
    assert status == "allowed" and text.plain == f"88 bytes: allowed (transposed tile, stack 48 <= {TRANSPOSED_STACK})"
    assert cli._spill_verdict(spills(TRANSPOSED_STACK + 8, 80), TRANSPOSED_STACK)[0] == "fails"


def test_show_compile_prints_a_table(monkeypatch):
    """ptxas's report as a table of named columns, not a Python repr."""
    import mlagen.codegen.build

    v = PRESETS["kimi-k2"].variants("sm_90")[1]
    real = mlagen.codegen.build.build

    def build(problem, variant):
        built = real(problem, variant)
        fake = Resources(registers=246, shared_static=16, stack_frame=0, spill_stores=0, spill_loads=0)
        return dataclasses.replace(built, module=dataclasses.replace(built.module, resources={
            built.plan.main_kernel: fake}))
    monkeypatch.setattr(mlagen.codegen.build, "build", build)
    result = runner.invoke(app, ["show", v.name, "--compile"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Resources(" not in result.stdout and "registers=" not in result.stdout
    header = next(line for line in result.stdout.splitlines() if "registers" in line and "spill stores" in line)
    assert "static smem" in header and "stack" in header
    row = next(line for line in result.stdout.splitlines() if "│ main" in line and "246" in line)
    assert row.split("│")[2].strip() == "246" and row.split("│")[3].strip() == "16"


def test_emit_says_what_it_wrote_per_file(tmp_path):
    """A line per file, manifests and launchers included: written, or unchanged (it already held
    that text); the source's line names the variant; stale kernels' removal is listed too."""
    result = runner.invoke(app, ["emit", "--variant", "naive_w4_sm80", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "kimi-k2" / "sm_80"
    name = validate(PRESETS["kimi-k2"].problem, parse_variant("naive_w4_sm80")).name
    assert result.stdout.splitlines() == [
        f"written    {folder / name}.cu  (variant naive_w4_sm80)",
        f"written    {folder / name}.json",
        "1 kernel file for preset kimi-k2, with its manifests: 2 of 2 files written, 0 unchanged"]
    stale = folder / "mlagen_old_kernel.cu"
    stale.write_text("// an earlier emit's\n")
    result = runner.invoke(app, ["emit", "--arch", "sm_80", "--launcher", "--out", str(tmp_path)])
    n = len(PRESETS["kimi-k2"].variants("sm_80"))
    lines = result.stdout.splitlines()
    assert f"unchanged  {folder / name}.cu  (variant naive_w4_sm80)" in lines
    assert f"unchanged  {folder / name}.json" in lines and f"written    {folder / name}_launch.h" in lines
    assert f"removed    {stale}  (a kernel the preset no longer has)" in lines and not stale.exists()
    assert lines[-1] == (f"{n} kernel files for preset kimi-k2, with their manifests and launchers: {3 * n - 2} of "
                         f"{3 * n} files written, 2 unchanged, 1 stale file removed")
    assert len(lines) == 3 * n + 2


def test_emit_into_a_folder_that_cannot_be_made(tmp_path):
    """/proc takes no new folders (even for root, whom os.access lets write anywhere): one line, exit 2."""
    for command in ("emit", "bench"):
        result = runner.invoke(app, [command, "--out", "/proc/mlagen-out"])
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith("error: --out: got '/proc/mlagen-out', expected a folder you may write to")


def _list_lines(stdout: str) -> list[str]:
    return [line.strip() for line in stdout.splitlines()]


def _variant_lines(lines: list[str], start: int, n: int) -> list[tuple[str, str]]:
    """(variant, kernel) of the n lines after `start`: 'VARIANT  kernel KERNEL'."""
    found = []
    for line in lines[start + 1:start + 1 + n]:
        variant, word, kernel = line.split()
        assert word == "kernel", line
        found.append((variant, kernel))
    return found


def test_list_prints_whole_names_in_a_narrow_pipe():
    """COLUMNS=60 and stdout a pipe: rich would cut a table at 60 columns; the names print whole."""
    run = subprocess.run([sys.executable, str(ROOT / "cli.py"), "list"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "60"}, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    lines = _list_lines(run.stdout)
    for p in PRESETS.values():
        assert p.description in run.stdout
        for arch in DEFAULT_EMIT_ARCHS:
            vs = p.variants(arch)
            start = lines.index(f"{p.name} on {arch}: {len(vs)} variant{'s' if len(vs) != 1 else ''}, in files "
                                f"mlagen_KERNEL_{p.problem.name}.cu")
            assert _variant_lines(lines, start, len(vs)) == [(v.name, v.code_name) for v in vs]


def test_list_names_the_file_each_variant_lands_in(tmp_path):
    """One name everywhere: a listed variant emitted alone lands in mlagen_<its listed kernel>_<problem>.cu."""
    result = runner.invoke(app, ["list", "--arch", "sm_90"])
    lines = _list_lines(result.stdout)
    p = PRESETS["kimi-k2"]
    start = next(i for i, line in enumerate(lines) if line.startswith("kimi-k2 on sm_90:"))
    pairs = _variant_lines(lines, start, len(p.variants("sm_90")))
    assert any(v != k for v, k in pairs)                       # an adaptive split's kernel leaves it out
    for variant, kernel in pairs:
        runner.invoke(app, ["emit", "--variant", variant, "--out", str(tmp_path)])
        assert (tmp_path / "kimi-k2" / parse_variant(variant).arch / f"mlagen_{kernel}_{p.problem.name}.cu").exists()


def test_list_arch():
    result = runner.invoke(app, ["list", "--arch", "sm_80", "--arch", "sm_90a", "--arch", "sm_80"])
    assert result.exit_code == 0, result.output
    lines = _list_lines(result.stdout)
    headers = [line.partition(", in files")[0] for line in lines if " on sm_" in line]
    def count(n: int) -> str:
        return f"{n} variant" + ("s" if n != 1 else "")
    assert headers == [f"{p.name} on {a}: {count(len(p.variants(a)))}" for p in PRESETS.values()
                       for a in ("sm_80", "sm_90a")]
    names = [line.split()[0] for line in lines if line]
    assert "naive_w4_sm80" in names and "naive_w4_sm90" not in names and "naive_w4_sm120" not in names


def test_show_source_is_the_source_alone():
    v = PRESETS["kimi-k2"].variants("sm_90")[1]
    plan = validate(PRESETS["kimi-k2"].problem, v)
    result = runner.invoke(app, ["show", v.name, "--source"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == render(plan).rstrip("\n")
    assert result.stdout.startswith("// mlagen generated kernel")
    assert "smem_bytes" in result.stderr and plan.name in result.stderr      # the plan went to stderr
    plain = runner.invoke(app, ["show", v.name])
    assert plain.stderr == "" and "smem_bytes" in plain.stdout and "__global__" not in plain.stdout


def test_check_failure_exits_1_and_shows_the_error_as_text(monkeypatch):
    """A kernel that does not compile is no usage error: exit 1; its message (brackets and all) is in the table."""
    import mlagen.codegen.build
    from mlagen.codegen.compiler import CompileError

    def build(problem, variant):
        raise CompileError(f"{variant.name}: error: [bad] expected a ';'")
    monkeypatch.setattr(mlagen.codegen.build, "build", build)
    result = runner.invoke(app, ["check", "--preset", "kimi-k2", "--arch", "sm_80"])
    n = len(PRESETS["kimi-k2"].variants("sm_80"))
    assert result.exit_code == 1, result.output
    assert result.stderr == f"error: {n} kernels failed to compile or spilled\n"
    assert "naive_w4_sm80: error: [bad] expected a ';'" in result.stdout


# ---- tables at any width

def _bench_result() -> BenchResult:
    def row(h, b, s, p, flash_us, dispatch_us):
        return RowResult(heads=h, batch=b, seqlen_q=s, prefix=p, grids=["seed"], floor_us=2.0,
                         cells={"naive": Cell(40.0, "naive_w4_sm90"), "flash": Cell(flash_us, "flash_x"),
                                EAGER: Cell(50.0), DISPATCH: Cell(dispatch_us, LONG)}, flashmla_us=17.6)
    rows = [row(64, 1, 9, 256, 10.0, 10.0), row(8, 16, 9, 1024, 25.0, 45.0)]
    rows[1].cells["flash"] = Cell(variant="flash_x", error="CompileError: [boom] | more")
    meta = {"gpu": "Test GPU", "arch": "sm_90a", "sm_count": 132, "page_size": 64, "mask": "causal", "dtype": "bf16",
            "copy_tbps": 4.25, "matmul_tflops": 785.0}
    return BenchResult(meta=meta, families=["naive", "flash"], rows=rows)


def _render(table, terminal: bool, width: int = 60) -> str:
    out = io.StringIO()
    cli._print_table(table, Console(file=out, width=width, force_terminal=terminal, soft_wrap=True))
    return out.getvalue()


def test_tables_are_never_cut():
    result = _bench_result()
    piped = _render(rich_table(result), terminal=False)
    assert "…" not in piped and LONG in piped and "dispatch vs FlashMLA" in piped
    assert max(len(line) for line in piped.splitlines()) > 60           # as wide as it needs
    in_terminal = _render(rich_table(result), terminal=True)
    assert "…" not in in_terminal
    assert max(len(line) for line in Text.from_ansi(in_terminal).plain.splitlines()) <= 60   # folded


def test_red_cells_are_text_not_markup():
    table = text_table("t", ["a", "b"], [["[bold]x[/bold]", "failed"]], red=lambda col, cell: cell == "failed")
    out = _render(table, terminal=False)
    assert "[bold]x[/bold]" in out
    assert table.columns[1]._cells[0].style == "red" and table.columns[0]._cells[0].style == ""


def test_markdown_table_escapes_pipes():
    lines = markdown_table(["a", "b|c"], [["x | y", "two\nlines"]])
    assert lines == ["| a | b\\|c |", "|---|---|", "| x \\| y | two lines |"]


# ---- bench, tune and fuzz results in each format, through the CLI with the GPU work faked

@pytest.mark.parametrize("args,masks,invariant", [
    ([], ("causal",), False),
    (["--mask", "tree", "--batch-invariant"], ("tree",), True),
    (["--mask", "causal,tree,tree-per-request"], ("causal", "tree", "tree-per-request"), False),
    (["--mask", "none, tree", "--mask", "tree-per-request,none"], ("none", "tree", "tree-per-request"), False),
])
def test_bench_masks_and_invariant_reach_the_config(args, masks, invariant, tmp_path, monkeypatch, fake_gpu):
    """--mask takes comma lists and repeats, in order, each mask once; the first is the base."""
    import mlagen.tools.bench

    configs = []
    monkeypatch.setattr(mlagen.tools.bench, "run_bench",
                        lambda rows, config, progress: configs.append(config) or _bench_result())
    done = runner.invoke(app, ["bench", "--row", "8,1,2,64", "--format", "json", "--out", str(tmp_path), *args])
    assert done.exit_code == 0, done.output
    (config,) = configs
    assert config.masks == masks and config.mask == masks[0] and config.batch_invariant is invariant


def test_bench_fp8_cases_reach_the_config(tmp_path, monkeypatch, fake_gpu):
    """--fp8 takes comma lists and repeats, in order, each case once; none by default."""
    import mlagen.tools.bench

    configs = []
    monkeypatch.setattr(mlagen.tools.bench, "run_bench",
                        lambda rows, config, progress: configs.append(config) or _bench_result())
    for args in ([], ["--fp8", "e4m3-q, ds_mla", "--fp8", "e4m3,ds_mla"]):
        done = runner.invoke(app, ["bench", "--row", "8,1,2,64", "--format", "json", "--out", str(tmp_path), *args])
        assert done.exit_code == 0, done.output
    assert [c.fp8 for c in configs] == [(), ("e4m3-q", "ds_mla", "e4m3")]


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_bench_formats(tmp_path, monkeypatch, fake_gpu):
    import mlagen.tools.bench

    result = _bench_result()
    monkeypatch.setattr(mlagen.tools.bench, "run_bench", lambda rows, config, progress: result)
    out = tmp_path / "out"
    as_json = runner.invoke(app, ["bench", "--row", "8,1,2,64", "--format", "json", "--out", str(out)])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == json.loads(to_json(result))
    assert as_json.stderr.splitlines() == [f"wrote {out / name}" for name in ("bench.json", "bench.md", "bench.png")]
    as_md = runner.invoke(app, ["bench", "--row", "8,1,2,64", "--format", "markdown", "--out", str(out)])
    assert as_md.exit_code == 0 and as_md.stdout == markdown(result)
    as_table = runner.invoke(app, ["bench", "--row", "8,1,2,64", "--out", str(out)], env={"COLUMNS": "60"})
    assert as_table.exit_code == 0 and as_table.stderr == ""
    assert LONG in as_table.stdout and "…" not in as_table.stdout and f"wrote {out / 'bench.md'}" in as_table.stdout


def _row_tunes() -> list[RowTune]:
    heuristic, best = parse_variant("mma_ht8_qt1_bn64_w4_st2_spa_sm90"), parse_variant(LONG)
    broken = parse_variant("mma_ht8_qt2_bn64_w4_st2_spa_sm90")
    ran = RowTune(row=Row(8, 4, 1, 4096), mask="causal", key="k1", incumbent=best,
                  trials=[Trial(heuristic, 30.0), Trial(best, 20.0), Trial(broken, error="CompileError: boom")])
    none = RowTune(row=Row(8, 4, 2, 4096), mask="tree", key="k2", trials=[Trial(broken, error="CompileError: boom")])
    return [ran, none]


def test_tune_kv_format_reaches_the_config(tmp_path, monkeypatch, fake_gpu):
    """--kv names the cache format the tuner quantizes its inputs to, --q the queries' (e4m3 over
    an e4m3 cache only); dtype by default."""
    import mlagen.tools.tune

    configs = []
    monkeypatch.setattr(mlagen.tools.tune, "tune", lambda rows, config, table, write_default, progress:
                        configs.append(config) or (tmp_path / "t.json", []))
    for args in ([], ["--kv", "ds_mla"], ["--kv", "e4m3", "--q", "e4m3"]):
        done = runner.invoke(app, ["tune", "--row", "8,4,1,4096", "--format", "json", *args])
        assert done.exit_code == 0, done.output
    assert [(c.kv_format, c.q_format) for c in configs] == [("dtype", "dtype"), ("ds_mla", "dtype"), ("e4m3", "e4m3")]
    done = runner.invoke(app, ["tune", "--row", "8,4,1,4096", "--q", "e4m3"])
    assert done.exit_code == 2 and "--q e4m3: expected --kv e4m3 with it" in done.output
    assert len(configs) == 3


def test_tune_formats(tmp_path, monkeypatch, fake_gpu):
    import mlagen.tools.tune

    results, path = _row_tunes(), tmp_path / "h200.json"
    monkeypatch.setattr(mlagen.tools.tune, "tune", lambda rows, config, table, write_default, progress: (path, results))
    data = json.loads(tune_json(path, results))
    assert data["table"] == str(path)
    first, second = data["shapes"]
    assert (first["heads"], first["batch"], first["seqlen_q"], first["prefix"], first["mask"]) == (8, 4, 1, 4096,
                                                                                                   "causal")
    assert first["best"] == {"variant": LONG, "us": 20.0, "error": ""} and first["gain"] == 1.5
    assert first["table"]["variant"] == LONG and first["trials"][2]["us"] is None
    assert second["best"]["us"] is None and second["heuristic"]["us"] is None and second["gain"] is None
    md = tune_markdown(path, results)
    assert f"- table file: {path}" in md
    assert f"| 8 | 4 | 1 | 4096 | causal | 30.0 | 20.0 | 20.0 | 1.50× | {LONG} | 3 | 1 |" in md
    assert "| 8 | 4 | 2 | 4096 | tree | — | — | none ran | — |" in md
    assert "…" not in _render(tune_table(results), terminal=False)
    for fmt, expected in (("json", tune_json(path, results)), ("markdown", md)):
        result = runner.invoke(app, ["tune", "--row", "8,4,1,4096", "--format", fmt])
        assert result.exit_code == 0, result.output
        assert result.stdout == expected and result.stderr == f"wrote {path}\n"
    result = runner.invoke(app, ["tune", "--row", "8,4,1,4096"], env={"COLUMNS": "60"})
    assert LONG in result.stdout and "none ran" in result.stdout and result.stdout.endswith(f"wrote {path}\n")


def _fuzz_report() -> Report:
    a, b = draw(3), draw(4)
    outcomes = [Outcome(a, "dispatch", "ok"), Outcome(a, LONG, "skip", "head_tile: got 64"),
                Outcome(b, "dispatch", "fail", "max error 3.0 at [0, 1] | lse nan\nmore"),
                Outcome(b, "mma_ht8_qt1_bn64_w4_st2_spa_sm90", "ok", drawn=True)]
    return Report(outcomes=outcomes, shapes=2, elapsed_s=0.5)


def test_fuzz_formats(monkeypatch, fake_gpu):
    import mlagen.runtime.op
    import mlagen.tools.fuzz

    report = _fuzz_report()

    def fuzz(seeds, variants, space, any_variant, budget_s, on_outcome):
        for o in report.outcomes:
            on_outcome(o)
        return report
    monkeypatch.setattr(mlagen.tools.fuzz, "fuzz", fuzz)
    monkeypatch.setattr(mlagen.runtime.op, "device_info", lambda device: ("sm_90a", 132))
    args = ["fuzz", "--seed", "3", "--cases", "2", "--max-batch", "4"]
    replay = "mlagen fuzz --seed 4 --cases 1 --max-batch 4"

    result = runner.invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 1                     # a check failed
    data = json.loads(result.stdout)
    assert data["summary"] == report.summary() and data["shapes"] == 2 and data["elapsed_s"] == 0.5
    assert (data["first_seed"], data["last_seed"], data["arch"]) == (3, 4, "sm_90a")
    assert data["kernels"] == [{"kernel": "dispatch", "ok": 1, "skipped": 0, "failed": 1},
                               {"kernel": LONG, "ok": 0, "skipped": 1, "failed": 0},
                               {"kernel": "random variants", "ok": 1, "skipped": 0, "failed": 0}]
    assert data["failures"] == [{"seed": 4, "shape": str(report.outcomes[2].shape), "variant": "dispatch",
                                 "message": report.outcomes[2].message, "replay": replay}]
    assert "FAIL seed 4" in result.stderr and f"replay: {replay}" in result.stderr       # live, beside the json

    result = runner.invoke(app, [*args, "--format", "markdown"])
    assert result.exit_code == 1
    assert result.stdout == fuzz_markdown(report, "mlagen fuzz: seeds 3..4 on sm_90a", lambda o: replay)
    assert "| dispatch | 1 | 0 | 1 |" in result.stdout and report.summary() in result.stdout
    assert f"(replay: `{replay}`)" in result.stdout

    result = runner.invoke(app, args, env={"COLUMNS": "60"})
    assert result.exit_code == 1 and result.stderr == ""
    assert LONG in result.stdout and "…" not in result.stdout
    assert f"replay: {replay}" in result.stdout and result.stdout.endswith(report.summary() + "\n")



@pytest.mark.parametrize("args,seeds,budget", [
    ([], 200, None),                                        # the default count
    (["--cases", "7"], 7, None),
    (["--minutes", "2"], None, 120.0),                      # seeds until the time runs out
    (["--minutes", "2", "--cases", "7"], 7, 120.0),         # whichever ends first
])
def test_fuzz_draws_seeds_until_cases_or_minutes_run_out(monkeypatch, fake_gpu, args, seeds, budget):
    import mlagen.runtime.op
    import mlagen.tools.fuzz

    seen = {}

    def fuzz(seeds, variants, space, any_variant, budget_s, on_outcome):
        seen.update(seeds=seeds, budget_s=budget_s)
        return Report(outcomes=[Outcome(draw(5), "dispatch", "ok")], shapes=1, elapsed_s=0.1)
    monkeypatch.setattr(mlagen.tools.fuzz, "fuzz", fuzz)
    monkeypatch.setattr(mlagen.runtime.op, "device_info", lambda device: ("sm_90a", 132))
    result = runner.invoke(app, ["fuzz", "--seed", "5", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert seen["seeds"].start == 5 and seen["budget_s"] == budget
    assert len(seen["seeds"]) == seeds if seeds is not None else len(seen["seeds"]) > 10**15
    assert json.loads(result.stdout)["last_seed"] == 5                  # the last seed drawn

def test_fuzz_formatters_alone():
    report = _fuzz_report()
    data = json.loads(fuzz_json(report, {"arch": "sm_120"}, lambda o: f"replay {o.shape.seed}"))
    assert data["arch"] == "sm_120" and data["failures"][0]["replay"] == "replay 4" and data["stopped"] is None
    table = fuzz_table(report, "t")
    assert table.row_count == 3 and table.columns[3]._cells[0].style == "red"     # dispatch failed once
    report.stopped = "the time budget ran out before seed 5"
    assert "stopped early: the time budget ran out before seed 5" in fuzz_markdown(report, "t", str)


def test_every_option_keeps_its_lower_case_flag():
    """Some typer releases (0.27) turn an option whose metavar is its own name in capitals into
    `--NAME`, unless the flag is named: every such option names its flag."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cli))
    unnamed = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        args = fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
        for arg, default in zip(args, defaults, strict=True):
            if not (isinstance(default, ast.Call) and getattr(default.func, "attr", "") == "Option"):
                continue
            metavar = next((k.value.value for k in default.keywords if k.arg == "metavar"), None)
            flags = [a for a in default.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            if metavar == arg.arg.upper() and not flags:
                unnamed.append(f"{fn.name}: {arg.arg}")
    assert not unnamed, f"options whose metavar is their name, without a named flag: {unnamed}"
