"""Merging two partial attention results computed over disjoint key sets.

Serving engines split the keys of one query row into parts (a shared prefix and a per-request
draft tree, a cached and a fresh segment) and attend to each part separately. Each part gives
an output normalized over its own keys plus its log-sum-exp; the exact result over the union
is a softmax-weighted average of the parts:

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Layouts follow `mlagen.verify_attention`: out [..., S, H, Dl] and lse [..., H, S] (natural
log, fp32). A part with no key has lse = -inf and contributes nothing, whatever its out holds;
when both parts are empty the row is out = 0, lse = -inf. Plain torch: runs on CPU and GPU and
under CUDA graph capture (no host reads).
"""

from __future__ import annotations

import math

import torch


def _check(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: got {type(t).__name__}, expected a torch.Tensor")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_b.shape: got {tuple(out_b.shape)}, expected out_a's {tuple(out_a.shape)}")
    if out_a.dim() < 3:
        raise ValueError(f"out_a.shape: got {tuple(out_a.shape)}, expected [..., S, H, Dl]")
    *lead, S, H, _ = out_a.shape
    want = (*lead, H, S)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(lse.shape) != want:
            raise ValueError(f"{name}.shape: got {tuple(lse.shape)}, expected [..., H, S]={list(want)} "
                             "(out is [..., S, H, Dl])")
    devices = {t.device for t in (out_a, lse_a, out_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"devices: got {sorted(map(str, devices))}, expected all four on one device")


def _merged(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged (out, lse) in fp32."""
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)   # both empty: weights exp(-inf) = 0
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    lse = m + torch.log(total)                                   # log(0) = -inf for empty rows
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # Weights in out's [..., S, H, 1] order; a zero weight masks its part's out entirely, so an
    # empty part may hold anything (even NaN) without leaking into the result.
    wa = (wa * inv).transpose(-1, -2).unsqueeze(-1)
    wb = (wb * inv).transpose(-1, -2).unsqueeze(-1)
    zero = out_a.new_zeros((), dtype=torch.float32)
    out = torch.where(wa > 0, out_a.float() * wa, zero) + torch.where(wb > 0, out_b.float() * wb, zero)
    return out, lse


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets into the result over their union.

    Args:
        out_a, out_b: [..., S, H, Dl], any float dtype (e.g. bf16 from `verify_attention`).
        lse_a, lse_b: [..., H, S], natural-log log-sum-exp of each part (-inf: the part has no
            key for that row). The leading dims `...` (e.g. B) match out's.

    Returns:
        (out [..., S, H, Dl] in out_a's dtype, lse [..., H, S] fp32). Math is fp32. A row empty
        in both parts gives out = 0, lse = -inf.

    For FlashInfer-style [N, H, D] outputs with [N, H] lse, pass `lse.transpose(-1, -2)` views.
    """
    _check(out_a, lse_a, out_b, lse_b)
    out, lse = _merged(out_a, lse_a, out_b, lse_b)
    return out.to(out_a.dtype), lse


def merge_states_(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                  lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-place `merge_states`: writes the merged result into out_a and lse_a, returns them.

    Same shapes and semantics as `merge_states`; lse_a must be a floating tensor (fp32 keeps
    full precision).
    """
    _check(out_a, lse_a, out_b, lse_b)
    out, lse = _merged(out_a, lse_a, out_b, lse_b)
    out_a.copy_(out)
    lse_a.copy_(lse)
    return out_a, lse_a
