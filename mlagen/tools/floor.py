"""The floor of a shape: the time no kernel can beat on a GPU with the measured ceilings.

bytes: every request's KV read once, q read, out written; flops: both products,
2*B*S*H*N*(Dl+Dr) for the scores plus 2*B*S*H*N*Dl for the values. The floor is the larger of
bytes / copy bandwidth and flops / matrix rate. On the H200: ~4.25 TB/s copy (read + write),
~785 TFLOP/s bf16, as `mlagen bench` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceilings:
    """Measured on the device in the same run."""

    copy_bytes_per_s: float     # device-to-device copy, read + write bytes counted
    matmul_flops_per_s: float   # dense bf16 matmul


def floor_bytes(heads: int, batch: int, seqlen_q: int, keys: int, dl: int = 512, dr: int = 64,
                elem_bytes: int = 2) -> int:
    """KV read once per request, q read, out written (lse ignored: it is 4*B*H*S bytes)."""
    kv = batch * keys * (dl + dr)
    q = batch * seqlen_q * heads * (dl + dr)
    out = batch * seqlen_q * heads * dl
    return (kv + q + out) * elem_bytes


def floor_flops(heads: int, batch: int, seqlen_q: int, keys: int, dl: int = 512, dr: int = 64) -> int:
    """2*B*S*H*N*((Dl+Dr) + Dl): q.k over Dl+Dr dims and p.v over Dl."""
    return 2 * batch * seqlen_q * heads * keys * (dl + dr + dl)


def floor_us(heads: int, batch: int, seqlen_q: int, keys: int, ceilings: Ceilings,
             dl: int = 512, dr: int = 64, elem_bytes: int = 2) -> float:
    """max(bytes / bandwidth, flops / rate) in µs."""
    t_mem = floor_bytes(heads, batch, seqlen_q, keys, dl, dr, elem_bytes) / ceilings.copy_bytes_per_s
    t_math = floor_flops(heads, batch, seqlen_q, keys, dl, dr) / ceilings.matmul_flops_per_s
    return max(t_mem, t_math) * 1e6
