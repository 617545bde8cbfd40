"""Peer timings measured on the H200: the bars each shape must beat.

CUDA graph replay, µs per call, bf16, page size 64, causal masks unless noted. `prefix`
excludes the S draft tokens (N = prefix + S keys per request). `floor_us` is the floor
(`mlagen.tools.floor`) at ~4.25 TB/s copy and ~785 TFLOP/s bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

PEER_GPU = "NVIDIA H200"


@dataclass(frozen=True)
class PeerRow:
    heads: int
    batch: int
    seqlen_q: int
    prefix: int
    floor_us: float
    torch_eager_us: float
    sglang_causal_us: float | None   # SGLang's Triton extend-attention kernel; None: not measured
    sglang_tree_us: float | None
    flashmla_us: float               # DeepSeek's FlashMLA (sm_90a only, causal only)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.heads, self.batch, self.seqlen_q, self.prefix)


PEERS: tuple[PeerRow, ...] = (
    PeerRow(64, 1, 9, 256, 0.4, 43.6, 41, 50, 17.6),
    PeerRow(64, 1, 9, 1024, 1.6, 64.1, 141, 151, 20.9),
    PeerRow(64, 1, 9, 4096, 6.5, 135.9, 535, 550, 33.6),
    PeerRow(64, 1, 9, 16384, 26.1, 403.6, 2117, 2172, 55.2),
    PeerRow(64, 1, 9, 65536, 104.5, 1480.8, 9824, 9870, 136.2),
    PeerRow(64, 1, 9, 131072, 208.9, 2917.5, None, None, 246.4),
    PeerRow(64, 1, 33, 256, 1.7, 67.1, 42, 51, 20.8),
    PeerRow(64, 1, 33, 4096, 24.1, 396.9, 534, 549, 47.4),
    PeerRow(64, 1, 33, 65536, 383.2, 5030.7, 9862, 9896, 442.5),
    PeerRow(64, 8, 9, 4096, 52.3, 875.7, 2488, 2540, 82.0),
    PeerRow(64, 32, 9, 4096, 209.4, 2886.1, 10060, 10288, 260.2),
    PeerRow(64, 64, 2, 8192, 185.7, 1674.3, 40873, 41552, 256.8),
    PeerRow(64, 128, 1, 4096, 146.6, 1751.8, None, None, 190.0),
    PeerRow(128, 1, 9, 65536, 208.9, 2765.4, 9863, 9896, 246.5),
    PeerRow(128, 32, 4, 4096, 185.9, 1627.5, 20030, 20498, 218.1),
    PeerRow(16, 64, 4, 4096, 73.3, 540.0, 5163, 5290, 126.1),
    PeerRow(8, 16, 9, 16384, 71.8, 1366.6, 2484, 2502, 132.0),
)

_BY_SHAPE = {p.shape: p for p in PEERS}


def peer(heads: int, batch: int, seqlen_q: int, prefix: int) -> PeerRow | None:
    """The peer row of this shape, or None where PEERS has none."""
    return _BY_SHAPE.get((heads, batch, seqlen_q, prefix))
