"""The scripts in benchmarks/ keep working: each one's command line, its CPU part (plans, rendered
and traced sources, parsers), its one-line exit where no GPU is visible, and on a GPU the script
itself on a small shape. EXERCISED (at the end) maps every file under benchmarks/ (results/ aside)
to the tests that exercise it, and must match the folder: a script no test runs fails here."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import ab_constant  # noqa: E402
import ab_trees  # noqa: E402
import bench_cli  # noqa: E402
import build_flashmla  # noqa: E402, F401  (its --help below; tests/test_live_peer.py for the rest)
import cold_code  # noqa: E402
import flashmla_sparse_tests  # noqa: E402, F401  (its --help below; tests/test_flashmla_sparse_script.py for the rest)
import host_cost  # noqa: E402
import hot_loop  # noqa: E402
import profile_row  # noqa: E402
import ragged  # noqa: E402
import ragged_drafts  # noqa: E402
import sanitize  # noqa: E402
import sass_histogram  # noqa: E402
import sparse_rows  # noqa: E402
import trace_blocks  # noqa: E402
import trace_exchange  # noqa: E402
import trace_seesaw  # noqa: E402
import wide_table  # noqa: E402

import mlagen  # noqa: E402
from mlagen.codegen import render as render_module  # noqa: E402
from mlagen.codegen.compiler import compile_source  # noqa: E402
from mlagen.codegen.render import render  # noqa: E402
from mlagen.dispatch import policy  # noqa: E402
from mlagen.dispatch.policy import INVARIANT_SPLIT_KEYS_LOG2  # noqa: E402
from mlagen.dsl.spec import Problem, Variant, parse_variant  # noqa: E402
from mlagen.plan.schedules import FP8_LDG, FP8_MMA, FP8_WS  # noqa: E402
from mlagen.plan.validate import validate  # noqa: E402
from mlagen.runtime import context_parallel, launch, op  # noqa: E402
from mlagen.runtime.inputs import key_bound  # noqa: E402
from mlagen.tools import sass  # noqa: E402
from mlagen.tools.grids import Row  # noqa: E402
from mlagen.tools.testing import assert_matches, make_case, make_sparse_case, reference_op  # noqa: E402
from mlagen.tools.workload import InputSet, Workload, problem_for  # noqa: E402

H200 = ("sm_90", "NVIDIA H200", policy.H200)     # arch, name, dispatch policy
SEESAW = "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a"
TRANSPOSED = "mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a"
EXCHANGE = "mma_ht64_qt1_bn64_w8_st1_sp8_cl_px_sm90a"
FP8_MMA_TILE = "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_f8_sm90a"
FP8_WS_TILE = "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a"

# Each GPU script with arguments for a small shape: run without a GPU it must exit with one line.
GPU_RUNS = {
    "sanitize.py": ["--only", "_w4_"],
    "host_cost.py": ["--calls", "200"],
    "ragged.py": ["8", "4", "9", "256", "2048"],
    "ragged_drafts.py": ["8", "4", "9", "256"],
    "sparse_rows.py": ["--heads", "16", "--seqlen-q", "2", "--batch", "2", "--topk", "64", "--cache-keys", "1024"],
    "wide_table.py": ["8", "1", "9", "256", "16384"],
    "profile_row.py": ["8", "1", "9", "1024"],
    "trace_blocks.py": ["64", "2", "9", "2048", "mma_ht32_qt2_bn64_w8_st2_spa_p16_tma_sm90a"],
    "trace_exchange.py": ["64", "1", "9", "256", EXCHANGE],
    "trace_seesaw.py": ["8", "16", "9", "16384", TRANSPOSED],
    "ab_trees.py": ["1", "main=.", "8,1,9,1024=main/dispatch"],
    "ab_constant.py": ["1", "MERGE_TARGET_BLOCKS=128,144", "8,1,9,1024"],
    "cold_code.py": ["1", "main=.", "8,1,9,1024=main/dispatch"],
}
HELP = ["ab_constant", "ab_trees", "build_flashmla", "cold_code", "flashmla_sparse_tests", "host_cost", "hot_loop",
        "profile_row", "ragged", "ragged_drafts", "sanitize", "sass_histogram", "sparse_rows", "trace_blocks",
        "trace_exchange", "trace_seesaw", "wide_table"]


def _script(name: str, *args: str, env: dict[str, str] | None = None,
            timeout: int = 300) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)   # mlagen, installed or not
    return subprocess.run([sys.executable, str(BENCH / name), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": path, **(env or {})})


def _needs_nvdisasm() -> None:
    try:
        sass.find_nvdisasm()
    except sass.SassError as e:
        pytest.skip(str(e))


@pytest.fixture
def templates_restored():
    """Leaves rendering from the repository's templates, whatever a test pointed it at."""
    before = render_module._SOURCE_TREE_TEMPLATES
    yield
    render_module._SOURCE_TREE_TEMPLATES = before
    render_module.environment.cache_clear()
    render.cache_clear()


# ---- every script: --help, and the one-line exit where no GPU is visible

@pytest.mark.parametrize("module", HELP)
def test_help_prints_the_usage(module, capsys):
    """--help prints the script's docstring under its own name and exits 0."""
    mod = sys.modules[module]
    with pytest.raises(SystemExit) as done:
        if module in ("ab_trees", "cold_code"):                      # cold_code.py takes ab_trees.py's arguments
            mod.parse_args(mod.__file__, mod.__doc__, ["--help"])
        else:
            mod.parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {module}.py")
    assert mod.__doc__.splitlines()[0] in out


@pytest.mark.parametrize("name", sorted(GPU_RUNS))
def test_gpu_scripts_exit_with_one_line_without_a_gpu(name):
    """With no CUDA device visible, a GPU script parses its arguments, then exits 1 with one line
    naming itself: no traceback."""
    done = _script(name, *GPU_RUNS[name], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"{name} needs a CUDA GPU") and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_require_gpu_names_the_script_and_the_reason(monkeypatch):
    monkeypatch.setattr(bench_cli, "gpu_missing", lambda: "no driver")
    with pytest.raises(SystemExit) as done:
        bench_cli.require_gpu("/x/y/script.py")
    assert str(done.value).startswith("script.py needs a CUDA GPU (no driver)") and "\n" not in str(done.value)
    monkeypatch.setattr(bench_cli, "gpu_missing", lambda: None)
    bench_cli.require_gpu("script.py")   # returns where a GPU is visible


def test_variant_arguments_are_checked_by_name():
    assert bench_cli.variant_name(SEESAW) == SEESAW
    with pytest.raises(SystemExit) as done:
        profile_row.parse_args(["8", "1", "9", "1024", "mma_nonsense"])
    assert done.value.code == 2
    with pytest.raises(SystemExit):
        ragged.parse_args(["8", "4", "9", "256", "2048", "bogus"])


# ---- sanitize.py

def test_sanitize_runs_every_family_on_valid_shapes():
    """Every (case, variant) that the sanitizer workload runs on an H200 is a valid plan that
    renders; the list covers the transposed tile, the seesaw, the P exchange and the dispatcher."""
    variants, exchange = sanitize.variants_for("sm_90")
    runs = sanitize.plan_runs(variants, exchange)
    pairs = [(shape, v) for shape, vs, _ in runs for v in vs if sanitize.fits(shape, v)]
    names = {sanitize.name_of(v) for _, v in pairs}
    assert {"dispatched", "naive_w4_sm90"} <= names
    assert any(v.transposed for _, v in pairs if v) and any(v.seesaw for _, v in pairs if v)
    assert sum(1 for _, v in pairs if v and v.p_exchange) == 4      # two variants, two SHORT cases
    for shape, v in pairs:
        if v is not None:
            assert render(validate(sanitize.problem_of(shape), v))
    assert sanitize.main(None, None, "sm_90", listing=True) == len(pairs) + len(sanitize.FEATURES)


def test_sanitize_runs_each_engine_feature_through_the_dispatcher(capsys):
    """The features (racecheck3's --only feature+) come after the variant runs: batch-invariant
    lengths of 1, 2, 3 and 8 splits, both FP8 cache formats, e4m3 queries, context-parallel
    shards under a per-request tree mask, and ragged rows on the seesaw and the transposed tile
    (the latter named for synccheck's --only _tr_)."""
    features = sanitize.main("feature+", None, "sm_90", listing=True)
    assert features == len(sanitize.FEATURES)
    out = capsys.readouterr().out
    first = len(sanitize.plan_runs(*sanitize.variants_for("sm_90")))
    for i, (feature, _, _) in enumerate(sanitize.FEATURES, start=first):
        assert f"case {i} feature+{feature}: listed" in out
    assert {f for f, _, _ in sanitize.FEATURES} == {"invariant", "fp8_e4m3", "fp8_ds_mla", "q_e4m3", "cp_shards",
                                                    "fp8_tile", "fp8_ws", "fp8_mma", "fp8_ldg", "ragged_rows",
                                                    "ragged_rows_tr_", "gathered", "gathered_naive",
                                                    "gathered_fp8_ldg"}
    assert "_tr_" in "feature+ragged_rows_tr_" and "_tr_" in sanitize.RAGGED_VARIANTS["ragged_rows_tr_"]
    assert "_ss_rg_" in sanitize.RAGGED_VARIANTS["ragged_rows"]
    counts = sanitize.RAGGED_COUNTS
    assert len(counts) == sanitize.RAGGED["batch"] and 0 in counts and max(counts) == sanitize.RAGGED["seqlen_q"]
    tiles = [extra["kv_format"] for f, _, extra in sanitize.FEATURES if f == "fp8_tile"]
    assert sorted(tiles) == ["ds_mla", "e4m3"]
    for arch in ("sm_90", "sm_80"):
        for fmt in tiles:
            variant = sanitize.fp8_tile(fmt, arch)
            assert render(validate(Problem(heads=8, kv_format=fmt, mask="tree", lse=True), variant))
    assert {extra.get("kv_format") for _, _, extra in sanitize.FEATURES} >= {"e4m3", "ds_mla"}
    # the FP8 tile on the fp8_ws, fp8_mma and fp8_ldg schedules, and the one-token tile on fp8_ldg, on sm_90a only
    def tile(f: str, fmt: str) -> Variant:
        return sanitize.GATHERED_TILE if f in sanitize.GATHERED_FEATURES else sanitize.fp8_tile(fmt, "sm_90")
    ws = [(f, shape, extra, sanitize.SM90A_FEATURES[f].adopt(tile(f, extra["kv_format"])))
          for f, shape, extra in sanitize.FEATURES if f in sanitize.SM90A_FEATURES]
    assert sorted(v.schedule for *_, v in ws) == ["fp8_ldg", "fp8_ldg", "fp8_mma", "fp8_mma", "fp8_ws", "fp8_ws"]
    assert sanitize.SM90A_FEATURES == {"fp8_ws": FP8_WS, "fp8_mma": FP8_MMA, "fp8_ldg": FP8_LDG,
                                       "gathered_fp8_ldg": FP8_LDG}
    for f, shape, extra, v in ws:
        if f in sanitize.GATHERED_FEATURES:
            problem = Problem(heads=shape["heads"], page_size=shape["page_size"], mask="none", keys="gathered",
                              lse=True, kv_format=extra["kv_format"])
        else:
            problem = sanitize.problem_of(shape).with_formats(extra["kv_format"], extra.get("q_format", "dtype"))
        assert render(validate(problem, v))
    assert features - sanitize.main("feature+", None, "sm_80", listing=True) == len(ws)
    assert any(shape.get("per_request_tree") for f, shape, _ in sanitize.FEATURES if f == "cp_shards")
    lengths = [p + sanitize.INVARIANT["seqlen_q"] for p in sanitize.INVARIANT["prefixes"]]
    assert sorted({min(-(-n // (1 << INVARIANT_SPLIT_KEYS_LOG2)), 8) for n in lengths}) == [1, 2, 3, 8]


@pytest.mark.parametrize("feature", ["q_e4m3", "cp_shards", "fp8_tile", "fp8_ldg", "ragged_rows", "gathered",
                                     "gathered_naive", "gathered_fp8_ldg"])
def test_sanitize_feature_calls_match_the_reference(feature, monkeypatch):
    """On the CPU, the fp64 reference standing in for the kernels: each feature's call gives the
    case's own result."""
    monkeypatch.setattr(context_parallel, "verify_attention", reference_op)
    monkeypatch.setattr(mlagen, "verify_attention", reference_op)
    shape = next(dict(s, **extra) for f, s, extra in sanitize.FEATURES if f == feature)
    maker = make_sparse_case if feature in sanitize.GATHERED_FEATURES else make_case
    case = maker(seed=1, device="cpu", **shape)
    out, lse = sanitize.run_feature(feature, case, "sm_90")
    assert_matches(out, lse, case)


def test_sanitize_only_and_skip_split_the_variants(capsys):
    """--only PART and --skip PART partition the pairs (run_gpu.sh's synccheck and racecheck)."""
    total = sanitize.main(None, None, "sm_90", listing=True)
    only = sanitize.main("_tr_", None, "sm_90", listing=True)
    skip = sanitize.main(None, "_tr_", "sm_90", listing=True)
    assert 0 < only < total and only + skip == total
    out = capsys.readouterr().out
    assert "case 0 mma_ht8_qt9_bn64_w8_st2_sp2_tr_sm90a: listed" in out
    args = sanitize.parse_args(["--skip", "_tr_", "--list"])
    assert (args.skip, args.only, args.list, args.arch, args.cases) == ("_tr_", None, True, "sm_90", None)
    # comma-separated parts: any of them (run_gpu.sh's synccheck also takes the fp8_ws, fp8_mma and fp8_ldg tiles)
    parts = "_tr_,feature+fp8_ws,feature+fp8_mma,fp8_ldg"
    both = sanitize.main(parts, None, "sm_90", listing=True)
    assert both == only + sum(1 for f, _, _ in sanitize.FEATURES if f in sanitize.SM90A_FEATURES)
    assert both == total - sanitize.main(None, parts, "sm_90", listing=True)
    assert f"--only {parts}" in (ROOT / "benchmarks" / "run_gpu.sh").read_text()


def test_sanitize_cases_split_the_racecheck():
    """run_gpu.sh's racecheck1, racecheck2 and racecheck3 (--cases 0-2, --cases 3-8, --only
    feature+) cover every pair once."""
    assert sanitize.case_numbers("0-2") == {0, 1, 2} and sanitize.case_numbers("3,5-6") == {3, 5, 6}
    assert sanitize.parse_args(["--cases", "3-8"]).cases == set(range(3, 9))
    total = sanitize.main(None, "_tr_", "sm_90", listing=True)
    first = sanitize.main(None, "_tr_", "sm_90", listing=True, cases={0, 1, 2})
    second = sanitize.main(None, "_tr_", "sm_90", listing=True, cases=set(range(3, 9)))
    third = sanitize.main("feature+", "_tr_", "sm_90", listing=True)
    assert 0 < first < total and 0 < third and first + second + third == total
    runs = sanitize.plan_runs(*sanitize.variants_for("sm_90"))
    assert len(runs) == 9 and [shape for shape, _, _ in runs[:3]] == sanitize.CASES


def test_sanitize_off_hopper_has_no_sm90a_variants():
    variants, exchange = sanitize.variants_for("sm_80")
    assert exchange == [] and all(v is None or v.arch == "sm_80" for v in variants)


# ---- host_cost.py

def test_host_cost_calls_are_valid_calls():
    """The timed calls reach the runtime's checks (a CPU tensor is refused there, by name), and
    the pieces of the runtime the script reads still exist."""
    timed, case = host_cost.cases(device="cpu")
    assert list(timed) == ["out= given", "allocating", "return_lse", "tree mask, out= given"]
    for fn in timed.values():
        with pytest.raises(mlagen.InputError, match="q.device"):
            fn()
    assert {"kernel", "layout"} <= set(op._Call.__dataclass_fields__) and isinstance(op._calls, dict)
    assert callable(launch._launch_kernel)
    fake = types.SimpleNamespace(kernel=launch.KernelLaunch(args=(0, 132, 1, 1, 256, 1, 1, 0), name="k_main"),
                                 layout=None)
    assert host_cost.describe(fake) == "kernel: k_main, grid (132, 1, 1) (one split)"
    assert host_cost.parse_args(["--calls", "50"]).calls == 50


# ---- ragged.py

def test_ragged_lengths_are_log_uniform_in_range():
    gen = torch.Generator().manual_seed(0)
    lengths = ragged.ragged_lengths(256, 9, 256, 16384, gen)
    assert lengths.dtype == torch.int32 and lengths.shape == (256,)
    assert 256 <= int(lengths.min()) and int(lengths.max()) <= 16384
    assert (lengths < 2048).sum() > 64 and (lengths > 2048).sum() > 64   # log-uniform: half below sqrt(range)
    again = ragged.ragged_lengths(256, 9, 256, 16384, torch.Generator().manual_seed(0))
    assert torch.equal(lengths, again)
    assert int(ragged.ragged_lengths(8, 9, 1, 4, torch.Generator().manual_seed(1)).min()) == 9   # at least S


def test_ragged_compares_the_pick_with_its_splits():
    args = ragged.parse_args([])
    assert (args.heads, args.batch, args.seqlen_q, args.min_keys, args.max_keys, args.variants) == \
        (64, 32, 9, 256, 16384, [])
    problem = problem_for(Row(64, 32, 9, 16384 - 9), ragged.PAGE_SIZE, "causal", "bf16")
    picked, others = ragged.compared(problem, 9, 32, 16384, *H200, [])
    assert picked.family == "mma"
    assert [v.kv_split for v in others] == ["adaptive", "balanced"]
    assert all(v.head_tile == picked.head_tile and v.q_tile == picked.q_tile for v in others)
    _, named = ragged.compared(problem, 9, 32, 16384, *H200, [SEESAW])
    assert named == [parse_variant(SEESAW)]


# ---- ragged_drafts.py

def test_ragged_drafts_spreads_the_same_tokens_evenly():
    counts = ragged_drafts.ragged_counts(64, 16, torch.Generator().manual_seed(0))
    assert len(counts) == 64 and min(counts) >= 1 and max(counts) <= 16 and len(set(counts)) > 8
    even = ragged_drafts.even_counts(64, sum(counts))
    assert sum(even) == sum(counts) and max(even) - min(even) <= 1
    trees = ragged_drafts.packed_trees([1, 4, 3], 4, torch.Generator().manual_seed(1))
    assert trees.shape == (3, 4, 4) and trees.dtype == torch.bool
    for b, s in enumerate([1, 4, 3]):
        assert trees[b, :s, :s].diagonal().all() and not trees[b, :s, :s].triu(1).any()
        assert not trees[b, s:].any() and not trees[b, :, s:].any()      # outside the corner: nothing
    args = ragged_drafts.parse_args([])
    assert (args.heads, args.batch, args.seqlen_q, args.prefix, args.mask) == (64, 32, 16, 4096, "tree")
    with pytest.raises(SystemExit):
        ragged_drafts.parse_args(["8", "4", "65"])


# ---- wide_table.py

def test_wide_table_widens_the_block_table_only():
    row = Row(8, 2, 3, 100)
    pages = 2
    table = torch.arange(4, dtype=torch.int32).view(2, pages)
    s = InputSet(q=torch.zeros(1), kv_cache=torch.zeros(1), block_table=table, cache_seqlens=torch.zeros(2),
                 tree_mask=None, out=torch.zeros(1))
    work = Workload(row=row, problem=problem_for(row, 64, "causal", "bf16"), sets=[s], visible=torch.empty(0),
                    scale=1.0)
    wide = wide_table.widened(work, 1000)
    got = wide.sets[0].block_table
    assert wide.kv_capacity == 16 * 64 and got.shape == (2, 16) and got.is_contiguous()
    assert torch.equal(got[:, :pages], table) and bool((got[:, pages:] == table[:, :1]).all())
    assert work.sets[0].block_table is table                    # the narrow workload is untouched


def test_wide_table_plans_each_run_as_the_runtime_does():
    row = Row(64, 1, 9, 256)
    problem = problem_for(row, wide_table.PAGE_SIZE, "causal", "bf16")
    plans = wide_table.plans(problem, row, 320, 131072, *H200)
    assert [(c, b) for _, c, b, _ in plans] == [(320, None), (131072, None), (131072, row.keys)]
    for _, capacity, bound, variant in plans:
        planned = capacity if bound is None else min(capacity, key_bound(bound))
        assert variant == op.pick_variant(problem, 9, 1, planned, capacity, *H200[:2], None, policy=policy.H200)
        validate(problem, variant)
    assert wide_table.parse_args([]).table_keys == 131072


# ---- profile_row.py

def test_profile_row_arguments():
    args = profile_row.parse_args(["64", "1", "9", "65536", SEESAW, "--calls", "6"])
    assert (args.heads, args.batch, args.seqlen_q, args.prefix, args.variant, args.calls) == (64, 1, 9, 65536,
                                                                                            SEESAW, 6)
    assert profile_row.parse_args(["8", "1", "9", "1024"]).variant is None


# ---- sass_histogram.py

def test_sass_histogram_counts_opcodes(tmp_path, capsys):
    path = tmp_path / "src.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(['==PROF== Connected to process'])
        w.writerow(["Kernel Name", "k_main"])
        w.writerow(["Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"])
        w.writerow(["0x0", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;", "1,000", "30"])
        w.writerow(["0x10", "@P0 BRA 0x0 ;", "100", "5"])
        w.writerow(["0x20", "@!UPT UIADD3 UR4, UR4, 0x1, URZ ;", "300", "0"])
        w.writerow(["0x30", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;", "1,000", "15"])
        w.writerow(["0x40", "EXIT ;", "", ""])                        # no counts: skipped
    executed, stalls = sass_histogram.histogram(str(path))
    assert executed == {"HGMMA": 2000, "UIADD3": 300, "BRA": 100}
    assert stalls["HGMMA"] == 45 and stalls["BRA"] == 5
    sass_histogram.main(str(path), top=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2,400 instructions executed, 50 stall samples" and len(out) == 4
    assert out[2].split() == ["HGMMA", "2,000", "83.3%", "90.0%"]


# ---- trace_blocks.py, trace_exchange.py, trace_seesaw.py

BLOCK_TRACE = GPU_RUNS["trace_blocks.py"][-1]           # its GPU run's variant
TRANSPOSED_TMA = "mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a"
CLUSTER = "mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a"


def _rendered(name: str, heads: int):
    plan = validate(Problem(heads=heads), parse_variant(name))
    return plan, render(plan)


def _defined(source: str) -> dict[str, str]:
    """The trace points a traced `source` defines, and each one's code."""
    out: dict[str, str] = {}
    for line in source.splitlines():
        if line.startswith("#define MLAGEN_TRACE_") and line != "#define MLAGEN_TRACE_ON":
            point, _, code = line.removeprefix("#define MLAGEN_TRACE_").partition(" ")
            assert point not in out, point
            out[point] = code
    return out


@pytest.mark.parametrize("name,heads", [(SEESAW, 64), (TRANSPOSED, 8), (TRANSPOSED_TMA, 8), (EXCHANGE, 64),
                                        (BLOCK_TRACE, 64), (CLUSTER, 64), ("flash_ht8_qt8_bn32_w8_st2_spa_sm90", 64)])
def test_trace_points_are_nothing_untraced(name, heads):
    """A rendered kernel holds trace points (mma ones) and none of the trace code: common.cuh.j2
    defines MLAGEN_TRACE as nothing unless the source defines MLAGEN_TRACE_ON before it."""
    _, source = _rendered(name, heads)
    assert "MLAGEN_TRACE_ON" in source and "#define MLAGEN_TRACE(point)\n" in source
    assert not re.search(r"^#define MLAGEN_TRACE_ON", source, re.MULTILINE)
    assert "mlagen_trace" not in source and "mlagen_ss_trace" not in source and "clock64" not in source
    points = trace_blocks.points_of(source)
    assert "start" in points or not name.startswith("mma_")
    assert all(point in trace_blocks.BLOCK_POINTS or point in trace_exchange.EXCHANGE_POINTS
               or any(point in schedule.points() for schedule in (trace_seesaw.SEESAW, trace_seesaw.TRANSPOSED))
               for point in points), points                   # no point that no tool stamps


def test_block_trace_defines_every_point():
    """trace_blocks.py defines each point of the kernel, its own as their stamps and the others as
    nothing: the transposed tile has no Q landing of its own, a cluster split its cluster's
    barriers instead of a count. (The seesaw's source holds tile_landed in the TMA pipeline's
    acquire, which only the lockstep loop calls: its column stays nan.)"""
    expected = {
        SEESAW: {"start", "work_list", "segment", "q_landed", "tile_landed", "loop_end", "staged", "written",
                 "counted", "merge_begin", "merge_end", "merge_wait", "pair_done"},
        TRANSPOSED_TMA: {"start", "work_list", "segment", "tile_landed", "loop_end", "staged", "written", "counted",
                         "merge_begin", "merge_end", "merge_wait"},
        BLOCK_TRACE: {"start", "segment", "q_landed", "tile_landed", "loop_end", "staged", "written", "counted",
                      "merge_begin", "merge_end", "merge_wait", "pair_done"},
        CLUSTER: {"start", "segment", "tile_landed", "loop_end", "cluster_met", "cluster_done",
                  "merge_wait"},          # (merge.cuh.j2's merge, which a cluster split never runs)
    }
    for name, points in expected.items():
        heads = 8 if "_tr_" in name else 64
        source = trace_blocks.traced_source(name, heads, trace_blocks.block_trace)
        assert source.startswith("#define MLAGEN_TRACE_ON\n") and "mlagen_trace[" in source and "clock64()" in source
        defined = _defined(source)
        assert set(defined) == set(trace_blocks.points_of(source)), name
        assert {point for point, code in defined.items() if code} == points, name
        assert all(defined[point] == trace_blocks.BLOCK_POINTS[point] for point in points), name
    timed = trace_blocks.traced_source(SEESAW, 64, lambda plan, source: trace_blocks.block_trace(plan, source, True))
    assert "clock64()" not in timed and "tr_gt()" in timed
    for other, message in ((EXCHANGE, "trace_exchange.py"), ("flash_ht8_qt8_bn32_w8_st2_spa_sm90", "not an mma")):
        with pytest.raises(SystemExit, match=message):               # one line
            trace_blocks.traced_source(other, 64, trace_blocks.block_trace)
    plan, source = _rendered(CLUSTER, 64)
    with pytest.raises(SystemExit, match="trace points not in the kernel.*segment"):
        trace_blocks.block_trace(plan, source.replace("MLAGEN_TRACE(segment);", ""))
    args = trace_blocks.parse_args(["64", "1", "9", "256", "--warm", "--gt"])
    assert (args.variant, args.warm, args.gt, args.source) == (None, True, True, False)


def test_block_trace_restores_rendering(monkeypatch):
    """traced_row's source rewrite ends with its warm-up: kernels built later render as usual."""
    import mlagen.codegen.build as build

    def no_case(**kwargs):
        raise RuntimeError("no GPU")

    render_before = build.render
    monkeypatch.setattr(trace_blocks, "make_case", no_case)
    with pytest.raises(RuntimeError, match="no GPU"):
        trace_blocks.traced_row(lambda plan, source: source, 64, 1, 9, 256)
    assert build.render is render_before


def test_exchange_trace_defines_every_point():
    source = trace_blocks.traced_source(EXCHANGE, 64, trace_exchange.exchange_trace)
    defined = _defined(source)
    assert {point: code for point, code in defined.items() if code} == trace_exchange.EXCHANGE_POINTS
    assert "clock64()" not in source
    with pytest.raises(SystemExit, match="not a P exchange"):
        trace_blocks.traced_source(BLOCK_TRACE, 64, trace_exchange.exchange_trace)
    with pytest.raises(SystemExit):
        trace_exchange.parse_args(["64", "1", "9", "256"])             # the variant is required


def test_seesaw_trace_defines_both_schedules():
    """Every stamp of a schedule is a trace point of its template, in no two slots at once; the
    transposed tile's trace keeps its pair count across a balanced range's segments."""
    for name, heads, schedule in ((SEESAW, 64, trace_seesaw.SEESAW), (TRANSPOSED, 8, trace_seesaw.TRANSPOSED)):
        assert trace_seesaw.schedule_of(parse_variant(name)) is schedule
        source = trace_blocks.traced_source(name, heads, trace_seesaw.paired_trace)
        defined = _defined(source)
        assert {point: code for point, code in defined.items() if code} == schedule.points(), name
        assert sum(code.startswith("TS(") for code in defined.values()) == len(schedule.steps), name
        assert sum(code.startswith("TB(") for code in defined.values()) == len(schedule.boundary), name
        assert sum("GT()" in code for code in defined.values()) == 1, name   # the global timer, once a pair
        slots = [slot for w in (0, 1) for slot, _ in schedule.sequence(w)] + [schedule.global_slot]
        slots += [schedule.boundary_slot + k for k in range(len(schedule.boundary))]
        assert len(set(slots)) == len(slots) and max(slots) < schedule.events, name
    assert trace_seesaw.TRANSPOSED.points()["pairs_before"].endswith("mlagen_ss_pairs[2 * SS_BLOCK + me] = 0")
    # the warp-specialized FP8 tiles run the seesaw's pairs: the same stamps, on inputs in the
    # formats their schedules read
    for name, formats in ((FP8_MMA_TILE, ("e4m3", "e4m3")), (FP8_WS_TILE, ("e4m3", "dtype"))):
        assert trace_seesaw.schedule_of(parse_variant(name)) is trace_seesaw.SEESAW
        assert trace_blocks.formats_of(parse_variant(name)) == formats
        defined = _defined(trace_blocks.traced_source(name, 64, trace_seesaw.paired_trace))
        assert {point: code for point, code in defined.items() if code} == trace_seesaw.SEESAW.points(), name
    assert trace_blocks.formats_of(None) == ("dtype", "dtype")
    plan, plain = _rendered("mma_ht8_qt8_bn64_w8_st2_sp2_sm90a", 64)
    assert trace_seesaw.paired_trace(plan, plain) == plain
    seesaw = trace_seesaw.SEESAW
    with pytest.raises(SystemExit, match="trace points not in the kernel"):
        trace_blocks.traced(plain, seesaw.header(), seesaw.points(), tuple(seesaw.points()))
    with pytest.raises(SystemExit):
        trace_seesaw.parse_args(["8", "16", "9", "16384", "mma_ht8_qt8_bn64_w8_st2_sp2_sm90a", "--source"])


@pytest.mark.parametrize("name,heads,trace", [
    (BLOCK_TRACE, 64, trace_blocks.block_trace), (EXCHANGE, 64, trace_exchange.exchange_trace),
    (TRANSPOSED, 8, trace_seesaw.paired_trace), (TRANSPOSED_TMA, 8, trace_seesaw.paired_trace),
    (SEESAW, 64, trace_seesaw.paired_trace)])
def test_traced_source_compiles(name, heads, trace):
    """Each tool's traced source of its default variant (and the seesaw's) compiles with NVRTC,
    its wgmmas still asynchronous and without spills (the 72-row transposed tile spills a little
    untraced too): a stamp that cost either would distort what it measures."""
    source = trace_blocks.traced_source(name, heads, trace)
    plan = validate(Problem(heads=heads), parse_variant(name))
    module = compile_source(source, plan.name, plan.arch.name)
    assert module.cubin[:4] == b"\x7fELF"
    assert "C751" not in module.log and "serialized" not in module.log, module.log
    assert plan.variant.transposed or all(not r.spills for r in module.resources.values()), module.resources


def test_seesaw_trace_phases_from_stamps():
    """Pairs 2000 cycles apart at 2 GHz: a period of 1 µs, each warpgroup step 100 cycles."""
    schedule = trace_seesaw.SEESAW

    def pair(start: int) -> list[int]:
        stamps = [0] * schedule.events
        for w in (0, 1):
            for i, (slot, _) in enumerate(schedule.sequence(w)):
                stamps[slot] = start + 100 * i
        return stamps

    got = trace_seesaw.phases([pair(2000 * i) for i in range(5)], 2.0, schedule)
    period = next(k for k in got if k.startswith("pair period"))
    assert got[period] == [1.0] * 3                                   # first and last pairs left out
    assert got["wg0: K0 landed -> S0 issued"] == [0.05] * 3


# ---- ab_trees.py, ab_constant.py, cold_code.py

def test_ab_trees_parses_rows_and_trees(tmp_path):
    text, row, cells = ab_trees.parse_cells(f"16,64,4,4096=main/{SEESAW}|new/dispatch", {"main": ROOT, "new": ROOT})
    assert (text, row, cells) == ("16,64,4,4096", Row(16, 64, 4, 4096), [("main", SEESAW), ("new", "dispatch")])
    assert ab_trees.parse_cells("8,16,9,16384:e4m3=main/dispatch", {"main": ROOT})[:2] == (
        "8,16,9,16384:e4m3", Row(8, 16, 9, 16384))
    assert ab_trees.row_suffixes("8,16,9,16384:ds_mla") == ("8,16,9,16384", "ds_mla", "causal")
    assert ab_trees.row_suffixes("8,16,9,16384:tree") == ("8,16,9,16384", None, "tree")
    assert ab_trees.row_suffixes("8,16,9,16384:causal") == ("8,16,9,16384", None, "causal")
    assert ab_trees.row_suffixes("8,16,9,16384:e4m3:tree-per-request") == ("8,16,9,16384", "e4m3", "tree-per-request")
    for bad in ("16,64,4,4096", "16,64,4,4096=other/dispatch", "16,64,4=main/dispatch", "8,1,9,64=main/mma_x",
                "8,1,9,64:fp4=main/dispatch", "8,1,9,64:tree:tree=main/dispatch", "8,1,9,64:e4m3:ds_mla=main/dispatch"):
        with pytest.raises(SystemExit):
            ab_trees.parse_cells(bad, {"main": ROOT})
    assert ab_trees.parse_args(__file__, None, ["2", f"main={ROOT}", "8,1,9,64=main/dispatch"]) == (
        2, {"main": ROOT}, ["8,1,9,64=main/dispatch"])
    with pytest.raises(SystemExit) as done:                          # a tree without templates/
        ab_trees.parse_args(__file__, None, ["2", f"main={tmp_path}", "8,1,9,64=main/dispatch"])
    assert done.value.code == 2


def test_ab_trees_renders_from_the_chosen_tree(tmp_path, templates_restored):
    """use_templates points rendering at another tree's templates/ (a copy with one edit here)."""
    shutil.copytree(ROOT / "templates", tmp_path / "templates")
    edited = tmp_path / "templates" / "mma.cu.j2"
    edited.write_text("// edited tree\n" + edited.read_text())
    plan = validate(Problem(heads=8), Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2,
                                              kv_split=3, arch="sm_90"))
    assert "// edited tree" not in render(plan)
    ab_trees.use_templates(tmp_path)
    assert render(plan).startswith("// edited tree")
    ab_trees.use_templates(ROOT)
    assert "// edited tree" not in render(plan)


def test_ab_constant_sets_and_restores_a_constant(templates_restored):
    validate_module = ab_constant.validate
    old = validate_module.MERGE_TARGET_BLOCKS
    plan = validate(Problem(heads=8), Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2,
                                              kv_split=3, arch="sm_90"))
    before = plan.split.merge_blocks(16, 9)
    try:
        ab_constant.set_constant("MERGE_TARGET_BLOCKS", 16)
        assert validate_module.MERGE_TARGET_BLOCKS == 16 and ab_constant.launcher.MERGE_TARGET_BLOCKS == 16
        assert plan.split.merge_blocks(16, 9) < before
    finally:
        ab_constant.set_constant("MERGE_TARGET_BLOCKS", old)
    assert validate_module.MERGE_TARGET_BLOCKS == old and plan.split.merge_blocks(16, 9) == before
    dispatch = ab_constant.policy
    tiles = dispatch.H200.pdl_tiles_per_sm
    try:
        ab_constant.set_constant("policy.H200.pdl_tiles_per_sm", tiles + 1)
        assert dispatch.H200.pdl_tiles_per_sm == tiles + 1
        assert dispatch.policy_for("sm_90", 78).pdl_tiles == (tiles + 1) * 78      # every device's policy follows
    finally:
        ab_constant.set_constant("policy.H200.pdl_tiles_per_sm", tiles)
    assert dispatch.H200.pdl_tiles_per_sm == tiles
    assert ab_constant.parse_setting("MERGE_TARGET_BLOCKS=128,144") == ("MERGE_TARGET_BLOCKS", [128, 144])
    for bad in ("NO_SUCH_CONSTANT=1", "MERGE_TARGET_BLOCKS=a,b", "policy.reset=1", "policy.H200.sm_count=1",
                "policy.H200.merge_tiles=1"):
        with pytest.raises(SystemExit):
            ab_constant.parse_setting(bad)
    assert ab_constant.parse_args(["3", "SEGMENT_TILES=2,3", "8,16,9,16384"]) == (
        3, ("SEGMENT_TILES", [2, 3]), ["8,16,9,16384"])


def test_cold_code_flush_kernel_is_large_straight_line_code():
    """The flush kernel compiles to ~240 KB of code: more than the SMs' instruction caches hold."""
    source = cold_code.flush_source()
    assert source.count("fmaf(") == cold_code.CHAINS * cold_code.STEPS
    module = compile_source(source, "icache_flush", "sm_90")
    _needs_nvdisasm()
    code = sass.instructions(sass.disassemble(module.cubin, "icache_flush", "sm_90"))
    assert len(code) >= cold_code.CHAINS * cold_code.STEPS and code[-1][0] > 200 * 1024


# ---- hot_loop.py

def test_hot_loop_reports_the_tile_loop(capsys):
    _needs_nvdisasm()
    line = hot_loop.report(64, SEESAW)
    assert line.startswith(f"{SEESAW}: ") and "tile loop 0x" in line and "KB of it past 64 KB" in line
    assert hot_loop.parse_args(["16", SEESAW, TRANSPOSED]).names == [SEESAW, TRANSPOSED]


# ---- run_gpu.sh

def _bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash"), "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


NO_GPU = "run_gpu.sh: no GPU here (nvidia-smi not found); run it on a machine with an NVIDIA GPU and its driver"


def test_run_gpu_parses_and_checks_its_steps(tmp_path):
    assert _bash("bash -n benchmarks/run_gpu.sh").returncode == 0
    usage = _bash("bash benchmarks/run_gpu.sh --help")
    assert usage.returncode == 0 and "bash benchmarks/run_gpu.sh STEP..." in usage.stdout
    bad = _bash("bash benchmarks/run_gpu.sh tests bogus")            # checked before any GPU is looked for
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "run_gpu.sh: unknown step 'bogus' (steps: tests verify memcheck synccheck racecheck1 racecheck2 racecheck3 "
        "racecheck "
        "sanitize tune tune8 peers bench ragged sparse host fuzz facts)")
    nogpu = subprocess.run([shutil.which("bash"), "benchmarks/run_gpu.sh", "tests"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={"PATH": str(tmp_path)})   # a PATH without nvidia-smi
    assert nogpu.returncode == 1 and nogpu.stderr.strip() == NO_GPU
    default = subprocess.run([shutil.which("bash"), "benchmarks/run_gpu.sh"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={"PATH": str(tmp_path)})
    assert default.returncode == 1 and default.stderr.splitlines() == [
        "run_gpu.sh: no steps named, so tests verify sanitize bench (about 30 min on an H200; --help lists the "
        "steps)",
        NO_GPU]
    got = _bash("source benchmarks/run_gpu.sh; gpu_slug 'NVIDIA H200'; gpu_slug 'NVIDIA H100 80GB HBM3'; "
                "expand_steps sanitize bench racecheck")
    assert got.stdout.splitlines() == ["h200", "h100-80gb-hbm3",
                                       "memcheck synccheck racecheck1 racecheck2 racecheck3 bench "
                                       "racecheck1 racecheck2 racecheck3"]


def test_run_gpu_steps_have_timeouts_and_help():
    """Every step but the aliases has a timeout under ten minutes, and the help names every step
    and the files it writes."""
    got = _bash('source benchmarks/run_gpu.sh; echo "$STEPS"; for s in $STEPS; do echo "${LIMIT[$s]:-none}"; done; '
                'usage')
    lines = got.stdout.splitlines()
    steps = lines[0].split()
    limits = dict(zip(steps, lines[1:1 + len(steps)], strict=True))
    usage = "\n".join(lines[1 + len(steps):])
    aliases = {"racecheck", "sanitize"}
    assert {s for s, limit in limits.items() if limit == "none"} == aliases, limits
    assert all(0 <= int(limit) < 600 for s, limit in limits.items() if s not in aliases), limits
    for step in steps:
        assert f"\n  {step} " in usage, step
    for name in ("gpu.txt", "gpu_tests.log", "gpu_verify.log", "sanitize_<step>.log", "tune.log", "tune8.log",
                 "bench.json", "ragged.log", "host_cost.log", "fuzz.log", "flashmla_sparse_tests.txt",
                 "sparse.md", "RESULTS=dir", "COPY_TO=dir"):
        assert name in usage, name


def test_run_gpu_writes_results_and_copies(tmp_path):
    """With a stand-in nvidia-smi: gpu.txt (name, driver, date, versions) in RESULTS and copied to
    COPY_TO/<gpu>/; nothing else is written for the `facts` step."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in\n  *name,driver_version*) echo "NVIDIA H200, 580.159.04" ;;\n'
                   '  *clocks.sm*) echo "1980 MHz, 3201 MHz" ;;\nesac\n')
    smi.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RESULTS": str(tmp_path / "results"),
           "COPY_TO": str(tmp_path / "out")}
    done = _bash("bash benchmarks/run_gpu.sh facts", env=env)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "results" / "gpu.txt").read_text()
    assert "name: NVIDIA H200\n" in text and "driver: 580.159.04\n" in text and "date: 20" in text
    assert f"torch: {torch.__version__}\n" in text and "cupy: " in text and "nvrtc: " in text
    assert (tmp_path / "out" / "h200" / "gpu.txt").read_text() == text
    assert sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file()) == ["gpu.txt"]


# ---- on a GPU: each script for real, on a small shape

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_RUNS))
def test_gpu_script_runs(name, tmp_path):
    """The script runs to the end on a small shape and prints what it is for."""
    args = GPU_RUNS[name]
    if name == "ab_trees.py":                                          # two trees: this one and a copy
        shutil.copytree(ROOT / "templates", tmp_path / "templates")
        args = ["1", f"main=.,copy={tmp_path}", "8,1,9,1024=main/dispatch|copy/dispatch",
                "8,1,9,1024:e4m3=main/dispatch|copy/dispatch"]
    done = _script(name, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    expect = {
        "sanitize.py": "pairs checked",
        "host_cost.py": "out= given, ctypes cuLaunchKernel",
        "ragged.py": "max |diff| vs dispatch",
        "ragged_drafts.py": "ragged / uniform",
        "wide_table.py": "wide table, max_seqlen_k=",
        "profile_row.py": "4 calls of ",
        "trace_blocks.py": "launch span",
        "trace_exchange.py": "launch span",
        "trace_seesaw.py": "pair period",
        "ab_trees.py": "copy/dispatch",
        "ab_constant.py": "MERGE_TARGET_BLOCKS 144",
        "cold_code.py": "flush kernel alone",
        "sparse_rows.py": "TFLOP/s",
    }[name]
    assert expect in out, out[-3000:]
    if name in ("ab_trees.py", "ab_constant.py", "cold_code.py"):
        assert out.count("best") >= 2
    if name == "ab_trees.py":                                          # the FP8 row too
        assert "8,1,9,1024:e4m3" in out and out.count("best") == 4


# ---- sparse_rows.py

def test_sparse_rows_arguments_and_flops():
    args = sparse_rows.parse_args([])
    assert (args.heads, args.seqlen_q, args.batch, args.topk, args.cache_keys) == ([64, 128], [1, 2, 4],
                                                                                   [1, 8, 32, 128], 2048, 65536)
    assert len(sparse_rows.rows(args)) == 24
    row = sparse_rows.SparseRow(128, 128, 2, 2048)
    assert row.flops == 2 * 128 * 2 * 128 * 2048 * (576 + 512) and row.gathered_bytes == 128 * 2 * 2048 * 656
    for argv in (["--topk", "70000"], ["--batch", "0"], ["--variant", "bogus"]):
        with pytest.raises(SystemExit):
            sparse_rows.parse_args(argv)


EXERCISED = {   # every file under benchmarks/ but results/ (and the bench's default output, latest/)
    "README.md": [],
    "bench_cli.py": [test_require_gpu_names_the_script_and_the_reason, test_variant_arguments_are_checked_by_name],
    "run_gpu.sh": [test_run_gpu_parses_and_checks_its_steps, test_run_gpu_steps_have_timeouts_and_help,
                   test_run_gpu_writes_results_and_copies],
    "sanitize.py": [test_sanitize_runs_every_family_on_valid_shapes, test_sanitize_only_and_skip_split_the_variants,
                    test_sanitize_cases_split_the_racecheck, test_sanitize_off_hopper_has_no_sm90a_variants,
                    test_sanitize_runs_each_engine_feature_through_the_dispatcher,
                    test_sanitize_feature_calls_match_the_reference,
                    test_gpu_script_runs],
    "host_cost.py": [test_host_cost_calls_are_valid_calls, test_gpu_script_runs],
    "ragged.py": [test_ragged_lengths_are_log_uniform_in_range, test_ragged_compares_the_pick_with_its_splits,
                  test_gpu_script_runs],
    "ragged_drafts.py": [test_ragged_drafts_spreads_the_same_tokens_evenly, test_gpu_script_runs],
    "wide_table.py": [test_wide_table_widens_the_block_table_only, test_wide_table_plans_each_run_as_the_runtime_does,
                      test_gpu_script_runs],
    "profile_row.py": [test_profile_row_arguments, test_gpu_script_runs],
    "sass_histogram.py": [test_sass_histogram_counts_opcodes],
    "trace_blocks.py": [test_trace_points_are_nothing_untraced, test_block_trace_defines_every_point,
                        test_block_trace_restores_rendering, test_traced_source_compiles, test_gpu_script_runs],
    "trace_exchange.py": [test_exchange_trace_defines_every_point, test_traced_source_compiles, test_gpu_script_runs],
    "trace_seesaw.py": [test_seesaw_trace_defines_both_schedules, test_seesaw_trace_phases_from_stamps,
                        test_traced_source_compiles, test_gpu_script_runs],
    "ab_trees.py": [test_ab_trees_parses_rows_and_trees, test_ab_trees_renders_from_the_chosen_tree,
                    test_gpu_script_runs],
    "ab_constant.py": [test_ab_constant_sets_and_restores_a_constant, test_gpu_script_runs],
    "cold_code.py": [test_cold_code_flush_kernel_is_large_straight_line_code, test_gpu_script_runs],
    "hot_loop.py": [test_hot_loop_reports_the_tile_loop],
    # and tests/test_flashmla_sparse_script.py: its shim, groups, skips and counts
    "flashmla_sparse_tests.py": [test_help_prints_the_usage],
    # and tests/test_live_peer.py: its checks, commands, stages and binding
    "build_flashmla.py": [test_help_prints_the_usage],
    # and tests/test_sparse_bench.py: the rows, inputs and table it prints
    "sparse_rows.py": [test_sparse_rows_arguments_and_flops, test_gpu_script_runs],
}


def test_every_benchmark_file_is_exercised():
    """A file added to benchmarks/ needs a test here (and an EXERCISED entry), or it fails CI."""
    found = sorted(str(p.relative_to(BENCH)) for p in BENCH.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.relative_to(BENCH).parts[0] not in
                   ("results", "latest"))
    assert found == sorted(EXERCISED)
    scripts = {f"{m}.py" for m in HELP} | set(GPU_RUNS)
    assert scripts <= set(EXERCISED)
    for name, tests in EXERCISED.items():
        assert tests or name == "README.md", name
        if name in GPU_RUNS:
            assert test_gpu_script_runs in tests, name
    readme = (BENCH / "README.md").read_text()
    for name in EXERCISED:
        assert name == "README.md" or f"`{name}`" in readme, f"benchmarks/README.md says nothing of {name}"
