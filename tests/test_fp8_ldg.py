"""The fp8_ldg schedule: a producer warpgroup loads each ds_mla row from global memory into its
registers, widens it there and stores the 16-bit tile while the seesaw's two warpgroups run the
products (templates/mma_fp8_ldg.cuh.j2). Its rules, plan and kernels on the CPU; on a GPU,
every row against the fp64 reference for paged keys (every mask, the splits, NaN pages, empty
requests) and gathered keys (sparse verify: ragged topk_length, unused slots, duplicates, page
sizes that are not powers of two), bitwise repeatable."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_checks import assert_bitwise_repeatable, require_target

import mlagen
from mlagen.codegen.build import build
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.mma_plan import FP8_WS_BARRIERS, FP8_WS_PRODUCER_WARPS
from mlagen.plan.schedules import FP8_LDG
from mlagen.plan.validate import validate
from mlagen.tools.testing import (
    assert_matches,
    assert_rows_match,
    make_case,
    make_sparse_case,
    pinned_balanced_ranges,
    tolerance,
)

LDG = "mma_ht64_qt1_bn64_w8_st2_spa_lg_sm90a"
# Its variants across the splits: adaptive (fp32 partials), fixed (16-bit partials), balanced.
LDG_VARIANTS = [LDG, "mma_ht64_qt1_bn64_w8_st2_sp3_p16_lg_sm90a"]
PAGED = Problem(heads=128, kv_format="ds_mla", lse=True)
GATHERED = PAGED.with_(mask="none", keys="gathered")


def test_the_schedule_reads_ds_mla_caches_on_sm90a():
    """fp8_ldg takes a ds_mla cache (paged or gathered keys) and the lockstep wgmma tile; each
    refusal names the field and what it needs."""
    v = parse_variant(LDG)
    assert v.schedule == "fp8_ldg" and v.name == LDG
    for problem in (PAGED, GATHERED, PAGED.with_(page_size=16, dtype="fp16", mask="tree")):
        assert validate(problem, v)
    for fmt in ("dtype", "e4m3"):
        with pytest.raises(SpecError, match=f"variant.schedule: got 'fp8_ldg', expected a cache in 'ds_mla' for the "
                                            f"fp8_ldg schedule, got problem.kv_format='{fmt}'"):
            validate(PAGED.with_(kv_format=fmt), v)
    for change, field in ((dict(loads="tma"), "loads"), (dict(stages=1), "stages"), (dict(block_n=32), "block_n"),
                          (dict(arch="sm_90"), "arch"), (dict(mma_pv=True), "mma_pv")):
        with pytest.raises(SpecError, match=field):
            validate(PAGED, v.with_(**change))


def test_the_plan_adds_a_producer_warpgroup_and_drops_the_staged_rows():
    """The producer's warps are launched beside the seesaw's, which keeps two 16-bit stages and no
    staged FP8 rows, with fp8_ws's mbarriers; over gathered keys a 64-bit word a stage more holds
    the rows the producer filled: the lockstep FP8 tile's 41,984 bytes of staged rows become a
    second 16-bit stage."""
    plan = validate(GATHERED, parse_variant(LDG))
    paged = validate(PAGED, parse_variant(LDG))
    lockstep = validate(GATHERED, parse_variant("mma_ht64_qt1_bn64_w8_st1_spa_sm90a"))
    assert FP8_LDG.producer_warps == FP8_WS_PRODUCER_WARPS == 4
    assert (plan.threads, plan.producer_threads, plan.launch_threads) == (256, 128, 384)
    assert plan.fp8_staging_bytes == 0 and lockstep.fp8_staging_bytes == 64 * 656
    assert plan.mbarriers == FP8_WS_BARRIERS == 10 and plan.seesaw
    assert plan.marks_listed_rows and not paged.marks_listed_rows and not lockstep.marks_listed_rows
    assert plan.smem_bytes == paged.smem_bytes + 2 * 8
    assert plan.smem_bytes == lockstep.smem_bytes - 64 * 656 + 64 * 576 * 2 + 10 * 8 + 2 * 8 <= plan.arch.smem_per_block


@pytest.mark.parametrize("problem", [GATHERED, PAGED.with_(mask="tree"), PAGED.with_(dtype="fp16", page_size=16)],
                         ids=["gathered", "paged-tree", "paged-fp16"])
@pytest.mark.parametrize("name", LDG_VARIANTS)
def test_its_kernels_compile_without_spills(problem, name):
    """Each variant compiles with no spill at its split of the registers (setmaxnreg), launched
    with the producer's threads; the computing threads' barrier 0 counts them alone, and no
    staged FP8 row or block-wide dequantization is left in the source."""
    built = build(problem, parse_variant(name))
    resources = built.module.resources[built.plan.main_kernel]
    assert not resources.spills, resources
    src = built.source
    assert "__launch_bounds__(384, 1)" in src and "constexpr int PRODUCER_THREADS = 128;" in src
    assert "setmaxnreg.dec.sync.aligned.u32" in src and "setmaxnreg.inc.sync.aligned.u32" in src
    assert "constexpr bool FP8 = false;" in src and "constexpr bool WS = true;" in src
    assert "dequantize_tile(" not in src and "produce_tiles(" in src and "kv_t staged[" not in src
    assert ("listed_row_at(p, listed[j])" in src) == ("unsigned long long valid[STAGES];" in src) == problem.gathered


def _paged(case, variant, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    return mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                   return_lse=True, **case.kwargs() | kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", LDG_VARIANTS)
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_paged_keys_match_the_reference(name, mask):
    """Shuffled pages among NaN ones of 64 and 16 keys, lengths that end inside a tile, an empty
    request and one shorter than a tile: every row and lse entry against the fp64 reference of
    the same ds_mla cache."""
    require_target("sm_90a")
    for seed, page_size in enumerate((64, 16)):
        case = make_case(batch=4, seqlen_q=3, heads=128, prefixes=[700, 0, 3500, 20], page_size=page_size, mask=mask,
                         seed=60 + seed, empty=[False, True, False, False], per_request_tree=True, kv_format="ds_mla")
        out, lse = _paged(case, parse_variant(name))
        assert_matches(out, lse, case)


@pytest.mark.gpu
@pytest.mark.parametrize("ranges", [1, 5, 64])
def test_balanced_ranges_that_cut_requests_anywhere(ranges):
    """The balanced split with its range count pinned: a block walks several segments, the
    producer's stages handed back only after each segment's epilogue has used the buffers."""
    require_target("sm_90a")
    case = make_case(batch=6, seqlen_q=2, heads=128, prefixes=[4000, 64, 0, 1900, 130, 9000], page_size=64,
                     mask="causal", seed=93, kv_format="ds_mla")
    with pinned_balanced_ranges(ranges):
        out, lse = _paged(case, parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_lg_sm90a"))
    assert_matches(out, lse, case)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,heads,seqlen_q,split", [(64, 128, 2, "a"), (61, 64, 3, "3"), (1, 64, 1, "16"),
                                                            (16, 128, 4, "1")])
def test_gathered_keys_match_the_reference(page_size, heads, seqlen_q, split):
    """Ragged topk_length (one request with none), a quarter of the slots unused, duplicate rows,
    NaN pages listed past each length; out poisoned with NaN: every row against the fp64
    reference, an empty request's out 0 and lse -inf."""
    require_target("sm_90a")
    case = make_sparse_case(batch=3, seqlen_q=seqlen_q, heads=heads, topk=448, pages=max(2, 1500 // page_size),
                            page_size=page_size, seed=page_size + heads, lengths=[448, 0, 203], kv_format="ds_mla")
    out = torch.full((3, seqlen_q, heads, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    variant = parse_variant(LDG.replace("_spa_", f"_sp{split}_"))
    result, lse = mlagen.verify_attention(case.q, case.kv_cache, return_lse=True, out=out, variant=variant,
                                          **case.kwargs())
    ref_out, ref_lse = case.reference(torch.float64)
    assert result is out
    assert_rows_match(result, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2), tolerance(result.dtype))
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()


@pytest.mark.gpu
def test_it_is_bitwise_repeatable():
    """Ten launches on the same inputs give the same bits: the producer's hand-offs leave no race
    for the results to show (racecheck and synccheck run it through sanitize.py)."""
    require_target("sm_90a")
    case = make_sparse_case(batch=4, seqlen_q=2, heads=128, topk=2048, pages=80, page_size=64, seed=3,
                            kv_format="ds_mla")
    variant = parse_variant(LDG)
    assert_bitwise_repeatable(lambda: mlagen.verify_attention(case.q, case.kv_cache, return_lse=True, variant=variant,
                                                              **case.kwargs()))
