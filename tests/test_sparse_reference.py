"""`mlagen.sparse_reference`: sparse verify attention (each query token over its own listed cache
rows) in fp64 on the CPU, checked against the dense reference on the same keys, against the
definition one row at a time, and on its corner cases: unused slots, duplicates, empty rows,
an extra cache, FP8 caches, NaN where nothing may be read, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import mlagen
from mlagen.tools.testing import make_case

F64 = torch.float64


def _flat_rows(case, b: int, n: int) -> torch.Tensor:
    """Request b's first n keys as flat cache row ids (page id x page_size + offset)."""
    page = case.kv_cache.size(1)
    j = torch.arange(n)
    return case.block_table[b, j // page].long() * page + j % page


def _visible_indices(case, mask: str, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [B, S, topk] listing, for each query token, the keys the dense reference lets it see
    under `mask` (its request's prefix, then its drafts by the mask), -1 after them; and the
    request lengths (topk_length: every slot a token may fill)."""
    B, S = case.q.shape[:2]
    lengths = case.cache_seqlens.tolist()
    indices = torch.full((B, S, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        rows = _flat_rows(case, b, n)
        seen = mlagen.runtime.reference.visible_keys(n, S, mask == "causal",
                                                     case.tree_mask if mask == "tree" else None)
        for s in range(S):
            listed = rows[seen[s]]
            indices[b, s, : len(listed)] = listed.int()
    return indices, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
@pytest.mark.parametrize("fmt", ["dtype", "e4m3", "ds_mla"])
def test_listing_each_tokens_visible_keys_gives_the_dense_reference(mask, fmt):
    """Every token's visible keys listed (the prefix, its drafts by the mask), each row of the
    result equals the dense reference's, in every cache format; NaN fills unused pages and rows
    past each length, so a stray read shows."""
    case = make_case(batch=3, seqlen_q=4, heads=8, prefixes=[70, 0, 130], page_size=16, mask=mask, seed=11,
                     device="cpu", dtype=torch.bfloat16, kv_format=fmt)
    kv_scale = case.kv_scale
    indices, lengths = _visible_indices(case, mask, topk=160)
    out, lse = mlagen.sparse_reference(case.q, case.kv_cache, indices, lengths, softmax_scale=case.scale,
                                       dtype=F64, kv_scale=kv_scale)
    ref_out, ref_lse = mlagen.reference(case.q, case.kv_cache, case.block_table, case.cache_seqlens, dtype=F64,
                                        **case.kwargs())
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def _by_definition(q, kv, indices, lengths, scale, dl):
    """One query row and one slot at a time, fp64: the module's definition."""
    B, S, H, _ = q.shape
    out = torch.zeros(B, S, H, dl, dtype=F64)
    lse = torch.full((B, H, S), -math.inf, dtype=F64)
    flat = kv.reshape(-1, kv.size(-1)).double()
    for b in range(B):
        for s in range(S):
            rows = [flat[int(r)] for k, r in enumerate(indices[b, s]) if r >= 0 and k < lengths[b]]
            if not rows:
                continue
            keys = torch.stack(rows)
            for h in range(H):
                scores = keys @ q[b, s, h].double() * scale
                lse[b, h, s] = torch.logsumexp(scores, 0)
                out[b, s, h] = torch.softmax(scores, 0) @ keys[:, :dl]
    return out, lse


def test_slots_duplicates_and_empty_tokens_follow_the_definition():
    """Random rows with duplicates, -1 slots, ragged topk_length (one request 0, one topk), a NaN
    page that only unused slots and slots past a length point at: the definition, row by row; a
    token with no valid slot has out 0 and lse -inf."""
    gen = torch.Generator().manual_seed(5)
    B, S, H, D, dl, page, pages, topk = 4, 3, 4, 40, 32, 8, 6, 12
    q = torch.randn(B, S, H, D, generator=gen, dtype=F64)
    kv = torch.randn(pages, page, D, generator=gen, dtype=F64)
    kv[0] = math.nan                                  # page 0: only what must never be read points there
    indices = torch.randint(page, pages * page, (B, S, topk), generator=gen, dtype=torch.int32)
    indices[:, :, 1] = indices[:, :, 0]               # duplicates
    indices[:, :, 2] = -1
    indices[1, 2, :] = -1                             # a token with no valid slot
    lengths = torch.tensor([topk, 0, 5, 7], dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):          # past a request's length: the NaN page
        indices[b, :, n:] = torch.randint(0, page, (S, topk - n), generator=gen, dtype=torch.int32)
    out, lse = mlagen.sparse_reference(q, kv, indices, lengths, softmax_scale=0.3, head_dim_v=dl, dtype=F64)
    want_out, want_lse = _by_definition(q, kv, indices, lengths.tolist(), 0.3, dl)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert not out.isnan().any()
    for b, s in ((1, 0), (1, 1), (1, 2)):             # topk_length 0: every token of request 1 is empty
        assert (out[b, s] == 0).all() and (lse[b, :, s] == -math.inf).all()
    assert (lse[1] == -math.inf).all() and (lse[0] > -math.inf).all()


def test_a_duplicated_row_counts_as_two_keys():
    """One row listed twice weighs as two equal keys: the result equals listing it once more in a
    cache that holds the row twice."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 2, 16, generator=gen, dtype=F64)
    kv = torch.randn(2, 4, 16, generator=gen, dtype=F64)
    twice, _ = mlagen.sparse_reference(q, kv, torch.tensor([[[3, 3, 5]]]), head_dim_v=8, dtype=F64)
    copy = kv.clone()
    copy[1, 3] = kv[0, 3]                             # row 7 holds row 3 again
    apart, _ = mlagen.sparse_reference(q, copy, torch.tensor([[[3, 7, 5]]]), head_dim_v=8, dtype=F64)
    once, _ = mlagen.sparse_reference(q, kv, torch.tensor([[[3, 5, -1]]]), head_dim_v=8, dtype=F64)
    torch.testing.assert_close(twice, apart, rtol=1e-14, atol=1e-14)
    assert not torch.allclose(twice, once)


def test_an_extra_cache_joins_the_same_softmax():
    """Rows of an extra cache (its own indices and lengths) attended with the first cache's equal
    one cache holding both caches' pages, listing all the rows."""
    gen = torch.Generator().manual_seed(9)
    B, S, H, D, page = 2, 2, 3, 24, 4
    q = torch.randn(B, S, H, D, generator=gen, dtype=F64)
    first = torch.randn(5, page, D, generator=gen, dtype=F64)
    extra = torch.randn(3, page, D, generator=gen, dtype=F64)
    idx = torch.randint(0, 5 * page, (B, S, 6), generator=gen, dtype=torch.int32)
    extra_idx = torch.randint(0, 3 * page, (B, S, 4), generator=gen, dtype=torch.int32)
    extra_len = torch.tensor([4, 1], dtype=torch.int32)
    out, lse = mlagen.sparse_reference(q, first, idx, head_dim_v=16, dtype=F64, extra_kv_cache=extra,
                                       extra_indices=extra_idx, extra_topk_length=extra_len)
    both = torch.cat([first, extra])
    shifted = torch.where(torch.arange(4)[None, None, :] < extra_len[:, None, None], extra_idx + 5 * page, -1)
    want_out, want_lse = mlagen.sparse_reference(q, both, torch.cat([idx, shifted.int()], dim=2), head_dim_v=16,
                                                 dtype=F64)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_bad_input_names_the_argument():
    q = torch.randn(2, 3, 4, 40, dtype=F64)
    kv = torch.randn(6, 8, 40, dtype=F64)
    idx = torch.zeros(2, 3, 5, dtype=torch.int32)
    cases = [
        (dict(indices=idx.float()), r"indices\.dtype: got torch\.float32, expected an integer dtype"),
        (dict(indices=idx[:, :2]), r"indices\.shape: got \(2, 2, 5\), expected \[B=2, S=3, topk >= 1\]"),
        (dict(indices=torch.full_like(idx, 48)),
         r"indices: got a row id 48, expected -1 or a row of the cache, 0\.\.47"),
        (dict(indices=torch.full_like(idx, -2)), r"indices: got a row id -2"),
        (dict(topk_length=torch.tensor([6, 1])), r"topk_length: got a length 6, expected 0\.\.topk=5"),
        (dict(topk_length=torch.tensor([1])), r"topk_length\.shape: got \(1,\), expected \[B=2\]"),
        (dict(kv_cache=torch.randn(6, 8, 41, dtype=F64)), r"q\.shape\[-1\] and kv_cache\.shape\[-1\]: got 40 and 41"),
        (dict(head_dim_v=41), r"head_dim_v: got 41"),
        (dict(extra_kv_cache=kv), r"an extra cache comes with its indices"),
        (dict(extra_kv_cache=kv, extra_indices=torch.full((2, 3, 2), 99)), r"extra_indices: got a row id 99"),
    ]
    for change, message in cases:
        args = dict(q=q, kv_cache=kv, indices=idx, head_dim_v=32) | change
        with pytest.raises(mlagen.InputError, match=message):
            mlagen.sparse_reference(**args)
