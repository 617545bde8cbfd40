"""`verify_attention` as a torch.library custom op: `torch.ops.mlagen.verify_attention`.

torch.compile cannot look inside the runtime (NVRTC loads, ctypes launches), so the op is
registered opaque with a fake (meta) implementation that only computes output shapes: Dynamo
traces calls without graph breaks, and Inductor / CUDA graphs treat it as one kernel call
that allocates its outputs. Registration happens when this module is first imported (mlagen
imports it; it costs a few milliseconds and compiles nothing).

The op's schema has no optional return, so it always returns (out, lse); lse is an empty [0]
fp32 tensor unless return_lse. `verify_attention_op` below hides that and also takes a
`Variant`. The variant crosses the op boundary by name (`Variant.name`, parsed back by
`mlagen.dsl.spec.parse_variant`), since custom ops take only tensors and plain values; an FP8
scale, a float or a tensor, crosses as one of two arguments (a schema has no float-or-tensor).
"""

import torch

from ..dsl.spec import Variant, parse_variant
from .inputs import InputError, key_bound, output_dtype
from .op import verify_attention

OP_NAME = "mlagen::verify_attention"


@torch.library.custom_op(OP_NAME, mutates_args=())
def _verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: str | None = None,
    head_dim_v: int = 512,
    max_seqlen_k: int | None = None,
    attn_sink: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | None = None,
    kv_scale_tensor: torch.Tensor | None = None,
    q_scale: float | None = None,
    q_scale_tensor: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    result = verify_attention(q, kv_cache, block_table, cache_seqlens, softmax_scale=softmax_scale,
                              causal=causal, tree_mask=tree_mask, return_lse=return_lse,
                              variant=parse_variant(variant) if variant is not None else None,
                              head_dim_v=head_dim_v, max_seqlen_k=max_seqlen_k, attn_sink=attn_sink,
                              batch_invariant=batch_invariant,
                              kv_scale=kv_scale_tensor if kv_scale_tensor is not None else kv_scale,
                              q_scale=q_scale_tensor if q_scale_tensor is not None else q_scale,
                              indices=indices, topk_length=topk_length, extra_kv_cache=extra_kv_cache,
                              extra_indices=extra_indices, extra_topk_length=extra_topk_length)
    if return_lse:
        return result  # type: ignore[return-value]  # (out, lse) with return_lse
    return result, q.new_empty(0, dtype=torch.float32)  # type: ignore[return-value]  # out alone without it


@_verify_attention.register_fake
def _verify_attention_fake(q, kv_cache, block_table, cache_seqlens, softmax_scale=None, causal=True,
                           tree_mask=None, return_lse=False, variant=None, head_dim_v=512, max_seqlen_k=None,
                           attn_sink=None, batch_invariant=None, kv_scale=None, kv_scale_tensor=None, q_scale=None,
                           q_scale_tensor=None, indices=None, topk_length=None, extra_kv_cache=None,
                           extra_indices=None, extra_topk_length=None):
    B, S, H, _ = q.shape
    out = q.new_empty(B, S, H, head_dim_v, dtype=output_dtype(q.dtype, kv_cache.dtype))
    lse = q.new_empty((B, H, S) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _split_scale(name: str, scale: object) -> tuple[float | None, torch.Tensor | None]:
    """An FP8 scale as the op's two arguments: (a float, None) or (None, a tensor). Checked
    before the op: its schema refuses anything else with an error that does not name `name`."""
    if scale is None or isinstance(scale, torch.Tensor):
        return None, scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InputError(f"{name}: got {type(scale).__name__}, expected None, a float or a one-element "
                         "torch.float32 tensor")
    return float(scale), None


def verify_attention_op(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    tree_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    variant: Variant | str | None = None,
    head_dim_v: int = 512,
    max_seqlen_k: int | None = None,
    attn_sink: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    kv_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`verify_attention` through the registered custom op: use this inside torch.compile'd
    code and CUDA graphs.

    Same arguments, shapes and results as `mlagen.verify_attention` (q [B, S, H, Dl+Dr],
    out [B, S, H, Dl] in q's dtype, lse [B, H, S] fp32; FP8 caches with kv_scale, e4m3
    queries with q_scale; gathered keys with indices and topk_length, and an extra cache), except: `variant` may
    also be a variant name (e.g. "flash_ht8_qt8_bn32_w8_st2_spa_sm90"), there is no `out=`
    (custom ops return fresh tensors) and no `check_values` (MLAGEN_CHECK_VALUES still applies
    eagerly).
    """
    if max_seqlen_k is not None:
        # checked before the op: its schema turns a bool into an int and refuses a str or a
        # float with an error of torch's that does not name the argument
        key_bound(max_seqlen_k)
    name = variant.name if isinstance(variant, Variant) else variant
    out, lse = torch.ops.mlagen.verify_attention(q, kv_cache, block_table, cache_seqlens,
                                                 softmax_scale, causal, tree_mask, return_lse, name,
                                                 head_dim_v, max_seqlen_k, attn_sink, batch_invariant,
                                                 *_split_scale("kv_scale", kv_scale),
                                                 *_split_scale("q_scale", q_scale), indices, topk_length,
                                                 extra_kv_cache, extra_indices, extra_topk_length)
    return (out, lse) if return_lse else out
