"""`mlagen bench --sparse` (mlagen.tools.sparse_bench): its grid, inputs and report on the CPU,
and a run on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from mlagen.dsl.spec import parse_variant
from mlagen.tools import sparse_bench
from mlagen.tools.sparse_bench import SparseResult, SparseRow, SparseRowResult


def test_the_grid_is_deepseek_v32s_rows():
    grid = sparse_bench.sparse_grid()
    assert len(grid) == 24 and grid[0] == SparseRow(64, 1, 1, 2048) and grid[-1] == SparseRow(128, 128, 4, 2048)
    assert {r.heads for r in grid} == {64, 128} and {r.seqlen_q for r in grid} == {1, 2, 4}
    row = SparseRow(128, 128, 2, 2048)
    assert row.flops == 2 * 128 * 2 * 128 * 2048 * (576 + 512) and row.gathered_bytes == 128 * 2 * 2048 * 656
    assert str(row) == "H=128 B=128 S=2 topk=2048"


def test_inputs_list_distinct_rows_of_each_request():
    """Each token lists topk distinct rows of its own request's region; the sets share the cache."""
    row = SparseRow(4, 3, 2, 40)
    sets = sparse_bench.sparse_inputs(row, 128, 2, "cpu")
    assert sets[0].kv_cache is sets[1].kv_cache and sets[0].kv_cache.shape == (3 * 2, 64, 656)
    for s in sets:
        assert s.indices.shape == (3, 2, 40) and s.indices.dtype == torch.int32
        assert s.q.shape == (3, 2, 4, 576) and s.out.shape == (3, 2, 4, 512)
        for b in range(3):
            assert ((s.indices[b] // 128) == b).all()
            assert all(len(set(t.tolist())) == 40 for t in s.indices[b])
    assert not torch.equal(sets[0].indices, sets[1].indices)


def _result() -> SparseResult:
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "driver": "580", "torch": "2.11", "date_utc": "today",
            "page_size": 64, "cache_keys": 65536, "matmul_tflops": 790.0, "copy_tbps": 3.0,
            "flashmla": "timed live on the same inputs (FlashMLA built at /x)"}
    named = "mma_ht64_qt1_bn64_w8_st2_spa_lg_sm90a"
    fast = SparseRowResult(64, 8, 2, 2048, floor_us=10.0, us={"dispatch": 20.0, named: 25.0}, flashmla_us=16.0,
                           flashmla_diff=1e-3)
    slow = SparseRowResult(128, 128, 2, 2048, floor_us=190.0, us={"dispatch": 660.0}, flashmla_us=350.0,
                           errors={named: "SpecError: no"})
    lone = SparseRowResult(64, 1, 1, 2048, floor_us=1.0, us={"dispatch": 19.0, named: 21.0})
    small = SparseRowResult(16, 2, 2, 64, floor_us=1.0, us={"dispatch": 9.0, named: 9.5},
                            errors={sparse_bench.FLASHMLA: "RuntimeError: Unsupported h_q: 16"})
    return SparseResult(meta=meta, cells=["dispatch", named], rows=[fast, slow, lone, small])


def test_the_report_gives_each_cell_its_rate_and_the_peers_ratio():
    result = _result()
    fast = result.rows[0]
    assert fast.vs_flashmla == pytest.approx(1.25) and result.rows[2].vs_flashmla is None
    assert fast.tflops(20.0) == pytest.approx(SparseRow(64, 8, 2, 2048).flops / 20.0 / 1e6)
    md = sparse_bench.markdown(result)
    assert md.startswith("# mlagen bench --sparse\n")
    assert "- FlashMLA: timed live on the same inputs (FlashMLA built at /x)" in md
    assert "- dispatch / FlashMLA over 2 rows: best 1.25×, median 1.89×, worst 1.89× (H=128 B=128 S=2 topk=2048)" in md
    line = next(x for x in md.splitlines() if x.startswith("| 64 | 8 | 2 | 2048 |"))
    assert f"| 20.0 ({fast.tflops(20.0):.0f} TF, 2.00×) |" in line and "| 1.25× | 1.0e-03 |" in line
    assert "| failed |" in next(x for x in md.splitlines() if x.startswith("| 128 | 128 |"))
    assert "| — | — | — |" in next(x for x in md.splitlines() if x.startswith("| 64 | 1 |"))
    assert "- H=128 B=128 S=2 topk=2048 mma_ht64_qt1_bn64_w8_st2_spa_lg_sm90a: SpecError: no" in md
    assert "| failed | — | — |" in next(x for x in md.splitlines() if x.startswith("| 16 | 2 |"))
    assert "- H=16 B=2 S=2 topk=64 FlashMLA: RuntimeError: Unsupported h_q: 16" in md
    named = result.cells[1]
    assert json.loads(result.to_json())["rows"][1]["errors"] == {named: "SpecError: no"}
    assert len(sparse_bench.rich_table(result).columns) == len(sparse_bench.table_rows(result)[0])


def test_write_all_writes_json_and_markdown(tmp_path):
    paths = sparse_bench.write_all(_result(), tmp_path / "out")
    assert [p.name for p in paths] == list(sparse_bench.FILES)
    assert json.loads(paths[0].read_text())["cells"][0] == "dispatch"
    assert paths[1].read_text() == sparse_bench.markdown(_result())


@pytest.mark.gpu
def test_a_run_times_each_cell_on_the_gpu():
    """One small row: the dispatcher's pick and a named variant timed, a variant that does not fit
    failing with its reason; FlashMLA as the loader finds it (live or the reason why not)."""
    config = sparse_bench.SparseConfig(cache_keys=4096, extra=(parse_variant("naive_w4_sm90"),
                                                               parse_variant("mma_ht16_qt4_bn64_w8_st2_spa_sm90")))
    result = sparse_bench.run_sparse([SparseRow(64, 2, 2, 256)], config)
    (row,) = result.rows
    assert row.us["dispatch"] > 0 and row.us["naive_w4_sm90"] > row.us["dispatch"]
    assert "mma_ht16_qt4_bn64_w8_st2_spa_sm90" in row.errors and row.floor_us > 0
    assert result.meta["flashmla"].startswith(("timed live", "not run: "))
    assert (row.flashmla_us is not None) == result.meta["flashmla"].startswith("timed live")
