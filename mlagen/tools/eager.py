"""MLA verify attention the way a PyTorch user writes it: the "torch eager" column of the bench.

Gather each request's pages, one batched matmul for the scores (in q's dtype, as cuBLAS runs
it), the masked softmax in fp32, one batched matmul with V. It batches over requests, so every
request must have the same number of keys (the benchmark rows do).
"""

from __future__ import annotations

import torch

from ..runtime.reference import visible_keys


def eager_visible(keys: int, seqlen_q: int, causal: bool, tree_mask: torch.Tensor | None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [S, N]: the mask a user builds once per step (prefix keys always visible)."""
    return visible_keys(keys, seqlen_q, causal, tree_mask, device)


def eager_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, keys: int,
                    visible: torch.Tensor, softmax_scale: float, head_dim_v: int = 512) -> torch.Tensor:
    """out [B, S, H, Dl] in q's dtype.

    q: [B, S, H, Dl+Dr]; kv_cache: [num_pages, page_size, (1,) Dl+Dr]; block_table: [B, max_pages]
    int32; keys: N, valid keys of every request; visible: bool [S, N] from `eager_visible`.
    """
    B, S, H, D = q.shape
    page_size = kv_cache.shape[1]
    pages = -(-keys // page_size)
    kv = kv_cache.view(kv_cache.shape[0], page_size, D)[block_table[:, :pages].long()]
    kv = kv.reshape(B, pages * page_size, D)[:, :keys]                       # [B, N, D]
    scores = torch.matmul(q.reshape(B, S * H, D), kv.transpose(1, 2))         # [B, S*H, N]
    scores = scores.view(B, S, H, keys).float() * softmax_scale
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype).view(B, S * H, keys)
    return torch.matmul(p, kv[..., :head_dim_v]).view(B, S, H, head_dim_v)
