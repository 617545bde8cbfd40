"""Choosing a variant and a split for a shape, without touching the device.

`choose_variant` answers, in this order:
1. The tuned table for this GPU and arch (`mlagen.dispatch.tables`: shipped defaults under the user's
   `mlagen tune` results): the entry of the shape's bucket (heads, Dl, Dr, dtype, page size,
   mask, S, log2 batch, log2 KV capacity); else the same bucket tuned with a causal mask (a mask
   changes only which scores are dropped, not the tiling that wins); else the bucket one KV
   length step (a factor of two) shorter or longer. An entry whose variant does not validate
   for this problem (another problem's tables, a family that changed) is passed over.
2. The heuristic: the tensor-core (mma) family wherever one of its variants fits the arch, else
   the scalar flash family; put as many query rows (positions x heads) in a block as the
   family's register budget holds, so each KV tile is loaded for as many rows as possible
   (`heuristic.heuristic_mma`, `flash_heuristic`); on sm_90a, a launch with many KV tiles of
   work per SM runs that tile on the seesaw schedule with TMA loads, and a short one that fits
   one wave as a P exchange (`untuned_variant`, `exchange_tile`); then
   split the key range by a small cost model of waves, tiles per block and the merge
   (`num_splits`).
Then, whichever answered, a batch (B >= 2) on the mma family runs the chosen tile with the
balanced split, whose ranges follow the real lengths on the device (`balanced_for_batch`).
Answers are memoized per shape: a call costs one cache lookup, no file I/O.
"""

from __future__ import annotations

import functools

from ..dsl.arch import runs_on
from ..dsl.errors import SpecError
from ..dsl.spec import Problem, Variant, naive, parse_variant
from ..plan.mma_plan import TRANSPOSED_ROWS
from ..plan.space import exchange_variants
from ..plan.validate import SEGMENT_TILES, is_valid, split_unit, validate
from . import tables
from .heuristic import heuristic_mma

MAX_FLASH_ROWS = 64        # 8 warps x 8 rows: the scalar kernel's accumulator budget
# The split-count model's costs, in KV-tile times of one block (~4 us on an H200 for the mma
# family): the merge blocks' wait and start, and per query row and split the partial's 4 KB
# written and read back (~3 TB/s).
MERGE_TILES = 0.75
SPLIT_TILES_PER_ROW = 3.4e-4
MAX_SPLITS = 128
# Without a table entry, an sm_90a tile runs the seesaw schedule (with TMA tile loads) from this
# many KV tiles of work (row groups x requests x tiles) per SM of a 132-SM Hopper. Tuned over the
# bench grid on the H200, the seesaw wins every row from 16 tiles per SM on but one (H=16 B=64 S=4
# at 31, where the lockstep kernel with TMA wins and the seesaw runs 3% behind it), and on those
# rows the heuristic's lockstep tile takes 1.2 to 1.55x the best time. At 4-5 tiles per SM the
# tune, which charged TMA calls a descriptor copy, had the seesaw lose (H=64 S=9 at 4096 keys:
# 26.4 against 22.7 µs); timed without that copy it wins there (20.4 against 22.0), so this
# threshold may be conservative; the table covers those rows (docs/performance.md, "Dispatch
# thresholds").
SEESAW_TILES_PER_SM = 12
HOPPER_SMS = 132
# Captured into a CUDA graph, an sm_90+ launch of at most this many KV tiles of work per SM goes
# as a programmatic dependent (`dependent_in_graphs`). H200, graph replay, same machine, every
# launch a dependent (MLAGEN_PDL=1) against plain: 0.6-0.9 µs less from 1 to 18 tiles per SM
# (S=9 at 1024 to 16384 keys, S=33 at 256 to 4096), no change at 31-35 (H=16 B=64 S=4, H=8 B=16
# S=9, H=64 B=8 S=9 at 4096 keys), 0.7-6.6% more from 62 on (65536 keys and up, H=64 B=64 S=2,
# H=64 B=128 S=1, H=128 B=32 S=4).
PDL_TILES_PER_SM = 24
# The balanced split's work list counts positions in int32 on the device (templates/merge.cuh.j2):
# every request's KV tiles and SEGMENT_TILES more, and per range (fewer than 2^16) a few more, so
# its requests' tiles must leave that margin below 2^31 (`balanced_list_fits`).
BALANCED_LIST_POSITIONS = 2**31 - 2**20


def _row_groups(variant: Variant, heads: int, seqlen_q: int) -> int:
    """Row groups (query tiles x head tiles) of one request under `variant`."""
    return -(-seqlen_q // variant.q_tile) * (heads // variant.head_tile)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@functools.lru_cache(maxsize=4096)
def heuristic_variant(problem: Problem, seqlen_q: int, arch: str) -> Variant:
    """The heuristic's pick: the tensor-core family where a variant fits (heuristic.heuristic_mma
    says how it tiles), else the scalar flash family."""
    return heuristic_mma(problem, seqlen_q, arch) or flash_heuristic(problem, seqlen_q, arch)


@functools.lru_cache(maxsize=4096)
def flash_heuristic(problem: Problem, seqlen_q: int, arch: str) -> Variant:
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


@functools.lru_cache(maxsize=4096)
def untuned_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str) -> Variant:
    """The pick for a shape no table covers: on a Hopper, a short launch that fits one wave as a
    P exchange (`exchange_tile`); else the heuristic's tile (`heuristic_variant`), on the
    seesaw schedule with TMA loads when it is an sm_90a mma tile with SEESAW_TILES_PER_SM or more
    KV tiles of work per SM (and the seesaw fits it: 64 rows, a page size TMA can box). Where a
    request's rows fit one transposed tile (`transposed_tile`) that tile runs instead, from the
    same work per SM.

    Such a launch takes the balanced split, a single request too: one range per SM, so one wave.
    For a single request the adaptive split's model goes to two or three waves from ~2000 tiles
    per row group (29 splits at 131072 keys, H=64 S=9). On the H200 that runs 12-13% slower than
    one wave (280 against 250 µs; 283 against 250 at H=128 with 65536 keys). At one wave the two
    splits tie (65536 keys, H=64: 142.3 against 144.4 µs)."""
    exchange = exchange_tile(problem, seqlen_q, batch, kv_capacity, arch)
    if exchange is not None:
        return exchange
    v = heuristic_variant(problem, seqlen_q, arch)
    transposed = transposed_tile(problem, seqlen_q, arch)
    if transposed is not None and batch * -(-kv_capacity // transposed.block_n) >= SEESAW_TILES_PER_SM * HOPPER_SMS:
        return transposed
    if v.family != "mma" or v.arch != "sm_90a":
        return v
    tiles = -(-kv_capacity // v.block_n)
    if _row_groups(v, problem.heads, seqlen_q) * batch * tiles < SEESAW_TILES_PER_SM * HOPPER_SMS:
        return v
    seesaw = v.with_(tma=True, seesaw=True, kv_split="balanced")
    return seesaw if is_valid(problem, seesaw) else v


def exchange_tile(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str) -> Variant | None:
    """The heuristic's sm_90a tile as a P exchange (`Variant.p_exchange`: a cluster with one KV
    tile a block, `space.exchange_variants`) where the block table holds at most 8 tiles and
    the launch's blocks, row groups x requests x cluster size, fit one wave of a 132-SM Hopper;
    None elsewhere. H200, S=9 H=64 with 256 keys (5 tiles, 45 blocks): 9.4 µs against the
    split's 10.6-10.8; S=33 (165 blocks, two waves): 18.2 against 15.0."""
    if not runs_on("sm_90a", arch):
        return None
    v = heuristic_variant(problem, seqlen_q, arch)
    if v.arch != "sm_90a":
        return None
    found = exchange_variants(problem, v, kv_capacity)
    if not found or batch * _row_groups(found[0], problem.heads, seqlen_q) * int(found[0].kv_split) > HOPPER_SMS:
        return None
    return found[0]


def dependent_in_graphs(variant: Variant, heads: int, seqlen_q: int, batch: int, kv_capacity: int,
                        sm_count: int) -> bool:
    """Whether a launch of `variant` for this shape goes as a programmatic dependent of the
    kernel before it while its stream is captured into a CUDA graph: launches of at most
    PDL_TILES_PER_SM KV tiles of work (row groups x requests x tiles) per SM, P exchanges
    included. Its blocks are then scheduled while that kernel drains, which hides the launch
    and tail of a short kernel; on long and batched launches it costs up to 7% on the H200."""
    tiles = _row_groups(variant, heads, seqlen_q) * batch * -(-kv_capacity // variant.block_n)
    return tiles <= PDL_TILES_PER_SM * sm_count


def transposed_tile(problem: Problem, seqlen_q: int, arch: str) -> Variant | None:
    """The transposed tile that holds all H*S rows of a request in one row group (16 to 72 rows,
    other than 64), balanced split with 16-bit partial rows, for a device of target `arch` that
    runs sm_90a; None where there is none.

    Such rows take a padded 64-row group on the other tiles (H=16 S=2: half of it padding) or two
    (H=8 S=9: 72 rows), and each group streams the request's keys. H200, graph replay, against
    the dispatcher's seesaw or lockstep tile: 0.70-0.84x at 32 rows (H=16 S=2, H=8 S=4) and 16
    (H=16 S=1), 0.79-0.88x at 72 (H=8 S=9) from 4096 key tiles of work, 0.97x at 2048, and
    1.12-1.27x at 1024 and fewer: a block's fixed costs over too few tiles. Hence the seesaw's
    threshold, counted over this tile's single row group.

    Its tiles load by cp.async: TMA loads (`tma`, pages of 64) run 32- and 16-row tiles 2-5%
    slower on the H200, and 72-row ones anywhere from 3% faster to 4% slower from one timing to
    the next, so they are left to the tuner."""
    rows = problem.heads * seqlen_q
    if rows not in TRANSPOSED_ROWS or rows % 64 == 0 or not runs_on("sm_90a", arch):
        return None
    v = Variant(family="mma", head_tile=problem.heads, q_tile=seqlen_q, kv_split="balanced", block_n=64,
                warps=8, stages=2, arch="sm_90a", part16=True, transposed=True)
    return v if is_valid(problem, v) else None


def covers(variant: Variant, kv_capacity: int) -> bool:
    """Whether `variant` runs requests of up to `kv_capacity` keys: every variant but a P
    exchange (`Variant.p_exchange`), whose cluster holds one block_n-key tile a block."""
    return not variant.p_exchange or kv_capacity <= int(variant.kv_split) * variant.block_n


def _tuned_keys(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int) -> list[str]:
    """Bucket keys to try, best match first (see the module docstring)."""
    masks = [problem.mask] + (["causal"] if problem.mask != "causal" else [])
    keys = [tables.bucket_key(problem, seqlen_q, batch, kv_capacity, m) for m in masks]
    for cap in (kv_capacity // 2, kv_capacity * 2):
        keys += [tables.bucket_key(problem, seqlen_q, batch, cap, m) for m in masks]
    return list(dict.fromkeys(keys))


def tuned_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                  gpu: str, family: str | None = None) -> Variant | None:
    """The tuned table's pick (within `family` if given) for this shape, or None.

    A P exchange entry (`Variant.p_exchange`) whose cluster holds fewer keys than the block
    table addresses says the P exchange wins a length step shorter: it gives way to the
    P exchange sized for these keys (`exchange_tile`) where one fits, rather than to a longer
    neighbour's split. H200, S=9 H=64 with 512 keys, where the table has entries at 256 (the
    P exchange on 5 blocks) and 1024 (a split): 10.3 µs on 8 blocks against the split's 12.55."""
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
                v = exchange_tile(problem, seqlen_q, batch, kv_capacity, arch)
                if v is None or (family is not None and v.family != family):
                    continue
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
    return balanced_for_batch(problem, tuned if tuned is not None
                              else untuned_variant(problem, seqlen_q, batch, kv_capacity, arch), batch)


def balanced_for_batch(problem: Problem, variant: Variant, batch: int) -> Variant:
    """`variant` with the balanced split when it runs a batch (B >= 2) on the mma family.

    The host knows the block table's capacity, not the lengths; a serving batch mixes short and
    long requests, and the adaptive or a fixed split, sized by the capacity, then leaves most SMs
    idle while the longest requests finish. The balanced split's ranges follow the real lengths
    on the device. H200, ragged batches (log-uniform lengths up to the capacity, graph replay):
    0.35x the adaptive split's time at H=64 B=64 S=2, 0.50x at H=8 B=16 S=9, 0.53x at H=16 B=64
    S=4, 0.64x at H=128 B=32 S=4, 0.83x at H=64 B=32 S=9; uniform batches pay 1-11% against the
    adaptive split (H=64 B=128 S=1 at 4096 keys: 212 against 193 µs; docs/performance.md). The
    tuner times batches this way (`tune.as_dispatched`). Pass `variant=` to pin a split.
    """
    if batch < 2 or variant.family != "mma" or variant.kv_split == "balanced":
        return variant
    balanced = variant.with_(kv_split="balanced", cluster=False)   # a cluster's split is capacity-sized too
    return balanced if is_valid(problem, balanced) else variant


def balanced_list_fits(variant: Variant, batch: int, kv_capacity: int) -> bool:
    """Whether a balanced split's work list can count `batch` requests of up to `kv_capacity`
    keys each (BALANCED_LIST_POSITIONS): false only past ~2^37 keys over the batch."""
    return batch * (-(-kv_capacity // variant.block_n) + SEGMENT_TILES) <= BALANCED_LIST_POSITIONS


def family_variant(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
                   gpu: str, family: str) -> Variant | None:
    """The dispatcher's choice restricted to one family (the bench's per-family column): the
    tuned one, else the family's default; None when no variant of the family validates."""
    tuned = tuned_variant(problem, seqlen_q, batch, kv_capacity, arch, gpu, family)
    if tuned is not None:
        return tuned
    if family == "naive":
        return naive(arch=arch)
    if family == "mma":      # the untuned pick (seesaw on long launches), where an mma tile fits
        if heuristic_mma(problem, seqlen_q, arch) is None:
            return None
        return untuned_variant(problem, seqlen_q, batch, kv_capacity, arch)
    try:
        return flash_heuristic(problem, seqlen_q, arch)
    except SpecError:
        return None


def reset() -> None:
    """Forget memoized choices and tables (after a tune wrote a new table)."""
    tables.reset()
    choose_variant.cache_clear()


@functools.lru_cache(maxsize=8192)
def num_splits(variant: Variant, heads: int, batch: int, seqlen_q: int, kv_capacity: int,
               sm_count: int, blocks_per_sm: int = 1) -> int:
    """Splits of the key range for one launch; `kv_capacity` bounds every request's length.

    Time is modelled in KV tiles per block: the waves the grid needs (sm_count * blocks_per_sm
    blocks run at once) times the tiles each block streams, plus the merge when there is more
    than one split (about a tile, and partials that grow with the split count). A
    ragged last wave is paid in full, so e.g. 9 row blocks on 132 SMs take 29 splits (261
    blocks, two full waves) rather than 30 (270 blocks, three waves). A seesaw block runs its
    tiles in pairs, and the kernel hands a split its tiles in whole pairs, so its tiles are
    counted so too: 65 tiles over 14 splits are 6 a block and three empty splits, which 11
    splits run with fewer partials (H200, H=64 S=9 at 4096 keys: 20.4 µs against 21.0). Measured
    by `mlagen bench`; a tuned table's fixed split overrides it.
    """
    if variant.family == "naive":
        return 1
    if variant.kv_split == "balanced":
        return balanced_parts(variant, heads, batch, seqlen_q, kv_capacity, sm_count, blocks_per_sm)
    if variant.kv_split != "adaptive":
        return int(variant.kv_split)
    blocks = batch * _row_groups(variant, heads, seqlen_q)
    per_wave = max(1, sm_count * blocks_per_sm)
    tiles = max(1, -(-kv_capacity // variant.block_n))
    unit = split_unit(variant)
    best, best_cost = 1, float("inf")
    for splits in range(1, min(MAX_SPLITS, tiles) + 1):
        waves = -(-blocks * splits // per_wave)
        partials = SPLIT_TILES_PER_ROW * batch * seqlen_q * heads * splits
        per_block = -(-tiles // (splits * unit)) * unit
        cost = waves * per_block + (MERGE_TILES + partials if splits > 1 else 0)
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


@functools.lru_cache(maxsize=8192)
def balanced_parts(variant: Variant, heads: int, batch: int, seqlen_q: int, kv_capacity: int,
                   sm_count: int, blocks_per_sm: int = 1) -> int:
    """Ranges of a balanced-split launch (its num_splits).

    On the device the requests' KV tiles (their lengths from `cache_seqlens`, in `block_n`-key
    tiles) form one list, each request preceded by `validate.SEGMENT_TILES` positions for the
    fixed cost of a block starting it, cut into this many equal ranges; the grid is (row groups of a
    request, ranges), about one block per resident slot, and block (x, y) runs row group x of
    every request that range y meets. All row groups of a request stream the same keys at the
    same time, so each KV tile is read from memory once and from L2 by the others (a list over
    all row groups puts them out of phase, and with the KV past the L2 each row group reads it
    from HBM: H=64 S=9 at 65536 keys 219 µs against 197 for the adaptive split). A request
    is split wherever a range ends; `KernelPlan.partial_rows` sizes the workspace for it, and
    templates/merge.cuh.j2 has the kernel's side. More ranges than the block table can hold
    tiles would only be empty.
    """
    groups = _row_groups(variant, heads, seqlen_q)
    tiles = max(1, -(-kv_capacity // variant.block_n))
    return max(1, min(sm_count * blocks_per_sm // max(1, groups), batch * tiles))
