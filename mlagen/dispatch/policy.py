"""Choosing a variant and a split for a shape on a device, without touching the device.

Every figure the choice compares a shape against is a field of one frozen dataclass,
`DispatchPolicy`, built for a device by `policy_for(arch, sm_count, smem_per_block)`: the
thresholds of work per SM count over the device's SMs, and every pick fits the device's shared
memory per block. `H200` is the policy of the device the figures were measured on (132 SMs),
the default of every caller without a device.

`choose_variant` answers, in this order:
1. The tuned table for this GPU and arch (`mlagen.dispatch.tables`: shipped defaults under the user's
   `mlagen tune` results): the entry of the shape's bucket (heads, Dl, Dr, dtype, page size,
   mask, S, log2 batch, log2 KV capacity); else the same bucket tuned with a causal mask (a mask
   changes only which scores are dropped, not the tiling that wins); else the bucket one KV
   length step (a factor of two) shorter or longer. An entry whose variant does not validate
   for this problem (another problem's tables, a family that changed) or does not fit the
   device's shared memory is passed over.
2. The heuristic: the tensor-core (mma) family wherever one of its variants fits the arch, else
   the scalar flash family; put as many query rows (positions x heads) in a block as the
   family's register budget holds, so each KV tile is loaded for as many rows as possible
   (`heuristic_mma`, `flash_heuristic`); on sm_90a, a launch with many KV tiles of
   work per SM runs that tile on the seesaw schedule with TMA loads, and a short one that fits
   one wave as a P exchange (`untuned_variant`, `exchange_tile`); then
   split the key range by a small cost model of waves, tiles per block and the merge
   (`num_splits`).
Then, whichever answered, a batch (B >= 2) on the mma family runs the chosen tile with the
balanced split, whose ranges follow the real lengths on the device (`balanced_for_batch`); and
the block table has its say: a P exchange whose cluster cannot hold the keys the table
addresses gives way to the choice for the whole table, and a balanced split whose work list
cannot count the table's tiles runs its tile with the adaptive split.
Answers are memoized per shape: a call costs one cache lookup, no file I/O.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..dsl.arch import get_arch, runs_on, specializations
from ..dsl.errors import SpecError
from ..dsl.spec import Problem, Variant, naive, parse_variant
from ..plan.families import FAMILIES, family_of
from ..plan.mma_plan import padded_rows
from ..plan.schedules import SCHEDULES, SEESAW, TRANSPOSED, schedule_of
from ..plan.space import tile_a_block_variants
from ..plan.tiles import FLASH_Q_TILE, balanced_q_tile, enumerate_tiles
from ..plan.validate import MAX_CLUSTER, SEGMENT_TILES, split_unit, validate
from . import tables

# The balanced split's work list counts positions in int32 on the device (templates/split_work_list.cuh.j2):
# every request's KV tiles and SEGMENT_TILES more, and per range (fewer than 2^16) a few more, so
# its requests' tiles must leave that margin below 2^31 (`balanced_list_fits`). A limit of the
# rendered kernel, the same on every device, not a threshold of the policy.
BALANCED_LIST_POSITIONS = 2**31 - 2**20


@dataclass(frozen=True)
class DispatchPolicy:
    """The figures the dispatcher compares a shape against, for one device.

    `sm_count` and `smem_per_block` describe the device. Of the thresholds, those of work per
    SM (`seesaw_tiles_per_sm`, `pdl_tiles_per_sm`) and in waves (`exchange_waves`) are compared
    with work over the whole device, `sm_count` times the figure (`seesaw_tiles`, `pdl_tiles`,
    `exchange_blocks`): they say how full the device is, and a device with fewer SMs fills at
    less work. The others count rows, tiles or time per block, which an SM runs the same
    whatever the count, and hold on every device. Each figure was measured on the H200
    (132 SMs); `policy_for` builds a device's policy, `H200` is that device's."""

    # The device.
    sm_count: int            # SMs: one wave runs sm_count blocks of one block per SM
    smem_per_block: int      # dynamic shared memory a block may opt into, bytes: every pick fits it

    # --- Scale with the SM count: compared with work over the whole device.

    # Without a table entry, an sm_90a tile runs the seesaw schedule (with TMA tile loads) from
    # this many KV tiles of work (row groups x requests x tiles) per SM, and a request whose rows
    # fit one transposed tile runs that tile from as many over its one row group: below it a
    # pair's chain and a block's fixed costs outweigh what they hide. The threshold may be
    # conservative; the table covers the rows near it (docs/performance.md, "Dispatch
    # thresholds"). Scales: the figures are work per SM, and the same launch gives each SM of a
    # device with fewer SMs more tiles.
    seesaw_tiles_per_sm: int = 12
    # Captured into a CUDA graph, an sm_90+ launch of at most this many KV tiles of work per SM
    # goes as a programmatic dependent (`dependent_in_graphs`): short launches gain, long ones pay
    # (docs/performance.md). Scales: the gain is a short kernel's launch and tail hidden behind
    # the kernel before it, and how short a launch runs is its work per SM.
    pdl_tiles_per_sm: int = 24
    # A short launch runs as a P exchange (`exchange_tile`) where its blocks, row groups x
    # requests x cluster size, fit this many waves of one block per SM: past one wave the
    # cluster split wins (docs/performance.md). Scales: in waves of sm_count blocks.
    exchange_waves: int = 1

    # --- Do not scale: per block, per row or per tile, the same on every device.

    # A P exchange gives every KV tile of the block table a block of one cluster, so it runs
    # where the table holds at most this many tiles of 64 keys: the largest cluster every sm_90
    # GPU schedules (`validate.MAX_CLUSTER`; 6 and 7 do not fit shared memory, so 8 takes 6-8
    # tiles). Does not scale: a cluster's size, not the device's.
    exchange_max_tiles: int = MAX_CLUSTER
    # The mma heuristic's tile (`heuristic_mma`): a block's KV stream costs about as much as this
    # many rows of mma work (per key, a block reads 1152 bytes and each row does 2*1088 flops).
    # Does not scale: the cost of one block against its own rows.
    row_cost_of_a_block: int = 24
    # Rows (q_tile x head_tile) an mma block holds at most: 8 warps of 128 fp32 accumulators a
    # thread (`arch.accumulator_budget`), and the height of a wgmma tile. Does not scale: a block's
    # register budget.
    max_mma_rows: int = 64
    # sm_90a's wgmma scores run rows faster than mma.sync (docs/performance.md); the heuristic
    # weighs wgmma tiles' costs by this. Does not scale: the speed of one SM's tensor cores.
    wgmma_cost: float = 0.75
    # Rows the scalar flash block holds at most: 8 warps x 8 rows, its accumulator budget. Does
    # not scale: a block's register budget.
    max_flash_rows: int = 64
    # A batch of at least this many requests runs an mma pick with the balanced split
    # (`balanced_for_batch`): ragged batches gain much more than uniform ones pay
    # (docs/performance.md). Does not scale: ragged lengths idle SMs on any device; one request
    # has no raggedness.
    balanced_batch: int = 2
    # The split-count model's costs (`num_splits`), in KV-tile times of one block: the merge
    # blocks' wait and start, and per query row and split the partial's 4 KB written and read
    # back. Do not scale: the model counts the waves over sm_count itself; these are costs of one
    # block and one row.
    merge_tiles: float = 0.75
    split_tiles_per_row: float = 3.4e-4
    # The adaptive split's largest count. Does not scale: the C++ launchers' `default_num_splits`
    # renders it as a constant and takes the SM count at run time, and every split adds partials
    # the merge reads; the model's waves already weigh the SMs.
    max_splits: int = 128

    @property
    def seesaw_tiles(self) -> int:
        """KV tiles of work from which an sm_90a tile runs the seesaw (or the transposed tile)."""
        return self.seesaw_tiles_per_sm * self.sm_count

    @property
    def pdl_tiles(self) -> int:
        """KV tiles of work up to which a launch goes as a programmatic dependent in graphs."""
        return self.pdl_tiles_per_sm * self.sm_count

    @property
    def exchange_blocks(self) -> int:
        """Blocks a P exchange's launch may have."""
        return self.exchange_waves * self.sm_count

    def fits(self, problem: Problem, variant: Variant) -> bool:
        """Whether `variant` validates for `problem` and its block fits `smem_per_block`."""
        try:
            return validate(problem, variant).smem_bytes <= self.smem_per_block
        except SpecError:
            return False


# The device every figure was measured on: NVIDIA H200, 132 SMs, 227 KB of shared memory per block.
H200 = DispatchPolicy(sm_count=132, smem_per_block=227 * 1024)


def policy_for(arch: str, sm_count: int, smem_per_block: int | None = None) -> DispatchPolicy:
    """The dispatch policy of a device of target `arch` with `sm_count` SMs and `smem_per_block`
    bytes of shared memory a block may opt into (default, and at most: the arch's): `H200`'s
    thresholds, those of work per SM counted over `sm_count`. Raises ValueError for an unknown
    arch, fewer than one SM or no shared memory."""
    limit = get_arch(arch).smem_per_block
    if sm_count < 1:
        raise ValueError(f"sm_count: got {sm_count}, expected at least 1")
    if smem_per_block is not None and smem_per_block < 1:
        raise ValueError(f"smem_per_block: got {smem_per_block}, expected a positive byte count")
    smem = limit if smem_per_block is None else min(smem_per_block, limit)
    return dataclasses.replace(H200, sm_count=sm_count, smem_per_block=smem)


def _row_groups(variant: Variant, heads: int, seqlen_q: int) -> int:
    """Row groups (query tiles x head tiles) of one request under `variant`."""
    return -(-seqlen_q // variant.q_tile) * (heads // variant.head_tile)


def _tile_shapes(heads: int, seqlen_q: int, policy: DispatchPolicy) -> list[tuple[int, int, int]]:
    """(cost, q_tile, head_tile) of the tiles holding at most `max_mma_rows` rows, every q tile
    length (`tiles.enumerate_tiles`), cheapest first: padded rows plus `row_cost_of_a_block` per
    block (each block streams the KV once); of equal cost, the most rows, then the shortest q tile."""
    shapes = []
    for head_tile, q_tile in enumerate_tiles(heads, seqlen_q, policy.max_mma_rows):
        blocks = -(-seqlen_q // q_tile) * (heads // head_tile)
        padded = blocks * padded_rows(q_tile * head_tile)
        shapes.append((padded + policy.row_cost_of_a_block * blocks, -q_tile * head_tile, q_tile, head_tile))
    return [(cost, q, h) for cost, _, q, h in sorted(shapes)]


def _fitting(problem: Problem, q_tile: int, head_tile: int, arch: str, policy: DispatchPolicy) -> Variant | None:
    """The widest KV tile and deepest pipeline that fit `arch` and the device's shared memory for
    this tile shape, or None. On sm_90a the splits exchange 16-bit partial rows (`partials`
    "16bit": less time on short split rows, the same on batched ones)."""
    m_pad = padded_rows(q_tile * head_tile)
    for block_n, stages in ((64, 2), (32, 3), (32, 2), (64, 1), (32, 1)):
        v = Variant(family="mma", head_tile=head_tile, q_tile=q_tile, kv_split="adaptive",
                    block_n=block_n, warps=max(4, m_pad // 8), stages=stages, arch=arch,
                    partials="16bit" if arch == "sm_90a" else "fp32")
        if policy.fits(problem, v):
            return v
    return None


def heuristic_mma(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy,
                  specialize: bool = True) -> Variant | None:
    """The mma variant for `problem` at S=seqlen_q on a device of target `arch`, or None.

    Per target the device runs (`arch`, and with `specialize` sm_90a on Hopper), the cheapest
    tile shape (padded rows plus `DispatchPolicy.row_cost_of_a_block` per block) that some variant fits;
    across targets, wgmma's measured speed-up (`DispatchPolicy.wgmma_cost`) weighs in.
    """
    best: tuple[float, Variant] | None = None
    shapes = _tile_shapes(problem.heads, seqlen_q, policy)
    for target in (arch, *(specializations(arch) if specialize else ())):
        weight = policy.wgmma_cost if target == "sm_90a" else 1.0
        for cost, q_tile, head_tile in shapes:
            v = _fitting(problem, q_tile, head_tile, target, policy)
            if v is not None:
                if best is None or cost * weight < best[0]:
                    best = (cost * weight, v)
                break
    return None if best is None else best[1]


@functools.lru_cache(maxsize=4096)
def heuristic_variant(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy) -> Variant:
    """The heuristic's pick: the tensor-core family where a variant fits (`heuristic_mma` says
    how it tiles), else the scalar flash family."""
    return heuristic_mma(problem, seqlen_q, arch, policy) or flash_heuristic(problem, seqlen_q, arch, policy)


@functools.lru_cache(maxsize=4096)
def flash_heuristic(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy) -> Variant:
    """The flash variant for `problem` at S=seqlen_q on `arch`: the largest row tile that fits
    (at most `DispatchPolicy.max_flash_rows` rows and the device's shared memory) of the
    balanced q tile of at most `tiles.FLASH_Q_TILE` positions (`tiles.balanced_q_tile`)."""
    q_tile = balanced_q_tile(seqlen_q, FLASH_Q_TILE)
    shapes = [(h, q) for h, q in enumerate_tiles(problem.heads, seqlen_q, policy.max_flash_rows, balanced=True)
              if q == q_tile]
    last_error: SpecError | None = None
    # More rows per block beat a deeper pipeline: rows are KV reuse.
    for head_tile, _ in reversed(shapes):
        for stages in (2, 1):
            v = Variant(family="flash", head_tile=head_tile, q_tile=q_tile, kv_split="adaptive",
                        block_n=32, warps=8, stages=stages, arch=arch)
            try:
                smem = validate(problem, v).smem_bytes
            except SpecError as e:
                last_error = e
                continue
            if smem <= policy.smem_per_block:
                return v
            last_error = SpecError("variant", v.name, f"at most {policy.smem_per_block} bytes of shared memory "
                                                      f"per block on this device, this variant needs {smem}")
    raise SpecError("problem", problem.name, f"a shape some flash variant can hold on {arch} "
                    f"(last refusal: {last_error})")


@functools.lru_cache(maxsize=4096)
def untuned_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                    policy: DispatchPolicy) -> Variant:
    """The pick for a shape no table covers: on a Hopper, a short launch that fits one wave as a
    P exchange (`exchange_tile`); else the heuristic's tile (`heuristic_variant`), on the
    seesaw schedule with TMA loads when it is an sm_90a mma tile with `DispatchPolicy.seesaw_tiles` or
    more KV tiles of work (`seesaw_tiles_per_sm` per SM; and the seesaw fits it: 64 rows, a
    page size TMA can box). Where a request's rows fit one transposed tile (`transposed_tile`)
    that tile runs instead, from the same work.

    Such a launch takes the balanced split, a single request too: one range per SM, so one wave,
    where the adaptive split's model goes to two or three waves from ~2000 tiles per row group
    and runs slower (docs/performance.md).

    An FP8 cache runs on the heuristic's mma tile that stages its rows (`fp8_tile`), where one
    fits, and e4m3 queries over an e4m3 cache on that tile's fp8_mma schedule on sm_90a; the
    others, and FP8 inputs where no tile fits, on the naive kernel (`fp8_variant`). Gathered
    keys run on `gathered_variant`."""
    if problem.gathered:
        return gathered_variant(problem, arch, policy)
    if problem.fp8:
        return fp8_tile(problem, seqlen_q, arch, policy) or fp8_variant(arch)
    exchange = exchange_tile(problem, seqlen_q, batch, kv_capacity, arch, policy)
    if exchange is not None:
        return exchange
    v = heuristic_variant(problem, seqlen_q, arch, policy)
    transposed = transposed_tile(problem, seqlen_q, arch, policy)
    if transposed is not None and batch * -(-kv_capacity // transposed.block_n) >= policy.seesaw_tiles:
        return transposed
    if not SEESAW.takes(v):
        return v
    tiles = -(-kv_capacity // v.block_n)
    if _row_groups(v, problem.heads, seqlen_q) * batch * tiles < policy.seesaw_tiles:
        return v
    seesaw = SEESAW.twin(v)
    balanced = seesaw.with_(kv_split="balanced") if seesaw is not None else None
    return balanced if balanced is not None and policy.fits(problem, balanced) else v


def exchange_tile(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                  policy: DispatchPolicy) -> Variant | None:
    """The heuristic's sm_90a tile as a P exchange (a cluster with one KV tile a block,
    `space.tile_a_block_variants`) where the block table holds at most
    `DispatchPolicy.exchange_max_tiles` tiles of 64 keys and the launch's blocks, row groups x
    requests x cluster size, fit `DispatchPolicy.exchange_blocks` (one wave of the device's
    SMs); None elsewhere."""
    if not runs_on("sm_90a", arch) or -(-kv_capacity // 64) > policy.exchange_max_tiles:
        return None
    v = heuristic_variant(problem, seqlen_q, arch, policy)
    if v.arch != "sm_90a":
        return None
    found = [w for w in tile_a_block_variants(problem, v, kv_capacity) if policy.fits(problem, w)]
    if not found or batch * _row_groups(found[0], problem.heads, seqlen_q) * int(found[0].kv_split) > \
            policy.exchange_blocks:
        return None
    return found[0]


def dependent_in_graphs(variant: Variant, heads: int, seqlen_q: int, batch: int, kv_capacity: int,
                        policy: DispatchPolicy) -> bool:
    """Whether a launch of `variant` for this shape goes as a programmatic dependent of the
    kernel before it while its stream is captured into a CUDA graph: launches of at most
    `DispatchPolicy.pdl_tiles` KV tiles of work (row groups x requests x tiles; `pdl_tiles_per_sm` per
    SM of the device), P exchanges included. Its blocks are then scheduled while that kernel
    drains, which hides the launch and tail of a short kernel; long and batched launches pay for
    it."""
    tiles = _row_groups(variant, heads, seqlen_q) * batch * -(-kv_capacity // variant.block_n)
    return tiles <= policy.pdl_tiles


def transposed_tile(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy) -> Variant | None:
    """The transposed tile that holds all H*S rows of a request in one row group (16 to 72 rows,
    other than 64), balanced split with 16-bit partial rows, for a device of target `arch` that
    runs sm_90a; None where there is none (or it does not fit the device's shared memory).

    Such rows take a padded 64-row group on the other tiles (H=16 S=2: half of it padding) or two
    (H=8 S=9: 72 rows), and each group streams the request's keys. From enough KV tiles of work
    it beats the dispatcher's seesaw or lockstep tile; on fewer a block's fixed costs over too
    few tiles lose (docs/performance.md). Hence the seesaw's threshold, counted over this tile's
    single row group.

    Its tiles load by cp.async: TMA loads (`loads` "tma", pages of 64) gain nothing steady on
    these rows, so they are left to the tuner."""
    rows = problem.heads * seqlen_q
    if rows not in TRANSPOSED.rows or rows % 64 == 0 or not runs_on("sm_90a", arch):
        return None
    v = TRANSPOSED.adopt(Variant(family="mma", head_tile=problem.heads, q_tile=seqlen_q, kv_split="balanced",
                                 arch="sm_90a", partials="16bit"))
    return v if policy.fits(problem, v) else None


# Batch-invariant mode splits every request's keys by its own length: into as few of
# INVARIANT_SPLITS splits as hold at most 2^INVARIANT_SPLIT_KEYS_LOG2 keys each (the kernels'
# `group_splits`), merged in split order, so a request's bits follow from its own inputs and
# these two numbers, never from the batch or the SM count. The launch's grid holds
# INVARIANT_SPLITS splits a row group; a group's blocks past its count do nothing.
# Shorter splits pay for more partial rows, longer ones leave small batches too few blocks
# (docs/performance.md holds the A/B). Short requests split less or not at all (up to 2048
# keys: one split, written out directly, no merge); a single long request still leaves SMs idle
# (65536 keys, H=64 S=9: 72 blocks on 132 SMs). docs/performance.md holds the A/B.
INVARIANT_SPLITS = 8
INVARIANT_SPLIT_KEYS_LOG2 = 11      # 2048 keys; the kernels' split_keys_log2 parameter


def fp8_variant(arch: str) -> Variant:
    """The naive family's variant on `arch`, which dequantizes each row as it reads it: the pick for
    e4m3 queries and for FP8 caches where no mma tile fits (`fp8_tile`)."""
    return naive(arch)


def fp8_tile(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy) -> Variant | None:
    """The mma tile for an FP8 cache that the heuristic sizes (`heuristic_mma`: the lockstep loop
    with cp.async loads, which stages FP8 rows, and an adaptive split), or None where none fits:
    the untuned pick for FP8 caches, which `balanced_for_batch` moves to the balanced split for a
    batch; it runs far ahead of the naive kernel (docs/performance.md). e4m3 queries take that
    tile on a schedule that reads them over the cache (`TileSchedule.q_formats`: fp8_mma, both
    products on e4m3 wgmma, over an e4m3 cache on sm_90a) where it fits, else None (the naive
    kernel's)."""
    if not problem.fp8_q:
        return heuristic_mma(problem, seqlen_q, arch, policy)
    tile = heuristic_mma(problem.with_(q_format="dtype"), seqlen_q, arch, policy)
    if tile is None:
        return None
    adopted = (s.adopt(tile) for s in SCHEDULES.values() if s.serves(problem, tile))
    return next((v for v in adopted if policy.fits(problem, v)), None)


@functools.lru_cache(maxsize=4096)
def batch_invariant_variant(problem: Problem, seqlen_q: int, arch: str, policy: DispatchPolicy) -> Variant:
    """The variant of batch-invariant mode: chosen from the problem, S and the arch alone (never
    the batch, the lengths, the table or the SM count), with a fixed split of `INVARIANT_SPLITS`
    that the launch narrows per request to its own length (`INVARIANT_SPLIT_KEYS_LOG2`), so that a
    request's output and lse bits depend only on its own queries, keys and length.
    The tile is the heuristic's (`heuristic_variant`), or the transposed tile where a request's
    rows fit one (`transposed_tile`); an sm_90a 64-row tile runs on the seesaw schedule with TMA
    loads where it fits. No balanced or adaptive split (their ranges follow the batch), no
    cluster or P exchange (their cluster sizes follow the table). FP8 inputs and gathered keys
    run on the naive kernel, which has no split."""
    if problem.fp8 or problem.gathered:
        return naive(arch)
    v = transposed_tile(problem, seqlen_q, arch, policy) or heuristic_variant(problem, seqlen_q, arch, policy)
    seesaw = SEESAW.twin(v) if SEESAW.takes(v) else None
    if seesaw is not None and policy.fits(problem, seesaw.with_(kv_split=INVARIANT_SPLITS)):
        v = seesaw
    fixed = v.with_(kv_split=INVARIANT_SPLITS)
    return fixed if policy.fits(problem, fixed) else v.with_(kv_split=1)


def covers(variant: Variant, kv_capacity: int) -> bool:
    """Whether `variant` runs requests of up to `kv_capacity` keys: every variant but one whose
    cluster holds one block_n-key tile a block (`TileSchedule.max_keys`: the P exchange)."""
    max_keys = schedule_of(variant).max_keys(variant)
    return not max_keys or kv_capacity <= max_keys


def _tuned_keys(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int) -> list[str]:
    """Bucket keys to try, best match first (see the module docstring)."""
    masks = [problem.mask] + (["causal"] if problem.mask != "causal" else [])
    keys = [tables.bucket_key(problem, seqlen_q, batch, kv_capacity, m) for m in masks]
    for cap in (kv_capacity // 2, kv_capacity * 2):
        keys += [tables.bucket_key(problem, seqlen_q, batch, cap, m) for m in masks]
    return list(dict.fromkeys(keys))


def tuned_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                  gpu: str, policy: DispatchPolicy, family: str | None = None) -> Variant | None:
    """The tuned table's pick (within `family` if given) for this shape, or None.

    A P exchange entry whose cluster holds fewer keys than the block
    table addresses says the P exchange wins a length step shorter: it gives way to the
    P exchange sized for these keys (`exchange_tile`) where one fits, rather than to a longer
    neighbour's split (docs/performance.md)."""
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
            if not runs_on(v.arch, arch):
                continue
            if not covers(v, kv_capacity):
                tile = exchange_tile(problem, seqlen_q, batch, kv_capacity, arch, policy)
                if tile is None or (family is not None and tile.family != family):
                    continue
                v = tile
        except ValueError:              # SpecError is one
            continue
        if policy.fits(problem, v):
            return v
    return None


def _table_or_heuristic(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str, gpu: str,
                        policy: DispatchPolicy) -> Variant:
    """The tuned pick, else the untuned one, with the balanced split for a batch."""
    tuned = tuned_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu, policy)
    return balanced_for_batch(problem, tuned if tuned is not None
                              else untuned_variant(problem, seqlen_q, batch, kv_capacity, arch, policy), batch, policy)


def gathered_variant(problem: Problem, arch: str, policy: DispatchPolicy) -> Variant:
    """The variant for gathered keys (`Problem.keys` "gathered", sparse verify): each query
    token's rows are its own, so a row group holds one token's heads, the tile the heuristic
    sizes for one token (`heuristic_mma` at S=1: the lockstep loop, whose cp.async copies load
    each listed row from its address, and an adaptive split over the slots), its splits' partial
    rows in fp32: short batches split each token's slots many ways, and 16-bit partials round
    each part once more, past FlashMLA's tolerance for this attention. The naive kernel where no
    such tile fits."""
    tile = heuristic_mma(problem, 1, arch, policy)
    return tile.with_(partials="fp32") if tile is not None else naive(arch=arch)


@functools.lru_cache(maxsize=8192)
def choose_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                   gpu: str = "", *, policy: DispatchPolicy = H200, table_capacity: int | None = None,
                   ragged_rows: bool = False) -> Variant:
    """The variant `verify_attention(variant=None)` runs for this shape on a `gpu` of `arch`
    whose figures (SM count, shared memory per block) `policy` holds (`policy_for`; default
    `H200`, 132 SMs).

    kv_capacity: keys the plan is made for, a bound on every request's length (max_seqlen_k's,
    else the block table's). table_capacity: keys the block table addresses (max_pages *
    page_size), which a request may hold past that bound; default kv_capacity. A choice that
    cannot run that many (a P exchange whose cluster holds fewer tiles) gives way to the choice
    for the whole table; a balanced split whose work list cannot count the table's tiles over
    the batch (`balanced_list_fits`, past ~2^37 keys) runs its tile with the adaptive split.
    FP8 inputs take the table's pick like any problem, else `untuned_variant`'s.
    ragged_rows: the call says which rows of each request are real (q_counts): a balanced split
    then runs ragged rows (`Variant.rows`), whose work lists skip the padded row groups.
    Gathered keys (sparse verify) run on `gathered_variant`.
    """
    if problem.gathered:         # no table holds them
        return gathered_variant(problem, arch, policy)
    table = kv_capacity if table_capacity is None else table_capacity
    v = _table_or_heuristic(problem, seqlen_q, batch, kv_capacity, arch, gpu, policy)
    if not covers(v, table):
        v = _table_or_heuristic(problem, seqlen_q, batch, table, arch, gpu, policy)
    if v.kv_split == "balanced" and not balanced_list_fits(v, batch, table):
        v = v.with_(kv_split="adaptive")
    if ragged_rows and v.kv_split == "balanced":
        v = v.with_(rows="ragged")
    return v


def balanced_for_batch(problem: Problem, variant: Variant, batch: int, policy: DispatchPolicy) -> Variant:
    """`variant` with the balanced split when it runs a batch (`DispatchPolicy.balanced_batch`, 2, or more
    requests) on a family that takes it (`KernelFamily.knobs`: the mma family), where that fits
    the device.

    The host knows the block table's capacity, not the lengths; a serving batch mixes short and
    long requests, and the adaptive or a fixed split, sized by the capacity, then leaves most SMs
    idle while the longest requests finish. The balanced split's ranges follow the real lengths
    on the device: ragged batches gain much more than uniform ones pay (docs/performance.md). The
    tuner times batches this way (`tune.as_dispatched`). Pass `variant=` to pin a split.
    """
    if batch < policy.balanced_batch or not family_of(variant).knobs or variant.kv_split == "balanced":
        return variant
    balanced = variant.with_(kv_split="balanced", combine="merge")   # a cluster's split is capacity-sized too
    return balanced if policy.fits(problem, balanced) else variant


def balanced_list_fits(variant: Variant, batch: int, kv_capacity: int) -> bool:
    """Whether a balanced split's work list can count `batch` requests of up to `kv_capacity`
    keys each (BALANCED_LIST_POSITIONS): false only past ~2^37 keys over the batch."""
    return batch * (-(-kv_capacity // variant.block_n) + SEGMENT_TILES) <= BALANCED_LIST_POSITIONS


def family_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                   gpu: str, family: str, policy: DispatchPolicy) -> Variant | None:
    """The dispatcher's choice restricted to one family (the bench's per-family column): the
    tuned one, else the family's default (`KernelFamily`): an untiled family's one variant
    (`naive`), a tensor-core family's untuned pick where a tile fits (`heuristic_mma`), else the
    flash heuristic's; None when no variant of the family validates."""
    tuned = tuned_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu, policy, family)
    if tuned is not None:
        return tuned
    entry = FAMILIES[family]
    if not entry.tiled:
        return naive(arch=arch)
    if entry.tensor_cores:      # the untuned pick (seesaw on long launches), where an mma tile fits
        if heuristic_mma(problem, seqlen_q, arch, policy) is None:
            return None
        return untuned_variant(problem, seqlen_q, batch, kv_capacity, arch, policy)
    try:
        return flash_heuristic(problem, seqlen_q, arch, policy)
    except SpecError:
        return None


def reset() -> None:
    """Forget memoized choices and tables (after a tune wrote a new table)."""
    tables.reset()
    choose_variant.cache_clear()


@functools.lru_cache(maxsize=8192)
def num_splits(variant: Variant, heads: int, batch: int, seqlen_q: int, kv_capacity: int,
               policy: DispatchPolicy, blocks_per_sm: int = 1) -> int:
    """Splits of the key range for one launch on the device of `policy` (its `sm_count`);
    `kv_capacity` bounds every request's length.

    Time is modelled in KV tiles per block: the waves the grid needs (sm_count * blocks_per_sm
    blocks run at once) times the tiles each block streams, plus the merge when there is more
    than one split (about a tile, `DispatchPolicy.merge_tiles`, and partials that grow with the split
    count, `DispatchPolicy.split_tiles_per_row`), at most `DispatchPolicy.max_splits` splits. A
    ragged last wave is paid in full, so e.g. 9 row blocks on 132 SMs take 29 splits (261
    blocks, two full waves) rather than 30 (270 blocks, three waves). A seesaw block runs its
    tiles in pairs, and the kernel hands a split its tiles in whole pairs, so its tiles are
    counted so too: 65 tiles over 14 splits are 6 a block and three empty splits, which 11
    splits run with fewer partials. A tuned table's fixed split overrides it.
    """
    if not family_of(variant).tiled:
        return 1
    if variant.kv_split == "balanced":
        return balanced_parts(variant, heads, batch, seqlen_q, kv_capacity, policy.sm_count, blocks_per_sm)
    if variant.kv_split != "adaptive":
        return int(variant.kv_split)
    blocks = batch * _row_groups(variant, heads, seqlen_q)
    per_wave = max(1, policy.sm_count * blocks_per_sm)
    tiles = max(1, -(-kv_capacity // variant.block_n))
    unit = split_unit(variant)
    best, best_cost = 1, float("inf")
    for splits in range(1, min(policy.max_splits, tiles) + 1):
        waves = -(-blocks * splits // per_wave)
        partials = policy.split_tiles_per_row * batch * seqlen_q * heads * splits
        per_block = -(-tiles // (splits * unit)) * unit
        cost = waves * per_block + (policy.merge_tiles + partials if splits > 1 else 0)
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


@functools.lru_cache(maxsize=8192)
def balanced_parts(variant: Variant, heads: int, batch: int, seqlen_q: int, kv_capacity: int,
                   sm_count: int, blocks_per_sm: int = 1) -> int:
    """Ranges of a balanced-split launch (its num_splits) on `sm_count` SMs.

    On the device the requests' KV tiles (their lengths from `cache_seqlens`, in `block_n`-key
    tiles) form one list, each request preceded by `validate.SEGMENT_TILES` positions for the
    fixed cost of a block starting it, cut into this many equal ranges; the grid is (row groups of a
    request, ranges), about one block per resident slot, and block (x, y) runs row group x of
    every request that range y meets. All row groups of a request stream the same keys at the
    same time, so each KV tile is read from memory once and from L2 by the others (a list over
    all row groups puts them out of phase, and with the KV past the L2 each row group reads it
    from HBM). A request
    is split wherever a range ends; `SplitPlan.partial_rows` sizes the workspace for it, and
    templates/split_work_list.cuh.j2 has the kernel's side. More ranges than the block table can hold
    tiles would only be empty.
    """
    groups = _row_groups(variant, heads, seqlen_q)
    tiles = max(1, -(-kv_capacity // variant.block_n))
    return max(1, min(sm_count * blocks_per_sm // max(1, groups), batch * tiles))
