"""The tensor-core family's heuristic tile choice: the mma variant the dispatcher starts from
for a shape no table covers (`heuristic_mma`)."""

from __future__ import annotations

from ..dsl.arch import specializations
from ..dsl.errors import SpecError
from ..dsl.spec import Problem, Variant
from ..plan.validate import validate

# Heuristic tile choice: a block's KV stream costs about as much as this many rows of mma work
# (per key, a block reads 1152 bytes and each row does 2*1088 flops).
ROW_COST_OF_A_BLOCK = 24
MAX_ROWS = 64
# sm_90a's wgmma scores run rows 1.25-1.45x faster than mma.sync on the H200 (H=64 S=9 at 65536
# keys: 345 µs against 453).
WGMMA_COST = 0.75


def _tile_shapes(heads: int, seqlen_q: int) -> list[tuple[int, int, int]]:
    """(cost, q_tile, head_tile) of the tiles holding at most MAX_ROWS rows, cheapest first:
    padded rows plus ROW_COST_OF_A_BLOCK per block (each block streams the KV once)."""
    shapes = []
    for head_tile in (d for d in range(1, heads + 1) if heads % d == 0):
        for q_tile in range(1, min(seqlen_q, MAX_ROWS // head_tile) + 1):
            blocks = -(-seqlen_q // q_tile) * (heads // head_tile)
            padded = blocks * (-(-(q_tile * head_tile) // 16) * 16)
            shapes.append((padded + ROW_COST_OF_A_BLOCK * blocks, -q_tile * head_tile, q_tile, head_tile))
    return [(cost, q, h) for cost, _, q, h in sorted(shapes)]


def _fitting(problem: Problem, q_tile: int, head_tile: int, arch: str) -> Variant | None:
    """The widest KV tile and deepest pipeline that fit `arch` for this tile shape, or None.
    On sm_90a the splits exchange 16-bit partial rows (`part16`: on the H200 1.5-2.8 µs less on
    short split rows, batched rows within noise)."""
    m_pad = -(-(q_tile * head_tile) // 16) * 16
    for block_n, stages in ((64, 2), (32, 3), (32, 2), (64, 1), (32, 1)):
        v = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, kv_split="adaptive",
                    block_n=block_n, warps=max(4, m_pad // 8), stages=stages, arch=arch,
                    part16=arch == "sm_90a")
        try:
            validate(problem, v)
            return v
        except SpecError:
            continue
    return None


def heuristic_mma(problem: Problem, seqlen_q: int, arch: str, specialize: bool = True) -> Variant | None:
    """The mma variant for `problem` at S=seqlen_q on a device of target `arch`, or None.

    Per target the device runs (`arch`, and with `specialize` sm_90a on Hopper), the cheapest
    tile shape of `_tile_shapes` that some variant fits; across targets, wgmma's measured
    speed-up weighs in.
    """
    best: tuple[float, Variant] | None = None
    shapes = _tile_shapes(problem.heads, seqlen_q)
    for target in (arch, *(specializations(arch) if specialize else ())):
        weight = WGMMA_COST if target == "sm_90a" else 1.0
        for cost, q_tile, head_tile in shapes:
            v = _fitting(problem, q_tile, head_tile, target)
            if v is not None:
                if best is None or cost * weight < best[0]:
                    best = (cost * weight, v)
                break
    return None if best is None else best[1]
