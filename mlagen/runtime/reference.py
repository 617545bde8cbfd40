"""The reference: MLA verify attention written plainly in PyTorch, in fp32 or fp64.

Same layouts and semantics as `mlagen.verify_attention` (docs/design.md): per request b the
valid keys are the first cache_seqlens[b] rows addressed through block_table; the S draft
tokens are the last S of them; prefix keys are always visible, draft keys by the mask; a row
that sees no key gives out = 0 and lse = -inf.

`reference` is what kernels are checked against: one request at a time, all S * H query rows of
the request in one matrix product against its gathered keys, masked by an [S, n] visibility
matrix, softmax in `dtype`. It runs on whatever device the inputs are (fp64 works on the GPU).
`reference_naive` is the same definition one row and one key at a time, for checking
`reference` itself on small cases.
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
    """The first n KV rows of request b, [n, Dl+Dr], in the cache's dtype. Only the request's
    first ceil(n / page_size) pages are read; rows past n on its last page are dropped."""
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1])
    page_size = kv.shape[1]
    pages = block_table[b, : -(-n // page_size)].long()
    return kv[pages].reshape(-1, kv.shape[-1])[:n]


def _request_mask(tree_mask: torch.Tensor | None, b: int) -> torch.Tensor | None:
    """Request b's [S, S] tree mask from a shared [S, S] or per-request [B, S, S] one."""
    if tree_mask is None:
        return None
    return tree_mask if tree_mask.dim() == 2 else tree_mask[b]


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
    """Reference MLA verify attention, on q's device.

    q: [B, S, H, Dl+Dr]; kv_cache: [num_pages, page_size, (1,) Dl+Dr]; block_table: [B, max_pages]
    int; cache_seqlens: [B] int; tree_mask: bool [S, S] or [B, S, S] (overrides causal).
    Returns out [B, S, H, Dl] and lse [B, H, S] (natural log), both in `dtype`.

    Per request b with n keys: its keys are gathered once ([n, D], `gather_kv`), the scores of
    all S * H query rows are one matrix product ([S * H, n]), keys a query does not see
    (`visible_keys`) are set to -inf, and the softmax runs in `dtype`. Nothing past a request's
    n keys is read, so NaN there (unused pages, the tail of the last page) cannot leak in.
    """
    B, S, H, D = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, S, H, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((B, H, S), -math.inf, dtype=dtype, device=q.device)
    queries = q.to(dtype).reshape(B, S * H, D)
    for b, n in enumerate(cache_seqlens.tolist()):          # the one host sync
        if n <= 0:
            continue
        kv = gather_kv(kv_cache, block_table, b, n).to(device=q.device, dtype=dtype)      # [n, D]
        seen = visible_keys(n, S, causal, _request_mask(tree_mask, b), q.device)           # [S, n]
        s = (queries[b] @ kv.T).view(S, H, n).mul_(scale)
        s.masked_fill_(~seen[:, None, :], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)                                              # [S, H]
        # exp(-inf - -inf) is NaN in rows that see no key: those rows' weights are 0.
        p = s.sub_(row_lse[..., None]).exp_().nan_to_num_(0.0)
        out[b] = (p.view(S * H, n) @ kv[:, :head_dim_v]).view(S, H, head_dim_v)
        lse[b] = row_lse.T
    return out, lse


def reference_naive(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    head_dim_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one query row and one key at a time, in fp64 on the CPU: slow, for
    checking `reference` on small cases.

    Same arguments as `reference`. Returns out [B, S, H, Dl] and lse [B, H, S], fp64. Key j of
    request b (0 <= j < cache_seqlens[b]) is row j % page_size of page block_table[b, j //
    page_size]; the last S keys are the draft tokens, the others the prefix. Query i sees every
    prefix key, and draft key k when tree_mask[(b,) i, k] (with a tree mask), k <= i (causal)
    or always (neither).
    """
    q, kv_cache = q.double().cpu(), kv_cache.double().cpu()
    kv_cache = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1])
    table, lengths = block_table.cpu().tolist(), cache_seqlens.cpu().tolist()
    B, S, H, _ = q.shape
    page = kv_cache.shape[1]
    out = torch.zeros(B, S, H, head_dim_v, dtype=torch.float64)
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
    for b in range(B):
        n = lengths[b]
        prefix = n - S
        mask = _request_mask(tree_mask, b)
        for i in range(S):
            keys = []
            for j in range(n):
                k = j - prefix                                  # draft index (negative: a prefix key)
                if k < 0:
                    sees = True
                elif mask is not None:
                    sees = bool(mask[i, k])
                else:
                    sees = k <= i or not causal
                if sees:
                    keys.append(kv_cache[table[b][j // page], j % page])
            if not keys:
                continue                                        # out stays 0, lse -inf
            rows = torch.stack(keys)                            # [keys, D]
            for h in range(H):
                scores = rows @ q[b, i, h] * softmax_scale
                top = scores.max()
                weights = torch.exp(scores - top)
                out[b, i, h] = weights @ rows[:, :head_dim_v] / weights.sum()
                lse[b, h, i] = top + torch.log(weights.sum())
    return out, lse
