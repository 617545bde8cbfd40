"""Paged cases for checking kernels against the reference, and the comparison itself.

The tests, `benchmarks/` and `mlagen fuzz` share these. A case fills every place no kernel may
read (unused pages, keys past a request's length, block-table entries past its pages) with NaN,
so a stray read shows up in the output; `poisoned_out` and `poison_allocator` do the same for
what a kernel must write.

The comparison (`mismatch`, `assert_matches`; `compare_rows` for outputs in other layouts) checks
every output row (b, i, h) and every lse entry on its own against the fp64 reference, so one wrong
row among thousands fails; `tolerance` says how far each may be off, and why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..runtime.inputs import output_dtype
from ..runtime.kv_formats import quantize_kv, quantize_q
from ..runtime.reference import reference
from ..runtime.sparse_reference import sparse_reference


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
    kv_scale: torch.Tensor | None = None   # an e4m3 cache's scale ([1] fp32 on the device), else None
    q_scale: torch.Tensor | None = None    # e4m3 queries' scale ([1] fp32 on the device), else None

    def kwargs(self) -> dict:
        """softmax_scale, causal, tree_mask and head_dim_v, as the op takes them, and kv_scale
        for an e4m3 cache, q_scale for e4m3 queries."""
        kw = dict(softmax_scale=self.scale, causal=self.causal, tree_mask=self.tree_mask, head_dim_v=self.dl)
        scales = {"kv_scale": self.kv_scale, "q_scale": self.q_scale}
        return kw | {k: v for k, v in scales.items() if v is not None}

    def reference(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, S, H, Dl] and lse [B, H, S] from `mlagen.reference`, computed in `dtype` on the
        case's device."""
        return reference(self.q, self.kv_cache, self.block_table, self.cache_seqlens,
                         dtype=dtype, **self.kwargs())


def random_tree(seqlen_q: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft tree as a bool [S, S] ancestor mask (each token sees itself and its
    ancestors; token k's parent is drawn uniformly from 0..k-1). gen: a CPU generator."""
    draws = torch.rand(seqlen_q, generator=gen).tolist()
    seen: list[int] = []                       # row k as a bit set of the tokens it sees
    for k, u in enumerate(draws):
        seen.append((1 << k) | (seen[int(u * k)] if k else 0))
    return torch.tensor([[bool(row >> j & 1) for j in range(seqlen_q)] for row in seen], dtype=torch.bool)


# Draft-tree shapes `tree_of_shape` draws: EAGLE's random trees, a chain (the causal mask), a star
# (every token a child of token 0), a full binary tree (deep and bushy), and "blind" (a random
# tree whose rows, some of them, see no draft token at all, not even their own).
TREE_SHAPES = ("random", "chain", "star", "binary", "blind")


def tree_of_shape(shape: str, seqlen_q: int, gen: torch.Generator) -> torch.Tensor:
    """A bool [S, S] draft-tree mask of one of `TREE_SHAPES`; row i: the draft tokens query i
    sees. gen: a CPU generator (random and blind shapes)."""
    if shape == "random":
        return random_tree(seqlen_q, gen)
    if shape == "blind":
        tree = random_tree(seqlen_q, gen)
        blind = torch.rand(seqlen_q, generator=gen) < 0.5
        return tree & ~blind[:, None]
    parent = {"chain": lambda k: k - 1, "star": lambda k: 0, "binary": lambda k: (k - 1) // 2}.get(shape)
    if parent is None:
        raise ValueError(f"tree shape: got {shape!r}, expected one of {', '.join(TREE_SHAPES)}")
    tree = torch.eye(seqlen_q, dtype=torch.bool)
    for k in range(1, seqlen_q):
        tree[k] |= tree[parent(k)]
    return tree


def _softmax_scale(head_dim: int, gen: torch.Generator) -> float:
    """1/sqrt(head_dim) times a random factor in [0.5, 2] (one draw of `gen`)."""
    return (1.0 / math.sqrt(head_dim)) * float(torch.empty(1).uniform_(0.5, 2.0, generator=gen))


def _in_formats(q: torch.Tensor, kv: torch.Tensor, q_format: str, kv_format: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q, kv, q_scale, kv_scale): q and the cache in their formats (`quantize_q`,
    `quantize_kv`), each scale None where its input stays 16-bit (ds_mla's scales are in its rows)."""
    q_scale = kv_scale = None
    if kv_format != "dtype":
        kv, kv_scale = quantize_kv(kv, kv_format)
    if q_format == "e4m3":
        q, q_scale = quantize_q(q)
    return q, kv, q_scale, kv_scale


def make_case(*, batch: int, seqlen_q: int, heads: int, prefixes: list[int], page_size: int,
              mask: str, seed: int, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
              dl: int = 512, dr: int = 64, empty: list[bool] | None = None,
              spare_pages: int = 3, per_request_tree: bool = False, table_pages: int = 0,
              tree_shape: str = "random", kv_format: str = "dtype", q_format: str = "dtype") -> Case:
    """A paged case: request b holds prefixes[b] + S keys (0 where empty[b]) on shuffled pages.

    q is [B, S, H, dl+dr] and the cache [pages, page_size, dl+dr], both standard normal in `dtype`
    on `device`, drawn there by a generator seeded with `seed`; the layout (page order, trees,
    scale) comes from a CPU generator seeded with `seed`. The same seed and device give the same
    case. mask: "causal", "tree" (one draft tree of `tree_shape`, or one per request with
    per_request_tree) or "none". The softmax scale is 1/sqrt(dl+dr) times a random factor in
    [0.5, 2]. NaN fills the unused pages (spare_pages of them), each request's keys past its
    length, and the block table's entries past a request's pages (they point at unused pages).
    The block table is table_pages wide, or one page wider than the longest request needs if that
    is more (an engine's table is sized for its longest context). Built with a few tensor ops on
    the device: no per-key or per-page work on the host. kv_format "e4m3" or "ds_mla": the cache
    is then `quantize_kv`'s (NaN stays NaN), with kv_scale for e4m3 (dl + dr = 576). q_format
    "e4m3": q is `quantize_q`'s, float8_e4m3fn with q_scale = amax / 448.
    """
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed + (1 << 32))   # not gen's stream
    D = dl + dr
    lengths = [0 if (empty and empty[b]) else prefixes[b] + seqlen_q for b in range(batch)]
    pages_needed = [-(-n // page_size) for n in lengths]
    max_pages = max(1, max(pages_needed) + 1, table_pages)   # a spare column: must never be read
    used = sum(pages_needed)
    order = torch.randperm(used + spare_pages, generator=gen)
    mine, nan_pages = order[:used], order[used:]
    # Valid rows of each page: request b's k-th page holds min(page_size, n_b - k * page_size).
    need = torch.tensor(pages_needed)
    first = torch.cumsum(need, 0) - need
    k = torch.arange(used) - first.repeat_interleave(need)
    filled = torch.zeros(used + spare_pages, dtype=torch.long)
    filled[mine] = (torch.tensor(lengths).repeat_interleave(need) - k * page_size).clamp(max=page_size)
    kv = torch.randn(used + spare_pages, page_size, D, generator=values, device=device, dtype=dtype)
    slot = torch.arange(page_size, device=device)
    kv.masked_fill_((slot[None, :] >= filled.to(device)[:, None])[..., None], math.nan)
    # Every table entry a NaN page, then each request's own pages in front.
    table = nan_pages.to(device)[torch.randint(0, len(nan_pages), (batch, max_pages), generator=values,
                                               device=device)].to(torch.int32)
    widest = max(pages_needed)
    if widest:
        own = torch.zeros(batch, widest, dtype=torch.int32)
        for b in range(batch):
            own[b, : pages_needed[b]] = mine[first[b]: first[b] + pages_needed[b]].to(torch.int32)
        col = torch.arange(widest, device=device)
        table[:, :widest] = torch.where(col[None, :] < need.to(device)[:, None], own.to(device), table[:, :widest])
    q = torch.randn(batch, seqlen_q, heads, D, generator=values, device=device, dtype=dtype)
    tree = None
    if mask == "tree":
        if per_request_tree:
            tree = torch.stack([tree_of_shape(tree_shape, seqlen_q, gen) for _ in range(batch)])
        else:
            tree = tree_of_shape(tree_shape, seqlen_q, gen)
        tree = tree.to(device)
    scale = _softmax_scale(D, gen)
    q, kv, q_scale, kv_scale = _in_formats(q, kv, q_format, kv_format)
    return Case(q=q, kv_cache=kv, block_table=table,
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
                tree_mask=tree, causal=(mask == "causal"), scale=scale, dl=dl, kv_scale=kv_scale, q_scale=q_scale)


@dataclass
class SparseCase:
    """One sparse verify problem (gathered keys) with its inputs; `kwargs()` gives the op's
    keyword arguments and `reference()` the expected out [B, S, H, Dl] and lse [B, H, S]."""

    q: torch.Tensor                  # [B, S, H, D]
    kv_cache: torch.Tensor           # [num_pages, page, D]; pages no used slot lists: NaN
    indices: torch.Tensor            # [B, S, topk] int32: flat row ids, -1 unused; past a length: NaN rows
    topk_length: torch.Tensor | None  # [B] int32, or None: every slot used
    scale: float
    dl: int
    kv_scale: torch.Tensor | None = None
    q_scale: torch.Tensor | None = None

    def kwargs(self) -> dict:
        """indices, topk_length, softmax_scale, causal=False and head_dim_v, as the op takes them,
        and kv_scale for an e4m3 cache, q_scale for e4m3 queries."""
        kw = dict(indices=self.indices, topk_length=self.topk_length, softmax_scale=self.scale, causal=False,
                  head_dim_v=self.dl)
        scales = {"kv_scale": self.kv_scale, "q_scale": self.q_scale}
        return kw | {k: v for k, v in scales.items() if v is not None}

    def reference(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """out [B, S, H, Dl] and lse [B, H, S] from `mlagen.sparse_reference`, in `dtype`."""
        return sparse_reference(self.q, self.kv_cache, self.indices, self.topk_length, softmax_scale=self.scale,
                                head_dim_v=self.dl, dtype=dtype, kv_scale=self.kv_scale, q_scale=self.q_scale)


def make_sparse_case(*, batch: int, seqlen_q: int, heads: int, topk: int, pages: int, page_size: int, seed: int,
                     lengths: list[int] | None = None, unused: float = 0.25, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", dl: int = 512, dr: int = 64, spare_pages: int = 3,
                     kv_format: str = "dtype", q_format: str = "dtype") -> SparseCase:
    """A sparse case: each query token lists `topk` random rows of the cache's `pages` pages.

    The cache holds those pages and `spare_pages` more filled with NaN, shuffled. Each slot
    lists a random row of the filled pages (rows listed twice happen, as an indexer's duplicates
    would), a share `unused` of them -1; the slots past request b's lengths[b] (default topk:
    topk_length None) list rows of the NaN pages, so a slot read past its length shows. q and
    the rows are standard normal in `dtype` on `device`; the softmax scale is 1/sqrt(dl+dr) times
    a random factor in [0.5, 2]. kv_format and q_format as for `make_case`.
    """
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=device).manual_seed(seed + (1 << 32))
    D = dl + dr
    order = torch.randperm(pages + spare_pages, generator=gen)
    filled, nan_pages = order[:pages], order[pages:]
    kv = torch.randn(pages + spare_pages, page_size, D, generator=values, device=device, dtype=dtype)
    kv[nan_pages.to(device)] = math.nan
    shape = (batch, seqlen_q, topk)
    offset = torch.randint(0, page_size, shape, generator=gen)
    indices = filled[torch.randint(0, pages, shape, generator=gen)] * page_size + offset
    indices[torch.rand(shape, generator=gen) < unused] = -1
    topk_length = None
    if lengths is not None:
        past = torch.arange(topk)[None, None, :] >= torch.tensor(lengths)[:, None, None]
        if spare_pages:
            stray = nan_pages[torch.randint(0, spare_pages, shape, generator=gen)] * page_size + offset
            indices = torch.where(past, stray, indices)
        topk_length = torch.tensor(lengths, dtype=torch.int32, device=device)
    q = torch.randn(batch, seqlen_q, heads, D, generator=values, device=device, dtype=dtype)
    scale = _softmax_scale(D, gen)
    q, kv, q_scale, kv_scale = _in_formats(q, kv, q_format, kv_format)
    return SparseCase(q=q, kv_cache=kv, indices=indices.to(torch.int32).to(device), topk_length=topk_length,
                      scale=scale, dl=dl, kv_scale=kv_scale, q_scale=q_scale)


# A case of either kind: paged keys (`make_case`) or gathered keys (`make_sparse_case`).
AnyCase = Case | SparseCase


def reference_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None = None,
                 cache_seqlens: torch.Tensor | None = None, *, return_lse: bool = False, variant: object = None,
                 check_values: object = None, max_seqlen_k: object = None, batch_invariant: object = None,
                 attn_sink: None = None, q_counts: object = None, indices: torch.Tensor | None = None,
                 topk_length: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`verify_attention` with the fp64 reference as its kernel, for tests that stand it in for
    the op on the CPU (monkeypatched where a caller imports the op): out in the op's output
    dtype, lse fp32; with indices, the sparse reference (causal False). The arguments that choose
    or check a kernel (variant, check_values, max_seqlen_k, batch_invariant) change nothing here,
    nor does q_counts (the reference computes the padded rows too, whose outputs the op leaves
    unspecified); sinks are the op's, not modelled. A given `out` is written and returned, as the
    op does."""
    if attn_sink is not None:
        raise ValueError("reference_op: attn_sink is not modelled; expected None")
    if indices is not None:
        if kwargs.pop("causal", False):
            raise ValueError("reference_op: causal=True with indices; expected False")
        if kwargs.pop("tree_mask", None) is not None:
            raise ValueError("reference_op: a tree_mask with indices; expected None")
        result, lse = sparse_reference(q, kv_cache, indices, topk_length, dtype=torch.float64, **kwargs)
    else:
        if block_table is None or cache_seqlens is None:
            raise ValueError(f"reference_op: paged keys need block_table and cache_seqlens; got "
                             f"{'block_table' if block_table is None else 'cache_seqlens'} None")
        result, lse = reference(q, kv_cache, block_table, cache_seqlens, dtype=torch.float64, **kwargs)
    result = result.to(output_dtype(q.dtype, kv_cache.dtype))
    if out is not None:
        result = out.copy_(result)
    return (result, lse.float()) if return_lse else result


def poisoned_out(case: AnyCase) -> torch.Tensor:
    """An `out=` tensor for the case, [B, S, H, Dl] in the op's output dtype (q's; with e4m3
    queries the cache's 16-bit dtype or bf16), all NaN: any element a kernel does not write
    stays NaN."""
    B, S, H, _ = case.q.shape
    return torch.full((B, S, H, case.dl), math.nan, dtype=output_dtype(case.q.dtype, case.kv_cache.dtype),
                      device=case.q.device)


def poison_allocator(nbytes: int, device: str = "cuda") -> None:
    """Leave NaN-filled blocks in torch's caching allocator so that workspaces the op allocates
    next start as NaN rather than zeros: a kernel that reads what it never wrote shows up."""
    blocks = [torch.full((nbytes // 4 + 1,), math.nan, device=device) for _ in range(2)]
    del blocks


# Rows whose reference RMS is below this fraction of the case's typical row RMS (over all rows
# that see a key) are measured against that floor instead: a relative error needs a denominator.
ROW_FLOOR = 1e-3


@dataclass(frozen=True)
class Tolerance:
    """How far a kernel's output may be from the fp64 reference, per row and per lse entry.

    row_rel: ||x - ref|| / ||ref|| over one output row (its Dl values), at most this.
    row_max: max |x - ref| over one row, at most this many times the row's RMS ||ref|| / sqrt(Dl).
    (Both denominators are floored at ROW_FLOOR times the case's typical row RMS.)
    lse_abs, lse_rel: |lse - ref| <= lse_abs + lse_rel * |ref| for every lse entry whose row sees
    a key; a row that sees none must have lse -inf and out exactly 0.
    """

    row_rel: float
    row_max: float
    lse_abs: float
    lse_rel: float


def tolerance(*dtypes: torch.dtype) -> Tolerance:
    """The tolerance for a kernel whose inputs and output are in `dtypes` (the coarsest one
    counts), from its machine epsilon eps (bf16 2^-7, fp16 2^-10; unit roundoff u = eps / 2):

    - row_rel = 2 eps (bf16 1.6e-2, fp16 2.0e-3). The kernels round the output to 16 bits (an
      element's relative error <= u), multiply V by P in 16 bits (each weight off by <= u
      relative: over a row about u / sqrt(3) times its norm), and with 16-bit partials (part16)
      round each split's row once more (<= u). A row's relative error is about u / 2 for each of
      these (the global error of a bf16 kernel measured about 1.9e-3), at most 3 u = 1.5 eps
      with every rounding of the row leaning the same way; 2 eps leaves room over that worst
      case and 4x over the typical row. The fp64 reference adds nothing: it reads the same
      16-bit inputs. A row scaled by 1.05 (a 5e-2 error) fails in either dtype.
    - row_max = 8 eps (bf16 6.3e-2, fp16 7.8e-3) times the row's RMS. The output rounding of an
      element is <= u |ref| and the row's largest elements reach about 5x its RMS over millions
      of rows; the 16-bit P adds a roughly normal error of about u / sqrt(3) RMS (6 sigma: 3.5 u);
      part16 once more up to 5 u: 13.5 u ~ 6.8 eps at worst. FlashMLA's elementwise 8e-4 + 2^-6
      |ref| is about as tight on the long rows its tests run (RMS ~1e-2: ours allows 6e-4) and
      would flag correct rows of a few keys, whose elements cancel (ref ~ 0) while the P
      rounding error stays at u times the values.
    - lse_abs = eps / 4 (bf16 2.0e-3, fp16 2.4e-4), lse_rel = 2^-13 (1.2e-4, FlashMLA's 8/65536).
      The kernels keep the softmax in fp32 (exp2/log2 approximations good to ~2^-22, the row
      sum l over up to 1e5 keys), but a row sum of 16-bit rounded weights is off by up to u / 2
      relative (two keys of nearly equal weight), which moves lse by up to u / 2 = eps / 4;
      lse_rel covers fp32 rounding of large logits (|lse| ~ 100: 1e-2).
    """
    eps = max(torch.finfo(d).eps for d in dtypes)
    return Tolerance(row_rel=2 * eps, row_max=8 * eps, lse_abs=eps / 4, lse_rel=2.0**-13)


# How far a result with e4m3 queries (q / q_scale rounded to float8_e4m3fn, q_scale = amax / 448)
# may be from the fp64 reference of the 16-bit queries they were quantized from: the queries'
# rounding (3 mantissa bits) moves every score. Measured over 400 fuzz-space shapes (standard
# normal queries, softmax scale 0.5-2 x 1/sqrt(576), every mask and cache format, up to 3000 keys,
# 1.2 million rows): the worst row was 0.150 off relative (median 0.024), its largest element
# 0.49 x the row's RMS, an lse 0.20 off. Each bound is about 1.5x the worst measured.
E4M3_QUERY_TOLERANCE = Tolerance(row_rel=0.25, row_max=0.75, lse_abs=0.3, lse_rel=0.0)

# How far the fp8_mma schedule (both products on e4m3 wgmma) may be from the fp64 reference of
# the same e4m3 queries and cache (dequantized). P goes to e4m3 for P·V (3 mantissa bits: each
# weight off by up to 2^-4 relative), which moves every output row, and the e4m3 tensor cores
# sum the scores' products with fewer bits than fp32, which moves the lse. Measured on an H100
# over 36 cases (64 heads, S 1/4/9, every mask, up to 3500 keys, 27,648 rows): the worst row
# 0.037 off relative (the bf16 path on the same inputs: 0.0019), its largest element 0.13 x the
# row's RMS, cosine at least 0.9994, an lse 0.0065 off. Each bound is about 1.5x the worst.
FP8_PRODUCTS_TOLERANCE = Tolerance(row_rel=0.06, row_max=0.2, lse_abs=0.01, lse_rel=0.0)


def _row_errors(x: torch.Tensor, ref: torch.Tensor,
                empty: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of x and ref [..., Dl] (fp64, one device): (relative error [...], max abs error
    [...], floored RMS of ref [...]). empty: bool [...], rows left out of the typical RMS."""
    dl = ref.shape[-1]
    diff = x - ref
    ref_sq = ref.square().sum(-1)                                         # [...]
    full = ~empty if empty is not None else torch.ones_like(ref_sq, dtype=torch.bool)
    typical = (ref_sq.sum() / (full.sum() * dl).clamp(min=1)).sqrt()
    rms = torch.maximum((ref_sq / dl).sqrt(), ROW_FLOOR * typical).clamp(min=torch.finfo(torch.float64).tiny)
    return diff.norm(dim=-1) / (rms * math.sqrt(dl)), diff.abs().amax(-1), rms


def _where(flat: int, shape: Sequence[int], dims: Sequence[str]) -> str:
    """'b=1, i=0, h=3' for a flat row index into `shape`."""
    names = list(dims) if len(dims) == len(shape) else [f"d{k}" for k in range(len(shape))]
    coords = []
    for size in reversed(shape):
        flat, c = divmod(flat, size)
        coords.append(c)
    return ", ".join(f"{n}={c}" for n, c in zip(names, reversed(coords), strict=True))


def compare_rows(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                 tol: Tolerance | None = None, dims: Sequence[str] = ("b", "i", "h")) -> str | None:
    """What is wrong with out [..., Dl] and lse [...] against the reference ref_out [..., Dl] and
    ref_lse [...] (fp64, computed from the same inputs), or None. lse's entries are laid out like
    out's rows (transpose an op's [B, H, S] lse to [B, S, H] first); lse None: not checked.

    Every row on its own: finite (a NaN is a row unwritten or NaN); where ref_lse is -inf (the
    row sees no key) exactly 0; otherwise its relative error and its max abs error within `tol`
    (None: `tolerance` of out's dtype). lse: fp32, -inf exactly where ref_lse is, no NaN, each
    entry within tol.lse_abs + tol.lse_rel * |ref|. The message names how many rows (entries)
    fail and the worst one by its index, in `dims` (b, i, h: request, draft position, head), with
    its errors and the tolerance. Runs on the reference's device with one host sync.
    """
    if tuple(out.shape) != tuple(ref_out.shape):
        return f"out: got shape {tuple(out.shape)}, expected {tuple(ref_out.shape)}"
    if tuple(ref_lse.shape) != tuple(ref_out.shape[:-1]):
        raise ValueError(f"ref_lse: shape {tuple(ref_lse.shape)}, expected out's rows {tuple(ref_out.shape[:-1])}")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != tuple(ref_lse.shape)):
        return f"lse: got {lse.dtype} {tuple(lse.shape)}, expected torch.float32 {tuple(ref_lse.shape)}"
    tol = tol or tolerance(out.dtype)
    device = ref_out.device
    ref = ref_out.to(torch.float64)
    x = out.to(device=device, dtype=torch.float64)
    ref_lse = ref_lse.to(torch.float64)
    empty = torch.isneginf(ref_lse)
    rel, max_abs, rms = _row_errors(x, ref, empty)
    nan = torch.isnan(x).any(-1)
    nonzero = empty & (x != 0).any(-1)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=device)
    score = torch.maximum(rel / tol.row_rel, max_abs / rms / tol.row_max)     # tolerances off
    score = torch.where(nan | nonzero, inf, torch.where(empty, 0.0, score)).flatten()
    worst = score.argmax()
    stats = [(score > 1).sum(), worst, nan.flatten()[worst], nonzero.flatten()[worst], rel.flatten()[worst],
             max_abs.flatten()[worst], rms.flatten()[worst]]
    if lse is not None:
        got = lse.to(device=device, dtype=torch.float64)
        bound = tol.lse_abs + tol.lse_rel * ref_lse.abs()
        lscore = (got - ref_lse).abs() / bound
        lscore = torch.where(empty, torch.where(torch.isneginf(got), 0.0, inf), lscore)
        lscore = torch.where(torch.isnan(got), inf, lscore).flatten()
        lworst = lscore.argmax()
        stats += [(lscore > 1).sum(), lworst, got.flatten()[lworst], ref_lse.flatten()[lworst], bound.flatten()[lworst]]
    stats = torch.stack([s.to(torch.float64) for s in stats]).tolist()        # the one host sync
    rows = ref.shape[:-1]
    problems = []
    bad, w, was_nan, was_nonzero, w_rel, w_abs, w_rms = stats[:7]
    if bad:
        at = _where(int(w), rows, dims)
        if was_nan:
            what = "unwritten or NaN"
        elif was_nonzero:
            what = f"sees no key, so must be exactly 0; max |out| {w_abs:.3g}"
        else:
            what = (f"relative error {w_rel:.3g} (tolerance {tol.row_rel:.3g}), max abs error {w_abs:.3g} = "
                    f"{w_abs / w_rms:.3g} x the row's rms {w_rms:.3g} (tolerance {tol.row_max:.3g} x rms)")
        problems.append(f"out: {int(bad)} of {math.prod(rows)} rows fail; worst ({at}): {what}")
    if lse is not None:
        bad, w, got_w, ref_w, bound_w = stats[7:]
        if bad:
            what = f"got {got_w:.7g}, expected {ref_w:.7g}"
            if math.isinf(ref_w):
                what += ": the row sees no key"
            elif not math.isnan(got_w):
                what += (f" (off by {abs(got_w - ref_w):.3g}, tolerance {tol.lse_abs:.3g} + {tol.lse_rel:.3g} |lse| = "
                         f"{bound_w:.3g})")
            problems.append(f"lse: {int(bad)} of {math.prod(rows)} entries fail; worst ({_where(int(w), rows, dims)}): "
                            f"{what}")
    return "; ".join(problems) or None


def assert_rows_match(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                      tol: Tolerance | None = None, dims: Sequence[str] = ("b", "i", "h")) -> None:
    """`compare_rows` as an assertion."""
    problem = compare_rows(out, lse, ref_out, ref_lse, tol, dims)
    assert problem is None, problem


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's relative error: max over rows (all dims but the last) of ||x - ref|| /
    ||ref||, with the denominator floored at ROW_FLOOR times the typical row's, in fp64."""
    x, ref = x.double(), ref.double().to(x.device)
    rel, _, _ = _row_errors(x, ref)
    return float(rel.max()) if rel.numel() else 0.0


def mismatch(out: torch.Tensor, lse: torch.Tensor | None, case: AnyCase, tol: Tolerance | None = None,
             expected: tuple[torch.Tensor, torch.Tensor] | None = None) -> str | None:
    """What is wrong with out [B, S, H, Dl] (and lse [B, H, S] fp32, if not None) against the fp64
    reference, or None: `compare_rows` on every row (b, i, h). tol: None for `tolerance` of out's
    and the inputs' dtypes; expected: the case's fp64 reference (out, lse) if already computed."""
    ref_out, ref_lse = expected if expected is not None else case.reference(torch.float64)
    if lse is not None:
        if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(ref_lse.shape):
            return f"lse: got {lse.dtype} {tuple(lse.shape)}, expected torch.float32 {tuple(ref_lse.shape)}"
        lse = lse.transpose(1, 2)
    return compare_rows(out, lse, ref_out, ref_lse.transpose(1, 2), tol or tolerance(out.dtype, case.q.dtype))


def assert_matches(out: torch.Tensor, lse: torch.Tensor | None, case: Case, tol: Tolerance | None = None) -> None:
    """`mismatch` as an assertion."""
    problem = mismatch(out, lse, case, tol)
    assert problem is None, problem


@contextmanager
def pinned_balanced_ranges(ranges: int) -> Iterator[None]:
    """Within it, balanced-split launches get `ranges` ranges (their num_splits) instead of one per
    resident slot, so a check picks the work list's layout (templates/split_work_list.cuh.j2: aligned or
    packed) on any GPU. The runtime's memoized launch plans are dropped on entry and exit."""
    from ..runtime import op

    planned = op.num_splits

    def splits(variant, *args) -> int:
        return ranges if variant.kv_split == "balanced" else planned(variant, *args)

    op._prepare.cache_clear()
    op.num_splits = splits
    try:
        yield
    finally:
        op.num_splits = planned
        op._prepare.cache_clear()
