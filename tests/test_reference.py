"""The reference against the plain loop (`reference_naive`), its mask and empty-row semantics,
the cases it runs on (`make_case`), and the row-by-row comparison kernels are judged by
(`mlagen.tools.testing.mismatch`)."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlagen.runtime.reference import reference, reference_naive, visible_keys
from mlagen.tools.testing import (
    TREE_SHAPES,
    Tolerance,
    assert_matches,
    compare_rows,
    make_case,
    mismatch,
    random_tree,
    rel_error,
    tolerance,
    tree_of_shape,
)


def _naive(case):
    return reference_naive(case.q, case.kv_cache, case.block_table, case.cache_seqlens, softmax_scale=case.scale,
                           causal=case.causal, tree_mask=case.tree_mask, head_dim_v=case.dl)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), seqlen_q=st.integers(1, 6), heads=st.sampled_from([1, 2, 4]),
       prefixes=st.lists(st.integers(0, 40), min_size=3, max_size=3), page=st.sampled_from([1, 4, 16]),
       mask=st.sampled_from(["causal", "tree", "none"]), empty=st.lists(st.booleans(), min_size=3, max_size=3),
       seed=st.integers(0, 10**6))
def test_reference_agrees_with_the_plain_loop(batch, seqlen_q, heads, prefixes, page, mask, empty, seed):
    """Random small cases: ragged, empty requests, pages of 1 to 16, every mask (one tree, or one
    per request), NaN in the spare pages and past every length (make_case): the vectorized
    reference equals the loop, and no NaN reaches either."""
    case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=prefixes[:batch], page_size=page,
                     mask=mask, seed=seed, device="cpu", dtype=torch.float32, dl=16, dr=8,
                     empty=empty[:batch], per_request_tree=seed % 2 == 1)
    assert torch.isnan(case.kv_cache).any()                 # the spare pages at least
    out, lse = case.reference(torch.float64)
    ref_out, ref_lse = _naive(case)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.allclose(out, ref_out, atol=1e-9, rtol=1e-9)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-9)
    empty_rows = torch.isinf(ref_lse).transpose(1, 2)
    assert (out[empty_rows] == 0).all()


def test_the_plain_loop_on_a_case_worked_by_hand():
    """One request, one query, two keys on pages of 1 (the table reversed), one head: the loop
    is softmax(q.k * scale) . v written out."""
    q = torch.tensor([[[[1.0, 0.0, 2.0]]]])                        # [1, 1, 1, 3]
    kv = torch.tensor([[[0.0, 1.0, 1.0]], [[1.0, 2.0, 0.5]], [[math.nan] * 3]])
    table = torch.tensor([[1, 0, 2]], dtype=torch.int32)         # key 0 on page 1, key 1 on page 0
    out, lse = reference_naive(q, kv, table, torch.tensor([2]), softmax_scale=0.5, head_dim_v=2)
    s = torch.tensor([0.5 * (1 + 1.0), 0.5 * (0 + 2.0)], dtype=torch.float64)   # both visible (S=1, causal)
    w = torch.softmax(s, 0)
    assert torch.allclose(out[0, 0, 0], w[0] * torch.tensor([1.0, 2.0]).double() + w[1] * torch.tensor([0.0, 1.0]))
    assert torch.allclose(lse[0, 0, 0], torch.logsumexp(s, 0))
    fast = reference(q, kv, table, torch.tensor([2]), softmax_scale=0.5, head_dim_v=2, dtype=torch.float64)
    assert torch.allclose(fast[0], out) and torch.allclose(fast[1], lse)


def test_empty_rows_give_zero_and_minus_inf():
    case = make_case(batch=2, seqlen_q=3, heads=2, prefixes=[5, 5], page_size=4, mask="causal", seed=0,
                     device="cpu", dtype=torch.float32, dl=16, dr=8, empty=[True, False])
    out, lse = case.reference()
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0


def test_rows_that_see_no_key_when_length_is_below_s():
    # 2 keys, 4 draft tokens: queries 0 and 1 would need keys at positions -2, -1.
    seen = visible_keys(2, 4, True, None)
    assert seen.tolist() == [[False, False], [False, False], [True, False], [True, True]]


def test_causal_equals_a_lower_triangular_tree():
    case = make_case(batch=2, seqlen_q=5, heads=3, prefixes=[7, 30], page_size=8, mask="causal", seed=3,
                     device="cpu", dtype=torch.float32, dl=16, dr=8)
    causal = case.reference(torch.float64)
    case.tree_mask, case.causal = torch.ones(5, 5, dtype=torch.bool).tril(), False
    tree = case.reference(torch.float64)
    assert torch.allclose(causal[0], tree[0]) and torch.allclose(causal[1], tree[1])


def test_no_mask_sees_every_valid_key():
    seen = visible_keys(6, 3, False, None)
    assert seen.all()
    tree = random_tree(3, torch.Generator().manual_seed(0))
    seen = visible_keys(6, 3, True, tree)
    assert seen[:, :3].all() and torch.equal(seen[:, 3:], tree)


def _paged(rows: torch.Tensor, page: int, gen: torch.Generator):
    """rows [n, D] laid out on shuffled pages of `page` rows, NaN everywhere else."""
    n, D = rows.shape
    pages = -(-n // page)
    order = torch.randperm(pages + 2, generator=gen)
    kv = torch.full((pages + 2, page, D), math.nan)
    flat = torch.full((pages * page, D), math.nan)
    flat[:n] = rows
    kv[order[:pages]] = flat.reshape(pages, page, D)
    table = torch.cat([order[:pages], order[pages:pages + 1]]).to(torch.int32)[None]
    return kv, table


def test_paging_does_not_change_the_result():
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(54, 24, generator=gen)
    q = torch.randn(1, 4, 2, 24, generator=gen)
    lens = torch.tensor([54], dtype=torch.int32)
    tree = random_tree(4, gen)
    results = []
    for page in (1, 4, 16, 64):
        kv, table = _paged(rows, page, gen)
        results.append(reference(q, kv, table, lens, tree_mask=tree, head_dim_v=16, dtype=torch.float64))
    for out, lse in results[1:]:
        assert torch.allclose(out, results[0][0]) and torch.allclose(lse, results[0][1])
    assert torch.isfinite(results[0][0]).all()


def test_a_case_puts_nan_exactly_where_no_kernel_may_read():
    """Valid keys finite, every slot past a request's length and every spare page NaN, block
    table entries past a request's pages on NaN pages; the same seed gives the same case."""
    kw = dict(batch=4, seqlen_q=3, heads=2, prefixes=[37, 0, 64, 5], page_size=16, mask="tree", seed=9, device="cpu",
              dl=16, dr=8, empty=[False, False, False, True], table_pages=12, per_request_tree=True)
    case = make_case(**kw)
    lengths = case.cache_seqlens.tolist()
    assert lengths == [40, 3, 67, 0] and case.block_table.shape == (4, 12)
    nan_rows = torch.isnan(case.kv_cache).all(-1)                     # [pages, 16]
    assert torch.equal(torch.isnan(case.kv_cache).any(-1), nan_rows)   # a row is all NaN or all finite
    valid = torch.zeros_like(nan_rows)
    for b, n in enumerate(lengths):
        pages = case.block_table[b, : -(-n // 16)].long()
        flat = valid[pages].reshape(-1)
        flat[:n] = True
        valid[pages] = flat.reshape(-1, 16)
        assert nan_rows[case.block_table[b, -(-n // 16):].long()].all()     # past its pages: NaN pages
    assert torch.equal(nan_rows, ~valid)
    assert case.tree_mask.shape == (4, 3, 3) and case.q.shape == (4, 3, 2, 24)
    again = make_case(**kw)
    for a, b in ((case.q, again.q), (case.kv_cache, again.kv_cache), (case.tree_mask, again.tree_mask)):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(case.block_table, again.block_table) and case.scale == again.scale


def test_random_tree_is_an_ancestor_mask():
    tree = random_tree(24, torch.Generator().manual_seed(3))
    assert tree.diagonal().all() and not tree.triu(1).any()
    for k in range(1, 24):
        parent = max(j for j in range(k) if tree[k, j])          # its nearest ancestor
        assert torch.equal(tree[k, :k], tree[parent, :k])          # sees what its parent sees
    assert torch.equal(tree, random_tree(24, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_tree_shapes_are_the_trees_they_name(shape):
    """Every shape sees no later token and is closed under ancestors (a token sees what its
    nearest ancestor sees); chain, star and binary have their named parents; blind drops the
    whole row of some tokens and keeps the rest of a random tree."""
    S = 33
    tree = tree_of_shape(shape, S, torch.Generator().manual_seed(5))
    assert tree.shape == (S, S) and tree.dtype == torch.bool and not tree.triu(1).any()
    seeing = [k for k in range(S) if tree[k].any()]
    full = random_tree(S, torch.Generator().manual_seed(5)) if shape == "blind" else tree
    for k in range(1, S):
        below = max(j for j in range(k) if full[k, j])
        assert torch.equal(full[k, :k], full[below, :k] | (torch.arange(k) == below))
    expect = {"chain": lambda k: k - 1, "star": lambda k: 0, "binary": lambda k: (k - 1) // 2}
    if shape in expect:
        assert tree.diagonal().all()
        assert all(max(j for j in range(k) if tree[k, j]) == expect[shape](k) for k in range(1, S))
    if shape == "chain":
        assert torch.equal(tree, torch.ones(S, S, dtype=torch.bool).tril())
    if shape == "blind":
        assert 0 < len(seeing) < S and all(torch.equal(tree[k], full[k]) for k in seeing)
    assert torch.equal(tree, tree_of_shape(shape, S, torch.Generator().manual_seed(5)))


def test_an_unknown_tree_shape_is_named():
    with pytest.raises(ValueError, match="tree shape: got 'ring'"):
        tree_of_shape("ring", 4, torch.Generator())


# The row-by-row comparison. A case whose rows differ in length: a long request, a short one and
# an empty one; the "kernel" is the fp64 reference itself rounded to bf16 (lse to fp32).
def _checked_case(dtype=torch.bfloat16):
    case = make_case(batch=3, seqlen_q=5, heads=8, prefixes=[3000, 40, 0], page_size=16, mask="tree", seed=2,
                     device="cpu", dtype=dtype, empty=[False, False, True], per_request_tree=True)
    out, lse = case.reference(torch.float64)
    return case, (out, lse), (out.to(dtype), lse.float())


def test_a_correct_output_passes_with_room():
    for dtype in (torch.bfloat16, torch.float16):
        case, (ref_out, _), (out, lse) = _checked_case(dtype)
        assert mismatch(out, lse, case) is None and mismatch(out, None, case) is None
        assert_matches(out, lse, case)
        # Only the rounding to 16 bits: a few times under the tolerance.
        assert rel_error(out, ref_out) < tolerance(dtype).row_rel / 4


def _scale_row(out, lse):
    out[1, 2, 3] *= 1.05


def _shift_one_value(out, lse):
    out[0, 4, 6, 100] += 1e-2             # a row of the 3000-key request: rms well under 0.1


def _unwritten_row(out, lse):
    out[1, 0, 7, :] = math.nan


def _empty_row_not_zero(out, lse):
    out[2, 1, 5, 0] = 1e-3


def _shift_one_lse(out, lse):
    lse[0, 6, 4] += 1e-2                  # lse is [B, H, S]: (b=0, i=4, h=6)


def _lse_nan(out, lse):
    lse[1, 3, 2] = math.nan


def _empty_lse_finite(out, lse):
    lse[2, 5, 1] = 0.0


@pytest.mark.parametrize("corrupt,row,message", [
    (_scale_row, "b=1, i=2, h=3", r"out: 1 of 120 rows fail; worst \(b=1, i=2, h=3\): relative error 0\.05"),
    (_shift_one_value, "b=0, i=4, h=6", r"out: 1 of 120 rows fail; worst \(b=0, i=4, h=6\): relative error .* max abs "
                                        r"error 0\.01\d* = .* x the row's rms"),
    (_unwritten_row, "b=1, i=0, h=7", r"out: 1 of 120 rows fail; worst \(b=1, i=0, h=7\): unwritten or NaN"),
    (_empty_row_not_zero, "b=2, i=1, h=5", r"out: 1 of 120 rows fail; worst \(b=2, i=1, h=5\): sees no key"),
    (_shift_one_lse, "b=0, i=4, h=6", r"^lse: 1 of 120 entries fail; worst \(b=0, i=4, h=6\): got .*off by 0\.01"),
    (_lse_nan, "b=1, i=2, h=3", r"^lse: 1 of 120 entries fail; worst \(b=1, i=2, h=3\): got nan"),
    (_empty_lse_finite, "b=2, i=1, h=5", r"^lse: 1 of 120 entries fail; worst \(b=2, i=1, h=5\): got 0, expected -inf"),
])
def test_one_bad_row_fails_and_is_named(corrupt, row, message):
    case, (ref_out, _), (out, lse) = _checked_case()
    assert mismatch(out, lse, case) is None
    corrupt(out, lse)
    problem = mismatch(out, lse, case)
    assert problem is not None and re.search(message, problem), problem
    with pytest.raises(AssertionError, match=re.escape(f"({row})")):
        assert_matches(out, lse, case)
    if corrupt is _scale_row:
        # One whole-output relative error (the old check, tolerance 1e-2) does not see it.
        assert (out.double() - ref_out).norm() / ref_out.norm() < 1e-2
        assert rel_error(out, ref_out) > 0.04


def test_the_shifted_value_is_small_against_the_values_but_not_its_row():
    """The 1e-2 shift above is under bf16's rounding of the cache's values (~N(0, 1): a unit in
    the last place is 2^-7 at 1) but ~10x its row's RMS tolerance: the row averages 3000 keys."""
    case, (ref_out, _), _ = _checked_case()
    rms = ref_out[0, 4, 6].norm() / math.sqrt(ref_out.shape[-1])
    assert rms < 0.1 and 1e-2 > 2 * tolerance(torch.bfloat16).row_max * rms


def test_every_failing_row_is_counted_and_the_worst_named():
    case, _, (out, lse) = _checked_case()
    out[0, 0, 0] *= 1.03
    out[1, 4, 2] *= 1.2
    out[1, 3, 1] *= 1.001                    # within the tolerance
    problem = mismatch(out, lse, case)
    assert problem.startswith("out: 2 of 120 rows fail; worst (b=1, i=4, h=2): relative error 0.2"), problem
    # Output and lse both wrong: both named.
    lse[0, 0, 0] -= 1
    both = mismatch(out, lse, case)
    assert re.search(r"^out: 2 of 120 .*; lse: 1 of 120 entries fail; worst \(b=0, i=0, h=0\)", both), both


def test_a_wrong_lse_layout_is_named():
    case, _, (out, lse) = _checked_case()
    assert mismatch(out, lse.transpose(1, 2), case) == (
        "lse: got torch.float32 (3, 5, 8), expected torch.float32 (3, 8, 5)")
    assert mismatch(out, lse.double(), case).startswith("lse: got torch.float64")


def test_tolerances_follow_the_dtypes():
    bf16, fp16 = tolerance(torch.bfloat16), tolerance(torch.float16)
    assert bf16 == Tolerance(row_rel=2**-6, row_max=2**-4, lse_abs=2**-9, lse_rel=2**-13)
    assert fp16.row_rel == bf16.row_rel / 8 and fp16.lse_abs == bf16.lse_abs / 8
    assert tolerance(torch.float16, torch.bfloat16) == bf16          # the coarsest counts
    # An fp16 kernel is held to fp16's tolerance: a bf16-sized error in a row fails it.
    case, _, (out, lse) = _checked_case(torch.float16)
    out[0, 1, 1] *= 1 + 2**-8
    assert "(b=0, i=1, h=1)" in mismatch(out, lse, case)


def test_compare_rows_names_rows_in_other_layouts():
    """A varlen output [T, H, Dl] with lse [T, H] (transposed from the op's [H, T])."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 4, 64, generator=gen, dtype=torch.float64)
    ref_lse = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    ref_lse[6] = -math.inf
    ref[6] = 0
    out, lse = ref.to(torch.bfloat16), ref_lse.float()
    assert compare_rows(out, lse, ref, ref_lse, dims=("t", "h")) is None
    out[5, 2, 10] += 0.5
    assert "worst (t=5, h=2)" in compare_rows(out, lse, ref, ref_lse, dims=("t", "h"))
    with pytest.raises(ValueError, match="ref_lse"):
        compare_rows(out, lse, ref, ref_lse.T)


def _small_case():
    return make_case(batch=2, seqlen_q=3, heads=2, prefixes=[5, 7], page_size=4, mask="causal", seed=0, device="cpu",
                     dtype=torch.float32, dl=16, dr=8)


@pytest.mark.parametrize("change,message", [
    (lambda c: {"q": c.q[..., :20]}, "q.shape[-1] and kv_cache.shape[-1]: got 20 and 24, expected one size"),
    (lambda c: {"q": c.q[0]}, "q.shape: got (3, 2, 24), expected [B, S, H, Dl+Dr] (4 dims)"),
    (lambda c: {"q": c.q.to(torch.int32)}, "q.dtype: got torch.int32, expected a floating dtype"),
    (lambda c: {"q": c.q.tolist()}, "q: got list, expected a torch.Tensor"),
    (lambda c: {"kv_cache": c.kv_cache[None]}, "kv_cache.shape: got (1, 8, 4, 24), expected [num_pages, page_size"),
    (lambda c: {"kv_cache": c.kv_cache.to("meta")}, "kv_cache: got a tensor on meta, expected a tensor on cpu"),
    (lambda c: {"block_table": c.block_table.float()}, "block_table.dtype: got torch.float32, expected an integer"),
    (lambda c: {"block_table": c.block_table[:1]}, "block_table.shape: got (1, 4), expected [B=2, max_pages >= 1]"),
    (lambda c: {"block_table": c.block_table + 100}, "block_table: got page id 10"),
    (lambda c: {"cache_seqlens": c.cache_seqlens[:1]}, "cache_seqlens.shape: got (1,), expected [B=2]"),
    (lambda c: {"cache_seqlens": c.cache_seqlens * 100}, "cache_seqlens[0]: got 800, expected 0..16"),
    (lambda c: {"tree_mask": torch.ones(2, 2, dtype=torch.bool)}, "tree_mask.shape: got (2, 2), expected [S, S]"),
    (lambda c: {"tree_mask": torch.ones(3, 3)}, "tree_mask.dtype: got torch.float32, expected torch.bool"),
    (lambda c: {"head_dim_v": 25}, "head_dim_v: got 25, expected an int with 0 < head_dim_v <= q.shape[-1]=24"),
])
def test_reference_names_a_bad_argument(change, message):
    """A bad argument is an InputError naming it, what it got and what was expected, before any work."""
    import mlagen

    case = _small_case()
    args = {"q": case.q, "kv_cache": case.kv_cache, "block_table": case.block_table,
            "cache_seqlens": case.cache_seqlens, "head_dim_v": 16, **change(case)}
    with pytest.raises(mlagen.InputError) as info:
        mlagen.reference(**args)
    assert message in str(info.value)


def test_reference_takes_any_integer_index_dtype():
    case = _small_case()
    out, _ = reference(case.q, case.kv_cache, case.block_table.long(), case.cache_seqlens.long(), head_dim_v=16)
    expected, _ = reference(case.q, case.kv_cache, case.block_table, case.cache_seqlens, head_dim_v=16)
    assert torch.equal(out, expected)
