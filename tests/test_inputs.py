"""Argument checks name the argument, what it got and what was expected (CPU tensors: the
metadata checks do not need a GPU; the CUDA requirement is the op's first check)."""

import pytest
import torch

from mlagen.runtime.inputs import InputError, check_inputs, check_out, key_bound


def args(B=2, S=3, H=4, D=576, pages=5, page=16, dtype=torch.bfloat16):
    return dict(q=torch.zeros(B, S, H, D, dtype=dtype), kv_cache=torch.zeros(pages, page, D, dtype=dtype),
                block_table=torch.zeros(B, 2, dtype=torch.int32),
                cache_seqlens=torch.zeros(B, dtype=torch.int32), tree_mask=None, head_dim_v=512,
                softmax_scale=None)


def test_good_arguments_give_the_sizes():
    s = check_inputs(**args())
    assert (s.batch, s.seqlen_q, s.heads, s.head_dim, s.dl) == (2, 3, 4, 576, 512)
    assert (s.num_pages, s.page_size, s.max_pages, s.dtype) == (5, 16, 2, "bf16")
    four_d = args()
    four_d["kv_cache"] = torch.zeros(5, 16, 1, 576, dtype=torch.bfloat16)
    assert check_inputs(**four_d).kv_strides == (16 * 576, 576)     # of the [pages, page, D] view
    assert s.mask_strides == (0, 0)
    shared, per_request = args(), args()
    shared["tree_mask"] = torch.ones(3, 3, dtype=torch.bool)
    per_request["tree_mask"] = torch.ones(2, 3, 3, dtype=torch.bool)
    assert check_inputs(**shared).mask_strides == (0, 3)
    assert check_inputs(**per_request).mask_strides == (9, 3)


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(2, 3, 4, 576)), r"q.dtype: got torch.float32, expected torch.bfloat16"),
    (dict(q=torch.zeros(2, 3, 576, dtype=torch.bfloat16)), r"q.shape: got \(2, 3, 576\)"),
    (dict(q=torch.zeros(2, 3, 4, 1152, dtype=torch.bfloat16)[..., ::2]), r"q.stride\(\): .*last dim contiguous"),
    (dict(q=torch.zeros(2, 3, 4, 580, dtype=torch.bfloat16)[..., :576]), r"q.stride\(\): .*multiples of 8"),
    (dict(kv_cache=torch.zeros(5, 16, 576, dtype=torch.float16)), r"kv_cache.dtype: got torch.float16"),
    (dict(kv_cache=torch.zeros(5, 16, 2, 576, dtype=torch.bfloat16)), r"kv_cache.shape: got \(5, 16, 2, 576\)"),
    (dict(kv_cache=torch.zeros(5, 16, 512, dtype=torch.bfloat16)), r"kv_cache.shape\[-1\]: got 512"),
    (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), r"block_table.dtype: got torch.int64"),
    (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), r"block_table.shape: got \(3, 2\)"),
    (dict(cache_seqlens=torch.zeros(2, dtype=torch.int64)), r"cache_seqlens.dtype"),
    (dict(cache_seqlens=torch.zeros(3, dtype=torch.int32)), r"cache_seqlens.shape: got \(3,\)"),
    (dict(tree_mask=torch.ones(3, 4, dtype=torch.bool)), r"tree_mask.shape: got \(3, 4\), expected \[S, S\]"),
    (dict(tree_mask=torch.ones(3, 3, dtype=torch.float32)), r"tree_mask.dtype"),
    (dict(head_dim_v=577), r"head_dim_v: got 577"),
    (dict(softmax_scale=float("nan")), r"softmax_scale: got nan"),
    (dict(q=torch.zeros(2, 65, 4, 576, dtype=torch.bfloat16), block_table=torch.zeros(2, 2, dtype=torch.int32),
          tree_mask=torch.ones(65, 65, dtype=torch.bool)), r"at most 64 draft tokens"),
])
def test_bad_arguments_are_named(change, match):
    a = args()
    a.update(change)
    with pytest.raises(InputError, match=match):
        check_inputs(**a)


def test_tensors_must_share_q_device():
    a = args()
    a["block_table"] = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    with pytest.raises(InputError, match="block_table: got a tensor on meta"):
        check_inputs(**a)


def test_out_argument():
    a = args()
    s = check_inputs(**a)
    check_out(torch.zeros(2, 3, 4, 512, dtype=torch.bfloat16), a["q"], s)
    with pytest.raises(InputError, match=r"out.shape: got \(2, 3, 4, 576\)"):
        check_out(torch.zeros(2, 3, 4, 576, dtype=torch.bfloat16), a["q"], s)
    with pytest.raises(InputError, match="out.dtype"):
        check_out(torch.zeros(2, 3, 4, 512), a["q"], s)


def test_a_length_bound_rounds_up_a_quarter_octave_at_most():
    assert key_bound(None) is None and key_bound(0) == key_bound(64) == 64
    bounds = [key_bound(n) for n in range(1, 300_000, 7)]
    for n, b in zip(range(1, 300_000, 7), bounds, strict=True):
        assert max(n, 64) <= b <= max(64, n * 1.19 + 1), (n, b)
    assert bounds == sorted(bounds) and len(set(bounds)) <= 4 * 19    # a few plans per doubling
    assert key_bound(4096) == 4096 and key_bound(4097) == 4871


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4096"])
def test_a_bad_length_bound_is_named(bad):
    with pytest.raises(InputError, match=r"^max_seqlen_k: got .*expected None or an int >= 0"):
        key_bound(bad)
