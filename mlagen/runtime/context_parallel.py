"""Context parallelism: one rank's shard of verify attention over an interleaved KV cache.

Decode context parallelism (vLLM's DCP, FlashInfer's cp_world/cp_rank) spreads each request's
keys over W ranks: global token t lives on rank (t // I) % W, I being the interleave size
(vLLM's `cp_kv_cache_interleave_size`; 1 by default). Rank r's local cache holds its tokens in
global order, so its local key j is global token ((j // I) * W + r) * I + j % I
(`cp_global_positions`). Each rank attends with every query over its own keys and returns
(out, lse); merging the W results with `merge_states` gives the unsharded result.

No kernel of its own: the core op already takes a per-request tree mask over the last S keys
of each request (query i sees key j of n if j < n - S, else by bit j - (n - S) of its row; for
n < S the first S - n bits stand for no key). On rank r a request of N global keys has n_r
local keys (`cp_local_seqlens`), and its last S local key slots are the window the mask covers:
slot k is local key j = n_r - S + k (no key when j < 0) at global position t; a prefix key
(t < N - S) is visible to every query, draft token d = t - (N - S) by the global rule (causal:
d <= i; a tree: bit [i, d] of the caller's mask; no mask: always) (`cp_shard_mask`). Every draft
token of the rank lies in that window, since local order is global order and the drafts are the
last S global keys. Without a mask the shard needs none either: every local key is visible.

Everything is torch ops on the lengths' device: no host reads, so a shard's call can be captured
in a CUDA graph; the builders run on CPU tensors too.
"""

from __future__ import annotations

import torch

from ..dsl.spec import MAX_SEQLEN_Q, Variant
from .inputs import InputError, key_bound, values_requested
from .kv_formats import as_bytes
from .op import verify_attention
from .varlen import check_varlen, verify_attention_varlen


def _check_layout(rank: int, world: int, interleave: int) -> None:
    """rank, world and interleave as host ints: world >= 1, 0 <= rank < world, interleave >= 1."""
    for name, value in (("world", world), ("interleave", interleave)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{name}: got {value!r}, expected a host int >= 1")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise InputError(f"rank: got {rank!r}, expected a host int in 0..world-1={world - 1}")


def _check_lengths(cache_seqlens: object, batch: int | None = None) -> torch.Tensor:
    """cache_seqlens as an integer [B] tensor (B = batch when given)."""
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1 \
            or cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype.is_complex \
            or cache_seqlens.dtype == torch.bool:
        raise InputError(f"cache_seqlens: got {getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                         f"{tuple(getattr(cache_seqlens, 'shape', ()))}, expected an int32 [B] tensor of "
                         "global lengths")
    if batch is not None and cache_seqlens.shape[0] != batch:
        raise InputError(f"cache_seqlens.shape: got {tuple(cache_seqlens.shape)}, expected [B={batch}]")
    return cache_seqlens


def cp_global_positions(local_positions: torch.Tensor, *, rank: int, world: int,
                        interleave: int = 1) -> torch.Tensor:
    """The global token index of each local key index on `rank`.

    Args:
        local_positions: integer tensor of any shape, local key indices j >= 0 on any device.
        rank, world, interleave: the shard's rank in 0..world-1, the number of ranks W and the
            interleave size I (host ints).

    Returns:
        int64 tensor of local_positions' shape and device: ((j // I) * W + rank) * I + j % I.
    """
    _check_layout(rank, world, interleave)
    j = local_positions.long()
    return (j // interleave * world + rank) * interleave + j % interleave


def cp_local_seqlens(cache_seqlens: torch.Tensor, *, rank: int, world: int, interleave: int = 1) -> torch.Tensor:
    """Each request's number of local keys on `rank`: how many t < N have (t // I) % W == rank.

    Args:
        cache_seqlens: integer [B] tensor of global lengths N (draft tokens included), any device.
        rank, world, interleave: as in `cp_global_positions`.

    Returns:
        int32 [B] on cache_seqlens' device: (N // (I W)) I + clamp(N % (I W) - rank I, 0, I).
    """
    _check_layout(rank, world, interleave)
    n = _check_lengths(cache_seqlens).long()
    cycle = interleave * world
    return (n // cycle * interleave + (n % cycle - rank * interleave).clamp(0, interleave)).to(torch.int32)


def _local_length(length: int, rank: int, world: int, interleave: int) -> int:
    """`cp_local_seqlens` of one host int (the local keys of `length` global ones), no device."""
    return int(cp_local_seqlens(torch.tensor([length]), rank=rank, world=world, interleave=interleave)[0])


def cp_shard_mask(cache_seqlens: torch.Tensor, seqlen_q: int, *, rank: int, world: int, interleave: int = 1,
                  causal: bool = True, tree_mask: torch.Tensor | None = None,
                  draft_counts: torch.Tensor | None = None) -> torch.Tensor | None:
    """The tree mask that applies the global causal or tree mask to `rank`'s local keys.

    Pass it with the local lengths (`cp_local_seqlens`) and causal=False to `verify_attention`,
    or, with draft_counts, to `verify_attention_varlen` (a packed mask); an engine builds both
    once per step and reuses them in every layer.

    Args:
        cache_seqlens: integer [B] tensor of global lengths N (draft tokens included).
        seqlen_q: S, the draft tokens per request (with draft_counts, max_seqlen_q).
        rank, world, interleave: as in `cp_global_positions`.
        causal: the global mask is causal (ignored with tree_mask); False with no tree_mask:
            no mask.
        tree_mask: bool (or uint8) [S, S] or [B, S, S] global draft-tree mask, as the op takes
            it (with draft_counts, packed top-left per request as `verify_attention_varlen`
            takes it), on cache_seqlens' device.
        draft_counts: integer [B] tensor of each request's draft count s_b (varlen), or None:
            every request has S.

    Returns:
        None without a mask (every local key is visible). Otherwise bool [B, S, S] on
        cache_seqlens' device: [b, i, k] says whether query i of request b sees local key
        n_r - s_b + k (n_r: its local length; s_b = S without draft_counts), False for entries
        outside the top-left s_b x s_b block and for slots before the local cache (j < 0).
    """
    if tree_mask is None and not causal:
        return None
    N = _check_lengths(cache_seqlens).long()
    n = cp_local_seqlens(N, rank=rank, world=world, interleave=interleave).long()
    device = N.device
    slots = torch.arange(seqlen_q, device=device)
    s = draft_counts.to(device=device, dtype=torch.long) if draft_counts is not None else \
        torch.full_like(N, seqlen_q)
    j = (n - s)[:, None] + slots[None, :]                                  # [B, S] local key of slot k
    d = cp_global_positions(j.clamp(min=0), rank=rank, world=world, interleave=interleave) - (N - s)[:, None]
    rows = slots[None, :, None]                                            # [1, S, 1] query i
    if tree_mask is not None:
        tree = tree_mask != 0
        tree = tree.expand(N.shape[0], seqlen_q, seqlen_q) if tree.dim() == 2 else tree
        draft = tree.gather(2, d.clamp(0, seqlen_q - 1)[:, None, :].expand(-1, seqlen_q, -1))
    else:
        draft = d[:, None, :] <= rows
    key = ((j >= 0) & (j < n[:, None]))[:, None, :]                       # a key of the request's window
    return key & ((d < 0)[:, None, :] | draft) & (rows < s[:, None, None])


def cp_shard_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                   rank: int, world: int, interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rank`'s shard of an unsharded paged cache, for tests and examples: its keys in global
    order on pages of the same size, request b on its own run of pages.

    Args:
        kv_cache: [num_pages, page_size, D] or [num_pages, page_size, 1, D] unsharded cache, any
            dtype (FP8 rows included).
        block_table: [B, max_pages] int32 page ids of each request.
        cache_seqlens: [B] int32 global lengths.
        rank, world, interleave: as in `cp_global_positions`.

    Returns:
        (local cache [B * P, page_size, D] in kv_cache's dtype, where P holds the rank's share of
        the block table's capacity; local block_table [B, P] int32, request b on pages
        b * P .. b * P + P - 1; local lengths [B] int32 as `cp_local_seqlens`), on kv_cache's
        device. Rows past a request's local length are zero. No host reads.
    """
    n = cp_local_seqlens(_check_lengths(cache_seqlens, block_table.shape[0]), rank=rank, world=world,
                         interleave=interleave)
    kv = kv_cache.reshape(kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[-1])
    kv = as_bytes(kv)                                                  # FP8 rows move as their bytes
    page_size = kv.shape[1]
    B, max_pages = block_table.shape
    pages = max(1, -(-_local_length(max_pages * page_size, rank, world, interleave) // page_size))
    j = torch.arange(pages * page_size, device=kv.device)
    t = cp_global_positions(j, rank=rank, world=world, interleave=interleave).clamp(max=max_pages * page_size - 1)
    valid = j[None, :] < n.to(kv.device)[:, None]                           # [B, P * page_size]
    # Page ids past a request's pages may be anything: those rows read page 0, then are zeroed.
    page_ids = torch.where(valid, block_table.to(kv.device).long()[:, t // page_size], 0)
    rows = kv[page_ids, t % page_size].masked_fill(~valid[..., None], 0)   # [B, P * page_size, D]
    local_table = torch.arange(B * pages, dtype=torch.int32, device=block_table.device).view(B, pages)
    return rows.reshape(B * pages, page_size, kv.shape[-1]).view(kv_cache.dtype), local_table, n


def _check_shard(q: torch.Tensor, cache_seqlens: object, tree_mask: object, causal: bool, rank: int, world: int,
                 interleave: int, seqlen_q: int, batch: int) -> None:
    """The checks the mask builder needs before it runs; the core op checks everything else."""
    _check_layout(rank, world, interleave)
    lengths = _check_lengths(cache_seqlens, batch)
    if lengths.dtype != torch.int32:
        raise InputError(f"cache_seqlens.dtype: got {lengths.dtype}, expected torch.int32")
    if lengths.device != q.device:
        raise InputError(f"cache_seqlens: got a tensor on {lengths.device}, expected one on {q.device}, where q is")
    if (causal or tree_mask is not None) and seqlen_q > MAX_SEQLEN_Q:
        raise InputError(f"q.shape[1]: got {seqlen_q}, expected at most {MAX_SEQLEN_Q} draft tokens: a shard "
                         "of a causal or tree mask runs as a tree mask")
    if tree_mask is not None:
        if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype not in (torch.bool, torch.uint8):
            raise InputError(f"tree_mask: got {getattr(tree_mask, 'dtype', type(tree_mask).__name__)}, "
                             "expected a torch.bool (or torch.uint8) tensor")
        if tuple(tree_mask.shape) not in ((seqlen_q, seqlen_q), (batch, seqlen_q, seqlen_q)):
            raise InputError(f"tree_mask.shape: got {tuple(tree_mask.shape)}, expected [S, S]=[{seqlen_q}, "
                             f"{seqlen_q}] or [B, S, S]=[{batch}, {seqlen_q}, {seqlen_q}]")
        if tree_mask.device != q.device:
            raise InputError(f"tree_mask: got a tensor on {tree_mask.device}, expected one on {q.device}, "
                             "where q is")


def _check_global_values(cache_seqlens: torch.Tensor) -> None:
    """Host read (only when values are checked): global lengths are >= 0. The core op checks the
    local ones against the local block table."""
    for b, n in enumerate(cache_seqlens.tolist()):
        if n < 0:
            raise InputError(f"cache_seqlens[{b}]: got {n}, expected a global length >= 0")


def _local_bound(max_seqlen_k: int | None, rank: int, world: int, interleave: int) -> int | None:
    """A bound on the global lengths as one on `rank`'s local lengths (a host int)."""
    if max_seqlen_k is None:
        return None
    key_bound(max_seqlen_k)                                       # checks it, naming max_seqlen_k
    return _local_length(max_seqlen_k, rank, world, interleave)


def _shard(cache_seqlens: torch.Tensor, seqlen_q: int, *, rank: int, world: int, interleave: int, causal: bool,
           tree_mask: torch.Tensor | None, check_values: bool | None, max_seqlen_k: int | None,
           draft_counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
    """What the core op gets on `rank` (arguments already checked): (local lengths, the shard's
    mask (`cp_shard_mask`), the local key bound); with check_values the global lengths are read."""
    if values_requested(check_values):
        _check_global_values(cache_seqlens)
    local = cp_local_seqlens(cache_seqlens, rank=rank, world=world, interleave=interleave)
    mask = cp_shard_mask(cache_seqlens, seqlen_q, rank=rank, world=world, interleave=interleave, causal=causal,
                         tree_mask=tree_mask, draft_counts=draft_counts)
    return local, mask, _local_bound(max_seqlen_k, rank, world, interleave)


def verify_attention_cp_shard(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    rank: int,
    world: int,
    interleave: int = 1,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    variant: Variant | None = None,
    head_dim_v: int = 512,
    check_values: bool | None = None,
    max_seqlen_k: int | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's shard of MLA verify attention under context parallelism.

    Request b's N = cache_seqlens[b] keys (its S draft tokens the last S) are spread over
    `world` ranks, global token t on rank (t // interleave) % world; this rank's local cache
    holds its tokens in global order. The masks apply by global position; merging every rank's
    (out, lse) with `merge_states` gives `verify_attention`'s result on the unsharded cache.
    Attention sinks go after the merge (`mlagen.runtime.sinks.apply_attn_sink_`).

    Args:
        q: [B, S, H, Dl+Dr] bf16/fp16 CUDA tensor, every query of the request on every rank (or
            float8_e4m3fn with q_scale, as in `verify_attention`).
        kv_cache: this rank's paged cache, [num_pages, page_size, Dl+Dr] (or with a 1 KV-head
            dim), q's dtype; or an FP8 cache as `verify_attention` takes it.
        block_table: [B, max_pages] int32, this rank's page ids of each request in order.
        cache_seqlens: [B] int32 on q's device: GLOBAL lengths N, draft tokens included (the
            local ones are derived: `cp_local_seqlens`).
        rank, world, interleave: this rank in 0..world-1, the number of ranks and the interleave
            size (host ints; world >= 1, interleave >= 1).
        softmax_scale, causal, tree_mask, variant, head_dim_v, check_values, batch_invariant,
            kv_scale, q_scale: as in `verify_attention`; the masks are the global ones (tree_mask [S, S] or
            [B, S, S], S <= 64; with causal or tree_mask S <= 64 too, since the shard runs as a
            tree mask). check_values also checks the global lengths (a host read).
        max_seqlen_k: optional host int bound on the GLOBAL lengths (this rank's share of it
            bounds the local ones).

    Returns:
        out [B, S, H, Dl] in q's dtype (e4m3 queries: as `verify_attention` says) and lse
        [B, H, S] fp32 over this rank's keys. A row that
        sees no key here gives out = 0 and lse = -inf, which `merge_states` ignores.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q.shape: got {tuple(getattr(q, 'shape', ()))}, expected [B, S, H, Dl+Dr] (4 dims)")
    B, S = q.shape[0], q.shape[1]
    _check_shard(q, cache_seqlens, tree_mask, causal, rank, world, interleave, S, B)
    local, mask, bound = _shard(cache_seqlens, S, rank=rank, world=world, interleave=interleave, causal=causal,
                                tree_mask=tree_mask, check_values=check_values, max_seqlen_k=max_seqlen_k)
    return verify_attention(q, kv_cache, block_table, local, softmax_scale=softmax_scale, causal=False,
                            tree_mask=mask, return_lse=True, variant=variant, head_dim_v=head_dim_v,
                            check_values=check_values, max_seqlen_k=bound, batch_invariant=batch_invariant,
                            kv_scale=kv_scale, q_scale=q_scale)


def verify_attention_varlen_cp_shard(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    *,
    rank: int,
    world: int,
    interleave: int = 1,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    variant: Variant | None = None,
    head_dim_v: int = 512,
    check_values: bool | None = None,
    max_seqlen_k: int | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_attention_cp_shard` for requests with different draft counts, packed as
    `verify_attention_varlen` takes them.

    Args:
        q: [total_q, H, Dl+Dr] bf16/fp16 CUDA tensor, requests packed back to back (or
            float8_e4m3fn with q_scale).
        kv_cache, block_table: this rank's paged cache and page ids, as in
            `verify_attention_cp_shard`.
        cache_seqlens: [B] int32 on q's device, GLOBAL lengths including request b's s_b draft
            tokens.
        cu_seqlens_q, max_seqlen_q: as in `verify_attention_varlen` (max_seqlen_q <= 64 with
            causal or tree_mask).
        rank, world, interleave, softmax_scale, causal, variant, head_dim_v, check_values,
            max_seqlen_k, batch_invariant, kv_scale, q_scale: as in `verify_attention_cp_shard`.
        tree_mask: the global packed mask, bool [B, max_seqlen_q, max_seqlen_q] with request
            b's s_b x s_b mask top-left (or [max_seqlen_q, max_seqlen_q] shared the same way).

    Returns:
        out [total_q, H, Dl] in q's dtype and lse [H, total_q] fp32 over this rank's keys (-inf
        and 0 for a row that sees none here), the pair `merge_states` takes.
    """
    check_varlen(q, cu_seqlens_q, max_seqlen_q, cache_seqlens, tree_mask)
    _check_shard(q, cache_seqlens, tree_mask, causal, rank, world, interleave, max_seqlen_q,
                 cu_seqlens_q.numel() - 1)
    local, mask, bound = _shard(cache_seqlens, max_seqlen_q, rank=rank, world=world, interleave=interleave,
                                causal=causal, tree_mask=tree_mask, check_values=check_values,
                                max_seqlen_k=max_seqlen_k, draft_counts=cu_seqlens_q[1:] - cu_seqlens_q[:-1])
    return verify_attention_varlen(q, kv_cache, block_table, local, cu_seqlens_q, max_seqlen_q,
                                   softmax_scale=softmax_scale, causal=False, tree_mask=mask, return_lse=True,
                                   variant=variant, head_dim_v=head_dim_v, check_values=check_values,
                                   max_seqlen_k=bound, batch_invariant=batch_invariant, kv_scale=kv_scale,
                                   q_scale=q_scale)
