"""The reference for sparse verify attention (DeepSeek Sparse Attention): each query token attends
to its own cache rows, chosen by an indexer, rather than to a request's paged prefix.

Query token s of request b attends to the cache rows `indices[b, s, :topk_length[b]]`, each the
row's page id x page_size + its offset within the page (the flat row of the cache read as
[num_pages * page_size, row]); -1 marks an unused slot. No causal or tree mask applies: the
indexer already chose. A row listed twice counts twice, as two keys. A query token with no
valid slot gets out = 0 and lse = -inf. An extra cache (FlashMLA's `extra_k_cache`) adds its own
rows to every token's keys in the same softmax.

Like `reference`, it runs in `dtype` on q's device and takes FP8 caches (a float8_e4m3fn cache
with kv_scale, DeepSeek's uint8 656-byte ds_mla rows) and e4m3 queries with q_scale, dequantized
as `kv_formats.dequantize_kv` specifies. Only the listed rows are read and dequantized; the
values an unused slot would read never reach the result.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .inputs import InputError, check_listed_values, fail, tensor_arg
from .kv_formats import dequantize_kv
from .reference import check_cache, check_integers, check_queries, dequantized_queries, fp8_layout


class KeySet(NamedTuple):
    """One cache's part of every query token's keys: the cache and the rows each token lists."""

    kv_cache: torch.Tensor               # [num_pages, page_size, (1,) row]
    indices: torch.Tensor                # [B, S, topk] int: flat row ids, -1 for an unused slot
    topk_length: torch.Tensor | None     # [B] int: slots past it are unused; None: all topk


def _check_key_set(prefix: str, keys: KeySet, q: torch.Tensor) -> None:
    """Shapes, dtypes and devices of one key set against q [B, S, H, D]; raises InputError."""
    B, S = q.shape[:2]
    check_cache(f"{prefix}kv_cache", keys.kv_cache, q)
    indices = tensor_arg(f"{prefix}indices", keys.indices, q.device)
    check_integers(f"{prefix}indices", indices)
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, S) or indices.size(2) < 1:
        fail(f"{prefix}indices.shape", tuple(indices.shape), f"[B={B}, S={S}, topk >= 1]")
    if keys.topk_length is not None:
        length = tensor_arg(f"{prefix}topk_length", keys.topk_length, q.device)
        check_integers(f"{prefix}topk_length", length)
        if tuple(length.shape) != (B,):
            fail(f"{prefix}topk_length.shape", tuple(length.shape), f"[B={B}]")


def gathered_keys(keys: KeySet, kv_scale: float | torch.Tensor | None, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [B, S, topk, Dl+Dr] in `dtype`, valid [B, S, topk] bool) of one key set: each slot's
    row, dequantized for an FP8 cache, and zeros where the slot is unused (-1, or past its
    request's topk_length). Only the listed rows are read."""
    cache = keys.kv_cache
    layout = fp8_layout(cache, kv_scale)
    flat = cache.reshape(cache.size(0) * cache.size(1), cache.size(-1))
    index = keys.indices.long()
    B, S, topk = index.shape
    valid = index >= 0
    if keys.topk_length is not None:
        slot = torch.arange(topk, device=index.device)
        valid &= slot[None, None, :] < keys.topk_length.long()[:, None, None]
    listed = index[valid]                                              # the rows read, in slot order
    rows = flat[listed]
    if layout is not None:
        rows = dequantize_kv(rows[None], layout, kv_scale)[0]
    out = torch.zeros(B, S, topk, rows.size(-1), dtype=dtype, device=cache.device)
    out[valid] = rows.to(dtype)
    return out, valid


def sparse_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    head_dim_v: int = 512,
    dtype: torch.dtype = torch.float32,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse verify attention, on q's device (see the module's text).

    q: [B, S, H, Dl+Dr]; kv_cache: [num_pages, page_size, (1,) Dl+Dr], or FP8 as for `reference`
    (float8_e4m3fn with kv_scale; uint8 ds_mla rows); indices: int [B, S, topk], flat row ids
    (page id x page_size + offset) or -1; topk_length: int [B] or None (all topk slots). The
    extra cache, with extra_indices [B, S, extra_topk] and extra_topk_length [B] (or None), is
    attended in the same softmax; it has kv_cache's format and kv_scale. Returns out
    [B, S, H, Dl] and lse [B, H, S] (natural log), both in `dtype`; a token with no valid slot has
    out 0 and lse -inf.

    Raises InputError, naming the argument, what it got and what was expected: a tensor of the
    wrong shape, dtype or device, a row id other than -1 outside the cache, a topk_length outside
    0..topk, an extra cache without its indices (or indices without the cache).
    """
    q = check_queries(q, head_dim_v)
    D = q.size(3)
    if (extra_kv_cache is None) != (extra_indices is None) or (extra_indices is None and extra_topk_length is not None):
        raise InputError("extra_kv_cache, extra_indices, extra_topk_length: an extra cache comes with its indices "
                         "(and optionally its topk_length); got "
                         + ", ".join(f"{n}={'a tensor' if v is not None else 'None'}" for n, v in (
                             ("extra_kv_cache", extra_kv_cache), ("extra_indices", extra_indices),
                             ("extra_topk_length", extra_topk_length))))
    sets = [("", KeySet(kv_cache, indices, topk_length))]
    if extra_kv_cache is not None and extra_indices is not None:    # given together (checked above)
        sets.append(("extra_", KeySet(extra_kv_cache, extra_indices, extra_topk_length)))
    for prefix, keys in sets:
        _check_key_set(prefix, keys, q)
        fp8_layout(keys.kv_cache, kv_scale)                     # the FP8 format's InputError before any work
    for prefix, keys in sets:
        check_listed_values(prefix, keys.indices, keys.topk_length, keys.kv_cache.size(0) * keys.kv_cache.size(1))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    parts = [gathered_keys(keys, kv_scale, dtype) for _, keys in sets]
    kv = torch.cat([rows for rows, _ in parts], dim=2).to(q.device)        # [B, S, K, D]
    valid = torch.cat([v for _, v in parts], dim=2).to(q.device)           # [B, S, K]
    queries = dequantized_queries(q, q_scale).to(dtype)                               # [B, S, H, D]
    scores = torch.einsum("bshd,bskd->bshk", queries, kv).mul_(scale)
    scores.masked_fill_(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)                                  # [B, S, H]
    # exp(-inf - -inf) is NaN in rows with no key: their weights are 0.
    p = scores.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    out = torch.einsum("bshk,bskd->bshd", p, kv[..., :head_dim_v])
    return out, lse.transpose(1, 2).contiguous()
