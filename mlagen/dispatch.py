"""Choosing a variant and a split for a shape, without touching the device.

The heuristic: put as many query rows (positions x heads) in a block as the family's thread
mapping holds, so each KV tile is loaded for as many rows as possible; then split the key range
until the grid fills the GPU about twice, but keep every split at least a few KV tiles long
(short splits cost more in the combine than they save).
"""

from __future__ import annotations

import functools

from .spec import Problem, Variant
from .validate import SpecError, validate

MAX_FLASH_ROWS = 64        # 8 warps x 8 rows: the scalar kernel's accumulator budget
WAVES = 2                  # blocks per SM the split aims for
MIN_TILES_PER_SPLIT = 4    # shortest split, in KV tiles
MAX_SPLITS = 128


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def heuristic_variant(problem: Problem, seqlen_q: int, arch: str) -> Variant:
    """The flash variant for `problem` at S=seqlen_q on `arch`: the largest row tile that fits."""
    q_tiles = -(-seqlen_q // 8)
    q_tile = -(-seqlen_q // q_tiles)            # balanced tiles of at most 8 positions
    last_error: SpecError | None = None
    # More rows per block beat a deeper pipeline: rows are KV reuse.
    for head_tile in sorted(_divisors(problem.heads), reverse=True):
        if q_tile * head_tile > MAX_FLASH_ROWS:
            continue
        for stages in (2, 1):
            v = Variant(family="flash", head_tile=head_tile, q_tile=q_tile, kv_split="adaptive",
                        block_n=32, warps=8, stages=stages, arch=arch)
            try:
                validate(problem, v)
                return v
            except SpecError as e:
                last_error = e
    raise SpecError("problem", problem.name, f"a shape some flash variant can hold on {arch} "
                    f"(last refusal: {last_error})")


def num_splits(variant: Variant, heads: int, batch: int, seqlen_q: int, kv_capacity: int,
               sm_count: int) -> int:
    """Splits of the key range for one launch; `kv_capacity` bounds every request's length."""
    if variant.family == "naive":
        return 1
    if variant.kv_split != "adaptive":
        return int(variant.kv_split)
    blocks = batch * -(-seqlen_q // variant.q_tile) * (heads // variant.head_tile)
    want = -(-WAVES * sm_count // max(blocks, 1))
    tiles = -(-kv_capacity // variant.block_n)
    most = max(1, tiles // MIN_TILES_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))
