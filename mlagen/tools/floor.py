"""The floor of a shape: the time no kernel can beat on a GPU with the measured ceilings.

bytes: every request's KV read once, q read, out written; flops: both products,
2*B*S*H*N*(Dl+Dr) for the scores plus 2*B*S*H*N*Dl for the values. The floor is the larger of
bytes / copy bandwidth and flops / matrix rate. On the H200: ~4.25 TB/s copy (read + write),
~785 TFLOP/s bf16, as `mlagen bench` measures them.

An FP8 cache's floor counts its own row bytes (576 for e4m3, 656 for DeepSeek's ds_mla rows);
with e4m3 queries, q at one byte an element and the flops at the FP8 matrix rate where the
run measured one (the bf16 rate otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dsl.kv_layout import E4M3_BYTES, row_bytes


@dataclass(frozen=True)
class Ceilings:
    """Measured on the device in the same run."""

    copy_bytes_per_s: float     # device-to-device copy, read + write bytes counted
    matmul_flops_per_s: float   # dense bf16 matmul
    fp8_matmul_flops_per_s: float | None = None   # dense e4m3 matmul; None where the GPU has none


def floor_bytes(heads: int, batch: int, seqlen_q: int, keys: int, dl: int = 512, dr: int = 64,
                elem_bytes: int = 2, kv_format: str = "dtype", q_format: str = "dtype") -> int:
    """KV read once per request, q read, out written (lse ignored: it is 4*B*H*S bytes).
    elem_bytes: the 16-bit cache's, q's and out's; an FP8 kv_format counts its row bytes
    (`kv_layout.row_bytes`), q_format "e4m3" one byte a query element."""
    kv_row = row_bytes(kv_format, dl + dr, elem_bytes)
    q_elem = E4M3_BYTES if q_format == "e4m3" else elem_bytes
    return batch * keys * kv_row + batch * seqlen_q * heads * ((dl + dr) * q_elem + dl * elem_bytes)


def floor_flops(heads: int, batch: int, seqlen_q: int, keys: int, dl: int = 512, dr: int = 64) -> int:
    """2*B*S*H*N*((Dl+Dr) + Dl): q.k over Dl+Dr dims and p.v over Dl."""
    return 2 * batch * seqlen_q * heads * keys * (dl + dr + dl)


def floor_us(heads: int, batch: int, seqlen_q: int, keys: int, ceilings: Ceilings,
             dl: int = 512, dr: int = 64, elem_bytes: int = 2, kv_format: str = "dtype",
             q_format: str = "dtype") -> float:
    """max(bytes / bandwidth, flops / rate) in µs; e4m3 queries take the FP8 rate when measured."""
    nbytes = floor_bytes(heads, batch, seqlen_q, keys, dl, dr, elem_bytes, kv_format, q_format)
    t_mem = nbytes / ceilings.copy_bytes_per_s
    rate = ceilings.matmul_flops_per_s
    if q_format == "e4m3" and ceilings.fp8_matmul_flops_per_s:
        rate = ceilings.fp8_matmul_flops_per_s
    t_math = floor_flops(heads, batch, seqlen_q, keys, dl, dr) / rate
    return max(t_mem, t_math) * 1e6
