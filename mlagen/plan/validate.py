"""Validation: decide whether a (problem, variant) pair can work, and derive its numbers.

`validate` is the only door from the DSL to code generation: it raises `SpecError` naming the
field, the value and the limit, or returns a `KernelPlan` holding every derived constant the
templates need (templates compute nothing; they `static_assert` what Python derived). It checks
what every variant shares here, and the family's own rules and block through the family's
registry entry (`families.KernelFamily.block`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ..dsl import kv_layout
from ..dsl.arch import Arch, get_arch
from ..dsl.errors import SpecError, require
from ..dsl.spec import (
    COMBINES,
    DTYPES,
    KEYS,
    KV_FORMATS,
    LOADS,
    MASKS,
    MAX_SEQLEN_Q,
    PARTIALS,
    Q_FORMATS,
    ROWS,
    Problem,
    Variant,
    kernel_name,
)
from .families import CHUNK, FAMILIES, KernelFamily, family_of
from .mma_plan import EXCHANGE_MAX_SLOT, EXCHANGE_SLOT, MmaLayout, fp8_row_bytes, fp8_staging_bytes
from .schedules import SCHEDULES, TileSchedule, schedule_of
from .terms import N, Term, ceil_div, select

MERGE_TARGET_BLOCKS = 128  # merge blocks a split launch aims for in all (about one wave on big GPUs)
MAX_CLUSTER = 8            # blocks per thread-block cluster that every sm_90 GPU can schedule


# What the balanced split counts a segment as (a range's share of one request: its Q, its first
# tiles landing, its epilogue) on top of the segment's KV tiles, in KV tiles: a range that starts
# a request then streams fewer tiles. Traces of the seesaw put a segment boundary at 2.6 to 2.9
# tiles (docs/performance.md).
SEGMENT_TILES = 3
# The balanced split lays its ranges out request-aligned (each range within one request, so each
# block starts one segment) when a range then holds no more tiles than a packed range holds
# positions, or this many more when every request then takes one range, which leaves no partial
# rows and no merge (templates/split_work_list.cuh.j2): one range a request gains, where more
# ranges a request either way lose (docs/performance.md).
UNSPLIT_SLACK_TILES = 1


@dataclass(frozen=True)
class SplitPlan:
    """How a plan's row groups split their keys over blocks and how the parts come together: the
    split's kind and count, the cluster, the balanced split's work-list units, the merge blocks
    and the pair merge, and the partial rows the workspace holds (`KernelPlan.split`)."""

    problem: Problem
    variant: Variant
    schedule: TileSchedule
    tiled: bool             # whether the family splits a row group's keys (`KernelFamily.tiled`)
    rows: int               # query rows per block
    warps: int              # computing warps per block
    head_tiles: int         # H / head_tile

    @property
    def part16(self) -> bool:
        """Whether a split's partial output rows are 16-bit, divided by their own row sum, in the
        output's dtype (Variant.partials "16bit"), rather than unnormalized fp32."""
        return self.variant.partials == "16bit"

    @property
    def cluster(self) -> bool:
        """Whether a row group's splits run as one thread-block cluster (Variant.combine
        "cluster")."""
        return self.variant.combine == "cluster"

    @property
    def cluster_size(self) -> int:
        """Blocks per thread-block cluster, the row group's splits; 0 without a cluster."""
        return int(self.variant.kv_split) if self.cluster else 0

    @property
    def kv_split_kind(self) -> str:
        """How the launch splits a row group's keys: "adaptive" (the count is a launch parameter
        the dispatcher picks), "balanced" (equal ranges of the list of all requests' tiles) or
        "fixed" (the count `fixed_splits`; a cluster's is its size)."""
        return self.variant.kv_split if isinstance(self.variant.kv_split, str) else "fixed"

    @property
    def balanced(self) -> bool:
        """Whether the split is the balanced one (kv_split_kind "balanced")."""
        return self.variant.kv_split == "balanced"

    @property
    def ragged_rows(self) -> bool:
        """Whether the balanced work list runs only each request's real row groups, its last
        q_counts[b] rows (Variant.rows "ragged"; templates/split_work_list.cuh.j2, slot_q_tile)."""
        return self.variant.rows == "ragged"

    @property
    def fixed_splits(self) -> int:
        """The split count of a fixed split (kv_split_kind "fixed"); 0 for the others."""
        return self.variant.kv_split if isinstance(self.variant.kv_split, int) else 0

    @property
    def merge_blocks_in_grid(self) -> bool:
        """Whether a split launch's grid holds merge blocks after the split blocks: every family
        that splits, but for a cluster split, whose blocks combine their rows themselves."""
        return self.tiled and not self.cluster

    @property
    def merge_after_ranges(self) -> bool:
        """Whether merge blocks run the balanced split's (empty) range loop and merge after it, so
        that their code is laid out after the tile loop (templates/split_merge_blocks.cuh.j2,
        balanced_block): the balanced seesaw and transposed tile, whose long tile loops
        would otherwise reach past the kernel's first 64 KB of code (the paired schedules)."""
        return self.balanced and self.schedule.paired

    @property
    def merge_at_top(self) -> bool:
        """Whether merge blocks branch off at the top of the main kernel, before any split work:
        where the grid holds merge blocks and they do not merge after the range loop."""
        return self.merge_blocks_in_grid and not self.merge_after_ranges

    @property
    def part16_workspace(self) -> bool:
        """Whether 16-bit partial rows (`part16`) travel through the global workspace, as they do
        without a cluster; the kernel then has the pair merge's code (templates/split_pair_merge.cuh.j2,
        end_pair)."""
        return self.part16 and not self.cluster

    @property
    def pair_merge(self) -> bool:
        """Whether a row group split in two ends as a pair, the second block merging both rows
        into the output with no merge block (templates/split_counters.cuh.j2, PAIR_MERGE):
        `part16_workspace` kernels of a schedule that merges pairs (`TileSchedule.pair_merge`: not
        the transposed tile, whose rows split in more than two). (Ragged rows never end as a
        pair: split_pair_merge.cuh.j2, pair_merge.)"""
        return self.part16_workspace and self.schedule.pair_merge

    @property
    def max_merge_blocks(self) -> int:
        """Most merge blocks a row group gets: one warp per row; 0 without a split."""
        return -(-self.rows // self.warps) if self.tiled else 0

    def q_tiles(self, seqlen_q: int) -> int:
        return -(-seqlen_q // self.variant.q_tile)

    def row_groups(self, batch: int, seqlen_q: int) -> int:
        """Row groups (query tile x head tile of one request): the split counters in the workspace."""
        return self.q_tiles(seqlen_q) * self.head_tiles * batch

    def merge_blocks(self, batch: int, seqlen_q: int) -> int:
        """Merge blocks per row group of a split launch: enough for about MERGE_TARGET_BLOCKS in
        all (latency rows spread each group's merge over many SMs; large batches, whose merge
        blocks would otherwise outnumber the SMs, get one per group)."""
        groups = max(1, self.row_groups(batch, seqlen_q))
        return max(1, min(self.max_merge_blocks, -(-MERGE_TARGET_BLOCKS // groups)))

    def split_launch(self, num_splits: int) -> bool:
        """Whether a launch with `num_splits` writes partials and holds merge blocks: any count
        above 1, and the balanced split always (which requests its ranges cut, and which have
        no keys, only the device knows); never a cluster split, whose blocks combine their rows
        in shared memory."""
        return self.tiled and not self.cluster and (num_splits > 1 or self.balanced)

    def partial_rows(self, batch: int, seqlen_q: int, num_splits: int) -> int:
        """Partial rows the workspace holds for a launch (0 without a split).
        Split k of request b has its own B*S*H rows; the balanced split (num_splits = its ranges)
        numbers its partials by slot, range + request, so num_splits + B - 1 slots of S*H rows
        suffice whatever the lengths (templates/split_partials.cuh.j2); with ragged rows, of S*H
        rows rounded up to whole query tiles."""
        if not self.split_launch(num_splits):
            return 0
        slots = num_splits + batch - 1 if self.balanced else num_splits * batch
        # ragged rows: a slot's rows over whole query tiles (templates/common.cuh.j2, part_row)
        positions = -(-seqlen_q // self.variant.q_tile) * self.variant.q_tile if self.ragged_rows else seqlen_q
        return slots * positions * self.problem.heads

    @property
    def segment_tiles(self) -> int:
        """A balanced split's cost of a segment, in KV tiles (SEGMENT_TILES)."""
        return SEGMENT_TILES

    @property
    def split_unit(self) -> int:
        """KV tiles the kernel hands a split, or a balanced range, together (`split_unit`)."""
        return split_unit(self.variant)

    @property
    def segment_units(self) -> int:
        """A balanced split's cost of a segment in its work list's units (`split_unit` tiles):
        SEGMENT_TILES, rounded up."""
        return -(-SEGMENT_TILES // self.split_unit)

    @property
    def unsplit_slack_units(self) -> int:
        """How many more units a balanced split's aligned range may hold than a packed one when no
        request is then split (UNSPLIT_SLACK_TILES, rounded up)."""
        return -(-UNSPLIT_SLACK_TILES // self.split_unit)

    @property
    def part_elem_bytes(self) -> int:
        """Bytes of one value of a partial output row: 4 (fp32), or 2 with 16-bit
        `Variant.partials`."""
        return 2 if self.part16 else 4

    @property
    def partial_row_bytes(self) -> int:
        """Workspace bytes per partial row: Dl values, then the row's (max, sum) as two floats."""
        return self.problem.dl * self.part_elem_bytes + 8


@dataclass(frozen=True)
class KernelPlan:
    """Everything derived from a validated (problem, variant): the templates' constants."""

    problem: Problem
    variant: Variant
    arch: Arch
    name: str               # C symbol prefix; the kernel is <name>_main
    threads: int            # threads per block of the main kernel that compute (launch_threads: all)
    rows: int               # query rows per block: q_tile * head_tile
    rows_pad: int           # rows rounded up to what the family's thread mapping covers
    rows_per_warp: int
    head_tiles: int         # H / head_tile
    row_elems: int          # padded shared-memory row of q/kv tiles, in elements
    smem_bytes: int         # dynamic shared memory of the main kernel
    mma: MmaLayout | None = None   # the tensor-core family's warp layout

    @property
    def main_kernel(self) -> str:
        """The main kernel's C symbol: <name>_main."""
        return f"{self.name}_main"

    @property
    def family(self) -> KernelFamily:
        """The variant's family (`families.FAMILIES`)."""
        return family_of(self.variant)

    @functools.cached_property
    def split(self) -> SplitPlan:
        """How its row groups split their keys and merge the parts (`SplitPlan`)."""
        return SplitPlan(problem=self.problem, variant=self.variant, schedule=self.schedule, tiled=self.uses_split,
                         rows=self.rows, warps=self.warps, head_tiles=self.head_tiles)

    @property
    def uses_split(self) -> bool:
        """Whether the kernel splits a row group's keys (a tiled family's, `KernelFamily.tiled`):
        it then has the workspace's partial rows and merge code."""
        return self.family.tiled

    @property
    def kv_layout(self) -> dict[str, int]:
        """The ds_mla row's byte offsets the kernels read (`mlagen.dsl.kv_layout`): the group
        scales (`scales_at`), one a `group_dim` latent dims, and the bf16 rope dims (`rope_at`)."""
        return {"scales_at": kv_layout.SCALES_AT, "rope_at": kv_layout.ROPE_AT, "group_dim": kv_layout.GROUP_DIM,
                "row_bytes": kv_layout.DS_MLA_ROW_BYTES}

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes of one element of the cache tensor: 2 for 16-bit caches, 1 for FP8 ones."""
        return 1 if self.problem.fp8_kv else 2

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one cached row as the cache holds it (`kv_layout.row_bytes`)."""
        return kv_layout.row_bytes(self.problem.kv_format, self.problem.head_dim, self.kv_elem_bytes)

    @property
    def fp8_staging_bytes(self) -> int:
        """Shared memory of the lockstep loop's staged FP8 rows (`mma_plan.fp8_staging_bytes`) for
        a family that stages them (`KernelFamily.fp8_kv` "staged"); 0 for 16-bit caches, the other
        families and a schedule whose producer widens the FP8 bytes in place (`producer_threads`)."""
        staged = self.family.fp8_kv == "staged" and not self.producer_threads
        return fp8_staging_bytes(self.problem, self.variant) if staged else 0

    @property
    def f8_row_bytes(self) -> int:
        """Bytes of a Q or KV row in the fp8_mma schedule's e4m3 tiles (`mma_plan.fp8_row_bytes`)."""
        return fp8_row_bytes(self.problem)

    @property
    def producer_threads(self) -> int:
        """Threads launched beside `threads` that load the KV tiles and widen an FP8 cache's bytes
        (`TileSchedule.producer_warps`); 0 where the computing threads load."""
        return self.schedule.producer_warps * 32

    @property
    def marks_listed_rows(self) -> bool:
        """Whether a producer warpgroup loads gathered keys and marks each tile's filled rows in
        shared memory (its stage's `valid` word) for the seesaw's mask: fp8_ldg over gathered
        keys (templates/mma_fp8_ldg.cuh.j2)."""
        return bool(self.producer_threads) and self.problem.gathered

    @property
    def launch_threads(self) -> int:
        """Threads per block of the main kernel's launch: `threads`, which compute, and the
        producer's (`producer_threads`)."""
        return self.threads + self.producer_threads

    # Constants the templates render from their one definition here.
    chunk = CHUNK                               # elements per 16-byte load
    tree_rows = MAX_SEQLEN_Q                    # tree-mask rows a block holds, 64-bit each
    exchange_slot = EXCHANGE_SLOT               # the P exchange's slot: P and the rows' sums
    exchange_max_slot = EXCHANGE_MAX_SLOT       # its slot of row maxima

    # What the templates read of the variant, and the flags derived from it: templates read the
    # plan's attributes only, never its variant.

    @property
    def schedule(self) -> TileSchedule:
        """The variant's schedule (`schedules.SCHEDULES`; the naive and flash families' is
        "lockstep")."""
        return schedule_of(self.variant)

    @property
    def template(self) -> str:
        """File name of the main kernel's template in templates/: the family's, or its schedule's
        (`KernelFamily.template_for`)."""
        return self.family.template_for(self.variant)

    @property
    def head_tile(self) -> int:
        """HT: query heads per block (Variant.head_tile; 1 for the naive family)."""
        return self.variant.head_tile

    @property
    def q_tile(self) -> int:
        """QT: query positions per block (Variant.q_tile; 1 for the naive family)."""
        return self.variant.q_tile

    @property
    def block_n(self) -> int:
        """Keys per KV tile staged in shared memory (Variant.block_n)."""
        return self.variant.block_n

    @property
    def warps(self) -> int:
        """Warps per block of the main kernel: threads / 32."""
        return self.threads // 32

    @property
    def stages(self) -> int:
        """KV tiles of shared memory the tile pipeline cycles through (Variant.stages)."""
        return self.variant.stages

    @property
    def tma(self) -> bool:
        """Whether KV tiles load as TMA boxes counted by mbarriers (Variant.loads "tma")."""
        return self.variant.loads == "tma"

    @property
    def seesaw(self) -> bool:
        """Whether mma.cu.j2 runs the seesaw's tile pairs in place of its lockstep loop
        (`TileSchedule.seesaw_loop`)."""
        return self.schedule.seesaw_loop

    @property
    def max_keys(self) -> int:
        """Most keys the block table may address (max_pages * page size), in keys: one block_n
        tile per block of the cluster for a schedule that runs one a block (the P exchange,
        `TileSchedule.max_keys`); 0 for no bound."""
        return self.schedule.max_keys(self.variant)

    @property
    def programmatic_launch(self) -> bool:
        """Whether the kernel takes part in programmatic dependent launch (griddepcontrol, sm_90
        and newer): it lets the stream's next kernel be scheduled early and waits for the
        previous one's writes, so a launch may start it as a programmatic dependent."""
        return self.arch.capability >= 90

    @property
    def prefetches_inputs(self) -> bool:
        """Whether the kernel, launched as a programmatic dependent, prefetches its Q rows and
        first KV tile into L2 while the previous grid drains: the kernels of a family that may
        (`KernelFamily.prefetches`) on a schedule that does (`TileSchedule.prefetches`) where
        `programmatic_launch`, but for the balanced split (its ranges need every request's
        length), FP8 caches (the prefetch reads 16-bit rows) and gathered keys (it reads the
        block table)."""
        return (self.programmatic_launch and self.family.prefetches and self.schedule.prefetches
                and not self.split.balanced and not self.problem.fp8_kv and not self.problem.gathered)

    @property
    def arch_specific(self) -> bool:
        """Whether the target is an arch-specific one (sm_90a): its PTX (wgmma, TMA) is in no
        other target's, so an nvcc build for another target must stop."""
        return self.arch.name.endswith("a")

    @property
    def mbarriers(self) -> int:
        """mbarriers in shared memory after the tree-mask rows, 8 bytes each (`TileSchedule.mbarriers`)."""
        return self.schedule.mbarriers(self.variant)

    @property
    def load_mbarriers(self) -> int:
        """Those of `mbarriers` that count a KV load's bytes (`TileSchedule.load_mbarriers`)."""
        return self.schedule.load_mbarriers(self.variant)

    def _grid(self, batch: N, seqlen_q: N, num_splits: N, merge_blocks: N) -> tuple[N | int, N, N]:
        """The grid's formula, on ints (`grid`) or on Terms (`grid_expr`). Split launches add z
        slabs after the B request slabs for the merge blocks, so that every merge block comes
        after every split block in grid order (a cluster split has none: its y is the cluster).
        A balanced split has (row groups of a request, ranges) split blocks in slab 0,
        num_splits being its ranges (`policy.balanced_parts`), and always its merge slabs. An
        untiled family (`KernelFamily.tiled`) runs a block per (head, query, request)."""
        if not self.family.tiled:
            return (self.problem.heads, seqlen_q, batch)
        x = ceil_div(seqlen_q, self.variant.q_tile) * self.head_tiles
        merge_slabs = (batch * merge_blocks + num_splits - 1) // num_splits
        if self.split.balanced:
            return (x, num_splits, 1 + merge_slabs)
        if self.split.cluster:
            return (x, num_splits, batch)
        return (x, num_splits, select(num_splits > 1, batch + merge_slabs, batch))

    def grid(self, batch: int, seqlen_q: int, num_splits: int) -> tuple[int, int, int]:
        """Grid of the kernel for a launch (`_grid`)."""
        return self._grid(batch, seqlen_q, num_splits, self.split.merge_blocks(batch, seqlen_q))

    def grid_expr(self) -> tuple[str, str, str]:
        """`grid` as C-like expressions of B, S, num_splits and merge_blocks (`merge_blocks`'s
        value), for manifests and launchers (`_grid` on Terms)."""
        x, y, z = self._grid(Term("B"), Term("S"), Term("num_splits"), Term("merge_blocks"))
        return (str(x), str(y), str(z))


def split_unit(variant: Variant) -> int:
    """KV tiles a split gets together (templates/common.cuh.j2's split_blocks; the balanced
    split's work list counts in them too): a pair for the paired schedules (the seesaw and the
    transposed tile), whose warpgroups take a tile each, else one (`TileSchedule.split_unit`).
    Their range of an odd count of tiles runs a padding tile, half a pair."""
    return schedule_of(variant).split_unit


def _check_problem(p: Problem) -> None:
    require(isinstance(p.heads, int) and 1 <= p.heads <= 1024, "problem.heads", p.heads,
            "an int in 1..1024")
    require(isinstance(p.dl, int) and p.dl >= 256 and p.dl % 256 == 0, "problem.dl", p.dl,
            "a positive multiple of 256 (each lane owns whole 16-byte chunks of the value row)")
    require(isinstance(p.dr, int) and 0 <= p.dr <= 256 and p.dr % CHUNK == 0, "problem.dr",
            p.dr, "a multiple of 8 in 0..256")
    require(p.dtype in DTYPES, "problem.dtype", p.dtype, f"one of {DTYPES}")
    require(isinstance(p.page_size, int) and 1 <= p.page_size <= 4096
            and (p.page_size & (p.page_size - 1) == 0 or p.keys == "gathered"),
            "problem.page_size", p.page_size, "a power of two in 1..4096 (any size in 1..4096 with gathered keys, "
            "whose rows the kernels address one by one)")
    require(p.mask in MASKS, "problem.mask", p.mask, f"one of {MASKS}")
    require(isinstance(p.lse, bool), "problem.lse", p.lse, "a bool")
    require(p.kv_format in KV_FORMATS, "problem.kv_format", p.kv_format, f"one of {KV_FORMATS}")
    require(p.q_format in Q_FORMATS, "problem.q_format", p.q_format, f"one of {Q_FORMATS}")
    require(p.keys in KEYS, "problem.keys", p.keys, f"one of {KEYS}")
    require(not p.gathered or p.mask == "none", "problem.mask", p.mask,
            "'none' with problem.keys='gathered' (each query row attends to the rows it lists: the indexer chose them)")
    fp8_rows = (kv_layout.LATENT_DIM, kv_layout.ROPE_DIM)
    for field, value, fp8 in (("kv_format", p.kv_format, p.fp8_kv), ("q_format", p.q_format, p.fp8_q)):
        require(not fp8 or (p.dl, p.dr) == fp8_rows, f"problem.{field}", value,
                f"'dtype' for dl={p.dl} dr={p.dr} (the FP8 formats hold DeepSeek's rows: dl, dr = {fp8_rows})")


# The families that take the knobs (`KernelFamily.knobs`) and those that do not, as messages name them.
_KNOBS = " or ".join(f.name for f in FAMILIES.values() if f.knobs)
_PLAIN = " and ".join(f.name for f in FAMILIES.values() if not f.knobs)


def _check_common(v: Variant) -> None:
    require(v.family in FAMILIES, "variant.family", v.family, f"one of {tuple(FAMILIES)}")
    knobs = family_of(v).knobs
    require(isinstance(v.warps, int) and 1 <= v.warps <= 16, "variant.warps", v.warps,
            "an int in 1..16")
    require(v.kv_split in ("adaptive", "balanced") or (isinstance(v.kv_split, int) and 1 <= v.kv_split <= 256),
            "variant.kv_split", v.kv_split, "'adaptive', 'balanced' or an int in 1..256")
    require(v.kv_split != "balanced" or knobs, "variant.kv_split", v.kv_split,
            f"'adaptive' or an int for the {_PLAIN} families ('balanced' is {_KNOBS} only)")
    require(v.mma_pv is False or (v.mma_pv is True and knobs), "variant.mma_pv", v.mma_pv,
            f"False, or True for the {_KNOBS} family (on sm_90a)")
    require(v.combine == "merge" or (v.combine == "cluster" and knobs and isinstance(v.kv_split, int)
                                     and 2 <= v.kv_split <= MAX_CLUSTER),
            "variant.combine", v.combine,
            f"one of {COMBINES}: 'cluster' for the {_KNOBS} family with kv_split an int in 2..{MAX_CLUSTER} "
            "(the cluster size)")
    require(v.partials == "fp32" or (v.partials == "16bit" and knobs), "variant.partials", v.partials,
            f"one of {PARTIALS}: '16bit' for the {_KNOBS} family")
    require(v.loads == "cp_async" or (v.loads == "tma" and knobs), "variant.loads", v.loads,
            f"one of {LOADS}: 'tma' for the {_KNOBS} family (on sm_90a)")
    schedule = SCHEDULES.get(v.schedule)
    require(schedule is not None and v.family in schedule.families, "variant.schedule", v.schedule,
            "one of " + "; ".join(f"{s.name!r} (family {' or '.join(s.families)})" for s in SCHEDULES.values()))
    require(v.rows == "dense" or (v.rows == "ragged" and v.kv_split == "balanced"), "variant.rows", v.rows,
            f"one of {ROWS}: 'ragged' with kv_split 'balanced' (its work list skips the padded rows)")


def _quoted(families: list[KernelFamily]) -> str:
    """The names of `families`, quoted, joined by "or" (for an expectation)."""
    return " or ".join(repr(f.name) for f in families)


def _check_fp8_family(p: Problem, v: Variant) -> None:
    """FP8 caches run on the families that dequantize each row as they read it (the naive one),
    and on the schedules that stage a tile's FP8 rows and dequantize them into the 16-bit tile
    their products read (`TileSchedule.fp8_kv_loads`) of the families that stage them (the mma
    one; `KernelFamily.fp8_kv`); e4m3 queries run on the families that read them
    (`KernelFamily.fp8_q`: the naive one) and on the schedules that read them
    (`TileSchedule.q_formats`)."""
    family, schedule = family_of(v), schedule_of(v)
    if p.fp8_q and not family.fp8_q:
        readers = [s.name for s in SCHEDULES.values() if s.serves(p, v)]
        elsewhere = "; ".join(f"{s.name} on {' or '.join(s.archs or ('any arch',))} over caches in "
                              f"{' or '.join(map(repr, s.kv_formats or ('dtype',)))}"
                              for s in SCHEDULES.values() if v.family in s.families and s.reads_queries(p.q_format))
        require(bool(readers), "variant.family", v.family,
                f"{_quoted([f for f in FAMILIES.values() if f.fp8_q])} for problem.q_format={p.q_format!r} "
                f"(the {v.family} family reads them {'with ' + elsewhere if elsewhere else 'nowhere'})")
        require(schedule.reads_queries(p.q_format), "variant.schedule", v.schedule,
                f"{' or '.join(map(repr, readers))} for problem.q_format={p.q_format!r} (the {v.family} family's "
                f"schedules that read e4m3 queries on {v.arch})")
    require(p.fp8_q or schedule.reads_queries(p.q_format), "variant.schedule", v.schedule,
            f"a schedule that reads problem.q_format={p.q_format!r} queries (the {v.schedule} schedule reads "
            f"{' or '.join(map(repr, schedule.q_formats))} ones)")
    if not p.fp8_kv or family.fp8_kv == "rows":
        return
    fp8 = f"for problem.kv_format={p.kv_format!r}"
    require(family.fp8_kv == "staged", "variant.family", v.family,
            f"{_quoted([f for f in FAMILIES.values() if f.fp8_kv])} {fp8}")
    _require_loads(v, lambda s: s.fp8_kv_loads, fp8, f"the {v.family} family's loops that stage FP8 rows",
                   "the loads that stage FP8 rows")


def _require_loads(v: Variant, loads_of: Callable[[TileSchedule], tuple[str, ...]], need: str, loops: str,
                   why: str) -> None:
    """`v`'s schedule is one that loads `need`'s keys (`loads_of` it is not empty: the family's
    schedules that do are named, with `loops`), and `v.loads` one of those loads (`why`)."""
    loaders = [s.name for s in SCHEDULES.values() if loads_of(s) and v.family in s.families]
    loads = loads_of(schedule_of(v))
    require(bool(loads), "variant.schedule", v.schedule, f"{' or '.join(map(repr, loaders))} {need} ({loops})")
    require(v.loads in loads, "variant.loads", v.loads, f"{' or '.join(map(repr, loads))} {need} ({why})")


def _check_schedule_formats(p: Problem, v: Variant) -> None:
    """A schedule that reads some cache formats only (`TileSchedule.kv_formats`) gets one of them."""
    schedule = schedule_of(v)
    formats = " or ".join(map(repr, schedule.kv_formats or ("dtype",)))
    require(schedule.reads(p.kv_format), "variant.schedule", v.schedule,
            f"a cache in {formats} for the {v.schedule} schedule, got problem.kv_format={p.kv_format!r}")


def _check_keys(p: Problem, v: Variant) -> None:
    """Gathered keys run on the families that read them (`KernelFamily.gathers`); a tiled one's
    row group holds one query token, whose listed rows its schedule loads one by one
    (`TileSchedule.gathered_loads`) over fixed or adaptive splits."""
    if not p.gathered:
        return
    gathered = "for problem.keys='gathered'"
    require(family_of(v).gathers, "variant.family", v.family,
            f"{_quoted([f for f in FAMILIES.values() if f.gathers])} {gathered} (the families that read each "
            "query row's listed cache rows)")
    if not family_of(v).tiled:
        return
    _require_loads(v, lambda s: s.gathered_loads, gathered, "the loops that load each listed row by its address",
                   "a TMA box copies a run of a page's rows")
    require(v.q_tile == 1, "variant.q_tile", v.q_tile,
            f"1 {gathered} (a row group's tiles hold the rows its one query token lists)")
    require(v.kv_split != "balanced", "variant.kv_split", v.kv_split, f"an int or 'adaptive' {gathered}")


def validate(problem: Problem, variant: Variant) -> KernelPlan:
    """Check `problem` and `variant` together; return the plan or raise `SpecError`."""
    _check_problem(problem)
    _check_common(variant)
    _check_keys(problem, variant)
    _check_fp8_family(problem, variant)
    _check_schedule_formats(problem, variant)
    try:
        arch = get_arch(variant.arch)
    except ValueError as e:
        raise SpecError("variant.arch", variant.arch, str(e).split("expected ", 1)[-1]) from None
    block = family_of(variant).block(problem, variant, arch)
    return KernelPlan(problem=problem, variant=variant, arch=arch, name=kernel_name(problem, variant),
                      threads=block.threads, rows=block.rows, rows_pad=block.rows_pad,
                      rows_per_warp=block.rows_per_warp, head_tiles=problem.heads // variant.head_tile,
                      row_elems=block.row_elems, smem_bytes=block.smem_bytes, mma=block.mma)


def is_valid(problem: Problem, variant: Variant) -> bool:
    """Whether `validate` accepts `problem` and `variant` (searches filter candidates with it)."""
    try:
        validate(problem, variant)
        return True
    except SpecError:
        return False
