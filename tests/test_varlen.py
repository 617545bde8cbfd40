"""Ragged draft counts on CPU: the padding and index math (mlagen.runtime.varlen) run through the
reference on the padded problem must equal the reference applied request by request."""

import pytest
import torch
from dropin_cases import per_request_reference, ragged_case
from hypothesis import given
from hypothesis import strategies as st

import mlagen
from mlagen.runtime.inputs import InputError
from mlagen.runtime.reference import reference
from mlagen.runtime.varlen import varlen_layout


def padded_reference(q, case, cu, max_seqlen_q, tree):
    """What verify_attention_varlen computes, with the reference in place of the kernel."""
    layout = varlen_layout(cu, max_seqlen_q, q.shape[0])
    mask = layout.pad_tree_mask(tree) if tree is not None else None
    out, lse = reference(layout.pad_queries(q), case.kv_cache, case.block_table, case.cache_seqlens,
                         softmax_scale=case.scale, causal=case.causal, tree_mask=mask,
                         head_dim_v=case.dl, dtype=torch.float64)
    return layout.unpad_out(out), layout.unpad_lse(lse)


def assert_same(got, want):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_single_token_and_full_requests(mask):
    counts, prefixes = [1, 5, 3, 1, 5], [40, 0, 17, 0, 100]   # prefix 0 and s_b < S: short caches
    q, case, cu, tree = ragged_case(counts, prefixes, heads=2, mask=mask, seed=3, dl=256)
    assert_same(padded_reference(q, case, cu, max(counts), tree), per_request_reference(q, case, cu, tree))


def test_shared_tree_mask_and_empty_request():
    counts, prefixes = [4, 0, 2, 1], [9, 30, 0, 3]
    q, case, cu, tree = ragged_case(counts, prefixes, heads=2, mask="tree", seed=5, dl=256,
                                    shared_tree=True)
    assert tree.shape == (4, 4)
    assert_same(padded_reference(q, case, cu, 4, tree), per_request_reference(q, case, cu, tree))


def test_max_seqlen_larger_than_every_request():
    counts, prefixes = [2, 1, 3], [5, 70, 0]
    q, case, cu, tree = ragged_case(counts, prefixes, heads=1, mask="causal", seed=8, dl=256)
    assert_same(padded_reference(q, case, cu, 7, None), per_request_reference(q, case, cu, None))


@given(data=st.data(), mask=st.sampled_from(["causal", "tree", "none"]), seed=st.integers(0, 2**20))
def test_ragged_batches_match_per_request_reference(data, mask, seed):
    B = data.draw(st.integers(1, 5))
    counts = data.draw(st.lists(st.integers(0, 9), min_size=B, max_size=B).filter(lambda c: sum(c) > 0))
    prefixes = data.draw(st.lists(st.integers(0, 60), min_size=B, max_size=B))
    page = data.draw(st.sampled_from([1, 4, 16]))
    q, case, cu, tree = ragged_case(counts, prefixes, heads=2, mask=mask, seed=seed, dl=256, page_size=page)
    assert_same(padded_reference(q, case, cu, max(counts), tree), per_request_reference(q, case, cu, tree))


def test_layout_indices():
    cu = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    layout = varlen_layout(cu, 3, 6)
    assert layout.offset.tolist() == [1, 3, 0, 2]
    # Packed rows land at the end of their request's slot of 3.
    assert layout.dst.tolist() == [1, 2, 6, 7, 8, 11]
    assert layout.src.view(4, 3)[0, 1:].tolist() == [0, 1] and layout.src.view(4, 3)[3, 2] == 5


def test_padded_tree_mask_layout():
    cu = torch.tensor([0, 2], dtype=torch.int32)
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [0, 0, 0]]], dtype=torch.bool)  # s_b=2 in a 3x3 slot
    padded = varlen_layout(cu, 3, 2).pad_tree_mask(tree)[0]
    # Column 0 is a prefix key (visible to all); the 2x2 tree sits bottom-right; row 0 is padding.
    assert padded.tolist() == [[True, True, True], [True, True, False], [True, True, True]]


def test_argument_errors():
    q = torch.zeros(3, 2, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    bt = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.full((2,), 3, dtype=torch.int32)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(InputError, match=r"q.shape: got \(1, 3, 2, 576\)"):
        mlagen.verify_attention_varlen(q[None], kv, bt, lens, cu, 2)
    with pytest.raises(InputError, match="cu_seqlens_q: got torch.int64"):
        mlagen.verify_attention_varlen(q, kv, bt, lens, cu.long(), 2)
    with pytest.raises(InputError, match="max_seqlen_q: got 0"):
        mlagen.verify_attention_varlen(q, kv, bt, lens, cu, 0)
    with pytest.raises(InputError, match=r"cache_seqlens.shape: got \(3,\)"):
        mlagen.verify_attention_varlen(q, kv, bt, torch.zeros(3, dtype=torch.int32), cu, 2)
    with pytest.raises(InputError, match=r"tree_mask.shape: got \(2, 3, 3\)"):
        mlagen.verify_attention_varlen(q, kv, bt, lens, cu, 2, tree_mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(InputError, match="cu_seqlens_q\\[2\\] - cu_seqlens_q\\[1\\]: got 2"):
        mlagen.verify_attention_varlen(q, kv, bt, lens, cu, 1, check_values=True)
    with pytest.raises(InputError, match="q.device"):   # the kernels need a GPU
        mlagen.verify_attention_varlen(q, kv, bt, lens, cu, 2)


def test_gathered_argument_errors():
    """Packed tokens' indices and topk_length are checked before any launch, each error naming
    the argument, what it got and what was expected."""
    q = torch.zeros(3, 2, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    cases = [
        (dict(indices=[[0]] * 3), "indices: got list, expected a torch.Tensor"),
        (dict(indices=idx[None]), r"indices.shape: got \(1, 3, 4\), expected \[total_q=3, topk\]"),
        (dict(indices=idx, topk_length=torch.ones(3, dtype=torch.int32)),
         r"topk_length.shape: got \(3,\), expected \[B=2\]"),
        (dict(indices=idx, topk_length=(1, 2)), "topk_length: got tuple, expected a torch.Tensor"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InputError, match=match):
            mlagen.verify_attention_varlen(q, kv, None, None, cu, 2, causal=False, **kwargs)
