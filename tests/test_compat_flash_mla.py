"""mlagen.compat.flash_mla on CPU: FlashMLA's signatures, defaults, types and conventions.
Numerics against the reference are GPU tests (tests/test_gpu_dropin.py)."""

import inspect
import math

import pytest
import torch

from mlagen.compat import flash_mla


def test_signatures_match_flash_mla():
    meta = inspect.signature(flash_mla.get_mla_metadata)
    assert list(meta.parameters) == ["cache_seqlens", "num_q_tokens_per_head_k", "num_heads_k",
                                     "num_heads_q", "is_fp8_kvcache", "topk"]
    run = inspect.signature(flash_mla.flash_mla_with_kvcache)
    assert list(run.parameters) == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                                    "tile_scheduler_metadata", "num_splits", "softmax_scale", "causal",
                                    "is_fp8_kvcache", "indices"]
    assert run.parameters["causal"].default is False and run.parameters["softmax_scale"].default is None


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
    assert seen == dict(softmax_scale=576 ** -0.5, causal=False, return_lse=True, head_dim_v=512)
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
