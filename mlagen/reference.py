"""The reference: MLA verify attention written plainly in PyTorch, in fp32 or fp64.

Same layouts and semantics as `mlagen.verify_attention` (see DESIGN.md): per request b the
valid keys are the first cache_seqlens[b] rows addressed through block_table; the S draft
tokens are the last S of them; prefix keys are always visible, draft keys by the mask; a row
that sees no key gives out = 0 and lse = -inf. Runs on CPU or GPU, on whatever device the
inputs are.
"""

from __future__ import annotations

import math

import torch


def visible_keys(n: int, seqlen_q: int, causal: bool, tree_mask: torch.Tensor | None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Bool [S, n]: whether query i sees key j of a request with n valid keys.

    tree_mask: bool [S, S] of this request, or None. It takes precedence over `causal`.
    """
    j = torch.arange(n, device=device)
    prefix = n - seqlen_q
    draft = j - prefix                     # draft index of key j (negative: prefix key)
    i = torch.arange(seqlen_q, device=device)[:, None]
    if tree_mask is not None:
        k = draft.clamp(min=0, max=seqlen_q - 1)
        seen = tree_mask.to(device=device, dtype=torch.bool)[:, k]
    elif causal:
        seen = draft[None, :] <= i
    else:
        seen = torch.ones(seqlen_q, n, dtype=torch.bool, device=device)
    return seen | (draft < 0)[None, :]


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """The first n KV rows of request b, [n, Dl+Dr], in the cache's dtype."""
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1])
    page_size = kv.shape[1]
    pages = block_table[b, : -(-n // page_size)].long()
    return kv[pages].reshape(-1, kv.shape[-1])[:n]


def reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    head_dim_v: int = 512,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA verify attention.

    q: [B, S, H, Dl+Dr]; kv_cache: [num_pages, page_size, (1,) Dl+Dr]; block_table: [B, max_pages]
    int; cache_seqlens: [B] int; tree_mask: bool [S, S] or [B, S, S] (overrides causal).
    Returns out [B, S, H, Dl] and lse [B, H, S] (natural log), both in `dtype`.
    """
    B, S, H, D = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, S, H, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((B, H, S), -math.inf, dtype=dtype, device=q.device)
    lengths = cache_seqlens.tolist()
    for b in range(B):
        n = int(lengths[b])
        if n <= 0:
            continue
        kv = gather_kv(kv_cache, block_table, b, n).to(dtype)          # [n, D]
        mask = None
        if tree_mask is not None:
            mask = tree_mask if tree_mask.dim() == 2 else tree_mask[b]
        seen = visible_keys(n, S, causal, mask, q.device)                # [S, n]
        s = torch.einsum("shd,nd->shn", q[b].to(dtype), kv) * scale      # [S, H, n]
        s = s.masked_fill(~seen[:, None, :], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)                             # [S, H]
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)            # empty rows: 0
        out[b] = torch.einsum("shn,nd->shd", p, kv[:, :head_dim_v])
        lse[b] = row_lse.transpose(0, 1)
    return out, lse
