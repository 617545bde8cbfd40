"""GPU: a tiny bench row and a tiny tune run end to end; the host cost of a call."""

from __future__ import annotations

import math

import pytest

from mlagen.dispatch import policy, tables
from mlagen.dsl.spec import parse_variant
from mlagen.runtime import tensormap
from mlagen.runtime.op import device_info, device_name, device_policy
from mlagen.tools.bench import DISPATCH, EAGER, INVARIANT, BenchConfig, fp8_cells, mask_cell, run_bench
from mlagen.tools.grids import Row
from mlagen.tools.report import from_json, summary_markdown, to_json, write_all
from mlagen.tools.timing import TimingConfig, l2_bytes, measure
from mlagen.tools.tune import TuneConfig, tune
from mlagen.tools.workload import FP8_CASES, make_workload, mlagen_call, problem_for, with_fp8, with_mask

pytestmark = pytest.mark.gpu

QUICK = TimingConfig(target_ms=1.0, reps=3, max_calls=50, budget_ms=10.0)


@pytest.fixture
def user_tables(tmp_path, monkeypatch):
    monkeypatch.setenv(tables.ENV_DIR, str(tmp_path / "tables"))
    policy.reset()
    yield
    policy.reset()


def test_tiny_bench_row(tmp_path, user_tables):
    result = run_bench([(Row(8, 2, 3, 100), ("custom",))], BenchConfig(timing=QUICK, host_calls=200))
    (row,) = result.rows
    for name in ("naive", "flash", EAGER, DISPATCH):
        cell = row.cells[name]
        assert cell.us is not None and math.isfinite(cell.us) and cell.us > 0, (name, cell)
    assert row.floor_us > 0 and result.meta["copy_tbps"] > 0 and result.meta["matmul_tflops"] > 0
    assert result.meta["host"]["us_per_call_out_given"] > 0
    assert all(p.exists() for p in write_all(result, tmp_path / "bench"))


def test_bench_side_cells(tmp_path, user_tables):
    """The dispatcher's pick under each further mask and batch-invariant mode's pick, timed on the
    base mask's inputs; their ratios reach the summary."""
    import torch

    masks = ("causal", "tree", "tree-per-request")
    config = BenchConfig(masks=masks, batch_invariant=True, timing=QUICK, host_calls=100)
    result = run_bench([(Row(64, 4, 9, 1000), ("serving",))], config)
    (row,) = result.rows
    assert result.other_masks == ["tree", "tree-per-request"] and result.invariant
    for name in (DISPATCH, mask_cell("tree"), mask_cell("tree-per-request"), INVARIANT):
        cell = row.cells[name]
        assert cell.us is not None and math.isfinite(cell.us) and cell.us > 0, (name, cell)
        assert row.over_dispatch(name) is not None
    device = torch.cuda.current_device()
    causal = problem_for(row.row, 64, "causal", "bf16")
    invariant = policy.batch_invariant_variant(causal, 9, device_info(device)[0], device_policy(device))
    assert row.cells[INVARIANT].variant == invariant.name
    assert row.cells[mask_cell("tree")].variant == row.cells[mask_cell("tree-per-request")].variant   # one problem
    assert summary_markdown(result)[0].endswith("| tree/causal | tree-per-request/causal | invariant/dispatch |")
    assert from_json(to_json(result)) == result
    assert all(p.exists() for p in write_all(result, tmp_path / "bench"))


def test_bench_fp8_cells(tmp_path, user_tables):
    """Each --fp8 case timed on the row's inputs quantized (the dispatcher's pick, and the mma tile
    over 16-bit queries), against a floor of its own below the bf16 floor; the FP8 matmul rate
    measured for e4m3 queries."""
    config = BenchConfig(fp8=tuple(FP8_CASES), timing=QUICK, host_calls=100)
    result = run_bench([(Row(16, 4, 4, 1000), ("serving",))], config)
    (row,) = result.rows
    assert result.fp8 == list(FP8_CASES) and result.meta["fp8_matmul_tflops"] > result.meta["matmul_tflops"]
    names = [c for case in FP8_CASES for c in fp8_cells(case)]
    for name in names:
        cell = row.cells[name]
        assert cell.us is not None and math.isfinite(cell.us) and cell.us > 0, (name, cell)
        # FP8 caches run on mma tiles, dispatched or named; e4m3 queries on the fp8_mma schedule
        assert cell.variant.startswith("mma_") and ("e4m3-q" not in name or "_f8_" in cell.variant), (name, cell)
        assert 0 < row.floor_of(name) < row.floor_us
    assert summary_markdown(result)[0].endswith(" | ".join(f"{n}/dispatch" for n in names) + " |")
    assert from_json(to_json(result)) == result


def test_fp8_workloads_run_and_match_the_bf16_result():
    """The FP8 sets run through the op; their outputs stay close to the bf16 inputs' (the
    quantization's error, not a kernel's)."""
    import torch

    work = make_workload(Row(8, 3, 5, 200), 64, "causal", "bf16", l2=0)
    bf16 = mlagen_call(work, None)(work.sets[0]).float()
    for case in FP8_CASES:
        fp8 = with_fp8(work, case, l2=0)
        out = mlagen_call(fp8, None)(fp8.sets[0]).float()
        assert bool(torch.isfinite(out).all())
        cos = torch.nn.functional.cosine_similarity(out.flatten(), bf16.flatten(), dim=0)
        assert cos > 0.99, (case, float(cos))


def test_with_mask_shares_the_inputs_and_runs():
    """A workload under another mask runs on the same tensors: only the tree mask differs."""
    import torch

    work = make_workload(Row(8, 3, 5, 200), 64, "causal", "bf16", l2=0)
    for mask in ("tree", "tree-per-request", "none"):
        other = with_mask(work, mask)
        assert other.sets[0].kv_cache is work.sets[0].kv_cache and other.sets[0].q is work.sets[0].q
        out = mlagen_call(other, None)(other.sets[0])
        assert out is other.sets[0].out and bool(torch.isfinite(out).all())


def test_tiny_tune_writes_a_table_dispatch_uses(tmp_path, user_tables):
    row = Row(8, 1, 2, 64)
    path, (result,) = tune([row], TuneConfig(max_candidates=3, split_top=1, workers=2, timing=QUICK))
    assert path.exists() and math.isfinite(result.best.us)
    entry = tables.load_table(path).entries[result.key]
    assert entry["variant"] == result.best.variant.name
    bench = run_bench([(row, ("custom",))], BenchConfig(timing=QUICK, host_calls=100))
    assert bench.rows[0].cells[DISPATCH].variant == result.best.variant.name
    # a second tune times that pick again as the row's incumbent, right after the untuned pick
    _, (again,) = tune([row], TuneConfig(max_candidates=3, split_top=1, workers=2, timing=QUICK))
    assert again.incumbent == result.best.variant and math.isfinite(again.incumbent_trial.us)
    assert again.incumbent in [t.variant for t in again.trials[:2]]


def test_tiny_fp8_tune_writes_keys_of_its_own_that_dispatch_uses(tmp_path, user_tables):
    """`mlagen tune --kv e4m3`: candidates timed on quantized inputs, the winner under an FP8 key,
    and the dispatcher's pick for that cache from then on."""
    import torch

    row = Row(8, 1, 2, 64)
    path, (result,) = tune([row], TuneConfig(kv_format="e4m3", max_candidates=4, split_top=1, workers=2, timing=QUICK))
    assert "_kve4m3_" in result.key and math.isfinite(result.best.us)
    assert tables.load_table(path).entries[result.key]["variant"] == result.best.variant.name
    device = torch.cuda.current_device()
    problem = problem_for(row, 64, "causal", "bf16").with_(kv_format="e4m3")
    picked = policy.choose_variant(problem, row.seqlen_q, row.batch, row.kv_capacity(64), device_info(device)[0],
                                   device_name(device), policy=device_policy(device))
    assert picked == result.best.variant


def test_host_cost_is_measured(user_tables):
    # The 20 us target is the benchmark's to report; here only that it measures something real.
    result = run_bench([(Row(64, 1, 9, 256), ("seed",))], BenchConfig(timing=QUICK, host_calls=200))
    host = result.meta["host"]
    for key in ("us_per_call_out_given", "us_per_call_allocating"):
        assert 0 < host[key] < 10_000, host


def test_measure_meets_every_cache_before_its_capture():
    """A TMA kernel's descriptor for a KV cache first met under capture is a copy node in the
    graph (mlagen.runtime.tensormap); measure runs every input set eagerly first, as an engine's warm-up
    does, so the timed graph has none (without the warm-up most timed calls of a TMA kernel pay
    one, ~2 µs each)."""
    import torch

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA kernels need sm_90")
    work = make_workload(Row(64, 1, 9, 4096), 64, "causal", "bf16", l2_bytes(torch.cuda.current_device()))
    assert len(work.sets) > 4                            # more sets than measure's eager probe runs
    captured = len(tensormap._captured)
    result = measure(mlagen_call(work, parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_p16_tma_ss_sm90a")), work.sets,
                     QUICK)
    assert result.replays > 0 and len(tensormap._captured) == captured
