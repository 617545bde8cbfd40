"""Attention backends: what computes absorbed MLA attention over the paged latent cache.

A backend is called as `mlagen.verify_attention` is, with the keyword arguments below, and
returns out [B, S, H, Dl] in q's dtype. Two are given:

- `MlagenBackend`: `mlagen.verify_attention`, the generated kernels (CUDA; bf16 or fp16 q, a
  cache in q's dtype or an FP8 one).
- `ReferenceBackend`: `mlagen.reference`, mlagen's plain-torch reference (any device, any float
  dtype, any head widths), computed in fp64 by default and returned in q's dtype, so that CPU
  runs go through the same integration code.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..runtime.op import verify_attention
from ..runtime.reference import reference


class AttentionBackend(Protocol):
    """Absorbed MLA attention over a paged latent cache (the signature of `MlagenBackend`)."""

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, *, softmax_scale: float, causal: bool,
                 tree_mask: torch.Tensor | None, head_dim_v: int, kv_scale: float | None,
                 max_seqlen_k: int | None) -> torch.Tensor:
        """q [B, S, H, Dl+Dr]; kv_cache [num_pages, page_size, row]; block_table [B, max_pages]
        int32; cache_seqlens [B] int32 (draft rows included); tree_mask bool [B, S, S] or None
        (then causal). Returns out [B, S, H, head_dim_v] in q's dtype."""
        ...


class MlagenBackend:
    """`mlagen.verify_attention` (needs a CUDA device, bf16/fp16 queries). Extra keyword
    arguments given here (e.g. variant=, batch_invariant=) go to every call."""

    name = "mlagen"

    def __init__(self, **op_kwargs: object) -> None:
        self.op_kwargs = op_kwargs

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, *, softmax_scale: float, causal: bool,
                 tree_mask: torch.Tensor | None, head_dim_v: int, kv_scale: float | None,
                 max_seqlen_k: int | None) -> torch.Tensor:
        return verify_attention(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                                causal=causal, tree_mask=tree_mask, head_dim_v=head_dim_v, kv_scale=kv_scale,
                                max_seqlen_k=max_seqlen_k, **self.op_kwargs)


class ReferenceBackend:
    """`mlagen.reference` computed in `dtype` (fp64 by default), out cast to q's dtype."""

    name = "reference"

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, *, softmax_scale: float, causal: bool,
                 tree_mask: torch.Tensor | None, head_dim_v: int, kv_scale: float | None,
                 max_seqlen_k: int | None) -> torch.Tensor:
        out, _ = reference(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                           tree_mask=tree_mask, head_dim_v=head_dim_v, dtype=self.dtype, kv_scale=kv_scale)
        return out.to(q.dtype)


def default_backend(device: torch.device | str) -> AttentionBackend:
    """`MlagenBackend` on a CUDA device, `ReferenceBackend` elsewhere."""
    return MlagenBackend() if torch.device(device).type == "cuda" else ReferenceBackend()
