"""Shared by the tests: building paged cases (NaN where nothing may be read) and comparing."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlagen.reference import reference


@dataclass
class Case:
    q: torch.Tensor              # [B, S, H, D]
    kv_cache: torch.Tensor       # [num_pages, page, D]; unused pages and keys past a length: NaN
    block_table: torch.Tensor    # [B, max_pages] int32; entries past a request's pages: NaN pages
    cache_seqlens: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor | None
    causal: bool
    scale: float
    dl: int

    def kwargs(self) -> dict:
        return dict(softmax_scale=self.scale, causal=self.causal, tree_mask=self.tree_mask,
                    head_dim_v=self.dl)

    def reference(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
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
              spare_pages: int = 3, per_request_tree: bool = False) -> Case:
    """A paged case: request b holds prefixes[b] + S keys (0 where empty[b]) on shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    D = dl + dr
    lengths = [0 if (empty and empty[b]) else prefixes[b] + seqlen_q for b in range(batch)]
    pages_needed = [-(-n // page_size) for n in lengths]
    max_pages = max(1, max(pages_needed) + 1)          # a spare column: must never be read
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
    B, S, H, _ = case.q.shape
    return torch.full((B, S, H, case.dl), math.nan, dtype=case.q.dtype, device=case.q.device)


def poison_allocator(nbytes: int, device: str = "cuda") -> None:
    """Leave NaN-filled blocks in torch's caching allocator so that workspaces the op allocates
    next start as NaN rather than zeros: a kernel that reads what it never wrote shows up."""
    blocks = [torch.full((nbytes // 4 + 1,), math.nan, device=device) for _ in range(2)]
    del blocks


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / max(denom, 1e-30)


def assert_matches(out: torch.Tensor, lse: torch.Tensor | None, case: Case, tol: float = 1e-2) -> None:
    """out (and lse) against the fp64 reference: every element written and finite, empty rows
    exactly zero / -inf, relative error under tol."""
    ref_out, ref_lse = case.reference(torch.float64)
    out = out.double()
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} output elements unwritten or NaN"
    empty = torch.isinf(ref_lse).transpose(1, 2)                 # [B, S, H]: rows with no key
    assert (out[empty] == 0).all(), "rows that see no key must be exactly 0"
    err = rel_error(out, ref_out)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    if lse is not None:
        assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(ref_lse.shape)
        lse = lse.double()
        assert not torch.isnan(lse).any(), "lse has NaN"
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse -inf rows differ"
        finite = ~torch.isinf(ref_lse)
        if finite.any():
            diff = (lse[finite] - ref_lse[finite]).abs().max().item()
            assert diff < tol * max(1.0, ref_lse[finite].abs().max().item()), f"lse differs by {diff:.3g}"
