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

Both take FP8 inputs too (`kv_formats`): a float8_e4m3fn cache with its kv_scale, a uint8 cache
of DeepSeek's 656-byte rows, and float8_e4m3fn queries with a q_scale. They are dequantized
exactly as `kv_formats.dequantize_kv` specifies (stored value x scale, in fp32) and the rest is
computed as for any cache. `reference` dequantizes only the rows it gathers, so bytes elsewhere
(unused pages, rows past a length, those rows' ds_mla scales) are never decoded.
"""

from __future__ import annotations

import math

import torch

from .inputs import InputError, fail, tensor_arg
from .kv_formats import QUANTIZED_DTYPES, check_scale, dequantize_e4m3, dequantize_kv, kv_format_of


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


def fp8_layout(kv_cache: torch.Tensor, kv_scale: float | torch.Tensor | None) -> str | None:
    """"e4m3" or "ds_mla" for an FP8 cache (checked with its kv_scale by
    `kv_formats.kv_format_of`), None for any other cache, which takes no kv_scale. Raises
    InputError."""
    if kv_cache.dtype in QUANTIZED_DTYPES or kv_scale is not None:
        return kv_format_of(kv_cache, kv_scale).name
    return None


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int,
              kv_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """The first n KV rows of request b, [n, Dl+Dr]: in the cache's dtype, or for an FP8 cache
    (float8_e4m3fn with kv_scale, or uint8 656-byte ds_mla rows) dequantized to fp32 [n, 576].
    Only the request's first ceil(n / page_size) pages are read, and rows past n on its last
    page are dropped before any dequantizing."""
    layout = fp8_layout(kv_cache, kv_scale)
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1])
    page_size = kv.shape[1]
    pages = block_table[b, : -(-n // page_size)].long()
    rows = kv[pages].reshape(-1, kv.shape[-1])[:n]
    return rows if layout is None else dequantize_kv(rows[None], layout, kv_scale)[0]


def dequantized_queries(q: torch.Tensor, q_scale: float | torch.Tensor | None) -> torch.Tensor:
    """q as it is, or float8_e4m3fn q dequantized with q_scale to fp32 (kv_formats' e4m3 rule)."""
    if q.dtype != torch.float8_e4m3fn and q_scale is None:
        return q
    if q.dtype != torch.float8_e4m3fn:
        raise InputError(f"q_scale: got a {type(q_scale).__name__}, expected None for a {q.dtype} q "
                         "(only float8_e4m3fn queries take one)")
    check_scale("q_scale", q_scale, q.device)
    return dequantize_e4m3(q, q_scale)  # type: ignore[arg-type]  # check_scale refused None


def check_integers(name: str, x: torch.Tensor) -> None:
    """InputError unless `x` (argument `name`) has an integer dtype."""
    if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        fail(f"{name}.dtype", x.dtype, "an integer dtype (torch.int32 or torch.int64)")


def check_queries(q: object, head_dim_v: object) -> torch.Tensor:
    """q, a floating [B, S, H, Dl+Dr] tensor, and head_dim_v, an int in 1..Dl+Dr: q as a tensor, or
    InputError naming the argument."""
    q = tensor_arg("q", q)
    if not q.dtype.is_floating_point:
        fail("q.dtype", q.dtype, "a floating dtype (torch.float8_e4m3fn with q_scale)")
    if q.dim() != 4:
        fail("q.shape", tuple(q.shape), "[B, S, H, Dl+Dr] (4 dims)")
    D = q.size(3)
    if not (isinstance(head_dim_v, int) and 0 < head_dim_v <= D):
        fail("head_dim_v", head_dim_v, f"an int with 0 < head_dim_v <= q.shape[-1]={D}")
    return q


def check_cache(name: str, kv_cache: object, q: torch.Tensor) -> torch.Tensor:
    """The cache argument `name` on q's device, [num_pages, page_size, (1,) row] with at least one
    page of one row, and a 16-bit row as wide as q's (an FP8 row's width is `fp8_layout`'s to
    check): the cache as a tensor, or InputError naming the argument."""
    cache = tensor_arg(name, kv_cache, q.device)
    if not (cache.dim() == 3 or (cache.dim() == 4 and cache.size(2) == 1)):
        fail(f"{name}.shape", tuple(cache.shape), "[num_pages, page_size, Dl+Dr] or [num_pages, page_size, 1, Dl+Dr]")
    if cache.size(0) < 1 or cache.size(1) < 1:
        fail(f"{name}.shape", tuple(cache.shape), "at least one page of at least one row")
    D = q.size(-1)
    if cache.dtype not in QUANTIZED_DTYPES and cache.size(-1) != D:
        fail(f"q.shape[-1] and {name}.shape[-1]", f"{D} and {cache.size(-1)}", "one size, Dl+Dr (a row's width)")
    return cache


def check_reference_inputs(q: object, kv_cache: object, block_table: object, cache_seqlens: object,
                           tree_mask: object, head_dim_v: int) -> None:
    """`reference`'s checks, before any work: each tensor on q's device with the shape and dtype
    `reference` documents, naming the argument, what it got and what it expected. Looser than the
    op's (`inputs.check_inputs`): any float dtype, any strides, any integer index dtype. An FP8
    cache and its kv_scale are checked by `fp8_layout`. Raises InputError."""
    q = check_queries(q, head_dim_v)
    B, S = q.shape[:2]
    check_cache("kv_cache", kv_cache, q)
    block_table = tensor_arg("block_table", block_table, q.device)
    check_integers("block_table", block_table)
    if block_table.dim() != 2 or block_table.size(0) != B or block_table.size(1) < 1:
        fail("block_table.shape", tuple(block_table.shape), f"[B={B}, max_pages >= 1]")
    cache_seqlens = tensor_arg("cache_seqlens", cache_seqlens, q.device)
    check_integers("cache_seqlens", cache_seqlens)
    if tuple(cache_seqlens.shape) != (B,):
        fail("cache_seqlens.shape", tuple(cache_seqlens.shape), f"[B={B}]")
    if tree_mask is not None:
        mask = tensor_arg("tree_mask", tree_mask, q.device)
        if mask.dtype not in (torch.bool, torch.uint8):
            fail("tree_mask.dtype", mask.dtype, "torch.bool (or torch.uint8)")
        if tuple(mask.shape) not in ((S, S), (B, S, S)):
            fail("tree_mask.shape", tuple(mask.shape), f"[S, S]=[{S}, {S}] or [B, S, S]=[{B}, {S}, {S}]")


def _check_lengths(lengths: list[int], block_table: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Each request's length within what its block table row addresses, and the pages it uses
    within the cache (one read of them back)."""
    pages, page_size = kv_cache.size(0), kv_cache.size(1)
    capacity = block_table.size(1) * page_size
    for b, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            fail(f"cache_seqlens[{b}]", n, f"0..{capacity} (block_table has {block_table.size(1)} pages of "
                  f"{page_size} rows)")
    used = [block_table[b, : -(-n // page_size)] for b, n in enumerate(lengths) if n > 0]
    if used:
        ids = torch.cat(used)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= pages:
            fail("block_table", f"page id {low if low < 0 else high} in a request's used pages",
                  f"page ids in 0..{pages - 1} (kv_cache.shape[0]={pages})")


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
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA verify attention, on q's device.

    q: [B, S, H, Dl+Dr]; kv_cache: [num_pages, page_size, (1,) Dl+Dr]; block_table: [B, max_pages]
    int; cache_seqlens: [B] int; tree_mask: bool [S, S] or [B, S, S] (overrides causal).
    Returns out [B, S, H, Dl] and lse [B, H, S] (natural log), both in `dtype`.

    FP8 inputs (`kv_formats`): kv_cache float8_e4m3fn [num_pages, page_size, (1,) 576] with
    kv_scale (a float or a one-element fp32 tensor on the cache's device), or uint8
    [num_pages, page_size, (1,) 656] in DeepSeek's ds_mla rows (no kv_scale); q float8_e4m3fn
    with q_scale (likewise). Each is dequantized (stored value x scale, in fp32) and then used
    as any cache or q, so the result equals the reference on `kv_formats.dequantize_kv`'s cache.

    Per request b with n keys: its keys are gathered once ([n, D], `gather_kv`, which
    dequantizes them), the scores of all S * H query rows are one matrix product ([S * H, n]),
    keys a query does not see (`visible_keys`) are set to -inf, and the softmax runs in `dtype`.
    Nothing past a request's n keys is read, so NaN or any other bytes there (unused pages, the
    tail of the last page, those rows' ds_mla scales) cannot leak in.

    Raises InputError, naming the argument, what it got and what was expected, for a tensor of
    the wrong shape, dtype or device (`check_reference_inputs`), a length outside what its block
    table row addresses, or a used page id outside the cache.
    """
    check_reference_inputs(q, kv_cache, block_table, cache_seqlens, tree_mask, head_dim_v)
    B, S, H, D = q.shape
    fp8_layout(kv_cache, kv_scale)                              # its InputError before any work
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, S, H, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((B, H, S), -math.inf, dtype=dtype, device=q.device)
    queries = dequantized_queries(q, q_scale).to(dtype).reshape(B, S * H, D)
    lengths = cache_seqlens.tolist()                        # a host sync, and one more for the page ids
    _check_lengths(lengths, block_table, kv_cache)
    for b, n in enumerate(lengths):
        if n <= 0:
            continue
        kv = gather_kv(kv_cache, block_table, b, n, kv_scale).to(device=q.device, dtype=dtype)   # [n, D]
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
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, one query row and one key at a time, in fp64 on the CPU: slow, for
    checking `reference` on small cases.

    Same arguments as `reference`; an FP8 cache is dequantized whole (`kv_formats.dequantize_kv`),
    and only the keys below read. Returns out [B, S, H, Dl] and lse [B, H, S], fp64. Key j of
    request b (0 <= j < cache_seqlens[b]) is row j % page_size of page block_table[b, j //
    page_size]; the last S keys are the draft tokens, the others the prefix. Query i sees every
    prefix key, and draft key k when tree_mask[(b,) i, k] (with a tree mask), k <= i (causal)
    or always (neither).
    """
    layout = fp8_layout(kv_cache, kv_scale)
    if layout is not None:
        kv_cache = dequantize_kv(kv_cache, layout, kv_scale)
    q, kv_cache = dequantized_queries(q, q_scale).double().cpu(), kv_cache.double().cpu()
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
