"""mlagen.compat.flash_mla on CPU: FlashMLA's signatures, defaults, types and conventions.
Numerics against the reference are GPU tests (tests/test_gpu_dropin.py)."""

import inspect
import math

import pytest
import torch

from mlagen.compat import flash_mla
from mlagen.runtime import inputs, op
from mlagen.runtime.inputs import InputError


def test_signatures_match_flash_mla():
    meta = inspect.signature(flash_mla.get_mla_metadata)
    assert list(meta.parameters) == ["cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k",
                                     "num_heads_q", "is_fp8_kvcache", "topk"]
    run = inspect.signature(flash_mla.flash_mla_with_kvcache)
    positional = [n for n, p in run.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                          "tile_scheduler_metadata", "num_splits", "softmax_scale", "causal",
                          "is_fp8_kvcache", "indices"]
    assert run.parameters["causal"].default is False and run.parameters["softmax_scale"].default is None
    # mlagen's extensions are keyword-only, after FlashMLA's arguments.
    extensions = {n: p.default for n, p in run.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert extensions == {"max_seqlen_k": None}
    assert list(run.parameters)[:len(positional)] == positional


def test_metadata_types():
    lens = torch.tensor([5, 9, 0], dtype=torch.int32)
    metadata, splits = flash_mla.get_mla_metadata(lens, 4 * 16, 1)
    assert metadata.dtype == splits.dtype == torch.int32
    assert metadata.dim() == 2 and splits.shape == (4,) and metadata.device == lens.device
    with pytest.raises(NotImplementedError, match="is_fp8_kvcache"):
        flash_mla.get_mla_metadata(lens, 4, 1, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="sparse"):
        flash_mla.get_mla_metadata(lens, 4, 1, num_heads_q=16, topk=2048)
    with pytest.raises(ValueError, match="num_heads_k: got 2"):
        flash_mla.get_mla_metadata(lens, 4, 2)


def test_defaults_and_empty_row_convention(monkeypatch):
    seen = {}

    def fake_op(q, k_cache, block_table, cache_seqlens, **kwargs):
        seen.update(kwargs)
        B, S, H, _ = q.shape
        lse = torch.zeros(B, H, S)
        lse[0] = -math.inf                      # mlagen's mark for a row with no key
        return torch.zeros(B, S, H, kwargs["head_dim_v"], dtype=q.dtype), lse

    monkeypatch.setattr(flash_mla, "verify_attention_op", fake_op)
    q = torch.zeros(2, 2, 16, 576, dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, torch.zeros(2, 2, dtype=torch.int32),
                                                torch.ones(2, dtype=torch.int32), 512, None)
    assert seen == dict(softmax_scale=576 ** -0.5, causal=False, return_lse=True, head_dim_v=512,
                        max_seqlen_k=None)
    assert out.shape == (2, 2, 16, 512) and lse.shape == (2, 16, 2)
    assert (lse[0] == math.inf).all() and (lse[1] == 0).all()


def test_unsupported_arguments():
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    k_cache = torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 512, None)
    with pytest.raises(NotImplementedError, match="sparse attention"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, *args, indices=torch.zeros(1, 1, 8, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="fp8 KV cache"):
        flash_mla.flash_mla_with_kvcache(q, k_cache, *args, is_fp8_kvcache=True)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        flash_mla.flash_mla_with_kvcache(q, k_cache.to(torch.float8_e4m3fn), *args)


class _Planned(Exception):
    """Raised by the stand-in planner: the plan was made, and nothing was launched."""


@pytest.fixture
def planner(monkeypatch):
    """The real op and host path on CPU tensors, up to the plan: records the KV capacity each
    plan is made for (`op._prepare`'s kv_capacity), then stops before any launch."""
    capacities = []

    def prepare(heads, dl, dr, dtype, page_size, mask, lse, batch, seqlen_q, kv_capacity, table_capacity, device,
                variant):
        capacities.append(kv_capacity)
        raise _Planned

    monkeypatch.setattr(op, "_calls", {})
    monkeypatch.setattr(op, "_require_cuda", lambda q: None)
    monkeypatch.setattr(op, "_prepare", prepare)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return capacities


def _wide_table_call(**kwargs):
    """One request of S=9 and 300 keys under a table of 2048 pages of 64 (131072 keys), the
    H200 benchmark's wide table."""
    q = torch.zeros(1, 9, 16, 576, dtype=torch.bfloat16)
    k_cache = torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16)
    block_table = torch.zeros(1, 2048, dtype=torch.int32)
    cache_seqlens = torch.full((1,), 300, dtype=torch.int32)
    return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, None, None,
                                            causal=True, **kwargs)


def test_max_seqlen_k_reaches_the_op(monkeypatch):
    seen = {}

    def fake_op(q, k_cache, block_table, cache_seqlens, **kwargs):
        seen.update(kwargs)
        B, S, H, _ = q.shape
        return torch.zeros(B, S, H, kwargs["head_dim_v"], dtype=q.dtype), torch.zeros(B, H, S)

    monkeypatch.setattr(flash_mla, "verify_attention_op", fake_op)
    _wide_table_call(max_seqlen_k=300)
    assert seen["max_seqlen_k"] == 300
    with pytest.raises(TypeError):    # keyword-only: FlashMLA's positional arguments end at indices
        flash_mla.flash_mla_with_kvcache(*([None] * 11), 300)


def test_max_seqlen_k_plans_for_the_bound_not_the_table(planner):
    """Through the registered op into the host path: the plan is made for the table's capacity
    without a bound, for the bound (a quarter octave up) with one."""
    with pytest.raises(_Planned):
        _wide_table_call()
    with pytest.raises(_Planned):
        _wide_table_call(max_seqlen_k=300)
    with pytest.raises(_Planned):
        _wide_table_call(max_seqlen_k=20)
    assert planner == [2048 * 64, inputs.key_bound(300), 64]
    assert 300 <= planner[1] < 2048 * 64


@pytest.mark.parametrize("bad", [-1, "4096", 4096.0, True])
def test_bad_max_seqlen_k_raises_before_any_plan(planner, bad):
    # Checked before the op (`verify_attention_op`): through the op's schema a bool would arrive
    # as 1 and a str or float would raise torch's RuntimeError instead.
    with pytest.raises(InputError, match=f"^max_seqlen_k: got {bad!r}, expected None or an int >= 0"):
        _wide_table_call(max_seqlen_k=bad)
    assert planner == []
