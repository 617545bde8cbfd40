"""The bench's arithmetic, grids, eager reference, reports and CLI errors, without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from mlagen.codegen.precompile import code_identity, precompile
from mlagen.dispatch import policy
from mlagen.dsl.spec import Problem, Variant, naive, parse_variant
from mlagen.plan.validate import validate
from mlagen.tools.bench import (
    DISPATCH,
    EAGER,
    FP8_MEMORY_ROWS,
    INVARIANT,
    TILE,
    WS,
    BenchConfig,
    BenchResult,
    Cell,
    RowResult,
    compile_jobs,
    fp8_case_of,
    fp8_cell,
    fp8_cells,
    fp8_floors,
    invalid_cells,
    mask_cell,
    plan_rows,
    row_variants,
    side_variants,
)
from mlagen.tools.eager import eager_attention, eager_visible
from mlagen.tools.floor import Ceilings, floor_bytes, floor_flops, floor_us
from mlagen.tools.grids import SEED, SERVING, TREES, Row, parse_row, select_rows
from mlagen.tools.peers import PEERS, peer
from mlagen.tools.report import FILES, from_json, markdown, plot, rich_table, summary_markdown, to_json, write_all
from mlagen.tools.testing import make_case
from mlagen.tools.timing import rotation_count
from mlagen.tools.workload import (
    FP8_CASES,
    InputSet,
    Workload,
    draft_tree,
    eager_call,
    fp8_case,
    fp8_problem,
    problem_for,
    with_fp8,
    with_mask,
)

H200 = Ceilings(copy_bytes_per_s=4.25e12, matmul_flops_per_s=785e12)   # the ceilings of PEERS' floor_us
PVM = "mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a"     # a named variant (--variant): valid for H=64 only
runner = CliRunner()


def test_floor_matches_peer_table():
    for p in PEERS:
        f = floor_us(p.heads, p.batch, p.seqlen_q, p.prefix + p.seqlen_q, H200)
        assert abs(f - p.floor_us) <= 0.05 + 0.005 * p.floor_us, (p.shape, f, p.floor_us)


def test_floor_parts():
    assert floor_bytes(64, 1, 9, 265) == (265 * 576 + 9 * 64 * 576 + 9 * 64 * 512) * 2
    assert floor_flops(64, 1, 9, 265) == 2 * 9 * 64 * 265 * (576 + 512)
    slow_mem = Ceilings(copy_bytes_per_s=1e9, matmul_flops_per_s=1e18)
    assert floor_us(64, 1, 9, 265, slow_mem) == pytest.approx(floor_bytes(64, 1, 9, 265) / 1e9 * 1e6)


def test_fp8_floors_count_their_own_bytes_and_rate():
    """An FP8 floor reads 576 (e4m3) or 656 (ds_mla) bytes a key; e4m3 queries read a byte an
    element and count their flops at the FP8 rate where one was measured."""
    bf16 = floor_bytes(64, 1, 9, 265)
    q_out = (9 * 64 * 576 + 9 * 64 * 512) * 2
    assert floor_bytes(64, 1, 9, 265, kv_format="e4m3") == 265 * 576 + q_out
    assert floor_bytes(64, 1, 9, 265, kv_format="ds_mla") == 265 * 656 + q_out
    assert floor_bytes(64, 1, 9, 265, kv_format="e4m3", q_format="e4m3") == 265 * 576 + 9 * 64 * (576 + 512 * 2)
    assert bf16 == 265 * 576 * 2 + q_out
    slow_math = Ceilings(copy_bytes_per_s=1e18, matmul_flops_per_s=1e9, fp8_matmul_flops_per_s=2e9)
    flops = floor_flops(64, 1, 9, 265)
    assert floor_us(64, 1, 9, 265, slow_math, kv_format="e4m3") == pytest.approx(flops / 1e9 * 1e6)
    assert floor_us(64, 1, 9, 265, slow_math, kv_format="e4m3", q_format="e4m3") == pytest.approx(flops / 2e9 * 1e6)
    unmeasured = Ceilings(copy_bytes_per_s=1e18, matmul_flops_per_s=1e9)
    assert floor_us(64, 1, 9, 265, unmeasured, q_format="e4m3") == pytest.approx(flops / 1e9 * 1e6)
    row = Row(64, 1, 9, 256)
    floors = fp8_floors(row, BenchConfig(fp8=("ds_mla", "e4m3-q")), slow_math)
    ds_mla = floor_us(64, 1, 9, 265, slow_math, kv_format="ds_mla")
    assert floors == {fp8_cell("ds_mla"): ds_mla, fp8_cell("ds_mla") + TILE: ds_mla,
                      fp8_cell("e4m3-q"): floor_us(64, 1, 9, 265, slow_math, kv_format="e4m3", q_format="e4m3")}


def test_grids():
    assert len(SEED) == 10 and {r.heads for r in SEED} == {64} and {r.batch for r in SEED} == {1}
    assert {(r.seqlen_q, r.prefix) for r in SEED} == {(s, p) for s in (9, 33)
                                                      for p in (256, 1024, 4096, 16384, 65536)}
    assert [(r.heads, r.batch, r.seqlen_q, r.prefix) for r in SERVING] == [p.shape for p in PEERS]
    assert max(r.batch for r in SERVING) == 128 and {r.heads for r in SERVING} == {8, 16, 64, 128}
    assert peer(64, 1, 9, 65536).flashmla_us == 136.2 and peer(64, 1, 9, 7) is None
    # The trees grid: wide trees only (S = 33 batched, S = 64), none of them in the other grids.
    assert {r.seqlen_q for r in TREES} == {33, 64} and not set(TREES) & (set(SEED) | set(SERVING))
    assert all(r.seqlen_q == 64 or r.batch > 1 for r in TREES)


def test_select_rows_dedupes_and_keeps_membership():
    rows = dict(select_rows(["seed", "serving", "seed"], ["64,1,9,256", "8,2,3,100"]))
    assert len(rows) == 19 + 1
    assert rows[Row(64, 1, 9, 256)] == ("seed", "serving", "custom")
    assert rows[Row(8, 2, 3, 100)] == ("custom",)
    assert rows[Row(64, 1, 9, 131072)] == ("serving",)


@pytest.mark.parametrize("text", ["64,1,9", "a,b,c,d", "64,1,0,10", "64,1,65,10", "0,1,9,10"])
def test_parse_row_errors(text):
    with pytest.raises(ValueError, match="--row"):
        parse_row(text)


def test_rotation_count():
    l2 = 60 << 20
    assert rotation_count(1 << 30, l2) == 2
    assert rotation_count(l2 // 4, l2) == 8
    assert rotation_count(1, l2) == 256


@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_eager_matches_reference(mask):
    case = make_case(batch=3, seqlen_q=5, heads=4, prefixes=[70] * 3, page_size=16, mask="none", seed=1,
                     dtype=torch.float32, device="cpu", dl=256, dr=64)
    tree = draft_tree(5) if mask == "tree" else None
    case.causal, case.tree_mask = mask == "causal", tree
    n = 75
    out = eager_attention(case.q, case.kv_cache, case.block_table, n, eager_visible(n, 5, case.causal, tree),
                          case.scale, head_dim_v=256)
    ref, _ = case.reference(torch.float64)
    assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4)


def _ancestors(parents: list[int], k: int) -> set[int]:
    seen = {k}
    while k:
        k = parents[k]
        seen.add(k)
    return seen


@pytest.mark.parametrize("batch", [None, 5])
def test_draft_tree_is_a_random_ancestor_mask(batch):
    """Each token sees itself and its ancestors only; its parent is its lowest other visible
    token, an earlier one; the root sees only itself."""
    trees = draft_tree(16, batch, seed=3)
    assert trees.dtype == torch.bool and trees.shape == ((16, 16) if batch is None else (batch, 16, 16))
    for t in trees.view(-1, 16, 16):
        assert t.diagonal().all() and not t.triu(1).any() and t[0].tolist() == [True] + [False] * 15
        parents = [0] + [int(t[k, :k].nonzero().max()) for k in range(1, 16)]
        for k in range(16):
            assert set(t[k].nonzero().flatten().tolist()) == _ancestors(parents, k), (k, parents)
    if batch is not None:       # per-request trees differ (with this seed, every one)
        assert len({tuple(t.flatten().tolist()) for t in trees}) == batch


def test_draft_tree_is_reproducible_by_seed():
    assert torch.equal(draft_tree(9, 4, seed=7), draft_tree(9, 4, seed=7))
    assert torch.equal(draft_tree(9), draft_tree(9, seed=0))
    assert not torch.equal(draft_tree(33, 4, seed=7), draft_tree(33, 4, seed=8))
    assert draft_tree(1).tolist() == [[True]] and draft_tree(1, 3).shape == (3, 1, 1)


def test_precompile_reports_errors_without_raising():
    good = (Problem(heads=8), naive(arch="sm_80"))
    bad = (Problem(heads=8), Variant(family="naive", head_tile=2, arch="sm_80"))
    calls = []
    result = precompile([good, bad, good], workers=1, on_done=calls.append)
    assert result[good] == "" and "SpecError" in result[bad] and len(calls) == 2


@pytest.mark.parametrize("name", ["mma_ht16_qt4_bn64_w8_st2_sp2_cl_sm90a", "mma_ht64_qt1_bn64_w8_st2_spb_sm90a",
                                  "mma_ht64_qt1_bn64_w8_st2_sp3_sm90a", "flash_ht8_qt8_bn32_w8_st2_spa_sm90"])
def test_code_identity_names_the_code_that_runs(name):
    """The bench and the tuner look a variant's compile error up by its code identity: that must
    be the code the variant runs (a cluster's size and the balanced split are compiled in)."""
    v = parse_variant(name)
    _, ident = code_identity(Problem(heads=64), v)
    assert ident.code_name == v.code_name
    assert validate(Problem(heads=64), ident)     # raises when the identity is no variant at all


def _synthetic() -> BenchResult:
    def row(h, b, s, p, naive_us, flash_us, eager_us, dispatch_us, flashmla=None):
        return RowResult(heads=h, batch=b, seqlen_q=s, prefix=p, grids=["seed"], floor_us=2.0,
                         cells={"naive": Cell(naive_us, "naive_w4_sm90"),
                                "flash": Cell(flash_us, "flash_ht8_qt8_bn32_w8_st2_spa_sm90"),
                                EAGER: Cell(eager_us),
                                DISPATCH: Cell(dispatch_us, "flash_ht8_qt8_bn32_w8_st2_spa_sm90")},
                         flashmla_us=flashmla)
    rows = [row(64, 1, 9, 256, 40.0, 10.0, 50.0, 10.0, 17.6), row(64, 1, 9, 4096, 400.0, 30.0, 130.0, 30.0, 33.6),
            row(8, 16, 9, 1024, 20.0, 25.0, 60.0, 25.0)]
    rows[1].cells["flash"] = Cell(variant="flash_x", error="CompileError: boom\nmore")
    meta = {"gpu": "Test GPU", "arch": "sm_90", "sm_count": 132, "driver": "1", "torch": "t", "cupy": "c",
            "nvrtc": "13.0", "date_utc": "2025-01-01 00:00:00 UTC", "page_size": 64, "mask": "causal",
            "dtype": "bf16", "copy_tbps": 4.25, "matmul_tflops": 785.0,
            "host": {"row": "64,1,9,256", "calls": 2000, "us_per_call_out_given": 12.0,
                     "us_per_call_allocating": 15.0}}
    return BenchResult(meta=meta, families=["naive", "flash"], rows=rows)


def _with_named_variant() -> BenchResult:
    """_synthetic() plus a --variant column: timed on the H=64 rows, invalid on the H=8 one."""
    result = _synthetic()
    result.extra = [PVM]
    r0, r1, r2 = result.rows
    r0.cells[PVM] = Cell(8.0, PVM)           # faster than the dispatcher's pick: it is the best now
    r1.cells[PVM] = Cell(31.0, PVM)
    r2.cells.update(invalid_cells(Problem(heads=8), [parse_variant(PVM)]))
    return result


def test_derived_columns():
    r0, r1, r2 = _synthetic().rows
    assert r0.speedup == 4.0 and r0.dispatch_vs_best == 1.0 and r0.dispatch_ok
    assert r1.speedup is None and r1.dispatch_ok                 # flash failed; dispatch is still fastest
    assert r2.dispatch_vs_best == 1.25 and not r2.dispatch_ok     # naive beats the dispatched pick
    assert r0.dispatch_vs_flashmla == 10.0 / 17.6 and r2.dispatch_vs_flashmla is None   # no FlashMLA figure


def test_reports_are_written(tmp_path):
    result = _synthetic()
    paths = write_all(result, tmp_path / "out")
    assert [p.name for p in paths] == list(FILES)
    back = from_json(paths[0].read_text())
    assert back == result
    data = json.loads(paths[0].read_text())
    assert data["rows"][0]["derived"]["x_floor"]["naive"] == 20.0
    md = paths[1].read_text()
    assert md.count("\n| ") == 2 * (1 + len(result.rows)) and "Test GPU" in md and "failed" in md
    summary = md.split("## Summary", 1)[1].split("## Every cell", 1)[0]
    assert summary.count("\n| ") == 1 + len(result.rows) and "mlagen / FlashMLA" in summary
    assert "CompileError: boom" in md and "12.0 µs/call" in md
    assert "dispatch vs FlashMLA over the 2 rows with its figure: best 0.57×, median 0.89×, worst 0.89× " \
           "(64,1,9,4096)" in md
    assert "| 17.6 | 0.57× |" in md and "| 1.25× ! | — | — |" in md
    assert data["rows"][0]["derived"]["dispatch_vs_flashmla"] == 10.0 / 17.6
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rich_table(result).row_count == len(result.rows)
    assert to_json(result) == to_json(back) and markdown(back) == md


def test_named_variant_columns(tmp_path):
    result = _with_named_variant()
    r0, r1, r2 = result.rows
    assert r0.best_us == 8.0 and r0.dispatch_vs_best == 1.25 and not r0.dispatch_ok   # counts toward best
    assert r1.best_us == 30.0 and r2.us(PVM) is None
    assert r2.cells[PVM].error == "SpecError: variant.head_tile: got 64, expected a divisor of problem.heads=8"
    paths = write_all(result, tmp_path)
    back = from_json(paths[0].read_text())
    assert back == result and back.extra == [PVM] and to_json(back) == to_json(result)
    md = paths[1].read_text().split("## Every cell", 1)[1]
    header = next(line for line in md.splitlines() if line.startswith("| H |"))
    assert f"| flash µs | {PVM} µs | naive/flash |" in header               # after the families
    lines = [line for line in md.splitlines() if line.startswith("| 64 | 1 | 9 | 256 |")]
    assert len(lines) == 1 and "| 8.0 (4.0×) | 4.00× |" in lines[0] and "| 1.25× ! |" in lines[0]
    assert "| 8 | 16 | 9 | 1024 |" in md and "| 25.0 (12.5×) | failed | 0.80× |" in md
    assert f"- 8,16,9,1024 {PVM}: SpecError: variant.head_tile: got 64" in md
    assert rich_table(result).columns[7].header == f"{PVM} µs"
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_a_line_per_named_variant(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot(_with_named_variant(), tmp_path / "bench.png")
    (fig,) = figures
    first = fig.axes[0]             # H=8: the named variant has no point there, the legend still names it
    assert first.get_title() == "H=8 B=16 S=9" and PVM not in first.get_legend_handles_labels()[1]
    labels = [t.get_text() for t in first.get_legend().get_texts()]
    assert labels == ["naive", "flash", PVM, EAGER, DISPATCH, "floor", "FlashMLA (H200, stored)"]
    plt.close(fig)
    live = _with_named_variant()
    for r in live.rows:
        r.flashmla_live = True
    live.meta["flashmla"] = "timed live on the same inputs (FlashMLA built at /x)"
    plot(live, tmp_path / "live.png")
    assert [t.get_text() for t in figures[-1].axes[0].get_legend().get_texts()][-1] == "FlashMLA"
    plt.close(figures[-1])
    assert "FlashMLA: timed live on the same inputs (FlashMLA built at /x)" in markdown(live)


def test_result_without_extra_loads():
    """bench.json written before --variant existed has no "extra" key."""
    result = _synthetic()
    data = json.loads(to_json(result))
    del data["extra"]
    back = from_json(json.dumps(data))
    assert back.extra == [] and back == result and markdown(back) == markdown(result)


def test_row_variants_takes_valid_named_variants():
    named = [parse_variant(PVM), parse_variant("flash_ht8_qt8_bn32_w8_st2_spa_sm90")]
    for heads, timed in ((64, {PVM, named[1].name}), (8, {named[1].name})):
        problem = Problem(heads=heads)
        found = row_variants(problem, Row(heads, 1, 9, 256), 64, "sm_90a", "NVIDIA H200", policy.H200, named)
        assert {n for n in found if n not in ("naive", "flash", "mma", DISPATCH)} == timed
        assert set(invalid_cells(problem, named)) == {v.name for v in named} - timed
        assert all(found[v.name] == v for v in named if v.name in timed)


def _with_side_cells() -> BenchResult:
    """_synthetic() with the dispatcher's pick under two further masks and batch-invariant mode's:
    the H=8 row is a batched row of the serving grid, and its tree-per-request cell failed."""
    result = _synthetic()
    result.other_masks, result.invariant = ["tree", "tree-per-request"], True
    r0, r1, r2 = result.rows
    r2.grids = ["serving"]
    for r, tree, per_request, invariant in ((r0, 12.0, 13.0, 9.0), (r1, 33.0, 36.0, 31.5), (r2, 30.0, None, 35.0)):
        r.cells[mask_cell("tree")] = Cell(tree, "mma_tree")
        r.cells[mask_cell("tree-per-request")] = (Cell(per_request, "mma_tree") if per_request else
                                                  Cell(variant="mma_tree", error="RuntimeError: boom"))
        r.cells[INVARIANT] = Cell(invariant, "mma_invariant")
    return result


def test_side_cells_are_no_candidates():
    """The further masks' and the invariant cells are no candidates for the base problem: an
    invariant pick faster than dispatch leaves 'dispatch vs best' alone."""
    r0, _, r2 = _with_side_cells().rows
    assert r0.best_us == 10.0 and r0.dispatch_ok and r0.over_dispatch(INVARIANT) == 0.9
    assert r0.over_dispatch(mask_cell("tree")) == 1.2 and r2.over_dispatch(mask_cell("tree-per-request")) is None


def test_side_cell_columns(tmp_path):
    result = _with_side_cells()
    summary = summary_markdown(result)
    assert summary[0].endswith("| mlagen / FlashMLA | tree/causal | tree-per-request/causal | invariant/dispatch |")
    assert summary[2].endswith("| 0.57× | 1.20× | 1.30× | 0.90× |")
    assert summary[4].endswith("| — | 1.20× | — | 1.40× |")
    paths = write_all(result, tmp_path)
    back = from_json(paths[0].read_text())
    assert back == result and to_json(back) == to_json(result) and back.side_cells == result.side_cells
    md = paths[1].read_text()
    header = next(line for line in md.split("## Every cell", 1)[1].splitlines() if line.startswith("| H |"))
    assert ("| dispatch vs best | dispatch:tree µs | tree/causal | dispatch:tree-per-request µs | "
            "tree-per-request/causal | invariant µs | invariant/dispatch | FlashMLA µs |") in header
    assert "| 1.25× ! | 30.0 (15.0×) | 1.20× | failed | — | 35.0 (17.5×) | 1.40× | — |" in md
    assert "mask causal (the dispatcher's pick also under tree, tree-per-request, on the same inputs: " \
           "dispatch:tree, dispatch:tree-per-request), bf16" in md
    assert "target at most 1.25× dispatch on the serving grid's batched rows: over the 1 timed, median 1.40×, " \
           "worst 1.40× (8,16,9,1024), 1 over the target" in md
    assert "- 8,16,9,1024 dispatch:tree-per-request: RuntimeError: boom" in md
    assert [c.header for c in rich_table(result).columns][11:13] == ["dispatch:tree µs", "tree/causal"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_without_side_cells_render_as_before():
    """A result without side cells has no side columns, and bench.json written before the mask
    axis (no "other_masks" or "invariant" key) loads and renders the same."""
    result = _synthetic()
    assert summary_markdown(result)[0] == ("| H | B | S | prefix | floor µs | mlagen µs | × floor | torch eager µs | "
                                           "FlashMLA µs | mlagen / FlashMLA |")
    data = json.loads(to_json(result))
    del data["other_masks"], data["invariant"]
    back = from_json(json.dumps(data))
    assert back == result and markdown(back) == markdown(result) and summary_markdown(back) == summary_markdown(result)
    assert "/causal" not in markdown(result) and "invariant" not in markdown(result)


def test_plot_shows_the_side_cells(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot(_with_side_cells(), tmp_path / "bench.png")
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["naive", "flash", EAGER, DISPATCH, mask_cell("tree"), mask_cell("tree-per-request"), INVARIANT,
                      "floor", "FlashMLA (H200, stored)"]
    plt.close(fig)


def test_side_variants():
    row = Row(64, 8, 9, 4096)
    cap = row.kv_capacity(64)
    assert side_variants(row, BenchConfig(), "sm_90a", "NVIDIA H200", policy.H200) == {}
    config = BenchConfig(masks=("causal", "tree", "tree-per-request"), batch_invariant=True)
    side = side_variants(row, config, "sm_90a", "NVIDIA H200", policy.H200)
    assert list(side) == [mask_cell("tree"), mask_cell("tree-per-request"), INVARIANT]
    tree = problem_for(row, 64, "tree", "bf16")
    picked = policy.choose_variant(tree, 9, 8, cap, "sm_90a", "NVIDIA H200", policy=policy.H200)
    assert side[mask_cell("tree")] == ("tree", tree, picked)
    assert side[mask_cell("tree-per-request")] == ("tree-per-request", tree, picked)
    mask, problem, invariant = side[INVARIANT]
    assert mask == "causal" and problem == problem_for(row, 64, "causal", "bf16")
    assert invariant == policy.batch_invariant_variant(problem, 9, "sm_90a", policy.H200)
    assert invariant.kv_split in (policy.INVARIANT_SPLITS, 1)


def _cpu_workload(row: Row) -> Workload:
    def one() -> InputSet:
        return InputSet(q=torch.zeros(row.batch, row.seqlen_q, row.heads, 576), kv_cache=torch.zeros(4, 64, 576),
                        block_table=torch.arange(4, dtype=torch.int32).view(row.batch, -1),
                        cache_seqlens=torch.full((row.batch,), row.keys, dtype=torch.int32), tree_mask=None,
                        out=torch.zeros(row.batch, row.seqlen_q, row.heads, 512))
    return Workload(row=row, problem=problem_for(row, 64, "causal", "bf16"), sets=[one(), one()],
                    visible=eager_visible(row.keys, row.seqlen_q, True, None, "cpu"), scale=1.0)


def test_with_mask_swaps_only_the_mask():
    row = Row(4, 2, 5, 60)
    work = _cpu_workload(row)
    tree, per_request, none = (with_mask(work, m) for m in ("tree", "tree-per-request", "none"))
    for other in (tree, per_request, none):
        for a, b in zip(work.sets, other.sets, strict=True):
            assert all(getattr(a, f) is getattr(b, f) for f in ("q", "kv_cache", "block_table", "cache_seqlens", "out"))
        assert other.row == row and other.scale == work.scale and len(other.sets) == len(work.sets)
    assert tree.problem == work.problem.with_(mask="tree") == per_request.problem
    assert none.problem.mask == "none" and none.sets[0].tree_mask is None and bool(none.visible.all())
    assert torch.equal(tree.sets[1].tree_mask, draft_tree(5)) and tree.sets[0].tree_mask is tree.sets[1].tree_mask
    assert torch.equal(tree.visible, eager_visible(row.keys, 5, False, draft_tree(5), "cpu"))
    assert torch.equal(per_request.sets[0].tree_mask, draft_tree(5, 2)) and per_request.visible is None
    assert torch.equal(with_mask(per_request, "causal").visible, work.visible)
    with pytest.raises(ValueError, match="per-request trees"):
        eager_call(per_request)


def test_with_fp8_quantizes_each_set_and_keeps_the_rest():
    """Each FP8 case's sets: the cache in its format (the scale with e4m3), e4m3 queries and a
    bf16 out for e4m3-q; block tables, lengths and masks shared; enough sets for twice the L2."""
    row = Row(4, 2, 5, 60)
    work = with_mask(_cpu_workload(row), "tree")
    for s in work.sets:
        s.q.normal_()
        s.kv_cache.normal_()
    for case, (kv_format, q_format) in FP8_CASES.items():
        fp8 = with_fp8(work, case, l2=5 * work.sets[0].nbytes)
        assert fp8.problem == fp8_problem(work.problem, case)
        assert (fp8.problem.kv_format, fp8.problem.q_format) == (kv_format, q_format)
        assert fp8.problem.dtype == "bf16" and fp8.problem.mask == "tree"
        assert len(fp8.sets) == rotation_count(fp8.sets[0].nbytes, 5 * work.sets[0].nbytes) > len(work.sets)
        for i, s in enumerate(fp8.sets):
            src = work.sets[i % len(work.sets)]
            assert s.block_table is src.block_table and s.cache_seqlens is src.cache_seqlens
            assert s.tree_mask is src.tree_mask
            assert s.kv_cache.dtype == (torch.uint8 if kv_format == "ds_mla" else torch.float8_e4m3fn)
            assert (s.kv_scale is None) == (kv_format == "ds_mla")
            if q_format == "e4m3":
                assert s.q.dtype == torch.float8_e4m3fn and s.out.dtype == torch.bfloat16
                assert torch.allclose(s.q.float() * s.q_scale, src.q.float(), rtol=0.07, atol=1e-2)
            else:
                assert s.q is src.q and s.out is src.out and s.q_scale is None
    assert fp8_problem(problem_for(row, 64, "causal", "fp16"), "e4m3").dtype == "fp16"


def test_fp8_case_names_each_pair_of_formats():
    """fp8_case: the FP8 case of a cache and query format (the tuner's --kv and --q), None for
    16-bit inputs, and an error naming the pairs for one no case holds."""
    assert [fp8_case(*formats) for formats in FP8_CASES.values()] == list(FP8_CASES)
    assert fp8_case("dtype", "dtype") is None
    with pytest.raises(ValueError, match="no FP8 case holds a ds_mla cache with e4m3 queries: one of e4m3/dtype"):
        fp8_case("ds_mla", "e4m3")


def test_fp8_side_variants_and_their_jobs():
    """--fp8 cases time the dispatcher's pick for the FP8 problem (an mma tile; for e4m3 queries
    over an e4m3 cache that tile on the fp8_mma schedule, both products on e4m3 wgmma) and,
    over a 16-bit query, the mma tile that reads the FP8 cache (`policy.fp8_tile`), compiled with
    the other cells."""
    row = Row(8, 16, 9, 16384)
    config = BenchConfig(fp8=tuple(FP8_CASES))
    side = side_variants(row, config, "sm_90a", "NVIDIA H200", policy.H200)
    assert list(side) == [c for case in FP8_CASES for c in fp8_cells(case)]
    assert list(side) == ["fp8:e4m3", "fp8:e4m3:tile", "fp8:e4m3:ws", "fp8:ds_mla", "fp8:ds_mla:tile", "fp8:e4m3-q"]
    for name, (mask, problem, variant) in side.items():
        case = fp8_case_of(name)
        assert mask == "causal" and problem == fp8_problem(problem_for(row, 64, "causal", "bf16"), case)
        assert validate(problem, variant)
        if name.endswith(TILE):
            assert variant == policy.fp8_tile(problem, 9, "sm_90a", policy.H200)
            assert (variant.family, variant.schedule, variant.loads) == ("mma", "lockstep", "cp_async")
        elif name.endswith(WS):    # the dispatcher's pick on the fp8_ws schedule, its split and rows kept
            picked = side[fp8_cell(case)][2]
            assert (variant.schedule, variant.loads) == ("fp8_ws", "tma") and case == "e4m3"
            assert (variant.kv_split, variant.head_tile, variant.q_tile) == (picked.kv_split, picked.head_tile,
                                                                             picked.q_tile)
        else:   # the dispatcher's pick: a tile for an FP8 cache, on fp8_mma for e4m3 queries
            assert variant.family == "mma" and (variant.schedule == "fp8_mma") == (case == "e4m3-q")
    q8 = fp8_problem(problem_for(row, 64, "causal", "bf16"), "e4m3-q")
    assert policy.fp8_tile(q8, 9, "sm_90a", policy.H200).schedule == "fp8_mma"
    assert policy.fp8_tile(q8, 9, "sm_80", policy.H200) is None             # e4m3 wgmma: sm_90a only
    (plan,) = plan_rows([(row, ("serving",))], config, "sm_90a", "NVIDIA H200", policy.H200)
    assert all((p, v) in compile_jobs([plan]) for _, p, v in plan.side.values())


def _with_fp8_cells() -> BenchResult:
    """_synthetic() with FP8 cells: the H=8 row is 8,16,9,16384, a memory-bound target row."""
    result = _synthetic()
    result.fp8 = ["e4m3", "e4m3-q"]
    result.meta["fp8_matmul_tflops"] = 1500.0
    r0, r1, r2 = result.rows
    r2.prefix = 16384
    assert r2.row in FP8_MEMORY_ROWS
    for r, e4m3, e4m3q in ((r0, 8.0, 7.0), (r1, 18.0, 12.0), (r2, 20.0, 30.0)):
        r.cells[fp8_cell("e4m3")] = Cell(e4m3, "naive_w4_sm90")
        r.cells[fp8_cell("e4m3") + TILE] = Cell(e4m3 * 0.625, "mma_ht8_qt8_bn64_w8_st2_spa_p16_sm90a")
        r.cells[fp8_cell("e4m3") + WS] = Cell(e4m3 * 0.5, "mma_ht8_qt8_bn64_w8_st2_spa_tma_ws_sm90a")
        r.cells[fp8_cell("e4m3-q")] = Cell(e4m3q, "naive_w4_sm90")
        r.fp8_floor_us = {fp8_cell("e4m3"): 1.0, fp8_cell("e4m3") + TILE: 1.0, fp8_cell("e4m3") + WS: 1.0,
                          fp8_cell("e4m3-q"): 0.5}
    return result


def test_fp8_cells_report_their_own_floor_and_targets(tmp_path):
    result = _with_fp8_cells()
    r0 = result.rows[0]
    assert r0.floor_of(fp8_cell("e4m3")) == 1.0 and r0.floor_of(DISPATCH) == 2.0 and r0.best_us == 10.0
    summary = summary_markdown(result)
    assert summary[0].endswith("| fp8:e4m3/dispatch | fp8:e4m3:tile/dispatch | fp8:e4m3:ws/dispatch "
                               "| fp8:e4m3-q/dispatch |")
    assert summary[4].endswith("| 0.80× | 0.50× | 0.40× | 1.20× |")
    paths = write_all(result, tmp_path)
    back = from_json(paths[0].read_text())
    assert back == result and back.side_cells == ["fp8:e4m3", "fp8:e4m3:tile", "fp8:e4m3:ws", "fp8:e4m3-q"]
    assert json.loads(paths[0].read_text())["rows"][2]["derived"]["x_floor"][fp8_cell("e4m3-q")] == 60.0
    md = paths[1].read_text()
    assert "| 20.0 (20.0×) | 0.80× | 12.5 (12.5×) | 0.50× | 10.0 (10.0×) | 0.40× | 30.0 (60.0×) | 1.20× |" in md
    assert "the FP8 matmul rate, 1500 TFLOP/s" in md
    assert ("fp8:e4m3 on the memory-bound rows: worst 0.80× bf16 (8,16,9,16384), 1 of 1 over 0.60×; worst 20.00× "
            "the FP8 floor; rows slower than bf16 on the whole run: 0") in md
    assert ("fp8:e4m3:tile on the memory-bound rows: worst 0.50× bf16 (8,16,9,16384), 0 of 1 over 0.60×; worst "
            "12.50× the FP8 floor") in md
    assert ("fp8:e4m3:ws on the memory-bound rows: worst 0.40× bf16 (8,16,9,16384), 0 of 1 over 0.60×; worst "
            "10.00× the FP8 floor") in md
    assert "fp8:e4m3-q on the compute-bound rows: none timed" in md
    data = json.loads(paths[0].read_text())
    del data["fp8"]
    for r in data["rows"]:
        del r["fp8_floor_us"]
    assert from_json(json.dumps(data)).fp8 == []      # results written before --fp8 load


def test_flashmla_refusal_is_recorded_with_its_reason(monkeypatch):
    """A row FlashMLA's live call refuses keeps the error's first line: in the row, its JSON and
    bench.md's failures."""
    from mlagen.tools import bench
    from mlagen.tools.live_peer import LivePeer

    def refuse(*_args, **_kwargs):
        raise RuntimeError("num_heads_k must divide num_heads\nException raised from get_mla_metadata")
    monkeypatch.setattr(bench, "dense_call", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(bench, "measure", refuse)
    live = LivePeer(module=object(), source="/x")   # type: ignore[arg-type]
    work = type("W", (), {"scale": 0.1, "sets": []})()
    us, error = bench._time_live_peer(live, work, BenchConfig())
    assert us is None and error.startswith("RuntimeError: num_heads_k must divide num_heads\n")
    result = _with_named_variant()
    result.rows[0].flashmla_error = error
    assert from_json(to_json(result)).rows[0].flashmla_error == error
    assert (f"- {result.rows[0].row} FlashMLA: RuntimeError: num_heads_k must divide num_heads"
            in markdown(result).splitlines())


def test_empty_result_writes(tmp_path):
    paths = write_all(BenchResult(meta={}, families=[]), tmp_path)
    assert all(p.exists() for p in paths)


@pytest.mark.parametrize("args,message", [
    (["bench", "--grid", "nope"], "--grid: got 'nope'"),
    (["bench", "--row", "64,1,9"], "--row: got '64,1,9'"),
    (["bench", "--mask", "diagonal"], "--mask: got 'diagonal'"),
    (["bench", "--page-size", "48"], "--page-size: got 48"),
    (["bench", "--dtype", "fp8"], "--dtype: got 'fp8'"),
    (["bench", "--fp8", "e4m3,e5m2"], "--fp8: got 'e5m2', expected one of e4m3, ds_mla, e4m3-q"),
    (["tune", "--kv", "fp8"], "--kv: got 'fp8', expected one of dtype, e4m3, ds_mla"),
    (["bench", "--target-ms", "0"], "--target-ms: got 0"),
    (["bench", "--variant", PVM, "--variant", "mma_fast"], "--variant: variant name: got 'mma_fast', expected e.g."),
    (["bench", "--variant", "naive_w4_sm91"], "--variant: got 'naive_w4_sm91' (arch sm_91), expected an arch among"),
    (["tune", "--max-candidates", "0"], "--max-candidates: got 0"),
    (["tune", "--split-top", "-1"], "--split-top: got -1"),
    (["tune", "--retimes", "-1"], "--retimes: got -1"),
    (["tune", "--workers", "0"], "--workers: got 0"),
    (["tune", "--table", "t.json", "--write-default"], "--table and --write-default"),
    (["tune", "--mask", "causal", "--mask", "zigzag"], "--mask: got 'zigzag'"),
])
def test_cli_argument_errors(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_cli_needs_a_gpu(command):
    result = runner.invoke(app, [command, "--row", "8,1,2,64"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_the_planned_rows_compile_every_cell_they_time():
    """`compile_jobs` of the planned rows holds each row's family, dispatch and side cells (the
    further masks' and batch-invariant mode's picks) under their own problems, so a bench run
    compiles everything it times up front."""
    config = BenchConfig(masks=("causal", "tree"), batch_invariant=True)
    plans = plan_rows(select_rows(["seed"], ["8,16,9,16384"]), config, "sm_90a", "NVIDIA H200", policy.H200)
    jobs = compile_jobs(plans)
    assert len(plans) == 11
    for plan in plans:
        assert plan.problem.mask == "causal" and set(plan.side) == {"dispatch:tree", INVARIANT}
        assert all((plan.problem, v) in jobs for v in plan.variants.values())
        mask, problem, variant = plan.side["dispatch:tree"]
        assert mask == "tree" and problem.mask == "tree" and (problem, variant) in jobs
        assert (plan.problem, plan.side[INVARIANT][2]) in jobs
    assert len(jobs) == sum(len(p.variants) + len(p.side) for p in plans)
