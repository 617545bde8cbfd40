"""Attention sinks: a per-head logit that takes part in each row's softmax without a value.

With a sink s_h, row (b, i, h) of the output is the attention output times
exp(lse) / (exp(lse) + exp(s_h)): the sink's share of the softmax weight goes to a zero value
vector. lse stays the log-sum-exp over the keys alone, as FlashMLA and gpt-oss-style sinks
define it. A sink of +inf gives 0, -inf leaves the row as it is, and a row that sees no key
stays 0 whatever its sink.
"""

from __future__ import annotations

import math

import torch

from .inputs import InputError


def check_attn_sink(attn_sink: object, heads: int, device: torch.device) -> None:
    """Raise InputError unless attn_sink is a float32 tensor [heads] on `device`."""
    if not isinstance(attn_sink, torch.Tensor):
        raise InputError(f"attn_sink: got {type(attn_sink).__name__}, expected None or a torch.Tensor "
                         f"[{heads}] float32")
    if attn_sink.dtype != torch.float32:
        raise InputError(f"attn_sink.dtype: got {attn_sink.dtype}, expected torch.float32")
    if tuple(attn_sink.shape) != (heads,):
        raise InputError(f"attn_sink.shape: got {tuple(attn_sink.shape)}, expected ({heads},): one sink per query head")
    if attn_sink.device != device:
        raise InputError(f"attn_sink.device: got {attn_sink.device}, expected {device}, where q is")


def apply_attn_sink_(out: torch.Tensor, lse_rows: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """Scale out [..., H, Dl] in place by each row's sink factor and return it.

    lse_rows: [..., H] fp32, each output row's lse (natural log, -inf for a row that sees no
    key), laid out like out's rows (the op's lse [B, H, S] transposed to [B, S, H]).
    attn_sink: [H] fp32. The factor sigmoid(lse - sink) equals exp(lse) / (exp(lse) + exp(sink))
    and neither overflows nor turns into NaN for finite values; a row without a key gets 0
    (also where the sink is -inf, whose difference would be NaN). The product is rounded once
    to out's dtype. Torch ops only, no host reads: CUDA-graph safe.
    """
    factor = torch.sigmoid(lse_rows - attn_sink)
    factor = factor.masked_fill(lse_rows == -math.inf, 0.0)
    return out.mul_(factor.unsqueeze(-1))
