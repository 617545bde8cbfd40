"""GPU property tests: every variant the DSL can express here against the fp64 reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import mlagen
from mlagen.dispatch.policy import INVARIANT_SPLIT_KEYS_LOG2, INVARIANT_SPLITS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, Variant, naive, parse_variant
from mlagen.plan.validate import is_valid, validate
from mlagen.runtime import workspace
from mlagen.tools.testing import (
    TREE_SHAPES,
    assert_matches,
    make_case,
    pinned_balanced_ranges,
    poison_allocator,
    poisoned_out,
    rel_error,
)

pytestmark = pytest.mark.gpu

HEADS = [8, 16, 64, 128]
PAGES = [1, 16, 64]
MASKS = ["causal", "tree", "none"]


def _arch() -> str:
    from mlagen.runtime.op import device_info

    return device_info(torch.cuda.current_device())[0]


@st.composite
def shapes(draw, max_work: float):
    """(batch, S, H, prefixes, page, mask, empty, lse, seed) with B*S*H*N under max_work."""
    batch = draw(st.integers(1, 8))
    seqlen_q = draw(st.integers(1, 64))
    heads = draw(st.sampled_from(HEADS))
    page = draw(st.sampled_from(PAGES))
    mask = draw(st.sampled_from(MASKS))
    top = draw(st.sampled_from([0, 64, 700, 5000, 20000]))
    prefixes = draw(st.lists(st.integers(0, top), min_size=batch, max_size=batch))
    empty = draw(st.lists(st.booleans(), min_size=batch, max_size=batch)) if draw(st.booleans()) else None
    assume(batch * seqlen_q * heads * (max(prefixes) + seqlen_q) <= max_work)
    return dict(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=prefixes, page_size=page,
                mask=mask, empty=empty, per_request_tree=draw(st.booleans()),
                lse=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@st.composite
def tiled_variants(draw, family: str, heads: int, arch: str):
    """Any flash/mma variant for `heads` on `arch` (invalid ones are rejected by the test)."""
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    return Variant(family=family, head_tile=draw(st.sampled_from(divisors)),
                   q_tile=draw(st.integers(1, 16)), block_n=draw(st.sampled_from([32, 64, 128])),
                   warps=draw(st.sampled_from([2, 4, 8, 16])), stages=draw(st.integers(1, 3)),
                   kv_split=draw(st.sampled_from(["adaptive", 1, 2, 5, "balanced"])), arch=arch,
                   partials="16bit" if family == "mma" and draw(st.booleans()) else "fp32")


def _run(case, variant, lse: bool):
    poison_allocator(64 << 20)
    out = poisoned_out(case)
    res = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                  variant=variant, return_lse=lse, out=out, **case.kwargs())
    torch.cuda.synchronize()
    return res if lse else (res, None)


@given(shape=shapes(max_work=3e8))
def test_naive_matches_reference(shape):
    lse = shape.pop("lse")
    case = make_case(**shape)
    out, lse_out = _run(case, naive(arch=_arch()), lse)
    assert_matches(out, lse_out, case)


@pytest.mark.parametrize("family", ["flash", "mma"])
@given(shape=shapes(max_work=4e9), data=st.data())
def test_tiled_families_match_reference(family, shape, data):
    lse = shape.pop("lse")
    variant = data.draw(tiled_variants(family, shape["heads"], _arch()))
    try:
        validate(mlagen.Problem(heads=shape["heads"]), variant)
    except SpecError:
        assume(False)
    case = make_case(**shape)
    out, lse_out = _run(case, variant, lse)
    assert_matches(out, lse_out, case)


SCHEDULES = {"wgmma": {}, "pvm": {"mma_pv": True}}


def _wgmma_variant(heads: int, schedule: str = "wgmma", kv_split: int | str = "adaptive") -> Variant:
    """The sm_90a mma variant: 64 rows (positions x heads), 8 warps, 64-key tiles; P·V on
    wgmma, or on mma.sync ("pvm")."""
    head_tile = min(heads, 64)
    return Variant(family="mma", head_tile=head_tile, q_tile=64 // head_tile, block_n=64, warps=8,
                   stages=2, arch="sm_90a", kv_split=kv_split, **SCHEDULES[schedule])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma needs a compute capability 9.0 GPU (sm_90a)")
@given(shape=shapes(max_work=4e9), schedule=st.sampled_from(list(SCHEDULES)),
       kv_split=st.sampled_from(["adaptive", 1, 2, 3, 16, "balanced"]), part16=st.booleans(), tma=st.booleans(),
       seesaw=st.booleans())
def test_wgmma_schedules_match_reference(shape, schedule, kv_split, part16, tma, seesaw):
    lse = shape.pop("lse")
    case = make_case(**shape)
    tma = tma and shape["page_size"] % 64 == 0     # a TMA tile is one page's run of rows
    seesaw = seesaw and tma and schedule == "wgmma"
    variant = _wgmma_variant(shape["heads"], schedule, kv_split).with_(
        partials="16bit" if part16 else "fp32", loads="tma" if tma else "cp_async",
        schedule="seesaw" if seesaw else "lockstep")
    out, lse_out = _run(case, variant, lse)
    assert_matches(out, lse_out, case)


def _transposed_tiles(heads: int) -> list[tuple[int, int]]:
    """(head_tile, q_tile) of the transposed tiles for `heads`: rows a multiple of 8, 16 to 72."""
    from mlagen.dsl.spec import MAX_SEQLEN_Q
    from mlagen.plan.mma_plan import TRANSPOSED_ROWS
    from mlagen.plan.tiles import enumerate_tiles

    return [(h, q) for h, q in enumerate_tiles(heads, MAX_SEQLEN_Q, max(TRANSPOSED_ROWS)) if h * q in TRANSPOSED_ROWS]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the transposed tile runs on wgmma: a compute capability 9.0 GPU (sm_90a)")
@given(shape=shapes(max_work=4e9), data=st.data(), kv_split=st.sampled_from(["adaptive", 1, 3, 16, "balanced"]),
       part16=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]), tma=st.booleans())
def test_transposed_tile_matches_reference(shape, data, kv_split, part16, dtype, tma):
    """The transposed tile (wgmma's N = the rows) over every shape the strategy draws: ragged,
    empty and NaN-tailed requests, every mask, lse, page sizes 1 to 64, fixed and balanced
    splits, q tiles that overhang S, bf16 and fp16, cp.async or TMA loads (pages of 64)."""
    lse = shape.pop("lse")
    head_tile, q_tile = data.draw(st.sampled_from(_transposed_tiles(shape["heads"])))
    variant = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, block_n=64, warps=8, stages=2,
                      arch="sm_90a", kv_split=kv_split, partials="16bit" if part16 else "fp32",
                      schedule="transposed", loads="tma" if tma and shape["page_size"] % 64 == 0 else "cp_async")
    case = make_case(dtype=dtype, **shape)
    out, lse_out = _run(case, variant, lse)
    assert_matches(out, lse_out, case)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the transposed tile runs on wgmma: a compute capability 9.0 GPU (sm_90a)")
@pytest.mark.parametrize("name,page_size", [("mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a", 16),
                                            ("mma_ht8_qt9_bn64_w8_st2_sp3_tr_sm90a", 16),
                                            ("mma_ht8_qt4_bn64_w8_st2_spb_tr_sm90a", 16),
                                            ("mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a", 64)])
def test_transposed_tile_is_bitwise_repeatable(name, page_size):
    """The warpgroups hand the running max, its moved flag and P^T over through named barriers
    (bar.arrive, then bar.sync), which compute-sanitizer's racecheck does not pair up: it reports
    every hand-off as a hazard. A real one would move the output between launches of the same
    inputs; 200 launches over ragged, tree-masked requests whose balanced ranges cross from one
    request into the next must agree to the bit (and with the reference)."""
    case = make_case(batch=6, seqlen_q=9, heads=8, prefixes=[2000, 0, 900, 3500, 5, 1400], page_size=page_size,
                     mask="tree", empty=[False, True, False, False, False, False], seed=11)
    with pinned_balanced_ranges(6):     # the packed layout (tests/balanced_worklist.py): ranges cross requests
        first, first_lse = _run(case, parse_variant(name), True)
        assert_matches(first, first_lse, case)
        for _ in range(200):
            out, lse = _run(case, parse_variant(name), True)
            assert torch.equal(out, first) and torch.equal(lse, first_lse)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the balanced variants here are sm_90a (compute capability 9.0)")
@pytest.mark.parametrize("name", ["mma_ht16_qt4_bn64_w8_st2_spb_sm90a", "mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a",
                                  "mma_ht16_qt4_bn64_w8_st2_spb_p16_tr_sm90a"])
@pytest.mark.parametrize("prefixes,ranges,aligned", [   # aligned: (in tiles, in the seesaw's pairs)
    ([3000, 700, 0, 2500, 1300], 16, (8, 4)), ([3000, 700, 0, 2500, 1300], 5, (0, 0)),
    ([1500] * 5, 16, (8, 4)), ([1500] * 5, 7, (0, 0)), ([1500] * 5, 10, (12, 6)),
    ([3000, 700, 0, 2500, 1300], 12, (11, 6)),
], ids=["ragged-aligned", "ragged-packed", "equal-aligned", "equal-packed", "equal-pairs", "ragged-mixed"])
def test_balanced_split_layouts_match_reference(name, prefixes, ranges, aligned):
    """Both layouts of the balanced work list (templates/split_work_list.cuh.j2) on the lockstep, seesaw and
    transposed kernels, with the launch's ranges pinned so that the lengths below take the one
    asked for (tests/balanced_worklist.py says which): aligned, every range inside one request,
    its tiles shared evenly; packed, ranges crossing from one request into the next. Ragged
    requests (one without keys), and requests of equal length as the bench's rows have them.
    Aligned requests split in two (every one in "equal-pairs", one among 1, 4 and 5 splits in
    "ragged-mixed") end through the pair merge on the 16-bit seesaw kernel; packed ones, and
    those of the other two kernels, through the merge blocks.
    The seesaw's work list counts pairs of tiles: the same layouts, in its units.
    Tree-masked; run twice, bitwise the same."""
    from balanced_worklist import work_list

    empty = [p == 0 for p in prefixes]
    case = make_case(batch=5, seqlen_q=4, heads=16, prefixes=prefixes, page_size=64, mask="tree", empty=empty, seed=5)
    plan = validate(Problem(heads=16), parse_variant(name))
    units = [-(-int(n) // (64 * plan.split.split_unit)) for n in case.cache_seqlens.tolist()]
    wl = work_list(units, ranges, plan.split.segment_units, plan.split.unsplit_slack_units)
    assert wl.aligned == aligned[plan.split.split_unit - 1]
    with pinned_balanced_ranges(ranges):
        out, lse = _run(case, parse_variant(name), True)
        assert_matches(out, lse, case)
        again, again_lse = _run(case, parse_variant(name), True)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the cluster split's variants here are sm_90a (compute capability 9.0)")
@given(shape=shapes(max_work=4e9), size=st.sampled_from([2, 3, 5, 8]), schedule=st.sampled_from(list(SCHEDULES)),
       part16=st.booleans())
def test_cluster_split_matches_reference(shape, size, schedule, part16):
    """The splits of a row group as one thread-block cluster, combining their rows through
    distributed shared memory: sizes that do and do not divide the tiles, empty splits, ragged
    and empty requests (the shapes strategy)."""
    lse = shape.pop("lse")
    case = make_case(**shape)
    variant = _wgmma_variant(shape["heads"], schedule, size).with_(combine="cluster",
                                                                   partials="16bit" if part16 else "fp32")
    out, lse_out = _run(case, variant, lse)
    assert_matches(out, lse_out, case)


def _exchange_tiles(heads: int) -> list[tuple[int, int]]:
    """(head_tile, q_tile) of the P exchange's tiles for `heads`: 49 to 64 rows."""
    return [(h, q) for h in range(1, heads + 1) if heads % h == 0 for q in range(1, 65) if 49 <= h * q <= 64]


def _exchange_case(data, size: int, dtype: torch.dtype = torch.bfloat16):
    """A case whose block table addresses at most size * 64 keys (make_case adds a spare page
    column to the table): ragged, empty and NaN-tailed requests, every mask, pages of 1-64."""
    heads = data.draw(st.sampled_from(HEADS))
    page = data.draw(st.sampled_from(PAGES))
    seqlen_q = data.draw(st.integers(1, 64))
    longest = (size * 64 // page - 1) * page      # the most keys a request may hold
    assume(longest >= seqlen_q)
    batch = data.draw(st.integers(1, 4))
    prefixes = data.draw(st.lists(st.integers(0, longest - seqlen_q), min_size=batch, max_size=batch))
    empty = data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)) if data.draw(st.booleans()) else None
    case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=prefixes, page_size=page,
                     mask=data.draw(st.sampled_from(MASKS)), empty=empty, dtype=dtype,
                     per_request_tree=data.draw(st.booleans()), seed=data.draw(st.integers(0, 2**31 - 1)))
    head_tile, q_tile = data.draw(st.sampled_from(_exchange_tiles(heads)))
    return case, Variant(family="mma", head_tile=head_tile, q_tile=q_tile, block_n=64, warps=8, stages=1,
                         arch="sm_90a", kv_split=size, combine="cluster", schedule="p_exchange")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the P exchange runs on wgmma in clusters: a compute capability 9.0 GPU (sm_90a)")
@given(data=st.data(), size=st.sampled_from([2, 3, 4, 5, 8]), lse=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_p_exchange_matches_reference(data, size, lse, dtype):
    """The P exchange on every cluster size that fits: requests that fill every block's tile or
    leave blocks without one (their slots are not sent), empty requests, q tiles that overhang S,
    pages of 1 to 64, every mask, bf16 and fp16."""
    case, variant = _exchange_case(data, size, dtype)
    out, lse_out = _run(case, variant, lse)
    assert_matches(out, lse_out, case)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the P exchange runs on wgmma in clusters: a compute capability 9.0 GPU (sm_90a)")
def test_p_exchange_is_bitwise_repeatable_and_refuses_a_wide_table():
    """The blocks of a cluster hand P over by bulk copies counted on each receiver's mbarrier,
    after a cluster barrier that says every receiver stopped reading Q: a missing order would
    move the output between launches of the same inputs. A block table wider than the cluster's
    tiles is refused before any launch, naming the variant and the keys."""
    variant = parse_variant("mma_ht64_qt1_bn64_w8_st1_sp5_cl_px_sm90a")
    case = make_case(batch=3, seqlen_q=9, heads=64, prefixes=[247, 0, 120], page_size=16, mask="tree",
                     empty=[False, True, False], per_request_tree=True, seed=3)
    first, first_lse = _run(case, variant, True)
    assert_matches(first, first_lse, case)
    for _ in range(200):
        out, lse = _run(case, variant, True)
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    wide = make_case(batch=1, seqlen_q=9, heads=64, prefixes=[100], page_size=64, mask="causal", seed=4,
                     table_pages=6)
    with pytest.raises(mlagen.InputError, match="variant.*at most 320 keys.*384"):
        _run(wide, variant, False)


@pytest.mark.parametrize("kv_split", [40, "balanced"])
def test_part16_costs_at_most_a_rounding(kv_split):
    """16-bit partial rows against fp32 ones on the same inputs: 40 splits (two rounds of the
    merge's 32, rescaled between them) and the balanced split, with logits large enough that
    the splits' maxima differ. Each partial is rounded once more, so the error may grow by
    about one 16-bit rounding of the output (2^-8 relative), not more."""
    case = make_case(batch=2, seqlen_q=9, heads=64, prefixes=[4000, 2600], page_size=64, mask="causal", seed=5)
    case.q.mul_(4)
    base = _wgmma_variant(64, kv_split=kv_split) if _arch() == "sm_90" else \
        Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8, stages=2, kv_split=kv_split, arch=_arch())
    ref, _ = case.reference(torch.float64)
    errors = {}
    for part16 in (False, True):
        out, lse = _run(case, base.with_(partials="16bit" if part16 else "fp32"), True)
        assert_matches(out, lse, case)
        errors[part16] = rel_error(out, ref)
    assert errors[True] <= errors[False] + 2**-8, errors


@given(shape=shapes(max_work=4e9))
def test_dispatched_matches_reference(shape):
    lse = shape.pop("lse")
    case = make_case(**shape)
    out, lse_out = _run(case, None, lse)
    assert_matches(out, lse_out, case)


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("seqlen_q", [1, 9, 33, 64])
def test_every_tree_shape_matches_reference(seqlen_q, heads):
    """Chains, stars, binary and random trees, and trees with rows that see no draft token, one
    for the batch and one per request, through the dispatcher's pick: a long request, one whose
    cache holds only its drafts (the blind rows see no key at all), a short one and an empty
    one, each row against the reference."""
    for i, shape in enumerate(TREE_SHAPES):
        for per_request in (False, True):
            case = make_case(batch=4, seqlen_q=seqlen_q, heads=heads, prefixes=[3000, 0, 130, 64], page_size=64,
                             mask="tree", tree_shape=shape, per_request_tree=per_request,
                             empty=[False, False, False, True], seed=100 * seqlen_q + 10 * i + per_request)
            out, lse = _run(case, None, True)
            assert_matches(out, lse, case)


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_scores_whose_running_max_jumps(scale):
    """Logits of 10-100 log2 units on pages of uneven magnitude: the running max moves by more
    than the mma kernels' rescale slack (8) on some tiles and by less on others, so both the
    rescale and the kept-max path run, in one split and across split merges."""
    case = make_case(batch=2, seqlen_q=4, heads=16, prefixes=[2000, 700], page_size=64,
                     mask="causal", seed=int(scale * 10))
    gen = torch.Generator().manual_seed(1)
    page_gain = 1 + 3 * torch.rand(case.kv_cache.shape[0], 1, 1, generator=gen)
    case = dataclasses.replace(case, kv_cache=(case.kv_cache.float() * page_gain.cuda()).to(case.kv_cache.dtype),
                               scale=scale)
    mma_sync = [Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8, stages=st, kv_split=1,
                        arch=_arch()) for st in (2, 1)]
    variants = [None, next(v for v in mma_sync if is_valid(mlagen.Problem(heads=16), v))]
    if torch.cuda.get_device_capability() == (9, 0):
        variants += [_wgmma_variant(16, "wgmma", 1), _wgmma_variant(16, "wgmma", 5),
                     _wgmma_variant(16, "pvm", "balanced")]
    for variant in variants:
        out, lse = _run(case, variant, True)
        assert_matches(out, lse, case)


def test_fp16_and_uncommon_widths():
    for dl, dr, dtype in ((512, 64, torch.float16), (256, 32, torch.bfloat16), (512, 0, torch.bfloat16)):
        case = make_case(batch=3, seqlen_q=5, heads=16, prefixes=[300, 0, 77], page_size=16,
                         mask="causal", seed=dl + dr, dtype=dtype, dl=dl, dr=dr)
        mma = Variant(family="mma", head_tile=16, q_tile=1, block_n=64, warps=4, stages=2, arch=_arch())
        for variant in (None, naive(arch=_arch()), mma, mma.with_(kv_split=3, partials="16bit")):
            if variant is not None and variant.family == "mma" and (dl + dr) % 64:
                continue
            out, lse = _run(case, variant, True)
            assert_matches(out, lse, case)


def test_cuda_graph_capture_and_replay():
    case = make_case(batch=4, seqlen_q=9, heads=64, prefixes=[1000, 37, 4000, 0], page_size=64,
                     mask="causal", seed=1)
    static = [case.q, case.kv_cache, case.block_table, case.cache_seqlens]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):             # warm-up: compile and load outside the capture
        mlagen.verify_attention(*static, return_lse=True, **case.kwargs())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mlagen.verify_attention(*static, return_lse=True, **case.kwargs())
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        # New values in the captured tensors: fresh queries, negated keys (NaN stays NaN), and
        # lengths that only shrink (keys past the original lengths are NaN).
        case.q.copy_(torch.randn(case.q.shape, generator=gen, device="cuda"))
        case.kv_cache.neg_()
        shrink = torch.randint(0, 40, (4,), generator=gen, device="cuda", dtype=torch.int32)
        case.cache_seqlens.copy_((case.cache_seqlens - shrink).clamp(min=0))
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, lse, case)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="TMA tile loads need a compute capability 9.0 GPU (sm_90a)")
def test_tma_descriptor_under_capture_and_across_streams():
    """A tma kernel's cache descriptor (mlagen/runtime/tensormap.py): a first call under graph capture
    records its copy in the graph, and an eager call with that cache, the graph never replayed,
    still reads a written descriptor; later captures of either cache replay right; a first eager
    call's descriptor is on the device before a call on another stream reads it."""
    variant = _wgmma_variant(64, kv_split=3).with_(loads="tma")

    def new_case(seed):
        return make_case(batch=2, seqlen_q=9, heads=64, prefixes=[300, 1000], page_size=64, mask="causal",
                         seed=seed)

    _run(new_case(0), variant, True)             # compile and load outside the captures
    replayed, idle = new_case(1), new_case(2)
    outs = []
    for case in (replayed, idle):                # each cache's first call is the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs.append(mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                variant=variant, return_lse=True, **case.kwargs()))
        if case is replayed:
            for t in outs[-1]:
                t.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            assert_matches(*outs[-1], replayed)
    assert_matches(*_run(idle, variant, True), idle)
    # Captured again: `replayed`'s graph copies into the buffer its first capture made, `idle`'s
    # reads the one its eager call wrote. Each replay is right.
    for case in (replayed, idle):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                          variant=variant, return_lse=True, **case.kwargs())
        for t in out:
            t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(*out, case)
    case = new_case(3)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    for stream in (first, second):
        stream.wait_stream(torch.cuda.current_stream())
    results = []
    for stream in (first, second):               # no synchronization between the two calls
        with torch.cuda.stream(stream):
            results.append(mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                   variant=variant, return_lse=True, **case.kwargs()))
    torch.cuda.synchronize()
    for out, lse in results:
        assert_matches(out, lse, case)


@pytest.mark.parametrize("kv_split", [5, "balanced", "pair"])
def test_split_merge_across_calls_streams_and_graphs(kv_split):
    """The merge's counters: left at zero by every launch (repeat calls), per stream (concurrent
    streams), and per graph (two graphs replayed at once on two streams). "pair": a split of two
    with 16-bit partials, whose second block merges (its tickets and its reset of the counter)."""
    split = Variant(family="mma", head_tile=16, q_tile=2, block_n=64, warps=8, stages=2,
                    kv_split=2 if kv_split == "pair" else kv_split,
                    partials="16bit" if kv_split == "pair" else "fp32", arch=_arch())
    cases = [make_case(batch=3, seqlen_q=5, heads=16, prefixes=[3000, 700, 0], page_size=64,
                       mask="tree", empty=[False, False, True], seed=s) for s in (11, 12)]

    def run(case):
        return mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                       variant=split, return_lse=True, **case.kwargs())

    for _ in range(3):                                     # same stream, call after call
        out, lse = run(cases[0])
        torch.cuda.synchronize()
        assert_matches(out, lse, cases[0])
    # The same case again would read the same partials even where a counter was left off zero
    # (its merge would start early): so the counters themselves must be back at zero.
    counters = workspace._buffers[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)][1]
    assert not counters.any(), counters.nonzero().flatten().tolist()
    streams = [torch.cuda.Stream() for _ in cases]
    for _ in range(3):                                     # two streams at once
        results = []
        for stream, case in zip(streams, cases, strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                results.append(run(case))
        torch.cuda.synchronize()
        for (out, lse), case in zip(results, cases, strict=True):
            assert_matches(out, lse, case)
    graphs, outputs = [], []
    for case in cases:                                     # one graph per case, replayed at once
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(run(case))
        graphs.append(graph)
    for _ in range(3):
        for (out, lse) in outputs:
            out.fill_(math.nan)
            lse.fill_(math.nan)
        for stream, graph in zip(streams, graphs, strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.replay()
        torch.cuda.synchronize()
        for (out, lse), case in zip(outputs, cases, strict=True):
            assert_matches(out, lse, case)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("kv_split", [None, 5, "balanced", "pair", "exchange"])
def test_back_to_back_launches_read_what_the_previous_one_wrote(kv_split, pdl, monkeypatch, request):
    """Each call's out is the next call's q (its first Dl dims, NaN before), so a launch that
    read its inputs before the previous kernel finished would read NaN: with programmatic
    dependent launch (MLAGEN_PDL=1, sm_90+; a P exchange's launches under graph capture always)
    the kernels must wait for it. Eagerly and inside a CUDA graph; with a split the calls also
    share the workspace and the counters that the previous launch's merge blocks (or a pair's
    second block) reset."""
    from mlagen.runtime import launch, op

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    monkeypatch.setattr(launch, "PDL", pdl)
    monkeypatch.setattr(op, "_calls", {})
    op._prepare.cache_clear()          # kernel launches carry the PDL choice
    request.addfinalizer(op._prepare.cache_clear)
    if kv_split == "exchange":      # short requests, a P exchange over 8 tiles of 16 x 4 rows
        if _arch() != "sm_90":
            pytest.skip("the P exchange runs on sm_90a")
        variant = Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8, stages=1, kv_split=8,
                          combine="cluster", schedule="p_exchange", arch="sm_90a")
        prefixes = [400, 30]
    else:
        variant = None if kv_split is None else Variant(
            family="mma", head_tile=16, q_tile=2, block_n=64, warps=8, stages=2,
            kv_split=2 if kv_split == "pair" else kv_split,
            partials="16bit" if kv_split == "pair" else "fp32", arch=_arch())
        prefixes = [2500, 300]
    cases = [make_case(batch=2, seqlen_q=5, heads=16, prefixes=prefixes, page_size=64, mask="causal", seed=s)
             for s in (21, 22, 23)]

    def chain():
        results = []
        for case, following in zip(cases, cases[1:] + [None], strict=True):
            out = following.q[..., :following.dl] if following is not None else None
            results.append(mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                   variant=variant, return_lse=True, out=out, **case.kwargs()))
        return results

    def poison():
        for case in cases[1:]:
            case.q[..., :case.dl] = math.nan

    def check(results):
        torch.cuda.synchronize()
        for (out, lse), case in zip(results, cases, strict=True):
            assert_matches(out, lse, case)

    poison()
    check(chain())                                         # eager (also compiles and loads)
    poison()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = chain()
    for _ in range(3):
        poison()
        graph.replay()
        check(results)


_LATE_WRITE = r"""
extern "C" __global__ void late_write(int* table, const int* table_src, int table_n,
                                      int* lengths, const int* lengths_src, int lengths_n, long long spin) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // the dependent may start now
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {}
  for (int i = threadIdx.x; i < table_n; i += blockDim.x) table[i] = table_src[i];
  for (int i = threadIdx.x; i < lengths_n; i += blockDim.x) lengths[i] = lengths_src[i];
}
"""


@pytest.mark.parametrize("name, page_size", [
    ("mma_ht16_qt4_bn64_w8_st1_sp8_cl_px_sm90a", 64), ("mma_ht16_qt4_bn64_w8_st1_sp8_cl_px_sm90a", 16),
    ("mma_ht16_qt4_bn64_w8_st2_sp3_sm90a", 16), ("mma_ht16_qt4_bn64_w8_st2_sp2_cl_p16_sm90a", 64),
    ("mma_ht16_qt4_bn64_w8_st2_spa_p16_tma_ss_sm90a", 64), ("mma_ht16_qt4_bn32_w8_st2_spa_sm90", 16)])
def test_prefetching_kernels_read_their_inputs_again_after_the_previous_grid(name, page_size, monkeypatch,
                                                                              request):
    """The P exchange and the fixed or adaptive splits, launched as programmatic dependents,
    read their length and page ids before griddepcontrol.wait, to prefetch into L2. Here the
    kernel before them lets them start at once, spins ~50 µs, and only then writes the block
    table (each request's pages rolled by one, so the stale first page is a NaN page) and the
    lengths (request 0 longer, request 1 shorter than the stale values). The output must be the
    new inputs' attention: nothing read before the wait may decide what is computed."""
    import cupy

    from mlagen.runtime import launch, op

    if _arch() != "sm_90":
        pytest.skip("prefetching before the wait needs sm_90 (the P exchange, sm_90a)")
    monkeypatch.setattr(launch, "PDL", True)
    monkeypatch.setattr(op, "_calls", {})
    op._prepare.cache_clear()
    request.addfinalizer(op._prepare.cache_clear)
    variant = parse_variant(name)
    case = make_case(batch=2, seqlen_q=5, heads=16, prefixes=[400, 30], page_size=page_size, mask="causal", seed=31)
    table, lengths = case.block_table.clone(), case.cache_seqlens.clone()
    stale_table = torch.roll(case.block_table, 1, dims=1).contiguous()
    stale_lengths = torch.tensor([200, 300], dtype=torch.int32, device="cuda")
    writer = cupy.RawKernel(_LATE_WRITE, "late_write")
    kwargs = case.kwargs()
    for _ in range(3):
        case.block_table.copy_(stale_table)
        case.cache_seqlens.copy_(stale_lengths)
        out = poisoned_out(case)
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            writer((1,), (128,), (cupy.from_dlpack(case.block_table), cupy.from_dlpack(table),
                                  cupy.int32(table.numel()), cupy.from_dlpack(case.cache_seqlens),
                                  cupy.from_dlpack(lengths), cupy.int32(lengths.numel()), cupy.int64(100_000)))
        _, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                         variant=variant, return_lse=True, out=out, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(case.block_table, table) and torch.equal(case.cache_seqlens, lengths)
        assert_matches(out, lse, case)


def test_runs_on_the_current_stream():
    case = make_case(batch=2, seqlen_q=4, heads=16, prefixes=[5000, 100], page_size=16, mask="tree",
                     seed=7)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                      **case.kwargs())
    stream.synchronize()
    assert_matches(out, None, case)


def test_bad_inputs_raise_before_launch():
    case = make_case(batch=2, seqlen_q=3, heads=8, prefixes=[10, 20], page_size=16, mask="causal", seed=0)
    args = [case.q, case.kv_cache, case.block_table, case.cache_seqlens]
    with pytest.raises(mlagen.InputError, match="q.dtype"):
        mlagen.verify_attention(case.q.float(), *args[1:])
    with pytest.raises(mlagen.InputError, match="q.device"):
        mlagen.verify_attention(case.q.cpu(), *args[1:])
    with pytest.raises(mlagen.InputError, match="block_table.dtype"):
        mlagen.verify_attention(*args[:2], case.block_table.long(), args[3])
    with pytest.raises(mlagen.InputError, match="tree_mask.shape"):
        mlagen.verify_attention(*args, tree_mask=torch.ones(4, 4, dtype=torch.bool, device="cuda"))
    with pytest.raises(mlagen.InputError, match="variant.arch"):
        other = "sm_80" if _arch() != "sm_80" else "sm_90"
        mlagen.verify_attention(*args, variant=naive(arch=other))


def test_value_checks_and_bad_values_stay_in_bounds():
    case = make_case(batch=2, seqlen_q=3, heads=8, prefixes=[10, 20], page_size=16, mask="causal", seed=0)
    table = case.block_table.clone()
    table[0, 0] = case.kv_cache.shape[0] + 5
    lengths = case.cache_seqlens.clone()
    lengths[1] = 10**6
    with pytest.raises(mlagen.InputError, match="block_table"):
        mlagen.verify_attention(case.q, case.kv_cache, table, case.cache_seqlens, check_values=True)
    with pytest.raises(mlagen.InputError, match=r"cache_seqlens\[1\]"):
        mlagen.verify_attention(case.q, case.kv_cache, case.block_table, lengths, check_values=True)
    # Unchecked, the same values run without touching memory they were not given.
    for variant in (None, naive(arch=_arch())):
        mlagen.verify_attention(case.q, case.kv_cache, table, lengths, variant=variant)
        torch.cuda.synchronize()


@pytest.mark.parametrize("heads,batch,prefixes", [(64, 1, [256]), (16, 3, [1000, 40, 3000])])
def test_a_length_bound_on_a_wide_block_table_stays_correct(heads, batch, prefixes):
    """A block table sized for 128k keys holding short requests (as engines size them): without a
    bound, with the true longest length, and with a bound below it (a broken promise)."""
    case = make_case(batch=batch, seqlen_q=9, heads=heads, prefixes=prefixes, page_size=64, mask="causal",
                     seed=batch, table_pages=2048)
    longest = int(case.cache_seqlens.max())
    for bound in (None, longest, longest // 3):
        poison_allocator(64 << 20)
        out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                           return_lse=True, out=poisoned_out(case), max_seqlen_k=bound,
                                           **case.kwargs())
        torch.cuda.synchronize()
        assert_matches(out, lse, case)


@pytest.mark.parametrize("family", ["naive", "flash", "mma"])
@pytest.mark.parametrize("mask", MASKS)
def test_attention_sinks_scale_every_row(family, mask):
    """attn_sink through the op on each family and mask, ragged with an empty request: out is
    the reference times exp(lse) / (exp(lse) + exp(sink[h])) (fp64), lse stays the reference's;
    sinks of +inf and -inf give 0 and the unscaled row."""
    from mlagen.tools.testing import compare_rows

    case = make_case(batch=3, seqlen_q=5, heads=8, prefixes=[300, 0, 77], page_size=16, mask=mask,
                     empty=[False, True, False], per_request_tree=True, seed=7)
    variant = {"naive": naive(arch=_arch()),
               "flash": Variant(family="flash", head_tile=8, q_tile=5, block_n=32, warps=8, stages=2,
                                kv_split="adaptive", arch=_arch()),
               "mma": Variant(family="mma", head_tile=8, q_tile=8, block_n=64, warps=8, stages=2, kv_split=2,
                              arch=_arch())}[family]
    sink = torch.tensor([0.0, 1.5, -2.0, math.inf, -math.inf, 3.0, 0.25, -0.5], device="cuda")
    out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                       return_lse=True, out=poisoned_out(case), attn_sink=sink, **case.kwargs())
    ref_out, ref_lse = case.reference(torch.float64)
    factor = torch.sigmoid(ref_lse - sink.double()[:, None]).masked_fill(ref_lse == -math.inf, 0.0)   # [B, H, S]
    expected = ref_out * factor.transpose(1, 2).unsqueeze(-1)
    assert compare_rows(out, lse.transpose(1, 2), expected, ref_lse.transpose(1, 2)) is None
    assert (out[:, :, 3] == 0).all()                                  # a sink of +inf
    plain = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                                    **case.kwargs())
    assert torch.equal(out[:, :, 4], plain[:, :, 4])                  # a sink of -inf


def test_attention_sinks_in_varlen_and_the_custom_op():
    """The same sink through verify_attention_varlen and torch.ops.mlagen.verify_attention: the
    bits of the plain op's result, row for row."""
    case = make_case(batch=2, seqlen_q=4, heads=16, prefixes=[1000, 50], page_size=64, mask="causal", seed=3)
    sink = torch.linspace(-3, 3, 16, device="cuda")
    out = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, attn_sink=sink,
                                  **case.kwargs())
    via_op = mlagen.verify_attention_op(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                        attn_sink=sink, **case.kwargs())
    assert torch.equal(out, via_op)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device="cuda")
    packed = mlagen.verify_attention_varlen(case.q.flatten(0, 1), case.kv_cache, case.block_table, case.cache_seqlens,
                                            cu, 4, attn_sink=sink, **case.kwargs())
    assert torch.equal(packed, out.flatten(0, 1))


@pytest.mark.parametrize("mask", MASKS)
def test_batch_invariant_bits_follow_the_request_alone(mask):
    """batch_invariant=True: request 0's out and lse bits are the same alone, among 3 or 17
    requests of other lengths, under a block table twice as wide, and through varlen with
    neighbours of other draft counts; and every request matches the reference, whether its
    length splits it once (written out directly), twice (a pair), three times or up to the cap."""
    S, H = 9, 16
    prefixes = [5000, 3000, 17000] + [37 * k for k in range(1, 15)]  # 3 splits, 2, the cap of 8, one
    splits = [min(-(-(n + S) // (1 << INVARIANT_SPLIT_KEYS_LOG2)), INVARIANT_SPLITS) for n in prefixes]
    assert splits[:4] == [3, 2, 8, 1] and max(splits[3:]) == 1
    big = make_case(batch=17, seqlen_q=S, heads=H, prefixes=prefixes, page_size=16,
                    mask=mask, per_request_tree=True, seed=11, table_pages=1100)
    kw = dict(big.kwargs(), return_lse=True, batch_invariant=True)

    def request0(batch: int, width: int | None = None):
        mask_b = big.tree_mask[:batch] if big.tree_mask is not None and big.tree_mask.dim() == 3 else big.tree_mask
        table = big.block_table[:batch, :width] if width else big.block_table[:batch]
        out, lse = mlagen.verify_attention(big.q[:batch].contiguous(), big.kv_cache, table.contiguous(),
                                           big.cache_seqlens[:batch].contiguous(), **dict(kw, tree_mask=mask_b))
        return out[0], lse[0]

    alone = request0(1)
    for got in (request0(3), request0(17), request0(1, width=-(-(5000 + S) // 16))):
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    from mlagen.tools.testing import compare_rows

    out, lse = mlagen.verify_attention(big.q, big.kv_cache, big.block_table, big.cache_seqlens, **kw)
    ref_out, ref_lse = big.reference(torch.float64)
    problem = compare_rows(out, lse.transpose(1, 2), ref_out, ref_lse.transpose(1, 2))
    assert problem is None, problem
    if mask != "tree":        # varlen: request 0's 9 rows beside requests of 1 and 5 draft tokens
        counts = [S, 1, 5]
        cu = torch.tensor([0, 9, 10, 15], dtype=torch.int32, device="cuda")
        q = torch.cat([big.q[b, :c] for b, c in enumerate(counts)])
        out, lse = mlagen.verify_attention_varlen(q, big.kv_cache, big.block_table[:3].contiguous(),
                                                  big.cache_seqlens[:3].contiguous(), cu, S,
                                                  **dict(kw, tree_mask=None))
        assert torch.equal(out[:S], alone[0]) and torch.equal(lse[:, :S], alone[1])
