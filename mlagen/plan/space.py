"""The variant space `mlagen tune` searches, in a fixed order of promise.

A structure is a variant with an adaptive split: family, head tile, q tile, block_n, warps,
stages (and on sm_90a where P·V runs).
Tile shapes come first by how often the KV is read (ceil(S/q_tile) * H/head_tile
passes over it per request: fewer is better), each with its most common knobs; knob variations
of the best tile shapes follow. Splits are searched separately (`split_variants`), since they
are launch parameters that do not change the compiled code, and the knobs that each make a
kernel of their own (16-bit partial rows, TMA tile loads) last (`twin_variants`), on the
fastest variants found.
"""

from __future__ import annotations

import itertools

from ..dsl.spec import Family, Problem, Variant, naive
from .families import FAMILIES, family_of
from .schedules import SCHEDULES
from .tiles import MAX_ROWS, enumerate_tiles
from .validate import MAX_CLUSTER, is_valid

SEARCH_BLOCK_NS = (32, 64)     # block_n the tuner tries: FLASH_BLOCK_NS (MMA_BLOCK_NS adds 128)
WARPS = (8, 4, 16)
STAGES = (2, 1, 3)
MMA_PV = (False, True)         # sm_90a: P·V on wgmma, or on mma.sync (valid nowhere else)
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
CLUSTER_SIZES = (2, 4, 8)   # cluster splits the tuner times (each size is its own kernel)
KNOB_TILE_SHAPES = 3           # tile shapes whose knob variations are searched


def tile_shapes(heads: int, seqlen_q: int) -> list[tuple[int, int]]:
    """The (head_tile, q_tile) pairs the tuner searches: those of balanced q tiles up to
    `tiles.MAX_ROWS` rows (`tiles.enumerate_tiles`), fewest KV passes first, then fewest rows
    (less padding), then the widest head tile."""
    shapes = enumerate_tiles(heads, seqlen_q, MAX_ROWS, balanced=True)
    return sorted(shapes, key=lambda hq: (-(-seqlen_q // hq[1]) * (heads // hq[0]), hq[0] * hq[1], -hq[0]))


def structures(problem: Problem, seqlen_q: int, arch: str, family: Family,
               limit: int | None = None) -> list[Variant]:
    """Valid adaptive-split variants of `family` for S=seqlen_q on `arch`, most promising first
    (an untiled family's, `KernelFamily.tiled`: its variant of 4 warps, then of 8). For queries
    in a format the family's own loops do not read (e4m3), the structures of the same problem
    with 16-bit queries on each schedule that reads them (`TileSchedule.q_formats`; fp8_mma),
    where valid."""
    if not FAMILIES[family].tiled:
        naives = [v for v in (naive(arch=arch, warps=4), naive(arch=arch, warps=8)) if is_valid(problem, v)]
        return naives[:limit]
    if problem.fp8_q and not FAMILIES[family].fp8_q:
        adopted = [s.adopt(v) for v in structures(problem.with_(q_format="dtype"), seqlen_q, arch, family)
                   for s in SCHEDULES.values() if s.serves(problem, v)]
        return list(dict.fromkeys(v for v in adopted if is_valid(problem, v)))[:limit]
    knobs = list(itertools.product(SEARCH_BLOCK_NS, WARPS, STAGES, MMA_PV))
    shapes = tile_shapes(problem.heads, seqlen_q)

    def make(shape: tuple[int, int], knob: tuple[int, int, int, bool]) -> Variant:
        return Variant(family=family, head_tile=shape[0], q_tile=shape[1], kv_split="adaptive",
                       block_n=knob[0], warps=knob[1], stages=knob[2], arch=arch, mma_pv=knob[3])

    found: list[Variant] = []
    # Tier 0: each tile shape once, with the first knobs that fit it.
    firsts: list[Variant] = []
    for shape in shapes:
        v = next((make(shape, k) for k in knobs if is_valid(problem, make(shape, k))), None)
        if v is not None:
            firsts.append(v)
    found.extend(firsts)
    # Tier 1: the other knobs of the best few tile shapes; they come after every tile shape
    # of tier 0 only when the limit leaves room, so reserve a third of it for them.
    if limit is not None:
        found = found[: max(1, limit - limit // 3)]
    for v in firsts[:KNOB_TILE_SHAPES]:
        for k in knobs:
            w = make((v.head_tile, v.q_tile), k)
            if w not in found and is_valid(problem, w):
                found.append(w)
    return found[:limit]


def split_variants(problem: Problem, variant: Variant, kv_capacity: int, skip: int) -> list[Variant]:
    """`variant` with each fixed split that leaves every split at least one KV tile, except
    `skip` (the split its adaptive rule already picks); for a family that takes the knobs
    (`KernelFamily.knobs`: the mma family) also the balanced split, the cluster splits of
    CLUSTER_SIZES that `problem` and the arch allow, and the schedules that run a tile a block
    of a cluster (the P exchange) where the block table holds few enough tiles
    (`tile_a_block_variants`)."""
    tiles = max(1, -(-kv_capacity // variant.block_n))
    fixed = [variant.with_(kv_split=s) for s in SPLITS if s <= tiles and s != skip]
    if not family_of(variant).knobs:
        return fixed
    clusters = [variant.with_(kv_split=s, combine="cluster") for s in CLUSTER_SIZES if s <= tiles]
    return (fixed + [variant.with_(kv_split="balanced")] + [c for c in clusters if is_valid(problem, c)]
            + tile_a_block_variants(problem, variant, kv_capacity))


def tile_a_block_variants(problem: Problem, variant: Variant, kv_capacity: int) -> list[Variant]:
    """`variant`'s tile on each schedule that runs one KV tile a block of a cluster
    (`TileSchedule.tile_a_block`: the P exchange), over the smallest cluster that gives every
    tile of the block table a block of its own, where one fits."""
    found = []
    for schedule in SCHEDULES.values():
        if not schedule.tile_a_block:
            continue
        base = schedule.adopt(variant)
        tiles = max(1, -(-kv_capacity // base.block_n))
        found += [v for v in (base.with_(kv_split=size) for size in range(max(2, tiles), MAX_CLUSTER + 1))
                  if is_valid(problem, v)][:1]
    return found


def structure_of(v: Variant) -> Variant:
    """`v` as a structure: its adaptive-split, knob-free form (what `structures` lists)."""
    defaults = Variant()
    return v.with_(kv_split=defaults.kv_split, combine=defaults.combine, partials=defaults.partials,
                   loads=defaults.loads, schedule=defaults.schedule)


def twin_variants(problem: Problem, variants: list[Variant]) -> list[Variant]:
    """The knob twins of each of `variants` of a family that takes the knobs
    (`KernelFamily.knobs`) that the tuner times last, in order: with 16-bit partials (a variant
    that exchanges partial rows between split blocks: its split is not 1), with TMA loads, with
    both, then on each schedule that twins the variant's (`TileSchedule.twin`: a lockstep
    variant as the seesaw, which loads with TMA) with its partials and with 16-bit ones, where
    valid for `problem`; each once, none of `variants`."""
    found: list[Variant] = []
    for v in variants:
        if not family_of(v).knobs:
            continue
        split = v.kv_split != 1
        twins = [w for w in (s.twin(v) for s in SCHEDULES.values()) if w is not None]
        knobs = ([v.with_(partials="16bit")] * split + [v.with_(loads="tma")]
                 + [v.with_(partials="16bit", loads="tma")] * split
                 + [t for w in twins for t in [w] + [w.with_(partials="16bit")] * split])
        for w in knobs:
            if w not in variants and w not in found and is_valid(problem, w):
                found.append(w)
    return found
