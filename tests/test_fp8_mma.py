"""The fp8_mma schedule: e4m3 queries over an e4m3 cache with both products on e4m3 wgmma. A
producer warpgroup lands each tile with TMA and transposes its value dims into a key-major copy
(8-bit wgmma reads K-major operands only) while the seesaw's two warpgroups run the products,
with P in e4m3 (templates/mma_ws_producer.cuh.j2, mma_seesaw.cuh.j2). Its rules, plan and
kernels on the CPU; on a GPU, every row against the fp64 reference of the same e4m3 inputs over
the splits, masks, page sizes, padding tiles and empty requests the seesaw takes, bitwise
repeatable, and under graph replay with scale tensors that change between replays."""

from __future__ import annotations

import pytest
import torch
from gpu_checks import assert_bitwise_repeatable, require_target

import mlagen
from mlagen.codegen.build import build
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.mma_plan import FP8_WS_BARRIERS, fp8_row_bytes
from mlagen.plan.schedules import FP8_MMA, FP8_WS
from mlagen.plan.validate import validate
from mlagen.tools.testing import FP8_PRODUCTS_TOLERANCE, compare_rows, make_case, pinned_balanced_ranges

F8 = "mma_ht64_qt1_bn64_w8_st2_spa_tma_f8_sm90a"
# Its variants across the splits the seesaw takes: adaptive, fixed, balanced (16-bit partials,
# ragged rows), and a row group of 16 heads x 4 queries.
F8_VARIANTS = [
    F8,
    "mma_ht64_qt1_bn64_w8_st2_sp3_p16_tma_f8_sm90a",
    "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_f8_sm90a",
    "mma_ht16_qt4_bn64_w8_st2_spb_tma_f8_sm90a",
    "mma_ht16_qt4_bn64_w8_st2_spb_tma_f8_rg_sm90a",
]
BOTH = dict(kv_format="e4m3", q_format="e4m3")


def test_the_schedule_reads_e4m3_queries_over_an_e4m3_cache_on_sm90a():
    """fp8_mma takes e4m3 queries over an e4m3 cache only, TMA loads and the seesaw's tile; e4m3
    queries on another mma schedule name fp8_mma, and on another arch the naive family; each
    refusal names the field and what it needs."""
    v = parse_variant(F8)
    assert v.schedule == "fp8_mma" and v.name == F8
    assert validate(Problem(**BOTH), v)
    with pytest.raises(SpecError, match="variant.family: got 'mma', expected 'naive' for problem.q_format='e4m3' "
                                        r"\(the mma family reads them with fp8_mma on sm_90a over caches in 'e4m3'\)"):
        validate(Problem(kv_format="ds_mla", q_format="e4m3"), v)
    with pytest.raises(SpecError, match="variant.schedule: got 'fp8_mma', expected a schedule that reads "
                                        "problem.q_format='dtype' queries"):
        validate(Problem(kv_format="e4m3"), v)
    with pytest.raises(SpecError, match="variant.schedule: got 'fp8_ws', expected 'fp8_mma' for "
                                        "problem.q_format='e4m3'"):
        validate(Problem(**BOTH), parse_variant(F8.replace("_f8", "_ws")))
    with pytest.raises(SpecError, match="variant.family: got 'mma', expected 'naive' for problem.q_format='e4m3'"):
        validate(Problem(**BOTH), parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_sm90"))
    for change, field in ((dict(loads="cp_async"), "loads"), (dict(stages=1), "stages"), (dict(block_n=32), "block_n"),
                          (dict(mma_pv=True), "mma_pv")):
        with pytest.raises(SpecError, match=field):
            validate(Problem(**BOTH), v.with_(**change))
    with pytest.raises(SpecError, match="page"):          # a 64-key box within one page
        validate(Problem(page_size=16, **BOTH), v)


def test_the_plan_holds_e4m3_tiles_and_a_key_major_value_copy_a_stage():
    """Q and two KV stages of 640-byte e4m3 rows (576 bytes in five 128-byte blocks), one
    key-major value copy (512 x 64 bytes) a stage, the producer's warpgroup and mbarriers."""
    problem = Problem(heads=64, mask="tree", lse=True, **BOTH)
    plan = validate(problem, parse_variant(F8))
    assert FP8_MMA.producer_warps == FP8_WS.producer_warps and FP8_MMA.q_formats == ("e4m3",)
    assert (plan.threads, plan.producer_threads, plan.launch_threads) == (256, 128, 384)
    assert fp8_row_bytes(problem) == plan.f8_row_bytes == 640 and plan.mbarriers == FP8_WS_BARRIERS
    tiles = 64 * 640 + 2 * 64 * (640 + 512)
    statistics = 64 * 72 * 2 + 2 * 64 * 4 + 64 * 4 + 64 * 8
    assert plan.smem_bytes == tiles + statistics + 8 * plan.mbarriers <= plan.arch.smem_per_block
    assert plan.problem.dtype == "bf16" and plan.fp8_staging_bytes == 0


@pytest.mark.parametrize("name", F8_VARIANTS)
@pytest.mark.parametrize("mask", ["tree", "causal"])
def test_its_kernels_compile_without_spills(name, mask):
    """Each variant compiles with no spill and no serialized wgmma, both products on e4m3 wgmma
    (m64n64k32 scores, m64n256k32 P·V with P from registers and from shared memory), the
    producer transposing with ldmatrix and stmatrix, and no widening."""
    built = build(Problem(heads=64, mask=mask, lse=True, **BOTH), parse_variant(name))
    resources = built.module.resources[built.plan.main_kernel]
    assert not resources.spills, resources
    assert "wgmma.mma_async instructions are serialized" not in built.module.log
    src = built.source
    assert "constexpr bool F8MMA = true;" in src and "typedef unsigned char q_t;" in src
    for shape in ("m64n64k32.f32.e4m3.e4m3", "m64n256k32.f32.e4m3.e4m3"):
        assert shape in src
    assert "transpose_tile(" in src and "stmatrix.sync.aligned.m8n8.x4.shared.b16" in src
    assert "widen_tile(" not in src and "e4m3x16_times" not in src and "cvt.rn.satfinite.e4m3x2.f32" in src


def test_16bit_kernels_render_none_of_its_code():
    """The fp8_ws and seesaw kernels keep their 16-bit tiles and products."""
    for problem, name in ((Problem(heads=64, kv_format="e4m3"), F8.replace("_f8", "_ws")),
                          (Problem(heads=64), F8.replace("_f8", "_ss"))):
        src = build(problem, parse_variant(name)).source
        assert "constexpr bool F8MMA = false;" in src and "e4m3.e4m3" not in src and "transpose_tile" not in src



def _run(case, variant, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                   return_lse=True, **case.kwargs() | kw)


def _compare(case, out, lse, keep=None, **kw) -> str | None:
    """compare_rows against the fp64 reference of the case's e4m3 inputs (dequantized), with the
    e4m3 products' tolerance; keep: the (b, i) rows to compare (ragged), else all."""
    ref_out, ref_lse = mlagen.reference(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                        dtype=torch.float64, **case.kwargs() | kw)
    lse, ref_lse = lse.transpose(1, 2), ref_lse.transpose(1, 2)
    if keep is not None:
        out, lse, ref_out, ref_lse = (torch.stack([x[b, i] for b, i in keep]) for x in (out, lse, ref_out, ref_lse))
    return compare_rows(out, lse, ref_out, ref_lse, FP8_PRODUCTS_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("name", F8_VARIANTS)
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_it_matches_the_reference_of_its_e4m3_inputs(name, mask):
    """Shuffled pages among NaN ones of 64 and 128 keys, requests whose lengths end inside a tile,
    an odd tile count (a padding tile), an empty request and one shorter than a tile; the scales
    as floats and as device tensors: every row and lse entry against the fp64 reference of the
    same e4m3 queries and cache."""
    require_target("sm_90a")
    variant = parse_variant(name)
    seqlen_q = variant.q_tile if variant.q_tile > 1 else 5
    for seed, (page_size, as_tensor) in enumerate(((64, False), (128, True))):
        case = make_case(batch=4, seqlen_q=seqlen_q, heads=64, prefixes=[700, 0, 3500, 20], page_size=page_size,
                         mask=mask, seed=40 + seed, empty=[False, True, False, False], per_request_tree=True, **BOTH)
        scales = {"kv_scale": case.kv_scale, "q_scale": case.q_scale}
        scales = {k: (v if as_tensor else float(v)) for k, v in scales.items()}
        keep = None
        if variant.rows == "ragged":
            counts = torch.tensor([seqlen_q, 0, 2, 1], dtype=torch.int32, device="cuda")
            scales["q_counts"] = counts
            keep = [(b, i) for b, c in enumerate(counts.tolist()) for i in range(seqlen_q - c, seqlen_q)]
        out, lse = _run(case, variant, **scales)
        scales.pop("q_counts", None)
        problem = _compare(case, out, lse, keep, **scales)
        assert problem is None, (name, mask, page_size, problem)


@pytest.mark.gpu
@pytest.mark.parametrize("ranges", [1, 5, 64])
def test_balanced_ranges_that_cut_requests_anywhere(ranges):
    """The balanced split with its range count pinned: the producer and the computing warps walk
    several segments per block with their mbarriers' phases carried across them."""
    require_target("sm_90a")
    variant = parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_f8_sm90a")
    case = make_case(batch=6, seqlen_q=3, heads=64, prefixes=[4000, 64, 0, 1900, 130, 9000], page_size=64,
                     mask="causal", seed=91, **BOTH)
    with pinned_balanced_ranges(ranges):
        out, lse = _run(case, variant)
    problem = _compare(case, out, lse)
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("name", [F8, "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_f8_sm90a"])
def test_it_is_bitwise_repeatable(name):
    """Ten launches on the same inputs give the same bits: the producer's hand-offs leave no race
    for the results to show (racecheck and synccheck run it in benchmarks/run_gpu.sh)."""
    require_target("sm_90a")
    case = make_case(batch=3, seqlen_q=9, heads=64, prefixes=[5000, 333, 64], page_size=64, mask="tree", seed=7,
                     **BOTH)
    assert_bitwise_repeatable(lambda: _run(case, parse_variant(name)))


@pytest.mark.gpu
def test_graph_replay_reads_changed_scales_and_new_lengths():
    """Captured once, replayed with the scale tensors, the lengths and the queries changed in
    place: each replay matches the reference of what it read."""
    require_target("sm_90a")
    variant = parse_variant(F8)
    case = make_case(batch=2, seqlen_q=4, heads=64, prefixes=[2000, 600], page_size=64, mask="causal", seed=5,
                     **BOTH)
    kv_scale, q_scale = case.kv_scale.clone(), case.q_scale.clone()
    out = torch.empty(2, 4, 64, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, 64, 4, dtype=torch.float32, device="cuda")
    kw = case.kwargs() | {"kv_scale": kv_scale, "q_scale": q_scale}

    def launch():
        o, s = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                       out=out, return_lse=True, **kw)
        lse.copy_(s)

    launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for factor, lengths in ((1.0, [2004, 604]), (0.5, [1500, 604]), (3.0, [68, 9])):
        kv_scale.copy_(case.kv_scale * factor)
        q_scale.copy_(case.q_scale / factor)
        case.cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        case.q.copy_(torch.randn(case.q.shape, device="cuda").to(case.q.dtype))
        graph.replay()
        problem = _compare(case, out, lse, kv_scale=kv_scale, q_scale=q_scale)
        assert problem is None, (factor, lengths, problem)


def test_the_dispatcher_and_the_tuner_run_e4m3_queries_on_it():
    """e4m3 queries over an e4m3 cache: the dispatcher's pick is the heuristic tile on fp8_mma on
    sm_90a (the naive kernel on other archs and caches), and the tuner's candidates are its pick,
    the naive kernel and the mma structures of the 16-bit-query problem on fp8_mma, every one
    valid."""
    from mlagen.dispatch.policy import H200, choose_variant
    from mlagen.plan.space import structures
    from mlagen.tools.tune import candidates

    problem = Problem(heads=64, **BOTH)
    picked = choose_variant(problem, 9, 32, 4160, "sm_90a", "NVIDIA H100", policy=H200)
    assert picked.schedule == "fp8_mma" and picked.kv_split == "balanced" and validate(problem, picked)
    assert choose_variant(problem, 9, 32, 4160, "sm_80", "NVIDIA A100", policy=H200).family == "naive"
    assert choose_variant(problem.with_(kv_format="ds_mla"), 9, 32, 4160, "sm_90a", "NVIDIA H100",
                          policy=H200).family == "naive"
    shapes = structures(problem, 9, "sm_90a", "mma")
    assert shapes and all(v.schedule == "fp8_mma" and validate(problem, v) for v in shapes)
    assert structures(problem, 9, "sm_90", "mma") == []        # fp8_mma runs on sm_90a only
    cands = candidates(problem, 9, 32, 4160, "sm_90", 24, H200)
    assert cands[0].schedule == "fp8_mma" and any(v.family == "naive" for v in cands)
    assert set(shapes) <= set(cands) and all(validate(problem, v) for v in cands)
