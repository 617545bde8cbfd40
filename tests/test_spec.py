"""The DSL: names are stable identities, validation names the field, value and limit."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlagen.dsl.arch import ARCHS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import (
    COMBINES,
    LOADS,
    MAX_SEQLEN_Q,
    PARTIALS,
    ROWS,
    SCHEDULES,
    Problem,
    Variant,
    kernel_name,
    naive,
    parse_variant,
)
from mlagen.plan.mma_plan import TRANSPOSED_ROWS
from mlagen.plan.schedules import SCHEDULES as REGISTRY
from mlagen.plan.tiles import FLASH_Q_TILE, MAX_ROWS, balanced_q_tile, enumerate_tiles
from mlagen.plan.validate import is_valid, validate

variants = st.builds(
    Variant,
    family=st.sampled_from(["flash", "mma"]),
    head_tile=st.integers(1, 128),
    q_tile=st.integers(1, 64),
    kv_split=st.one_of(st.just("adaptive"), st.integers(1, 256)),
    block_n=st.sampled_from([16, 32, 64, 128]),
    warps=st.integers(1, 16),
    stages=st.integers(1, 4),
    arch=st.sampled_from(sorted(ARCHS)),
    schedule=st.sampled_from(SCHEDULES),
    loads=st.sampled_from(LOADS),
    combine=st.sampled_from(COMBINES),
    partials=st.sampled_from(PARTIALS),
    mma_pv=st.booleans(),
    rows=st.sampled_from(ROWS),
)


@given(variants)
def test_variant_name_round_trips(v):
    assert parse_variant(v.name) == v


@given(st.sampled_from(sorted(ARCHS)), st.integers(1, 16))
def test_naive_name_round_trips(arch, warps):
    assert parse_variant(naive(arch=arch, warps=warps).name) == naive(arch=arch, warps=warps)


def test_names_are_readable_and_distinct():
    a = Variant(head_tile=8, q_tile=8)
    assert a.name == "flash_ht8_qt8_bn32_w8_st2_spa_sm90"
    assert a.with_(kv_split=4).name != a.name
    assert a.with_(kv_split=4).code_name == a.code_name     # the split is a launch parameter
    p = Problem(heads=64, mask="tree", lse=True)
    assert p.name == "h64_dl512_dr64_bf16_p64_tree_lse"
    assert kernel_name(p, a) == "mlagen_flash_ht8_qt8_bn32_w8_st2_sm90_h64_dl512_dr64_bf16_p64_tree_lse"
    w = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", mma_pv=True)
    assert w.name == "mma_ht64_qt1_bn64_w8_st2_spa_pvm_sm90a"
    assert w.code_name == "mma_ht64_qt1_bn64_w8_st2_pvm_sm90a" != w.with_(mma_pv=False).code_name
    c = w.with_(kv_split=4, combine="cluster", partials="16bit", loads="tma")
    assert c.name == c.code_name == "mma_ht64_qt1_bn64_w8_st2_sp4_pvm_cl_p16_tma_sm90a"


@pytest.mark.parametrize("bad", ["flash_ht8", "flash_hx8_qt8_bn32_w8_st2_spa_sm90", "conv_ht8_qt8_bn32_w8_st2_spa_sm90",
                                 "flash_htx_qt8_bn32_w8_st2_spa_sm90", "naive_w4_gfx90"])
def test_bad_names_say_what_was_expected(bad):
    with pytest.raises(ValueError, match="expected"):
        parse_variant(bad)


# a valid transposed tile for H=8 S=9, and a valid P exchange for H=64, which the cases below
# break one rule of
TRANSPOSED = Variant(family="mma", head_tile=8, q_tile=9, block_n=64, arch="sm_90a", schedule="transposed")
EXCHANGE = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1, arch="sm_90a", kv_split=5,
                   combine="cluster", schedule="p_exchange")


@pytest.mark.parametrize("problem,variant,field", [
    (Problem(heads=64), Variant(head_tile=7), "variant.head_tile"),
    (Problem(heads=64), Variant(block_n=48), "variant.block_n"),
    (Problem(heads=64), Variant(q_tile=65), "variant.q_tile"),
    (Problem(heads=64), Variant(q_tile=16, head_tile=16, warps=4), "variant"),            # accumulators
    (Problem(heads=64), Variant(q_tile=8, head_tile=8, stages=2, arch="sm_120"), "variant"),  # smem
    (Problem(heads=64), Variant(arch="sm_70"), "variant.arch"),
    (Problem(heads=64), Variant(kv_split=0), "variant.kv_split"),
    (Problem(heads=64), Variant(family="gemm"), "variant.family"),
    (Problem(dl=500), Variant(), "problem.dl"),
    (Problem(dr=60), Variant(), "problem.dr"),
    (Problem(page_size=48), Variant(), "problem.page_size"),
    (Problem(mask="sliding"), Variant(), "problem.mask"),
    (Problem(dtype="fp8"), Variant(), "problem.dtype"),
    (Problem(), naive().with_(head_tile=2), "variant.head_tile"),
    (Problem(), Variant(mma_pv=True), "variant.mma_pv"),                                  # flash family
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, mma_pv=True), "variant"),  # sm_90
    (Problem(), Variant(kv_split=4, combine="cluster"), "variant.combine"),               # flash family
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, combine="cluster"),
     "variant.combine"),                                                                  # adaptive
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, kv_split=9, combine="cluster"),
     "variant.combine"),                                                                  # more than 8 blocks
    (Problem(), Variant(family="mma", head_tile=8, q_tile=8, block_n=32, kv_split=4, combine="cluster", arch="sm_80"),
     "variant.combine"),                                                                  # no clusters before sm_90
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=32, stages=1, kv_split=4, combine="cluster"),
     "variant.combine"),                                                                  # staged rows do not fit
    (Problem(), Variant(kv_split=4, partials="16bit"), "variant.partials"),               # flash family
    (Problem(), Variant(loads="tma"), "variant.loads"),                                   # flash family
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, loads="tma"), "variant.loads"),  # sm_90
    (Problem(page_size=16), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", loads="tma"),
     "variant.loads"),                                                                    # a tile spans pages
    (Problem(), Variant(schedule="seesaw"), "variant.schedule"),                          # flash family
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", schedule="seesaw"),
     "variant.schedule"),                                                                 # needs tma
    (Problem(), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", loads="tma", mma_pv=True,
                        schedule="seesaw"), "variant.schedule"),                          # P·V on mma.sync
    (Problem(heads=8), Variant(schedule="transposed"), "variant.schedule"),               # flash family
    (Problem(heads=8), TRANSPOSED.with_(arch="sm_90"), "variant.schedule"),               # no wgmma
    (Problem(heads=16), TRANSPOSED.with_(head_tile=16, q_tile=5), "variant"),             # 80 rows
    (Problem(heads=8), TRANSPOSED.with_(head_tile=1), "variant"),                         # 9 rows
    (Problem(heads=8, dr=32), TRANSPOSED, "variant"),                                     # P^T needs Dr=64
    (Problem(heads=8), TRANSPOSED.with_(kv_split=4, combine="cluster"), "variant.schedule"),  # no cluster
    (Problem(heads=8), TRANSPOSED.with_(mma_pv=True), "variant.schedule"),                # both products on wgmma
    (Problem(heads=8, page_size=16), TRANSPOSED.with_(loads="tma"), "variant.loads"),     # a tile is one page's run
    (Problem(), Variant(schedule="p_exchange"), "variant.schedule"),                      # flash family
    (Problem(), EXCHANGE.with_(arch="sm_90"), "variant.schedule"),                        # no wgmma
    (Problem(), EXCHANGE.with_(combine="merge"), "variant.schedule"),                     # the exchange is a cluster's
    (Problem(), EXCHANGE.with_(head_tile=32), "variant"),                                 # 32 rows
    (Problem(), EXCHANGE.with_(stages=2), "variant.schedule"),                            # one tile a block
    (Problem(), EXCHANGE.with_(partials="16bit"), "variant.schedule"),                    # nothing partial
    (Problem(), EXCHANGE.with_(kv_split=6), "variant"),                                   # 10 value slices: no room
])
def test_validation_names_field_value_and_limit(problem, variant, field):
    with pytest.raises(SpecError) as info:
        validate(problem, variant)
    assert info.value.field == field
    assert "expected" in str(info.value) and "got" in str(info.value)


def test_sixteen_warp_mma_blocks_keep_their_accumulators_in_registers():
    """512 threads get 128 registers each: 128 output accumulators then spill (ptxas: 728 bytes
    for mma_ht64_qt2_bn32_w16_st1 on sm_90), so 16-warp blocks stop at 64 rows."""
    with pytest.raises(SpecError, match=r"at most 64 output accumulators per thread with 16 warps; "
                                        r"128 padded rows x 32 dims / 32 lanes = 128: use fewer rows$"):
        validate(Problem(heads=64), parse_variant("mma_ht64_qt2_bn32_w16_st1_spa_sm90"))
    validate(Problem(heads=64), parse_variant("mma_ht64_qt1_bn64_w16_st1_spa_sm90"))   # 64 rows fit


def test_sixteen_warp_flash_blocks_keep_their_accumulators_in_registers():
    """The scalar flash family follows the same register budget: a CPU compile sweep found its
    16-warp blocks with 80-128 accumulators spilling 64-1012 bytes a thread on sm_90."""
    with pytest.raises(SpecError, match=r"at most 64 fp32 accumulators per thread with 16 warps; "
                                        r".* gives 96: use a smaller tile$"):
        validate(Problem(heads=64), parse_variant("flash_ht32_qt3_bn32_w16_st1_spa_sm90"))
    validate(Problem(heads=64), parse_variant("flash_ht64_qt1_bn32_w16_st1_spa_sm90"))   # 4 rows a warp: 64


def test_shared_memory_error_says_how_much():
    with pytest.raises(SpecError, match=r"at most 101376 bytes .* sm_120, this variant needs \d+"):
        validate(Problem(), Variant(q_tile=8, head_tile=8, stages=2, arch="sm_120"))


def test_plan_derives_the_template_numbers():
    plan = validate(Problem(heads=64), Variant(head_tile=8, q_tile=5, warps=8, block_n=32, stages=2))
    assert plan.rows == 40 and plan.rows_per_warp == 5 and plan.rows_pad == 40
    assert plan.head_tiles == 8 and plan.threads == 256
    assert plan.split.max_merge_blocks == 5                   # 40 rows, one per warp of 8
    assert plan.split.row_groups(batch=3, seqlen_q=9) == 2 * 8 * 3
    assert plan.split.merge_blocks(batch=3, seqlen_q=9) == 3  # ceil(128 / 48 groups)
    assert plan.split.merge_blocks(batch=1, seqlen_q=1) == 5  # 8 groups: capped at one warp per row
    assert plan.split.merge_blocks(batch=64, seqlen_q=9) == 1
    # split blocks in z slabs 0..2, then ceil(3 requests * 3 merge blocks / 4 splits) merge slabs
    assert plan.grid(batch=3, seqlen_q=9, num_splits=4) == (2 * 8, 4, 3 + 3)
    assert plan.grid(batch=3, seqlen_q=9, num_splits=1) == (2 * 8, 1, 3)
    assert plan.grid_expr() == ("ceil(S / 5) * 8", "num_splits",
                                "num_splits > 1 ? B + (B * merge_blocks + num_splits - 1) / num_splits : B")
    assert plan.split.partial_rows(batch=3, seqlen_q=9, num_splits=4) == 4 * 3 * 9 * 64
    assert plan.split.partial_rows(batch=3, seqlen_q=9, num_splits=1) == 0
    # the balanced split: num_splits is its ranges; always merge slabs; slots = ranges + B - 1
    bal = validate(Problem(heads=64), Variant(head_tile=8, q_tile=8, warps=8, block_n=64, stages=2,
                                              family="mma", kv_split="balanced"))
    assert bal.split.split_launch(1) and not plan.split.split_launch(1)
    assert bal.grid(batch=3, seqlen_q=9, num_splits=1) == (2 * 8, 1, 1 + 3 * bal.split.merge_blocks(3, 9))
    assert bal.grid(batch=3, seqlen_q=9, num_splits=14) == (2 * 8, 14, 1 + 1)
    assert bal.split.partial_rows(batch=3, seqlen_q=9, num_splits=14) == (14 + 3 - 1) * 9 * 64
    assert bal.split.partial_row_bytes == 512 * 4 + 8             # fp32 values, then (max, sum)
    assert validate(Problem(heads=64), bal.variant.with_(partials="16bit")).split.partial_row_bytes == 512 * 2 + 8
    n = validate(Problem(heads=16), naive())
    assert n.grid(batch=2, seqlen_q=3, num_splits=1) == (16, 3, 2)


def test_cluster_split_is_a_kernel_of_its_own_without_workspace():
    v = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, kv_split=4, combine="cluster", arch="sm_90a")
    assert v.name == "mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a" and parse_variant(v.name) == v
    assert v.code_name == "mma_ht64_qt1_bn64_w8_st2_sp4_cl_sm90a" != v.with_(kv_split=8).code_name
    plan = validate(Problem(heads=64), v)
    assert plan.grid(3, 9, 4) == (9, 4, 3)                  # y: the cluster's blocks; no merge slabs
    assert not plan.split.split_launch(4) and plan.split.partial_rows(3, 9, 4) == 0
    assert plan.grid_expr() == ("ceil(S / 1) * 1", "num_splits", "B")
    # 16-bit staged rows take half the shared memory: this tile's buffers hold them, not fp32 ones
    small = v.with_(block_n=32, stages=1, arch="sm_90")
    assert validate(Problem(heads=64), small.with_(partials="16bit")).smem_bytes > 0
    with pytest.raises(SpecError, match="staged output rows"):
        validate(Problem(heads=64), small)


def test_p_exchange_fits_sizes_two_to_five_and_eight():
    """Its shared memory: Q (later the slots), the tile, and (k - 1) x ceil(8 / k) value slices
    of 8 KB; sizes 6 and 7 need 10 and 12 slices, past sm_90a's 227 KB."""
    fits = {k: is_valid(Problem(), EXCHANGE.with_(kv_split=k)) for k in range(2, 9)}
    assert fits == {2: True, 3: True, 4: True, 5: True, 6: False, 7: False, 8: True}
    assert validate(Problem(), EXCHANGE).smem_bytes == 9 * 8192 * 2 + 8 * 8192 + 5 * 256 + 1024 + 512 + 8 + 5 * 8


def test_every_schedule_is_registered_with_its_template_and_rules():
    """The registry holds each `Variant.schedule` value once, with a template that exists; a
    schedule's rules name the field a variant breaks."""
    root = Path(__file__).resolve().parent.parent
    assert tuple(REGISTRY) == SCHEDULES
    for name, schedule in REGISTRY.items():
        assert schedule.name == name and (root / "templates" / schedule.template).is_file()
    assert [name for name, s in REGISTRY.items() if s.split_unit == 2] == ["seesaw", "transposed", "fp8_ws", "fp8_mma",
                                                                                   "fp8_ldg"]
    seesaw = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", loads="tma", schedule="seesaw")
    assert REGISTRY["seesaw"].check(seesaw) is None
    assert REGISTRY["seesaw"].check(seesaw.with_(loads="cp_async")).startswith("loads 'tma'")
    assert validate(Problem(), seesaw).template == "mma.cu.j2"
    assert validate(Problem(heads=8), TRANSPOSED).template == "mma_transposed.cu.j2"
    assert validate(Problem(), EXCHANGE).template == "mma_exchange.cu.j2"


@pytest.mark.parametrize("heads", [1, 6, 8, 64, 128])
def test_tile_shapes_are_every_divisor_and_q_tile_under_the_row_bound(heads):
    """`enumerate_tiles` yields each (head_tile, q_tile) with head_tile dividing the heads, q_tile
    at most S and MAX_SEQLEN_Q, at most the row bound of rows, and with `balanced` only the q
    tiles ceil(S/n): each once, in (head_tile, q_tile) order."""
    for seqlen_q in (*range(1, MAX_SEQLEN_Q + 1), 100):
        balanced_q = {-(-seqlen_q // n) for n in range(1, seqlen_q + 1)}
        for max_rows in (1, 8, 64, 72, MAX_ROWS):
            for balanced in (False, True):
                shapes = enumerate_tiles(heads, seqlen_q, max_rows, balanced=balanced)
                expected = [(h, q) for h in range(1, heads + 1) for q in range(1, min(seqlen_q, MAX_SEQLEN_Q) + 1)
                            if heads % h == 0 and h * q <= max_rows and (not balanced or q in balanced_q)]
                assert shapes == expected, (heads, seqlen_q, max_rows, balanced)
        for most in range(1, seqlen_q + 1):
            assert balanced_q_tile(seqlen_q, most) == max(q for q in balanced_q if q <= most)


def test_tile_shapes_hold_what_each_caller_draws_from():
    """The tuner's balanced tiles up to MAX_ROWS rows, the dispatcher's mma tiles of every q tile
    up to 64 rows and its flash q tile, and the fuzzer's 64-row and transposed tiles."""
    assert (8, 9) in enumerate_tiles(64, 9, balanced=True) and (8, 8) not in enumerate_tiles(64, 9, balanced=True)
    assert (2, 17) in enumerate_tiles(64, 33, MAX_ROWS, balanced=True)      # ceil(33/2); no 16: ceil(33/3) = 11
    assert {q for _, q in enumerate_tiles(64, 33, 64)} == set(range(1, 34))
    assert [q for h, q in enumerate_tiles(16, 9, 64, balanced=True) if h == 16] == [1, 2, 3]     # not 4 = 64/16
    assert balanced_q_tile(9, FLASH_Q_TILE) == 5 and balanced_q_tile(16, FLASH_Q_TILE) == 8
    assert [hq for hq in enumerate_tiles(128, MAX_SEQLEN_Q, 64) if hq[0] * hq[1] == 64] == [
        (1, 64), (2, 32), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1)]
    transposed = [hq for hq in enumerate_tiles(6, MAX_SEQLEN_Q, max(TRANSPOSED_ROWS))
                  if hq[0] * hq[1] in TRANSPOSED_ROWS]
    assert transposed[0] == (1, 16) and (6, 12) in transposed and (3, 24) in transposed


def test_with_formats_names_the_output_dtype():
    """Inputs in FP8 formats keep the problem's dtype for the output while some input is 16-bit;
    e4m3 queries over an FP8 cache write bf16."""
    fp16 = Problem(dtype="fp16")
    assert fp16.with_formats("e4m3", "dtype") == fp16.with_(kv_format="e4m3")
    assert fp16.with_formats("dtype", "e4m3") == fp16.with_(q_format="e4m3")
    both = fp16.with_formats("ds_mla", "e4m3")
    assert (both.dtype, both.kv_format, both.q_format) == ("bf16", "ds_mla", "e4m3")


def test_ragged_rows_are_a_balanced_splits_and_named_rg():
    """Variant.rows "ragged" names the kernel `_rg`, plans ragged rows (partial rows over whole
    query tiles, no pair merge in the kernel) and needs the balanced split, whose work list skips
    the padded rows; validation names the field otherwise."""
    v = parse_variant("mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a").with_(rows="ragged")
    assert v.name == "mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_rg_sm90a" and parse_variant(v.name) == v
    plan, dense = validate(Problem(heads=16), v), validate(Problem(heads=16), v.with_(rows="dense"))
    assert plan.split.ragged_rows and not dense.split.ragged_rows and plan.name != dense.name
    assert plan.split.partial_rows(3, 9, 8) == (8 + 3 - 1) * 12 * 16
    assert dense.split.partial_rows(3, 9, 8) == (8 + 3 - 1) * 9 * 16
    with pytest.raises(SpecError, match=r"variant.rows: got 'ragged'.*kv_split 'balanced'"):
        validate(Problem(heads=16), v.with_(kv_split="adaptive"))
