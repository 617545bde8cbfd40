"""Shared by the drop-in tests: ragged (varlen) batches and prefix/draft key splits, built on
`mlagen.tools.testing.make_case`, with their per-request references."""

from __future__ import annotations

import torch

from mlagen.runtime.reference import gather_kv, reference
from mlagen.tools.testing import Case, make_case, random_tree


def ragged_case(counts: list[int], prefixes: list[int], *, heads: int, mask: str, seed: int,
                page_size: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu",
                dl: int = 512, shared_tree: bool = False):
    """A varlen batch: request b has prefixes[b] prefix keys and counts[b] draft tokens.

    Returns (q [total_q, H, D], case, cu_seqlens_q [B+1] int32, packed tree mask or None):
    `case` holds the paged cache of the lengths prefix + count (its own q is unused).
    """
    S = max(counts)
    gen = torch.Generator().manual_seed(seed + 1)
    # make_case's request b holds prefix + seqlen_q keys; with seqlen_q=1 and prefix
    # prefixes[b] + counts[b] - 1 that is exactly prefix + count (an empty request: 0 keys).
    base = make_case(batch=len(counts), seqlen_q=1, heads=heads, page_size=page_size, mask="none",
                     prefixes=[max(p + c - 1, 0) for p, c in zip(prefixes, counts, strict=True)],
                     empty=[p + c == 0 for p, c in zip(prefixes, counts, strict=True)],
                     seed=seed, dtype=dtype, device=device, dl=dl)
    total = sum(counts)
    q = torch.randn(total, heads, base.q.shape[-1], generator=gen).to(device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    tree = None
    if mask == "tree":
        if shared_tree:
            tree = random_tree(S, gen).to(device)
        else:
            tree = torch.zeros(len(counts), S, S, dtype=torch.bool)
            for b, c in enumerate(counts):
                tree[b, :c, :c] = random_tree(c, gen)
            tree = tree.to(device)
    case = Case(q=base.q, kv_cache=base.kv_cache, block_table=base.block_table,
                cache_seqlens=base.cache_seqlens, tree_mask=None, causal=(mask == "causal"),
                scale=base.scale, dl=dl)
    return q, case, cu, tree


def per_request_reference(q: torch.Tensor, case: Case, cu: torch.Tensor, tree: torch.Tensor | None,
                          dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference applied request by request: out [total_q, H, Dl], lse [H, total_q]."""
    outs, lses = [], []
    bounds = cu.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        mask = None
        if tree is not None:
            mask = (tree if tree.dim() == 2 else tree[b])[: hi - lo, : hi - lo]
        out, lse = reference(q[lo:hi][None], case.kv_cache, case.block_table[b: b + 1],
                             case.cache_seqlens[b: b + 1], softmax_scale=case.scale, causal=case.causal,
                             tree_mask=mask, head_dim_v=case.dl, dtype=dtype)
        outs.append(out[0])
        lses.append(lse[0])
    H = q.shape[1]
    if not outs:
        return q.new_zeros(0, H, case.dl, dtype=dtype), q.new_zeros(H, 0, dtype=dtype)
    return torch.cat(outs), torch.cat(lses, dim=1)


def draft_only(case: Case) -> Case:
    """The same queries against only each request's S draft keys (its last S), one page per
    request: with `case`'s mask the draft part of a prefix + draft cascade."""
    B, S = case.q.shape[:2]
    rows = [gather_kv(case.kv_cache, case.block_table, b, int(n))[int(n) - S:]
            for b, n in enumerate(case.cache_seqlens.tolist())]
    kv = torch.stack(rows)                                             # [B, S, D]: page b
    table = torch.arange(B, dtype=torch.int32, device=kv.device)[:, None]
    lengths = torch.full((B,), S, dtype=torch.int32, device=kv.device)
    return Case(q=case.q, kv_cache=kv, block_table=table, cache_seqlens=lengths,
                tree_mask=case.tree_mask, causal=case.causal, scale=case.scale, dl=case.dl)


def prefix_only(case: Case) -> Case:
    """The same queries against only the prefix keys (every one visible): the other part."""
    S = case.q.shape[1]
    return Case(q=case.q, kv_cache=case.kv_cache, block_table=case.block_table,
                cache_seqlens=case.cache_seqlens - S, tree_mask=None, causal=False,
                scale=case.scale, dl=case.dl)
