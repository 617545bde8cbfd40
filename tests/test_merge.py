"""merge_states on CPU: merging a prefix part and a draft part equals attention over both."""

import math

import pytest
import torch
from dropin_cases import draft_only, prefix_only

import mlagen
from mlagen.tools.testing import make_case


@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_prefix_plus_draft_equals_union(mask):
    # Request 1 has no prefix: its prefix part is empty (lse -inf) for every row.
    case = make_case(batch=3, seqlen_q=5, heads=4, prefixes=[40, 0, 77], page_size=16, mask=mask,
                     seed=11, dtype=torch.float64, device="cpu", per_request_tree=True)
    full_out, full_lse = case.reference(torch.float64)
    out_a, lse_a = prefix_only(case).reference(torch.float64)
    out_b, lse_b = draft_only(case).reference(torch.float64)
    assert torch.isinf(lse_a[1]).all()
    out, lse = mlagen.merge_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, full_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, full_lse.float(), rtol=1e-5, atol=1e-5)
    # The other order, in place, in bf16 outputs.
    b16, l32 = out_b.bfloat16(), lse_b.float()
    res = mlagen.merge_states_(b16, l32, out_a.bfloat16(), lse_a.float())
    assert res[0] is b16 and res[1] is l32
    torch.testing.assert_close(b16.double(), full_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(l32, full_lse.float(), rtol=1e-5, atol=1e-5)


def test_empty_parts():
    S, H, D = 2, 3, 8
    out_a = torch.full((S, H, D), math.nan)               # an empty part may hold anything
    lse_a = torch.full((H, S), -math.inf)
    out_b = torch.randn(S, H, D)
    lse_b = torch.randn(H, S)
    lse_b[1, 0] = -math.inf                               # row (s=0, h=1) empty in both parts
    out, lse = mlagen.merge_states(out_a, lse_a, out_b, lse_b)
    expect = out_b.clone()
    expect[0, 1] = 0
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(lse, lse_b)
    assert lse[1, 0] == -math.inf and not torch.isnan(out).any()


def test_equal_parts_add_log2():
    out = torch.randn(1, 4, 2, 16)
    lse = torch.randn(1, 2, 4)
    merged, merged_lse = mlagen.merge_states(out, lse, out, lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse + math.log(2))


def test_shape_errors():
    out, lse = torch.zeros(4, 2, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"lse_b.shape: got \(4, 2\), expected \[..., H, S\]=\[2, 4\]"):
        mlagen.merge_states(out, lse, out, lse.T)
    with pytest.raises(ValueError, match="out_b.shape"):
        mlagen.merge_states(out, lse, out[:1], lse)
    with pytest.raises(TypeError, match="out_a: got list"):
        mlagen.merge_states([], lse, out, lse)
