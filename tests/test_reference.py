"""The reference against a plain fp64 loop, and its mask and empty-row semantics."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlagen.reference import reference, visible_keys
from mlagen.testing import make_case, random_tree


def loop_reference(case, dtype=torch.float64):
    """Row by row, key by key: the definition in DESIGN.md, nothing vectorized but the dots."""
    q, kv, bt, lens = case.q.double(), case.kv_cache.double(), case.block_table, case.cache_seqlens
    B, S, H, D = q.shape
    page = kv.shape[1]
    out = torch.zeros(B, S, H, case.dl, dtype=dtype)
    lse = torch.full((B, H, S), -math.inf, dtype=dtype)
    for b in range(B):
        n = int(lens[b])
        prefix = n - S
        for i in range(S):
            keys = []
            for j in range(n):
                if j < prefix:
                    keys.append(j)
                    continue
                k = j - prefix
                if case.tree_mask is not None:
                    t = case.tree_mask if case.tree_mask.dim() == 2 else case.tree_mask[b]
                    ok = bool(t[i, k])
                elif case.causal:
                    ok = k <= i
                else:
                    ok = True
                if ok:
                    keys.append(j)
            if not keys:
                continue
            rows = torch.stack([kv[int(bt[b, j // page]), j % page] for j in keys])
            for h in range(H):
                s = rows @ q[b, i, h] * case.scale
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p[:, None] * rows[:, : case.dl]).sum(0) / p.sum()
                lse[b, h, i] = m + torch.log(p.sum())
    return out, lse


@settings(max_examples=25)
@given(batch=st.integers(1, 3), seqlen_q=st.integers(1, 6), heads=st.sampled_from([1, 2, 4]),
       prefixes=st.lists(st.integers(0, 40), min_size=3, max_size=3), page=st.sampled_from([1, 4, 16]),
       mask=st.sampled_from(["causal", "tree", "none"]), empty=st.lists(st.booleans(), min_size=3, max_size=3),
       seed=st.integers(0, 10**6))
def test_reference_agrees_with_a_plain_loop(batch, seqlen_q, heads, prefixes, page, mask, empty, seed):
    case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=prefixes[:batch], page_size=page,
                     mask=mask, seed=seed, device="cpu", dtype=torch.float32, dl=16, dr=8,
                     empty=empty[:batch], per_request_tree=seed % 2 == 1)
    out, lse = case.reference(torch.float64)
    ref_out, ref_lse = loop_reference(case)
    assert torch.allclose(out, ref_out, atol=1e-9, rtol=1e-9)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = ~torch.isinf(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-9)


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
