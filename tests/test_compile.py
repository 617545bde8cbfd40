"""Every spec either validates, renders and compiles for its arch, or raises the clear error;
preset and knob variants compile for the CI archs without spills.

The default run compiles a representative set: per arch, the largest tile of each kind of kernel
(template, schedule, load, split and knobs), each family with fp16 and each mask, and a spread of
the sm_90a schedules' tiles, dtypes and masks. The rest of the matrix (every preset variant, every
combination) is marked compile_matrix and runs with --compile-matrix, as CI does.
"""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlagen.codegen.build import build
from mlagen.codegen.render import render
from mlagen.dispatch.presets import PRESETS
from mlagen.dsl.arch import CI_ARCHS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import Problem, Variant, naive, parse_variant
from mlagen.plan.mma_plan import TRANSPOSED_STACK
from mlagen.plan.schedules import stack_budget
from mlagen.plan.validate import is_valid, validate

MATRIX = pytest.mark.compile_matrix


def _rows(v: Variant) -> int:
    return 0 if v.family == "naive" else v.head_tile * v.q_tile


def _kind(v: Variant) -> tuple:
    """What sets a kernel's code apart from another's, but for the size of its tile (a fixed split
    is a launch parameter; a cluster's size is compiled in)."""
    split = v.kv_split if v.combine == "cluster" or not isinstance(v.kv_split, int) else "fixed"
    return (v.arch, v.family, v.warps, v.block_n, v.stages, split, v.mma_pv, v.partials, v.loads, v.schedule)


def largest_of_each_kind(jobs: list[tuple]) -> list:
    """Jobs ending in (preset, variant) as pytest params: of each kind of kernel, the valid job
    with the largest tile (the nearest to the register limit) runs by default, the rest are
    compile_matrix."""
    largest: dict[tuple, int] = {}
    for i, (*_, preset, v) in enumerate(jobs):
        best = largest.get(_kind(v))
        if is_valid(preset.problem, v) and (best is None or _rows(v) > _rows(jobs[best][-1])):
            largest[_kind(v)] = i
    chosen = set(largest.values())
    return [pytest.param(*job, id=f"{job[-2].name}-{job[-1].name}", marks=() if i in chosen else MATRIX)
            for i, job in enumerate(jobs)]


def representative(cases: list[tuple], chosen: list[tuple]) -> list:
    """`cases` as pytest params; those not in `chosen` are compile_matrix."""
    assert set(chosen) <= set(cases), set(chosen) - set(cases)
    return [pytest.param(*c, id="-".join(map(str, c)), marks=() if c in chosen else MATRIX) for c in cases]


problems = st.builds(
    Problem,
    heads=st.sampled_from([1, 8, 16, 24, 64, 128]),
    dl=st.sampled_from([256, 512, 500]),
    dr=st.sampled_from([0, 32, 64, 60]),
    dtype=st.sampled_from(["bf16", "fp16"]),
    page_size=st.sampled_from([1, 16, 64, 48]),
    mask=st.sampled_from(["causal", "tree", "none"]),
    lse=st.booleans(),
)
variants = st.one_of(
    st.builds(naive, arch=st.sampled_from(CI_ARCHS), warps=st.sampled_from([1, 2, 4, 8])),
    st.builds(
        Variant, family=st.just("flash"), head_tile=st.sampled_from([1, 2, 4, 8, 16, 3]),
        q_tile=st.integers(1, 16), block_n=st.sampled_from([32, 64, 48]), warps=st.sampled_from([2, 4, 8]),
        stages=st.integers(1, 3), arch=st.sampled_from(CI_ARCHS),
    ),
)


@settings(max_examples=30)
@given(problems, variants)
def test_every_spec_compiles_or_raises_a_clear_error(problem, variant):
    try:
        plan = validate(problem, variant)
    except SpecError as e:
        assert e.field.startswith(("problem", "variant")) and "expected" in str(e)
        return
    built = build(problem, variant)
    assert plan.main_kernel in built.module.resources
    assert built.module.cubin[:4] == b"\x7fELF"


PRESET_JOBS = [(p, v) for p in PRESETS.values() for a in CI_ARCHS for v in p.variants(a)]


@pytest.mark.parametrize("preset,variant", largest_of_each_kind(PRESET_JOBS))
def test_preset_variants_compile_without_spills(preset, variant):
    """No spills, but in a transposed tile of more than 32 rows a bounded stack."""
    built = build(preset.problem, variant)
    for name, r in built.module.resources.items():
        assert r.stack_frame <= stack_budget(variant), f"{name}: {r}"
        assert not r.spills or stack_budget(variant), f"{name} spills: {r}"
        assert r.registers <= 255
    assert built.plan.smem_bytes <= built.plan.arch.smem_per_block


# Knobs that make a kernel of their own, each on the presets' mma structures (tag: the knob's part
# of the kernel name):
# - the balanced split (a loop over row-group segments), on every CI arch;
# - the cluster split at sizes 2 and 8 (the combine over distributed shared memory holds every
#   block's row in flight), on sm_90;
# - 16-bit partial rows (normalized in the epilogue, unpacked in the merge) on every CI arch, and
#   with the balanced and cluster splits on sm_90a;
# - TMA tile loads (mbarrier stages, one issuing thread) with the counted and balanced splits.
# (The presets' seesaw kernels are a knob twin already: their lockstep tiles are in the presets too.
# The transposed tiles take none of these knobs but the split and part16, which
# test_transposed_variants_compile_with_asynchronous_wgmmas covers.)
MMA_JOBS = [(p, v) for p, v in PRESET_JOBS if v.family == "mma" and not v.seesaw and not v.transposed]
PART16_JOBS = [(p, v.with_(partials="16bit")) for p, v in MMA_JOBS]
KNOB_JOBS = ([("_spb_", p, v.with_(kv_split="balanced")) for p, v in MMA_JOBS]
             + [("_cl_", p, v.with_(kv_split=k, combine="cluster")) for p, v in MMA_JOBS for k in (2, 8)
                if v.arch in ("sm_90", "sm_90a")]
             + [("_p16_", p, v) for p, v in PART16_JOBS]
             + [("_p16_", p, v.with_(kv_split=k, combine=c)) for p, v in PART16_JOBS if v.arch == "sm_90a"
                for k, c in (("balanced", "merge"), (8, "cluster"))]
             + [("_tma_", p, v.with_(loads="tma", kv_split=k, partials=partials)) for p, v in MMA_JOBS
                if v.arch == "sm_90a" for k, partials in (("adaptive", "fp32"), ("balanced", "16bit"))])


@pytest.mark.parametrize("tag,preset,variant", largest_of_each_kind(KNOB_JOBS))
def test_knob_variants_compile_without_spills(tag, preset, variant):
    # a cluster's staged rows, or a TMA tile's page, may not fit a preset, and gathered keys take no
    # balanced split or TMA: refused, then skipped
    if (tag in ("_cl_", "_tma_") or preset.problem.gathered) and not is_valid(preset.problem, variant):
        with pytest.raises(SpecError) as refused:
            validate(preset.problem, variant)
        pytest.skip(f"{variant.name}: {refused.value}")
    built = build(preset.problem, variant)
    assert tag in built.plan.main_kernel
    for name, r in built.module.resources.items():
        assert not r.spills, f"{name} spills: {r}"


# Each family on each CI arch with what the presets (bf16, causal) leave out: fp16, the tree mask
# (naive, mma: the presets' largest mma tile of the arch) and no mask with lse (flash, which no
# preset picks).
def _largest_mma(arch: str) -> Variant:
    return max((v for v in PRESETS["kimi-k2"].variants(arch) if v.family == "mma" and v.arch == arch), key=_rows)


FAMILY_JOBS = [job for a in CI_ARCHS for job in (
    (Problem(heads=64, dtype="fp16", mask="tree"), naive(arch=a)),
    (Problem(heads=64, dtype="fp16", mask="tree"), _largest_mma(a)),
    (Problem(heads=16, dtype="fp16", mask="none", lse=True), Variant(head_tile=8, q_tile=4, stages=1, arch=a)))]


@pytest.mark.parametrize("problem,variant", FAMILY_JOBS, ids=[f"{p.name}-{v.name}" for p, v in FAMILY_JOBS])
def test_each_family_compiles_with_fp16_and_each_mask(problem, variant):
    built = build(problem, variant)
    assert built.plan.main_kernel in built.module.resources
    assert f"_{problem.dtype}_" in built.plan.main_kernel and f"_{problem.mask}" in built.plan.main_kernel
    for name, r in built.module.resources.items():
        assert not r.spills and r.registers <= 255, f"{name}: {r}"


def test_sm90a_products_run_on_wgmma():
    v = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2, arch="sm_90a")
    for dtype in ("bf16", "fp16"):
        built = build(Problem(dtype=dtype), v)
        assert built.plan.mma.wgmma
        assert "wgmma.mma_async.sync.aligned.m64n32k16" in built.source       # scores
        assert "wgmma.mma_async.sync.aligned.m64n256k16" in built.source      # output
        scores_only = build(Problem(dtype=dtype), v.with_(mma_pv=True))             # output on mma.sync
        assert "m64n256k16" not in scores_only.source and "m64n32k16" in scores_only.source
        assert not any(r.spills for r in scores_only.module.resources.values())
        assert not any(r.spills for r in built.module.resources.values())
        assert "wgmma.mma_async" not in render(validate(Problem(dtype=dtype), v.with_(arch="sm_90")))
    with pytest.raises(SpecError, match="on sm_90a the scores run on wgmma"):
        validate(Problem(), v.with_(block_n=32))


@pytest.mark.parametrize("dtype,mask,split,part16", representative(
    [(d, m, s, p) for d in ("bf16", "fp16") for m in ("causal", "tree")
     for s, p in (("adaptive", False), ("balanced", True))],
    [("bf16", "tree", "balanced", True), ("fp16", "causal", "adaptive", False)]))
def test_seesaw_variants_compile_without_spills_or_serialized_wgmmas(dtype, mask, split, part16):
    """The seesaw loop holds the scores of a whole tile (32 fp32) beside half the output (128)
    in each thread: close to the 255 registers, so every build checks for spills, and for the
    waits or serialization ptxas adds around wgmmas."""
    v = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2, arch="sm_90a", kv_split=split,
                partials="16bit" if part16 else "fp32", loads="tma", schedule="seesaw")
    built = build(Problem(heads=64, dtype=dtype, mask=mask), v)
    assert "scores_wgmma64" in built.source and "wgmma_pv_regs" in built.source
    for name, r in built.module.resources.items():
        assert not r.spills and r.stack_frame == 0, f"{name}: {r}"
    log = built.module.log
    assert "C751" not in log and "serialized" not in log and "injected" not in log, log


TRANSPOSED_TILES = [(8, 8, 9, "adaptive", True), (8, 8, 9, "balanced", False), (16, 16, 2, "balanced", True),
                    (16, 8, 2, 3, False), (64, 16, 4, "adaptive", False)]


# by default each tile once, each dtype and mask at least once, and the tree mask on both 72-row tiles
@pytest.mark.parametrize("dtype,mask,heads,head_tile,q_tile,split,part16", representative(
    [(d, m, *t) for d in ("bf16", "fp16") for m in ("causal", "tree", "none") for t in TRANSPOSED_TILES],
    [("bf16", "tree", *TRANSPOSED_TILES[0]), ("fp16", "tree", *TRANSPOSED_TILES[1]),
     ("fp16", "none", *TRANSPOSED_TILES[2]), ("bf16", "causal", *TRANSPOSED_TILES[3]),
     ("fp16", "causal", *TRANSPOSED_TILES[4])]))
def test_transposed_variants_compile_with_asynchronous_wgmmas(dtype, mask, heads, head_tile, q_tile, split, part16):
    """The transposed tile: wgmma's N is the block's rows (no padding to 64), the output product
    reads the tile M-major, and ptxas neither serializes nor waits around its wgmmas. At 72 rows
    its 144 output accumulators leave a few spills (40-56 bytes, as in the hand-written kernel
    the H200 timed), and a tree mask's byte reads a few more (88-96 bytes at 72 rows, 8 at 64):
    more than 128 bytes means something grew; 32 rows fit with room."""
    v = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, block_n=64, warps=8, stages=2, arch="sm_90a",
                kv_split=split, partials="16bit" if part16 else "fp32", schedule="transposed")
    built = build(Problem(heads=heads, dtype=dtype, mask=mask), v)
    rows = head_tile * q_tile
    assert f"m64n{rows}k16" in built.source and "stmatrix.sync.aligned.m8n8.x4.trans" in built.source
    assert built.plan.smem_bytes == rows * 576 * 2 + 2 * 64 * 576 * 2 + 2048
    for name, r in built.module.resources.items():
        assert r.stack_frame <= stack_budget(v) == (0 if rows <= 32 else TRANSPOSED_STACK), f"{name}: {r}"
    log = built.module.log
    assert "C751" not in log and "serialized" not in log and "injected" not in log, log


EXCHANGE_PROBLEMS = [("bf16", "causal", True), ("fp16", "tree", False), ("bf16", "none", False)]
EXCHANGE_TILES = [(64, 64, 1, 5), (64, 32, 2, 8), (8, 8, 7, 2), (16, 16, 4, 3), (128, 64, 1, 4)]


# by default each tile once, the problems in turn
@pytest.mark.parametrize("dtype,mask,lse,heads,head_tile,q_tile,size", representative(
    [(*p, *t) for p in EXCHANGE_PROBLEMS for t in EXCHANGE_TILES],
    [(*EXCHANGE_PROBLEMS[i % 3], *t) for i, t in enumerate(EXCHANGE_TILES)]))
def test_p_exchange_variants_compile_without_spills_or_serialized_wgmmas(dtype, mask, lse, heads, head_tile, q_tile,
                                                                         size):
    """The P exchange at every cluster size that fits, on 49- to 64-row tiles: bulk copies
    between the blocks' shared memory, the value product from shared memory on m64n64, no
    spills, and ptxas neither serializes nor waits around its wgmmas."""
    v = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, block_n=64, warps=8, stages=1, arch="sm_90a",
                kv_split=size, combine="cluster", schedule="p_exchange")
    built = build(Problem(heads=heads, dtype=dtype, mask=mask, lse=lse), v)
    assert "cp.async.bulk.shared::cluster.shared::cta" in built.source and "m64n64k16" in built.source
    for name, r in built.module.resources.items():
        assert (r.stack_frame, r.spill_stores) == (0, 0), f"{name}: {r}"
    log = built.module.log
    assert "C751" not in log and "serialized" not in log and "injected" not in log, log


def test_sources_are_self_contained():
    plan = validate(Problem(mask="tree"), Variant())
    includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', render(plan))
    assert includes == ["cuda_bf16.h"]


def test_sources_have_no_generic_lambdas():
    """NVRTC 13.0 (the H200 image's) takes a lambda with an `auto` parameter inside a kernel for a
    host function and fails; 13.5 (CI's) accepts it, so only this check catches one here."""
    for preset, variant in PRESET_JOBS:   # the seesaw among them
        source = render(validate(preset.problem, variant))
        assert not re.search(r"\]\s*\([^)]*\bauto\b", source), f"{variant.name}: a generic lambda"


@pytest.mark.parametrize("dtype,mask", representative(
    [(d, m) for d in ("bf16", "fp16") for m in ("causal", "tree")], [("bf16", "causal"), ("fp16", "tree")]))
def test_wgmma_variants_are_not_serialized(dtype, mask):
    """ptxas serializes every wgmma of a kernel (C7518/C7519, a large slowdown it only warns
    about) when, e.g., a wgmma or its accumulators sit in a branch ptxas sees as divergent, and
    injects waits (C7517) when registers of an in-flight wgmma are touched; keep the sm_90a
    kernels free of all of them."""
    problem = Problem(heads=64, dtype=dtype, mask=mask)
    for v in ("mma_ht64_qt1_bn64_w8_st2_spa_sm90a", "mma_ht8_qt8_bn64_w8_st2_spa_sm90a",
              "mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a", "mma_ht64_qt1_bn64_w8_st2_spb_sm90a"):
        log = build(problem, parse_variant(v)).module.log
        assert "C751" not in log and "serialized" not in log and "injected" not in log, log
