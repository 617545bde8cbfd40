"""Ragged draft counts: requests with different numbers of query tokens in one launch.

Queries arrive packed, `[total_q, H, D]`, request b owning rows cu_seqlens_q[b] ..
cu_seqlens_q[b+1]-1 (s_b = its draft count). The kernels want a dense `[B, S, H, D]`, so each
request is padded to S = max_seqlen_q with its s_b queries placed at the END of its slot
(padded positions S-s_b .. S-1). That placement makes the padding exact without kernel changes:

- The kernel treats the last S keys of a request as draft tokens. Request b's real draft tokens
  are its last s_b keys, so padded draft column k' = S-s_b+t is its draft token t, and columns
  k' < S-s_b are really prefix keys.
- Causal: padded query S-s_b+i sees columns k' <= S-s_b+i, i.e. every prefix key and draft
  tokens 0..i: exactly the request's causal mask.
- Tree: the request's s_b x s_b mask goes in the bottom-right block of the S x S mask and the
  columns k' < S-s_b (prefix keys) are made visible to every row.

The padded rows (positions < S-s_b) are dropped. When the counts differ, the kernels get them
(`q_counts`) and the dispatcher's balanced split runs ragged rows (`Variant.rows`): each of its
blocks' work lists skips the padded row groups, and every request's real ones are dealt round
the row-group slots, so a batch costs about its real rows, not B * max_seqlen_q. Other kernels
compute the padded rows too. Every index is built on the
device from cu_seqlens_q with torch ops: no host reads, so the op can be captured in a CUDA
graph (max_seqlen_q is a host int, as in other varlen attention APIs).

Packed tree mask format: bool `[B, max_seqlen_q, max_seqlen_q]` with request b's s_b x s_b
mask in the top-left corner (`tree_mask[b, i, k]` for i, k < s_b; the rest is ignored), or one
`[max_seqlen_q, max_seqlen_q]` mask whose top-left s_b x s_b block every request uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from typing_extensions import Unpack, overload

from ..dsl.spec import Variant
from . import inputs
from .kv_formats import as_bytes
from .op import VerifyOptions, verify_attention


@dataclass(frozen=True)
class VarlenLayout:
    """Index maps between the packed rows and the padded [B, S, ...] problem (all on device).

    offset: [B] int64, S - s_b: padded position of each request's first query.
    src: [B * S] int64, the packed row that fills each padded slot (clamped into range for
        padded slots, whose results are dropped).
    dst: [total_q] int64, the padded slot (b * S + position) of each packed row.
    """

    batch: int
    max_seqlen_q: int
    total_q: int
    offset: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """[total_q, H, D] -> [B, S, H, D] (padded slots hold copies of real rows); e4m3 rows move
        as their bytes."""
        return as_bytes(q).index_select(0, self.src).view(q.dtype).view(self.batch, self.max_seqlen_q, *q.shape[1:])

    def pad_tree_mask(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """Packed mask ([B, S, S] or [S, S], top-left per request) -> the padded problem's
        [B, S, S] bool mask (bottom-right per request, prefix columns visible)."""
        S = self.max_seqlen_q
        pos = torch.arange(S, device=self.offset.device)
        off = self.offset[:, None, None]
        rows = pos[None, :, None] - off                           # [B, S, 1] query index in request
        cols = pos[None, None, :] - off                           # [B, 1, S] draft index in request
        mask = tree_mask.to(torch.bool)
        if mask.dim() == 2:
            mask = mask.expand(self.batch, S, S)
        req = torch.arange(self.batch, device=self.offset.device)[:, None, None]
        inner = mask[req, rows.clamp(min=0), cols.clamp(min=0)]
        return inner | (cols < 0) | (rows < 0)

    def unpad_out(self, out: torch.Tensor) -> torch.Tensor:
        """[B, S, H, Dl] -> [total_q, H, Dl]."""
        return out.reshape(self.batch * self.max_seqlen_q, *out.shape[2:]).index_select(0, self.dst)

    def unpad_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """[B, H, S] -> [H, total_q]."""
        H = lse.shape[1]
        return lse.transpose(0, 1).reshape(H, self.batch * self.max_seqlen_q).index_select(1, self.dst)


def varlen_layout(cu_seqlens_q: torch.Tensor, max_seqlen_q: int, total_q: int) -> VarlenLayout:
    """The index maps for requests cu_seqlens_q ([B+1] int, on any device) padded to
    max_seqlen_q positions each, with total_q packed rows."""
    cu = cu_seqlens_q.long()
    B, S = cu.numel() - 1, max_seqlen_q
    offset = S - (cu[1:] - cu[:-1])
    pos = torch.arange(S, device=cu.device)
    src = (cu[:-1, None] + pos[None, :] - offset[:, None]).clamp(min=0, max=max(total_q - 1, 0))
    token = torch.arange(total_q, device=cu.device)
    # Request of each packed row: the first b whose end exceeds it (empty requests skipped).
    req = torch.searchsorted(cu[1:], token, right=True).clamp(max=max(B - 1, 0))
    dst = req * S + offset[req] + token - cu[req]
    return VarlenLayout(batch=B, max_seqlen_q=S, total_q=total_q, offset=offset,
                        src=src.reshape(-1), dst=dst)


def check_varlen(q: object, cu_seqlens_q: object, max_seqlen_q: object, cache_seqlens: object,
                 tree_mask: object) -> None:
    """The packed layout's arguments, before any launch: q [total_q, H, D], cu_seqlens_q int32
    [B+1] on q's device, max_seqlen_q a host int >= 1, cache_seqlens [B], tree_mask packed
    [B, max_seqlen_q, max_seqlen_q] or [max_seqlen_q, max_seqlen_q]; raises InputError."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise inputs.InputError(f"q.shape: got {tuple(getattr(q, 'shape', ()))}, expected "
                                "[total_q, H, Dl+Dr] (3 dims, requests packed)")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32 \
            or cu_seqlens_q.dim() != 1:
        raise inputs.InputError(f"cu_seqlens_q: got {getattr(cu_seqlens_q, 'dtype', type(cu_seqlens_q))} "
                                f"{tuple(getattr(cu_seqlens_q, 'shape', ()))}, expected int32 [B+1]")
    if cu_seqlens_q.device != q.device:
        raise inputs.InputError(f"cu_seqlens_q: got a tensor on {cu_seqlens_q.device}, expected "
                                f"one on {q.device}, where q is")
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or max_seqlen_q < 1:
        raise inputs.InputError(f"max_seqlen_q: got {max_seqlen_q!r}, expected a host int >= 1 "
                                "(the largest draft count in the batch)")
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.shape != (cu_seqlens_q.numel() - 1,):
        raise inputs.InputError(f"cache_seqlens.shape: got {tuple(cache_seqlens.shape)}, expected "
                                f"[B={cu_seqlens_q.numel() - 1}] (cu_seqlens_q has B+1 entries)")
    B, S = cu_seqlens_q.numel() - 1, max_seqlen_q
    if isinstance(tree_mask, torch.Tensor) and tuple(tree_mask.shape) not in ((S, S), (B, S, S)):
        raise inputs.InputError(f"tree_mask.shape: got {tuple(tree_mask.shape)}, expected the packed "
                                f"[B, max_seqlen_q, max_seqlen_q]=[{B}, {S}, {S}] or [{S}, {S}]")


def _check_counts(cu_seqlens_q: torch.Tensor, max_seqlen_q: int, total_q: int) -> None:
    """Host reads (only when values are checked): offsets start at 0, grow, end at total_q."""
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != total_q:
        raise inputs.InputError(f"cu_seqlens_q: got first {cu[0]}, last {cu[-1]}, expected 0 and "
                                f"q.shape[0]={total_q}")
    for b in range(len(cu) - 1):
        if not 0 <= cu[b + 1] - cu[b] <= max_seqlen_q:
            raise inputs.InputError(f"cu_seqlens_q[{b + 1}] - cu_seqlens_q[{b}]: got "
                                    f"{cu[b + 1] - cu[b]}, expected 0..max_seqlen_q={max_seqlen_q}")


# The three calls, by return_lse, as verify_attention's.
@overload
def verify_attention_varlen(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                            cache_seqlens: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, *,
                            return_lse: Literal[False] = ..., **options: Unpack[VerifyOptions]) -> torch.Tensor: ...
@overload
def verify_attention_varlen(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                            cache_seqlens: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, *,
                            return_lse: Literal[True],
                            **options: Unpack[VerifyOptions]) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def verify_attention_varlen(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                            cache_seqlens: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, *,
                            return_lse: bool = ...,
                            **options: Unpack[VerifyOptions]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def verify_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Variant | None = None,
    head_dim_v: int = 512,
    check_values: bool | None = None,
    max_seqlen_k: int | None = None,
    attn_sink: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA verify attention for a batch whose requests have different draft counts.

    Args:
        q: [total_q, H, Dl+Dr] bf16/fp16 CUDA tensor, requests packed back to back; or
            float8_e4m3fn with q_scale, as in `verify_attention`.
        kv_cache, block_table: as in `verify_attention` (block_table [B, max_pages] int32).
        cache_seqlens: [B] int32, valid keys of request b including its s_b draft tokens, which
            sit at positions cache_seqlens[b]-s_b .. cache_seqlens[b]-1.
        cu_seqlens_q: [B+1] int32 on q's device; request b owns q rows
            cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 (s_b = the difference, 0..max_seqlen_q).
        max_seqlen_q: host int, the largest s_b (at most 64 with a tree mask).
        softmax_scale, causal, return_lse, variant, head_dim_v, check_values, max_seqlen_k,
            attn_sink, batch_invariant, kv_scale, q_scale: as in `verify_attention`; check_values
            also checks cu_seqlens_q (a host read).
        tree_mask: packed bool [B, max_seqlen_q, max_seqlen_q], request b's s_b x s_b draft
            tree mask in the top-left corner (or [max_seqlen_q, max_seqlen_q] shared the same
            way); tree_mask[b, i, k]: query i of request b sees its draft token k.
        indices: optional [total_q, topk] int32, gathered keys (sparse verify) as in
            `verify_attention`, one row of slots per packed query token; block_table,
            cache_seqlens and tree_mask are then None and causal False. Each token runs as a
            request of its own (no padding).
        topk_length: optional [B] int32 with indices: request b's tokens use their first
            topk_length[b] slots; None: all topk.

    Returns:
        out [total_q, H, Dl] in q's dtype (with e4m3 queries, as `verify_attention` says) and,
        if return_lse, lse [H, total_q] fp32 (natural log, -inf for a row with no key): the same
        [..., S, H, Dl] / [..., H, S] pairing as `verify_attention`, so `merge_states` accepts
        them.
    """
    check_varlen(q, cu_seqlens_q, max_seqlen_q, cache_seqlens, tree_mask)
    total_q = q.shape[0]
    if inputs.values_requested(check_values):
        _check_counts(cu_seqlens_q, max_seqlen_q, total_q)
    if indices is not None:
        return _gathered(q, kv_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_q, indices, topk_length,
                         return_lse=return_lse, check_values=check_values, softmax_scale=softmax_scale,
                         causal=causal, tree_mask=tree_mask, variant=variant, head_dim_v=head_dim_v,
                         max_seqlen_k=max_seqlen_k, attn_sink=attn_sink, batch_invariant=batch_invariant,
                         kv_scale=kv_scale, q_scale=q_scale)
    layout = varlen_layout(cu_seqlens_q, max_seqlen_q, total_q)
    if total_q == 0:
        dtype = inputs.output_dtype(q.dtype, getattr(kv_cache, "dtype", q.dtype))
        empty = q.new_empty(0, q.shape[1], head_dim_v, dtype=dtype)
        return (empty, q.new_empty(q.shape[1], 0, dtype=torch.float32)) if return_lse else empty
    padded_mask = layout.pad_tree_mask(tree_mask) if tree_mask is not None else None
    # Ragged counts: the kernels learn which rows are real, and a balanced split skips the rest.
    ragged = total_q < layout.batch * max_seqlen_q
    q_counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]) if ragged else None
    result = verify_attention(layout.pad_queries(q), kv_cache, block_table, cache_seqlens,
                              softmax_scale=softmax_scale, causal=causal, tree_mask=padded_mask,
                              return_lse=return_lse, variant=variant, head_dim_v=head_dim_v,
                              check_values=check_values, max_seqlen_k=max_seqlen_k, attn_sink=attn_sink,
                              batch_invariant=batch_invariant, kv_scale=kv_scale, q_scale=q_scale,
                              q_counts=q_counts)
    if not return_lse:
        return layout.unpad_out(result)  # type: ignore[arg-type]  # a tensor without return_lse
    out, lse = result
    return layout.unpad_out(out), layout.unpad_lse(lse)


def _gathered(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
              cache_seqlens: torch.Tensor | None, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
              indices: torch.Tensor, topk_length: torch.Tensor | None, *, return_lse: bool,
              check_values: bool | None, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys of packed tokens: each token a request of one query (B = total_q, S = 1),
    its slot count repeated from its request's on the device (no host read: `output_size`)."""
    total_q = q.shape[0]
    indices = inputs.tensor_arg("indices", indices, q.device)
    if indices.dim() != 2 or indices.size(0) != total_q:
        inputs.fail("indices.shape", tuple(indices.shape),
                    f"[total_q={total_q}, topk] (one row of slots per packed query token)")
    batch = cu_seqlens_q.numel() - 1
    if topk_length is not None:
        topk_length = inputs.tensor_arg("topk_length", topk_length, q.device)
        if topk_length.shape != (batch,):
            inputs.fail("topk_length.shape", tuple(topk_length.shape), f"[B={batch}] (cu_seqlens_q has B+1 entries)")
    per_token = None
    if topk_length is not None:
        counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        per_token = torch.repeat_interleave(topk_length, counts, output_size=total_q)
    result = verify_attention(q[:, None], kv_cache, block_table, cache_seqlens, return_lse=return_lse,
                              check_values=check_values, indices=indices[:, None], topk_length=per_token, **kwargs)
    if not return_lse:
        return result[:, 0]  # type: ignore[call-overload]  # a tensor without return_lse
    out, lse = result
    return out[:, 0], lse[:, :, 0].T
