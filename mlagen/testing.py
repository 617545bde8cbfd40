"""Paged cases for checking kernels against the reference, and the comparison itself.

The tests, `benchmarks/` and `mlagen fuzz` share these. A case fills every place no kernel may
read (unused pages, keys past a request's length, block-table entries past its pages) with NaN,
so a stray read shows up in the output; `poisoned_out` and `poison_allocator` do the same for
what a kernel must write.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .reference import reference


@dataclass
class Case:
    """One paged verify-attention problem with its inputs; `kwargs()` gives the op's keyword
    arguments and `reference()` the expected out [B, S, H, Dl] and lse [B, H, S]."""

    q: torch.Tensor              # [B, S, H, D]
    kv_cache: torch.Tensor       # [num_pages, page, D]; unused pages and keys past a length: NaN
    block_table: torch.Tensor    # [B, max_pages] int32; entries past a request's pages: NaN pages
    cache_seqlens: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor | None
    causal: bool
    scale: float
    dl: int

    def kwargs(self) -> dict:
        """softmax_scale, causal, tree_mask and head_dim_v, as the op takes them."""
        return dict(softmax_scale=self.scale, causal=self.causal, tree_mask=self.tree_mask,
                    head_dim_v=self.dl)

    def reference(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, S, H, Dl] and lse [B, H, S] from `mlagen.reference`, computed in `dtype`."""
        return reference(self.q, self.kv_cache, self.block_table, self.cache_seqlens,
                         dtype=dtype, **self.kwargs())


def random_tree(seqlen_q: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft tree as a bool [S, S] ancestor mask (each token sees itself and its
    ancestors; token k's parent is drawn from 0..k-1)."""
    mask = torch.zeros(seqlen_q, seqlen_q, dtype=torch.bool)
    for k in range(seqlen_q):
        mask[k, k] = True
        if k:
            parent = int(torch.randint(0, k, (1,), generator=gen))
            mask[k] |= mask[parent]
    return mask


def make_case(*, batch: int, seqlen_q: int, heads: int, prefixes: list[int], page_size: int,
              mask: str, seed: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
              dl: int = 512, dr: int = 64, empty: list[bool] | None = None,
              spare_pages: int = 3, per_request_tree: bool = False, table_pages: int = 0) -> Case:
    """A paged case: request b holds prefixes[b] + S keys (0 where empty[b]) on shuffled pages.

    q is [B, S, H, dl+dr] and the cache [pages, page_size, dl+dr], both in `dtype` on `device`,
    from a generator seeded with `seed` (the same seed gives the same case). mask: "causal",
    "tree" (one random draft tree, or one per request with per_request_tree) or "none". The
    softmax scale is 1/sqrt(dl+dr) times a random factor in [0.5, 2]. NaN fills the unused
    pages (spare_pages of them), each request's keys past its length, and the block table's
    entries past a request's pages (they point at unused pages). The block table is
    table_pages wide, or one page wider than the longest request needs if that is more (an
    engine's table is sized for its longest context).
    """
    gen = torch.Generator().manual_seed(seed)
    D = dl + dr
    lengths = [0 if (empty and empty[b]) else prefixes[b] + seqlen_q for b in range(batch)]
    pages_needed = [-(-n // page_size) for n in lengths]
    max_pages = max(1, max(pages_needed) + 1, table_pages)   # a spare column: must never be read
    total = sum(pages_needed) + spare_pages
    order = torch.randperm(total, generator=gen)
    kv = torch.full((total, page_size, D), math.nan, dtype=torch.float32)
    nan_pages = order[sum(pages_needed):]
    table = torch.empty(batch, max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lengths):
        mine = order[used: used + pages_needed[b]]
        used += pages_needed[b]
        rows = torch.randn(n, D, generator=gen)
        flat = torch.full((pages_needed[b] * page_size, D), math.nan)
        flat[:n] = rows
        if pages_needed[b]:
            kv[mine] = flat.reshape(-1, page_size, D)
        table[b, : pages_needed[b]] = mine.to(torch.int32)
        spare = nan_pages[torch.randint(0, len(nan_pages), (max_pages - pages_needed[b],), generator=gen)]
        table[b, pages_needed[b]:] = spare.to(torch.int32)
    q = torch.randn(batch, seqlen_q, heads, D, generator=gen)
    tree = None
    if mask == "tree":
        if per_request_tree:
            tree = torch.stack([random_tree(seqlen_q, gen) for _ in range(batch)])
        else:
            tree = random_tree(seqlen_q, gen)
        tree = tree.to(device)
    scale = (1.0 / math.sqrt(D)) * float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))
    return Case(q=q.to(device=device, dtype=dtype), kv_cache=kv.to(device=device, dtype=dtype),
                block_table=table.to(device), cache_seqlens=torch.tensor(lengths, dtype=torch.int32,
                                                                         device=device),
                tree_mask=tree, causal=(mask == "causal"), scale=scale, dl=dl)


def poisoned_out(case: Case) -> torch.Tensor:
    """An `out=` tensor for the case, [B, S, H, Dl] in q's dtype, all NaN: any element a kernel
    does not write stays NaN."""
    B, S, H, _ = case.q.shape
    return torch.full((B, S, H, case.dl), math.nan, dtype=case.q.dtype, device=case.q.device)


def poison_allocator(nbytes: int, device: str = "cuda") -> None:
    """Leave NaN-filled blocks in torch's caching allocator so that workspaces the op allocates
    next start as NaN rather than zeros: a kernel that reads what it never wrote shows up."""
    blocks = [torch.full((nbytes // 4 + 1,), math.nan, device=device) for _ in range(2)]
    del blocks


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over all elements, in fp64."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / max(denom, 1e-30)


def mismatch(out: torch.Tensor, lse: torch.Tensor | None, case: Case, tol: float = 1e-2) -> str | None:
    """What is wrong with out [B, S, H, Dl] (and lse [B, H, S] fp32) against the fp64 reference,
    or None: every element written and finite, rows that see no key exactly 0 (lse -inf), and the
    relative error (Frobenius norm over the whole output) under tol."""
    ref_out, ref_lse = case.reference(torch.float64)
    out = out.double()
    if torch.isnan(out).any():
        return f"{int(torch.isnan(out).sum())} output elements unwritten or NaN"
    empty = torch.isinf(ref_lse).transpose(1, 2)                 # [B, S, H]: rows with no key
    if not (out[empty] == 0).all():
        return "rows that see no key must be exactly 0"
    err = rel_error(out, ref_out)
    if not err < tol:
        return f"relative error {err:.3g} >= {tol}"
    if lse is None:
        return None
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(ref_lse.shape):
        return f"lse: got {lse.dtype} {tuple(lse.shape)}, expected torch.float32 {tuple(ref_lse.shape)}"
    lse = lse.double()
    if torch.isnan(lse).any():
        return "lse has NaN"
    if not torch.equal(torch.isinf(lse), torch.isinf(ref_lse)):
        return "lse -inf rows differ"
    finite = ~torch.isinf(ref_lse)
    if finite.any():
        diff = (lse[finite] - ref_lse[finite]).abs().max().item()
        if not diff < tol * max(1.0, ref_lse[finite].abs().max().item()):
            return f"lse differs by {diff:.3g}"
    return None


def assert_matches(out: torch.Tensor, lse: torch.Tensor | None, case: Case, tol: float = 1e-2) -> None:
    """`mismatch` as an assertion."""
    problem = mismatch(out, lse, case, tol)
    assert problem is None, problem


@contextmanager
def pinned_balanced_ranges(ranges: int) -> Iterator[None]:
    """Within it, balanced-split launches get `ranges` ranges (their num_splits) instead of one per
    resident slot, so a check picks the work list's layout (templates/merge.cuh.j2: aligned or
    packed) on any GPU. The runtime's memoized launch plans are dropped on entry and exit."""
    from . import runtime

    planned = runtime.num_splits

    def splits(variant, *args) -> int:
        return ranges if variant.kv_split == "balanced" else planned(variant, *args)

    runtime._prepare.cache_clear()
    runtime.num_splits = splits
    try:
        yield
    finally:
        runtime.num_splits = planned
        runtime._prepare.cache_clear()
