"""FlashMLA's dense-decode API on mlagen kernels: change one import to switch.

    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from mlagen.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache

Same argument layouts, defaults and results as FlashMLA's functions of these names, on every
GPU mlagen targets (sm_80, sm_89, sm_90, sm_120), with any power-of-two page size. mlagen
schedules its own work, so `get_mla_metadata` returns small placeholders of FlashMLA's types
and `flash_mla_with_kvcache` ignores them. What FlashMLA offers and mlagen does not (sparse
attention through `indices`, fp8 KV caches) raises NotImplementedError. For draft-tree masks,
which FlashMLA lacks, call `mlagen.verify_attention(..., tree_mask=...)` directly. One mlagen
extension, keyword-only so FlashMLA's positional calls are unchanged: `flash_mla_with_kvcache(...,
max_seqlen_k=n)`, a host bound on `cache_seqlens` that plans the kernel for n keys instead of
the block table's capacity.

Calls go through the `mlagen::verify_attention` custom op, so they trace under torch.compile.
"""

from __future__ import annotations

import math

import torch

from ..runtime.ops import verify_attention_op

# FlashMLA's tile-scheduler metadata rows hold 8 int32 fields each.
_METADATA_FIELDS = 8


def _unsupported(what: str) -> None:
    raise NotImplementedError(f"mlagen.compat.flash_mla: {what} is not supported by mlagen "
                              "(dense bf16/fp16 KV only); use FlashMLA for it")


def get_mla_metadata(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
    num_heads_q: int | None = None,
    is_fp8_kvcache: bool = False,
    topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduling metadata, as placeholders: mlagen splits work per launch itself.

    Args:
        cache_seqlens: [B] int32, as passed to `flash_mla_with_kvcache`.
        num_q_tokens_per_head_k: S * H_q / H_k (unused).
        num_heads_k: KV heads; MLA has one latent head, so 1.
        num_heads_q, is_fp8_kvcache, topk: as in FlashMLA; fp8 and sparse (topk) raise
            NotImplementedError.

    The metadata carry no length bound: they live on cache_seqlens' device, and reading one
    back in every layer's call would be a host sync, which neither FlashMLA nor mlagen does.
    Pass the bound to `flash_mla_with_kvcache(..., max_seqlen_k=)` instead.

    Returns:
        (tile_scheduler_metadata [1, 8] int32, num_splits [B+1] int32), zeros on
        cache_seqlens' device.
    """
    if is_fp8_kvcache:
        _unsupported("is_fp8_kvcache=True")
    if topk is not None:
        _unsupported(f"sparse attention (topk={topk})")
    if num_heads_k != 1:
        raise ValueError(f"num_heads_k: got {num_heads_k}, expected 1 (MLA's one latent KV head)")
    device = cache_seqlens.device
    metadata = torch.zeros(1, _METADATA_FIELDS, dtype=torch.int32, device=device)
    num_splits = torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=device)
    return metadata, num_splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor | None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    *,
    max_seqlen_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode attention, computed by mlagen.

    Args:
        q: [B, S, H, 576] bf16/fp16 (S query tokens per request; the last S keys of each
            request are theirs).
        k_cache: [num_blocks, page_block_size, 1, 576] (or without the 1), q's dtype.
        block_table: [B, max_blocks] int32.
        cache_seqlens: [B] int32, keys per request including the S query tokens.
        head_dim_v: value width, 512.
        tile_scheduler_metadata, num_splits: from `get_mla_metadata`; ignored.
        softmax_scale: default q.shape[-1] ** -0.5, as FlashMLA.
        causal: FlashMLA's default False (every valid key visible); True: query i sees the
            prefix and query tokens 0..i.
        is_fp8_kvcache, indices: fp8 KV and sparse attention raise NotImplementedError.
        max_seqlen_k: mlagen's extension, keyword-only: optional host int, a bound on
            cache_seqlens (engines keep one per step; FlashMLA has no such argument). The
            kernel, its split and its table entry are then chosen for that many keys (rounded
            up: at most 19% more, at least 64) instead of for the block table's capacity,
            block_table.shape[1] * page_block_size, which engines size for the longest context.
            A request longer than the bound still runs correctly, on a plan made for fewer
            keys. Not an int >= 0: mlagen.InputError, before anything is launched.

    Returns:
        (out [B, S, H, head_dim_v] in q's dtype, lse [B, H, S] fp32, natural log). FlashMLA's
        convention for a row that sees no key: out 0, lse +inf.
    """
    if is_fp8_kvcache or k_cache.dtype not in (torch.bfloat16, torch.float16):
        _unsupported(f"an fp8 KV cache (is_fp8_kvcache={is_fp8_kvcache}, k_cache.dtype={k_cache.dtype})")
    if indices is not None:
        _unsupported("sparse attention (indices)")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = verify_attention_op(q, k_cache, block_table, cache_seqlens, softmax_scale=scale,
                                   causal=causal, return_lse=True, head_dim_v=head_dim_v,
                                   max_seqlen_k=max_seqlen_k)
    # mlagen marks an empty row with lse = -inf; FlashMLA with +inf.
    return out, lse.masked_fill(lse == -math.inf, math.inf)
