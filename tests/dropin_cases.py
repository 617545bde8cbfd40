"""Shared by the drop-in tests: ragged (varlen) batches and prefix/draft key splits, built on
`mlagen.tools.testing.make_case`, with their per-request references; FlashMLA's dense-decoding test
grid (`FlashMLAParams`, `FLASH_MLA_GRID`, `FLASH_MLA_ZERO_LENGTH`), its cases
(`flash_mla_case`), their fp64 reference per KV-head group (`flash_mla_reference`) and
FlashMLA's elementwise comparison (`flash_mla_mismatch`)."""

from __future__ import annotations

import dataclasses
import math

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


# ---- FlashMLA's dense-decoding test grid (the deepseek-ai/FlashMLA repository's own tests) ----

# The axes of FlashMLA's correctness cases; H_q runs over the values with H_q % H_kv == 0.
FLASH_MLA_AXES: dict[str, tuple] = dict(b=(1, 2, 6, 64), s_q=(1, 2, 4), s_k=(20, 140, 4096),
                                        h_q=(1, 3, 9, 63, 64, 126, 128), h_kv=(1, 2, 3, 8),
                                        varlen=(False, True), causal=(False, True))
# Page ids FlashMLA's tests put in block-table entries past a request's pages: far past any cache.
UNUSED_PAGE_ID = 2147480000
# FlashMLA's tolerances, elementwise: an element passes when |x - ref| < abs or |x - ref| / (|ref|
# + 1e-6) < rel; out also needs 1 - 2 sum(x ref) / sum(x^2 + ref^2) <= the cosine difference.
FLASH_MLA_OUT_ABS = 8e-4
FLASH_MLA_OUT_REL = 2.01 / 128
FLASH_MLA_OUT_COS_DIFF = 5e-6
FLASH_MLA_LSE_ABS = 1e-6
FLASH_MLA_LSE_REL = 8.01 / 65536


@dataclasses.dataclass(frozen=True)
class FlashMLAParams:
    """One case of FlashMLA's dense-decoding grid: b requests of s_q query tokens with s_k keys
    each (varlen: max(N(s_k, s_k / 2), s_q) per request; zero_lengths: about half of them 0),
    h_q query heads over h_kv KV heads, pages of 64; sink: with attention sinks."""

    b: int
    s_q: int
    s_k: int
    varlen: bool
    causal: bool
    h_q: int
    h_kv: int
    zero_lengths: bool = False
    sink: bool = False
    seed: int = 0

    @property
    def id(self) -> str:
        return (f"b{self.b}-sq{self.s_q}-sk{self.s_k}{'v' if self.varlen else ''}-hq{self.h_q}-hkv{self.h_kv}"
                f"{'-causal' if self.causal else ''}{'-zeros' if self.zero_lengths else ''}"
                f"{'-sink' if self.sink else ''}")


def grid_axes() -> dict[str, tuple]:
    """FLASH_MLA_AXES (a copy)."""
    return dict(FLASH_MLA_AXES)


def _head_pairs() -> list[tuple[int, int]]:
    return [(h, k) for h in FLASH_MLA_AXES["h_q"] for k in FLASH_MLA_AXES["h_kv"] if h % k == 0]


def _sample_grid(per_pair: int = 4) -> list[FlashMLAParams]:
    """A deterministic sample of FlashMLA's 2304 correctness cases: for each (H_q, H_kv) pair and
    causal flag, `per_pair` cases whose (b, s_q, s_k, varlen) step through those 72 combinations
    by a stride coprime to 72, so every value of every axis comes up many times."""
    rest = [(b, s_q, s_k, v) for b in FLASH_MLA_AXES["b"] for s_q in FLASH_MLA_AXES["s_q"]
            for s_k in FLASH_MLA_AXES["s_k"] for v in FLASH_MLA_AXES["varlen"]]
    cases, t = [], 0
    for h_q, h_kv in _head_pairs():
        for causal in FLASH_MLA_AXES["causal"]:
            for _ in range(per_pair):
                b, s_q, s_k, varlen = rest[(t * 29) % len(rest)]
                cases.append(FlashMLAParams(b, s_q, s_k, varlen, causal, h_q, h_kv, seed=t))
                t += 1
    return cases


# 128 cases of the grid, and FlashMLA's corner cases (b=128, s_q=2, 4096 keys varied per request,
# some requests empty) once per (H_q, H_kv) pair, causal for every other pair.
FLASH_MLA_GRID: list[FlashMLAParams] = _sample_grid()
FLASH_MLA_ZERO_LENGTH: list[FlashMLAParams] = [
    FlashMLAParams(128, 2, 4096, True, k % 2 == 1, h_q, h_kv, zero_lengths=True, seed=1000 + k)
    for k, (h_q, h_kv) in enumerate(_head_pairs())]
# Attention sinks on a few cases: one or several KV heads, s_q 1 and 4, empty requests.
FLASH_MLA_SINKS: list[FlashMLAParams] = [
    FlashMLAParams(2, 1, 140, False, False, 128, 1, sink=True, seed=2000),
    FlashMLAParams(6, 4, 4096, True, True, 64, 8, sink=True, seed=2001),
    FlashMLAParams(64, 2, 20, True, True, 9, 3, sink=True, seed=2002),
    FlashMLAParams(128, 2, 4096, True, False, 126, 2, zero_lengths=True, sink=True, seed=2003),
]


@dataclasses.dataclass
class FlashMLACase:
    """A case's inputs in FlashMLA's layouts: q [b, s_q, h_q, 576], k_cache [pages, 64, h_kv, 576]
    (NaN in every row past a request's length and in the unused pages), block_table [b,
    max_pages] int32 (UNUSED_PAGE_ID past each request's pages), cache_seqlens [b] int32, and
    attn_sink [h_q] fp32 or None."""

    q: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    attn_sink: torch.Tensor | None
    causal: bool


def _lengths(p: FlashMLAParams, gen: torch.Generator) -> list[int]:
    if p.varlen:
        draws = torch.normal(float(p.s_k), p.s_k / 2, (p.b,), generator=gen).tolist()
        lengths = [max(int(x), p.s_q) for x in draws]
    else:
        lengths = [p.s_k] * p.b
    if p.zero_lengths:
        empty = (torch.randn(p.b, generator=gen) > 0).tolist()
        empty[0], empty[-1] = True, False                     # at least one of each
        lengths = [0 if e else n for n, e in zip(lengths, empty, strict=True)]
    return lengths


def table_width(lengths: list[int], page_size: int = 64) -> int:
    """Block-table columns of a case: its longest request rounded up to 256 keys (at least one)."""
    return max(1, -(-max(lengths) // 256) * 256 // page_size)


def flash_mla_shape(p: FlashMLAParams, page_size: int = 64) -> tuple[list[int], int]:
    """(lengths, block-table columns) of case `p`, as `flash_mla_case` draws them."""
    lengths = _lengths(p, torch.Generator().manual_seed(p.seed))
    return lengths, table_width(lengths, page_size)


def flash_mla_case(p: FlashMLAParams, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                   page_size: int = 64, spare_pages: int = 2) -> FlashMLACase:
    """The inputs of case `p`, as FlashMLA's test draws them: q and keys N(0, 1) / 10 clamped
    to [-1, 1]; each request's pages shuffled over the cache, which holds exactly the pages in
    use and `spare_pages` more (all NaN); the block table as wide as the longest request rounded
    up to 256 keys. Sinks: N(0, 1) around 3 (near the rows' lse, so the factor is far from 0 and
    1), a third of them +inf and a third -inf. Layout from a CPU generator, values from one on
    the device, both seeded with p.seed."""
    gen = torch.Generator().manual_seed(p.seed)
    values = torch.Generator(device=device).manual_seed(p.seed + (1 << 32))
    lengths = _lengths(p, gen)
    need = [-(-n // page_size) for n in lengths]
    used = sum(need)
    width = table_width(lengths, page_size)
    order = torch.randperm(used + spare_pages, generator=gen)
    table = torch.full((p.b, width), UNUSED_PAGE_ID, dtype=torch.int32)
    filled = torch.zeros(used + spare_pages, dtype=torch.long)        # valid rows per page
    start = 0
    for b, (n, k) in enumerate(zip(lengths, need, strict=True)):
        pages = order[start:start + k]
        table[b, :k] = pages.to(torch.int32)
        filled[pages] = (n - torch.arange(k) * page_size).clamp(max=page_size)
        start += k
    D = 576
    k_cache = torch.randn(used + spare_pages, page_size, p.h_kv, D, generator=values, device=device)
    k_cache = (k_cache / 10).clamp_(-1, 1).to(dtype)
    slot = torch.arange(page_size, device=device)
    k_cache.masked_fill_((slot[None, :] >= filled.to(device)[:, None])[:, :, None, None], math.nan)
    q = (torch.randn(p.b, p.s_q, p.h_q, D, generator=values, device=device) / 10).clamp_(-1, 1).to(dtype)
    sink = None
    if p.sink:
        sink = torch.randn(p.h_q, generator=gen) + 3.0
        pick = torch.rand(p.h_q, generator=gen)
        sink[pick < 1 / 3] = math.inf
        sink[pick > 2 / 3] = -math.inf
        sink = sink.to(device)
    return FlashMLACase(q=q, k_cache=k_cache, block_table=table.to(device),
                        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
                        attn_sink=sink, causal=p.causal)


def flash_mla_reference(case: FlashMLACase, softmax_scale: float | None = None,
                        head_dim_v: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 reference (`mlagen.reference`) of a FlashMLA case, one call per KV head g on its
    query heads g*G .. g*G+G-1 (G = H_q / H_kv), then the sink: out [b, s_q, h_q, Dv] and lse
    [b, h_q, s_q], fp64, lse -inf for a row that sees no key (mlagen's convention). The sink
    factor is FlashMLA's definition exp(lse) / (exp(lse) + exp(sink)), written out in fp64."""
    q, kv = case.q, case.k_cache
    H, H_kv = q.shape[2], kv.shape[2]
    G = H // H_kv
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    parts = [reference(q[:, :, g * G:(g + 1) * G], kv[:, :, g], case.block_table, case.cache_seqlens,
                       softmax_scale=scale, causal=case.causal, head_dim_v=head_dim_v, dtype=torch.float64)
             for g in range(H_kv)]
    out = torch.cat([o for o, _ in parts], dim=2)
    lse = torch.cat([s for _, s in parts], dim=1)
    if case.attn_sink is not None:
        e = lse.exp()
        factor = e / (e + case.attn_sink.double()[:, None].exp())              # [b, h_q, s_q]
        factor = torch.where(torch.isneginf(lse), 0.0, factor)                  # a row with no key stays 0
        out = out * factor.transpose(1, 2)[..., None]
    return out, lse


def _elementwise(name: str, x: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float) -> str | None:
    """FlashMLA's elementwise rule on finite entries (fp64): what fails, or None."""
    err = (x - ref).abs()
    ok = (err < abs_tol) | (err / (ref.abs() + 1e-6) < rel_tol)
    bad = int((~ok).sum())
    if not bad:
        return None
    rel = torch.where(ok, 0.0, err / (ref.abs() + 1e-6))
    w = int(rel.flatten().argmax())
    where = list(torch.unravel_index(torch.tensor(w), x.shape))
    return (f"{name}: {bad} of {x.numel()} elements fail |x - ref| < {abs_tol:g} or rel < {rel_tol:.4g}; worst at "
            f"{[int(c) for c in where]}: {float(x.flatten()[w]):.7g} vs {float(ref.flatten()[w]):.7g}")


def flash_mla_mismatch(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                       ref_lse: torch.Tensor) -> str | None:
    """FlashMLA's own checks of (out, lse) from `flash_mla_with_kvcache` against the fp64
    reference (ref_lse -inf for a row with no key): lse +inf exactly at those rows and no NaN or
    other infinity anywhere; out 0 there; elsewhere every element within FlashMLA's tolerances
    (FLASH_MLA_OUT_* and FLASH_MLA_LSE_*) and out's cosine difference at most
    FLASH_MLA_OUT_COS_DIFF. Returns what fails, or None."""
    problems = []
    x, ref = out.double(), ref_out.double()
    got, want = lse.double(), ref_lse.double()
    empty = torch.isneginf(want)
    if not torch.equal(torch.isposinf(got), empty) or torch.isneginf(got).any() or got.isnan().any():
        problems.append(f"lse: +inf at {int(torch.isposinf(got).sum())} entries, expected exactly the "
                        f"{int(empty.sum())} of rows with no key; -inf at {int(torch.isneginf(got).sum())}, "
                        f"NaN at {int(got.isnan().sum())}")
    if not torch.isfinite(x).all():
        problems.append(f"out: {int((~torch.isfinite(x)).sum())} elements not finite")
    rows_empty = empty.transpose(1, 2)                                          # [b, s_q, h_q]
    if (x[rows_empty] != 0).any():
        problems.append("out: a row with no key is not 0")
    if problems:
        return "; ".join(problems)
    full = ~empty
    problems += [p for p in (_elementwise("out", x, ref, FLASH_MLA_OUT_ABS, FLASH_MLA_OUT_REL),
                             _elementwise("lse", got[full], want[full], FLASH_MLA_LSE_ABS, FLASH_MLA_LSE_REL))
                 if p is not None]
    if float(ref.square().sum()) >= 1e-12:
        cos_diff = 1 - 2 * float((x * ref).sum()) / float((x.square() + ref.square()).sum())
        if abs(cos_diff) > FLASH_MLA_OUT_COS_DIFF:
            problems.append(f"out: cosine difference {cos_diff:.3g}, tolerance {FLASH_MLA_OUT_COS_DIFF:g}")
    return "; ".join(problems) or None
