"""Choosing a variant and a split for a shape, without touching the device.

`choose_variant` answers, in this order:
1. The tuned table for this GPU and arch (`mlagen.tables`: shipped defaults under the user's
   `mlagen tune` results): the entry of the shape's bucket (heads, Dl, Dr, dtype, page size,
   mask, S, log2 batch, log2 KV capacity); else the same bucket tuned with a causal mask (a mask
   changes only which scores are dropped, not the tiling that wins); else the bucket one KV
   length step (a factor of two) shorter or longer. An entry whose variant does not validate
   for this problem (another problem's tables, a family that changed) is passed over.
2. The heuristic: the flash family; put as many query rows (positions x heads) in a block as its
   thread mapping holds, so each KV tile is loaded for as many rows as possible; then split the
   key range until the grid fills the GPU about twice, but keep every split at least a few KV
   tiles long (short splits cost more in the combine than they save).
Answers are memoized per shape: a call costs one cache lookup, no file I/O.
"""

from __future__ import annotations

import functools

from . import tables
from .space import structures
from .spec import Problem, Variant, naive, parse_variant
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


def _tuned_keys(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int) -> list[str]:
    """Bucket keys to try, best match first (see the module docstring)."""
    masks = [problem.mask] + (["causal"] if problem.mask != "causal" else [])
    keys = [tables.bucket_key(problem, seqlen_q, batch, kv_capacity, m) for m in masks]
    for cap in (kv_capacity // 2, kv_capacity * 2):
        keys += [tables.bucket_key(problem, seqlen_q, batch, cap, m) for m in masks]
    return list(dict.fromkeys(keys))


def tuned_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                  gpu: str, family: str | None = None) -> Variant | None:
    """The tuned table's pick (within `family` if given) for this shape, or None."""
    entries = tables.entries_for(gpu, arch)
    if not entries:
        return None
    for key in _tuned_keys(problem, seqlen_q, batch, kv_capacity):
        entry = entries.get(key)
        if entry is None:
            continue
        name = entry.get("variant") if family is None else entry.get("families", {}).get(family, {}).get("variant")
        if not name:
            continue
        try:
            v = parse_variant(name)
            if v.arch == arch:
                validate(problem, v)
                return v
        except (ValueError, SpecError):
            continue
    return None


@functools.lru_cache(maxsize=8192)
def choose_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                   gpu: str = "") -> Variant:
    """The variant `verify_attention(variant=None)` runs for this shape on a `gpu` of `arch`.

    kv_capacity: keys the block table addresses (max_pages * page_size), a bound on lengths.
    """
    tuned = tuned_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu)
    return tuned if tuned is not None else heuristic_variant(problem, seqlen_q, arch)


def family_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                   gpu: str, family: str) -> Variant | None:
    """The dispatcher's choice restricted to one family (the bench's per-family column): the
    tuned one, else the family's default; None when no variant of the family validates."""
    tuned = tuned_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu, family)
    if tuned is not None:
        return tuned
    if family == "naive":
        return naive(arch=arch)
    if family == "flash":
        try:
            return heuristic_variant(problem, seqlen_q, arch)
        except SpecError:
            return None
    found = structures(problem, seqlen_q, arch, family, limit=1)
    return found[0] if found else None


def reset() -> None:
    """Forget memoized choices and tables (after a tune wrote a new table)."""
    tables.reset()
    choose_variant.cache_clear()


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
