"""The fp8_ws schedule: a producer warpgroup lands an e4m3 cache's tiles with TMA in the back of
their 16-bit stages and widens them in place while the seesaw's two warpgroups run the products
(templates/mma_ws_producer.cuh.j2). Its rules, plan and kernels on the CPU; on a GPU, every row
against the fp64 reference of the same e4m3 cache over the splits, masks, page sizes, padding
tiles and empty requests the seesaw takes, bitwise repeatable, and under graph replay with a
scale tensor that changes between replays."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_bitwise_repeatable, require_target

import mlagen
from mlagen.codegen.build import build
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.mma_plan import FP8_WS_BARRIERS, FP8_WS_PRODUCER_WARPS
from mlagen.plan.schedules import FP8_WS, SEESAW
from mlagen.plan.validate import validate
from mlagen.tools.testing import assert_matches, compare_rows, make_case, pinned_balanced_ranges

WS = "mma_ht64_qt1_bn64_w8_st2_spa_tma_ws_sm90a"
# Its variants across the splits the seesaw takes: adaptive, fixed, balanced (16-bit partials,
# ragged rows), and a row group of 16 heads x 4 queries.
WS_VARIANTS = [
    WS,
    "mma_ht64_qt1_bn64_w8_st2_sp3_p16_tma_ws_sm90a",
    "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a",
    "mma_ht16_qt4_bn64_w8_st2_spb_tma_ws_sm90a",
    "mma_ht16_qt4_bn64_w8_st2_spb_tma_ws_rg_sm90a",
]


def test_the_schedule_reads_e4m3_caches_through_tma_on_sm90a():
    """fp8_ws takes an e4m3 cache only (a 16-bit one runs the seesaw; ds_mla's rows are not boxed
    yet), TMA loads and the seesaw's tile; each refusal names the field and what it needs."""
    v = parse_variant(WS)
    assert v.schedule == "fp8_ws" and v.name == WS
    assert validate(Problem(kv_format="e4m3"), v)
    for fmt in ("dtype", "ds_mla"):
        with pytest.raises(SpecError, match=f"variant.schedule: got 'fp8_ws', expected a cache in 'e4m3' for the "
                                            f"fp8_ws schedule, got problem.kv_format='{fmt}'"):
            validate(Problem(kv_format=fmt), v)
    for change, field in ((dict(loads="cp_async"), "loads"), (dict(stages=1), "stages"), (dict(block_n=32), "block_n"),
                          (dict(arch="sm_90"), "arch"), (dict(mma_pv=True), "mma_pv")):
        with pytest.raises(SpecError, match=field):
            validate(Problem(kv_format="e4m3"), v.with_(**change))
    with pytest.raises(SpecError, match="page"):          # a 64-key box within one page
        validate(Problem(kv_format="e4m3", page_size=16), v)


def test_the_plan_adds_a_producer_warpgroup_to_the_seesaws_block():
    """The producer's warps are launched beside the computing ones, which keep the seesaw's layout:
    two 16-bit stages and no staged rows (the FP8 bytes land inside the stages), with two more
    mbarriers than the seesaw's."""
    problem = Problem(heads=64, kv_format="e4m3", mask="tree", lse=True)
    plan = validate(problem, parse_variant(WS))
    seesaw = validate(problem.with_(kv_format="dtype"), parse_variant(WS.replace("_ws", "_ss")))
    assert FP8_WS.producer_warps == FP8_WS_PRODUCER_WARPS == 4 and SEESAW.producer_warps == 0
    assert (plan.threads, plan.producer_threads, plan.launch_threads) == (256, 128, 384)
    assert (seesaw.threads, seesaw.producer_threads, seesaw.launch_threads) == (256, 0, 256)
    assert plan.fp8_staging_bytes == 0 and plan.seesaw and plan.mbarriers == FP8_WS_BARRIERS == 10
    assert plan.smem_bytes == seesaw.smem_bytes + 8 * (plan.mbarriers - seesaw.mbarriers)
    assert plan.smem_bytes <= plan.arch.smem_per_block


@pytest.mark.parametrize("name", WS_VARIANTS)
@pytest.mark.parametrize("dtype,mask", [("bf16", "tree"), ("fp16", "causal")])
def test_its_kernels_compile_without_spills(name, dtype, mask):
    """Each variant compiles with no spill: the producer gives its registers to the computing
    warpgroups (setmaxnreg), and its kernel is launched with the producer's threads; the
    computing threads' barrier 0 counts them alone."""
    built = build(Problem(heads=64, kv_format="e4m3", dtype=dtype, mask=mask, lse=True), parse_variant(name))
    resources = built.module.resources[built.plan.main_kernel]
    assert not resources.spills, resources
    assert "wgmma.mma_async instructions are serialized" not in built.module.log   # (scores_widened's wait)
    src = built.source
    assert "__launch_bounds__(384, 1)" in src and "constexpr int PRODUCER_THREADS = 128;" in src
    assert "setmaxnreg.dec.sync.aligned.u32" in src and "setmaxnreg.inc.sync.aligned.u32" in src
    assert 'asm volatile("bar.sync 0, %0;\\n" :: "n"(THREADS) : "memory");' in src
    assert "constexpr bool FP8 = false;" in src and "constexpr bool WS = true;" in src
    assert "dequantize_tile(" not in src and "produce_tiles(" in src


def test_16bit_seesaw_kernels_keep_their_source():
    """The seesaw over a 16-bit cache renders none of the producer's code."""
    src = build(Problem(heads=64), parse_variant(WS.replace("_ws", "_ss"))).source
    assert "constexpr int PRODUCER_THREADS = 0;" in src and "__launch_bounds__(256, 1)" in src
    assert "produce_tiles" not in src and "setmaxnreg" not in src and "STAGE_FRONT" not in src



def _check(case, variant, kv_scale, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                       variant=variant, return_lse=True, **case.kwargs() | {"kv_scale": kv_scale} | kw)
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("name", WS_VARIANTS)
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_it_matches_the_reference_of_its_e4m3_cache(name, mask):
    """Shuffled pages among NaN ones of 64 and 128 keys, requests whose lengths end inside a tile,
    an odd tile count (a padding tile), an empty request and one shorter than a tile; the scale
    as a float and as a device tensor: every row and lse entry against the fp64 reference of the
    same e4m3 cache, with bf16's tolerance."""
    require_target("sm_90a")
    variant = parse_variant(name)
    q_tile, heads = variant.q_tile, 64
    seqlen_q = q_tile if q_tile > 1 else 5
    for seed, (page_size, as_tensor) in enumerate(((64, False), (128, True))):
        case = make_case(batch=4, seqlen_q=seqlen_q, heads=heads, prefixes=[700, 0, 3500, 20], page_size=page_size,
                         mask=mask, seed=40 + seed, empty=[False, True, False, False], per_request_tree=True,
                         kv_format="e4m3")
        scale = case.kv_scale if as_tensor else float(case.kv_scale)
        if variant.rows == "ragged":
            counts = torch.tensor([seqlen_q, 0, 2, 1], dtype=torch.int32, device="cuda")
            out, lse = _check(case, variant, scale, q_counts=counts)
            keep = [(b, i) for b, c in enumerate(counts.tolist()) for i in range(seqlen_q - c, seqlen_q)]
        else:
            out, lse = _check(case, variant, scale)
            keep = None
        ref_out, ref_lse = mlagen.reference(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                            dtype=torch.float64, **case.kwargs() | {"kv_scale": scale})
        lse, ref_lse = lse.transpose(1, 2), ref_lse.transpose(1, 2)
        if keep is not None:
            out, lse, ref_out, ref_lse = (torch.stack([x[b, i] for b, i in keep]) for x in (out, lse, ref_out, ref_lse))
        problem = compare_rows(out, lse, ref_out, ref_lse)
        assert problem is None, (name, mask, page_size, problem)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [WS, "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a"])
def test_fp16_queries_over_an_e4m3_cache(name):
    """fp16 queries and output (the widening's fp16 unit and shift): every row against the
    reference, fp16's tolerance."""
    require_target("sm_90a")
    case = make_case(batch=3, seqlen_q=5, heads=64, prefixes=[900, 0, 2100], page_size=64, mask="tree", seed=17,
                     dtype=torch.float16, empty=[False, True, False], kv_format="e4m3")
    out, lse = _check(case, parse_variant(name), case.kv_scale)
    assert out.dtype == torch.float16
    assert_matches(out, lse, case)


@pytest.mark.gpu
@pytest.mark.parametrize("ranges", [1, 5, 64])
def test_balanced_ranges_that_cut_requests_anywhere(ranges):
    """The balanced split with its range count pinned: ranges that start and end mid-request, so
    the producer and the computing warps walk several segments per block with their mbarriers'
    phases carried across them; every row against the reference."""
    require_target("sm_90a")
    variant = parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a")
    case = make_case(batch=6, seqlen_q=3, heads=64, prefixes=[4000, 64, 0, 1900, 130, 9000], page_size=64,
                     mask="causal", seed=91, kv_format="e4m3")
    with pinned_balanced_ranges(ranges):
        out, lse = _check(case, variant, case.kv_scale)
    assert_matches(out, lse, case)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [WS, "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a"])
def test_it_is_bitwise_repeatable(name):
    """Ten launches on the same inputs give the same bits: the producer's hand-offs leave no race
    for the results to show (racecheck and synccheck run it in benchmarks/run_gpu.sh)."""
    require_target("sm_90a")
    case = make_case(batch=3, seqlen_q=9, heads=64, prefixes=[5000, 333, 64], page_size=64, mask="tree",
                     seed=7, kv_format="e4m3")
    assert_bitwise_repeatable(lambda: _check(case, parse_variant(name), case.kv_scale))


@pytest.mark.gpu
def test_graph_replay_reads_a_changed_scale_and_new_lengths():
    """Captured once, replayed with the scale tensor, the lengths and the queries changed in
    place: each replay matches the reference of what it read."""
    require_target("sm_90a")
    variant = parse_variant(WS)
    case = make_case(batch=2, seqlen_q=4, heads=64, prefixes=[2000, 600], page_size=64, mask="causal", seed=5,
                     kv_format="e4m3")
    scale = case.kv_scale.clone()
    out = torch.empty(2, 4, 64, 512, dtype=torch.bfloat16, device="cuda")
    kw = case.kwargs() | {"kv_scale": scale}
    mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                out=out, **kw)
    for factor, lengths in ((1.0, [2004, 604]), (0.5, [1500, 604]), (3.0, [68, 9])):
        scale.copy_(case.kv_scale * factor)
        case.cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        case.q.normal_()
        graph.replay()
        ref_out, _ = mlagen.reference(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                      dtype=torch.float64, **kw)
        problem = compare_rows(out, None, ref_out, torch.zeros(ref_out.shape[:-1], dtype=torch.float64, device="cuda"))
        assert problem is None, (factor, lengths, problem)
