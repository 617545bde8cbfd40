"""The registry of the tile loop's schedules (`Variant.schedule`): everything a schedule is, in
one entry each.

A schedule is how a block runs its KV tiles: in lockstep (templates/mma.cu.j2), as the seesaw's
tile pairs (mma.cu.j2 with templates/mma_seesaw.cuh.j2), as the transposed tile
(templates/mma_transposed.cu.j2) or as the P exchange of a cluster split
(templates/mma_exchange.cu.j2). An entry holds its template, the settings it accepts
(`TileSchedule.check`), its layout and shared memory (`TileSchedule.block_layout`), its
mbarriers and stack, the cache formats it reads, the flags its templates and the plan read, and
how the tuner and the fuzzer form its variants (`TileSchedule.adopt`, `TileSchedule.twin`,
`TileSchedule.rows`, `TileSchedule.tile_a_block`). Code outside this module asks an entry
(`schedule_of`) rather than comparing schedule names, so a schedule arrives as one entry here
and its template files. The naive and flash families run their own loops and take the
"lockstep" schedule only (`TileSchedule.families`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..dsl.spec import COMBINES, FAMILIES, LOADS, PARTIALS, Problem, Variant
from .mma_plan import (
    EXCHANGE_ROWS,
    FP8_WS_PRODUCER_WARPS,
    MMA_BLOCK_NS,
    MMA_M,
    TRANSPOSED_ROWS,
    WGMMA_ARCHS,
    WGMMA_TILE,
    MmaLayout,
    exchange_layout,
    exchange_mbarriers,
    fp8_products_layout,
    ldg_layout,
    lockstep_layout,
    no_mbarriers,
    no_stack,
    seesaw_load_mbarriers,
    seesaw_mbarriers,
    stage_mbarriers,
    transposed_layout,
    transposed_stack,
    widened_layout,
    ws_landing_mbarriers,
    ws_mbarriers,
)

ANY_STAGES = (1, 2, 3, 4)       # pipeline depths `validate` accepts for any tile


@dataclass(frozen=True)
class TileSchedule:
    """One schedule of the tile loop: what it accepts, how it lays out its block, and how the
    plan, the tuner and the fuzzer treat it.

    name: its `Variant.schedule` value.
    template: the main kernel's template in templates/ (the mma family's; the naive and flash
        families render their own).
    families: the `Variant.family` values whose variants may name it.
    archs: targets it runs on (None: every arch with mma.sync).
    block_ns, warps, stages: the KV tile widths, warps per block and pipeline depths it accepts
        (warps None: as many as the layout's rules allow).
    loads, combines, partials: the `Variant.loads`, `Variant.combine` and `Variant.partials`
        values it accepts.
    mma_pv: whether it accepts the output product on mma.sync (`Variant.mma_pv`).
    paired: whether its tile loop takes the KV tiles in pairs, a warpgroup a tile: a split, or a
        balanced range, then gets whole pairs (`split_unit` 2).
    partial_rows: whether its splits produce partial output rows to combine (the P exchange
        exchanges P instead).
    layout: its layout, shared memory up to the tree-mask rows included, or a message saying
        which rule the variant breaks (after `check`); `block_layout` adds its mbarriers.
    mbarriers: the mbarriers its kernel keeps after the tree-mask rows, 8 bytes each.
    load_mbarriers: those of `mbarriers` that count a KV load's bytes (one TMA arrival each).
    stack: bytes of stack (spills) its kernels may take; more means something grew.
    rows: the block rows (q_tile * head_tile) it takes, where that is a fixed set (its layout
        checks them; the dispatcher and the fuzzer draw from them); (): what the layout's rules
        allow.
    fp8_kv_loads: the `Variant.loads` it accepts over an FP8 cache, whose rows it stages and
        dequantizes into 16-bit tiles; (): it reads 16-bit caches only.
    seesaw_loop: whether templates/mma.cu.j2 runs the seesaw's tile pairs
        (templates/mma_seesaw.cuh.j2) in place of its lockstep loop (`KernelPlan.seesaw`).
    pair_merge: whether a row group split in two may end as a pair, the second block merging
        both rows (`SplitPlan.pair_merge`); the transposed tile's rows split in more than two.
    prefetches: whether its kernel, launched as a programmatic dependent, prefetches its Q rows
        and first KV tile into L2 while the previous grid drains (`KernelPlan.prefetches_inputs`;
        never with the balanced split, whose ranges need every request's length). The seesaw's
        first TMA boxes go out right after the wait; the transposed tile's first loads too.
    tile_a_block: whether each block of its cluster runs one block_n-key tile: the block table
        may address at most cluster size x block_n keys (`max_keys`), and the tuner's split
        search forms it over the smallest cluster that gives every tile a block
        (`space.tile_a_block_variants`).
    twin_of: the schedule whose variants the tuner and the dispatcher also run on this one, the
        tile unchanged (`twin`); None: none.
    kv_formats: the `Problem.kv_format` values it reads; None: every format its family reads.
    q_formats: the `Problem.q_format` values it reads.
    gathered_loads: the `Variant.loads` it accepts over gathered keys (`Problem.keys`
        "gathered"), whose rows it loads one by one from the addresses the indices give; (): it
        reads paged keys only.
    producer_warps: warps launched beside `Variant.warps` that load the KV tiles and widen an
        FP8 cache's bytes while the `Variant.warps` warps run the products (the kernel's
        `PRODUCER_THREADS`); 0: the same warps load and compute.
    kv_template: the template fragment that holds its KV tiles (`KvTiles`) and, with a producer,
        the producer's loop (`produce_tiles`); "": the lockstep loop's by loads and cache format
        (templates/mma_kv_tma.cuh.j2, mma_kv_fp8.cuh.j2, mma_kv_cp_async.cuh.j2), with fp8_ws's
        producer (templates/mma_ws_producer.cuh.j2).
    fuzz_weight: its share of the fuzzer's draws among the schedules a draw's family, arch and
        cache format take (`mlagen.tools.fuzz.draw_variant`).
    """

    name: str
    template: str
    families: tuple[str, ...]
    archs: tuple[str, ...] | None
    block_ns: tuple[int, ...]
    warps: tuple[int, ...] | None
    stages: tuple[int, ...]
    loads: tuple[str, ...]
    combines: tuple[str, ...]
    partials: tuple[str, ...]
    mma_pv: bool
    paired: bool
    partial_rows: bool
    layout: Callable[[Problem, Variant], MmaLayout | str]
    mbarriers: Callable[[Variant], int]
    load_mbarriers: Callable[[Variant], int]
    stack: Callable[[Variant], int]
    rows: Sequence[int]
    fp8_kv_loads: tuple[str, ...]
    seesaw_loop: bool
    pair_merge: bool
    prefetches: bool
    tile_a_block: bool
    twin_of: str | None
    kv_formats: tuple[str, ...] | None = None
    q_formats: tuple[str, ...] = ("dtype",)
    gathered_loads: tuple[str, ...] = ()
    producer_warps: int = 0
    kv_template: str = ""
    fuzz_weight: int = 1

    @property
    def split_unit(self) -> int:
        """KV tiles a split, or a balanced range, gets together: 2 for a paired schedule, else 1."""
        return 2 if self.paired else 1

    def takes(self, v: Variant) -> bool:
        """Whether `v`'s family and arch may run this schedule (`families`, `archs`); the rest of
        its settings are `check`'s."""
        return v.family in self.families and (self.archs is None or v.arch in self.archs)

    def reads(self, kv_format: str) -> bool:
        """Whether it reads caches of `kv_format`: one of `kv_formats`, and for an FP8 format with
        loads that stage FP8 rows (`fp8_kv_loads`)."""
        listed = self.kv_formats is None or kv_format in self.kv_formats
        return listed and (kv_format == "dtype" or bool(self.fp8_kv_loads))

    def reads_queries(self, q_format: str) -> bool:
        """Whether it reads queries of `q_format` (`q_formats`)."""
        return q_format in self.q_formats

    def serves(self, p: Problem, v: Variant) -> bool:
        """Whether it may run `v`'s family and arch over `p`'s cache and query formats (`takes`,
        `reads`, `reads_queries`); the rest of `v`'s settings are `check`'s."""
        return self.takes(v) and self.reads(p.kv_format) and self.reads_queries(p.q_format)

    def draw_rows(self, arch: str) -> Sequence[int]:
        """The block rows (q_tile * head_tile) a random variant for `arch` takes: `rows`, else on a
        wgmma arch the rows that pad to its tile's; (): any."""
        if self.rows:
            return self.rows
        return range(WGMMA_TILE[0] - MMA_M + 1, WGMMA_TILE[0] + 1) if arch in WGMMA_ARCHS else ()

    def check(self, v: Variant) -> str | None:
        """The first of this schedule's rules that `v` breaks, as what it needs; None if none."""
        rules = (
            ("arch", v.arch, self.archs),
            ("block_n", v.block_n, self.block_ns),
            ("warps", v.warps, self.warps),
            ("stages", v.stages, self.stages),
            ("loads", v.loads, self.loads),
            ("combine", v.combine, self.combines),
            ("partials", v.partials, self.partials),
            ("mma_pv", v.mma_pv, (False, True) if self.mma_pv else (False,)),
        )
        for field, value, accepted in rules:
            if accepted is not None and value not in accepted:
                listed = " or ".join(map(repr, accepted))
                return f"{field} {listed} for the {self.name} schedule, got {value!r}"
        return None

    def block_layout(self, p: Problem, v: Variant) -> MmaLayout | str:
        """`layout`, its shared memory with the mbarriers after the tree-mask rows (in the dynamic
        block: a static one would be padded to the dynamic block's 1024-byte alignment)."""
        layout = self.layout(p, v)
        if isinstance(layout, str):
            return layout
        return replace(layout, smem_bytes=layout.smem_bytes + self.mbarriers(v) * 8)

    def max_keys(self, v: Variant) -> int:
        """Most keys the block table may address for `v`: one block_n tile a block of its cluster
        where `tile_a_block`; 0 for no bound."""
        return int(v.kv_split) * v.block_n if self.tile_a_block else 0

    def adopt(self, v: Variant) -> Variant:
        """`v` on this schedule, with each setting of which it accepts one value set to it."""
        fixed = {field: accepted[0] for field, accepted in (
            ("block_n", self.block_ns), ("warps", self.warps), ("stages", self.stages), ("loads", self.loads),
            ("combine", self.combines), ("partials", self.partials)) if accepted is not None and len(accepted) == 1}
        return v.with_(schedule=self.name, **fixed, **({} if self.mma_pv else {"mma_pv": False}))

    def twin(self, v: Variant) -> Variant | None:
        """`v`, a variant of the schedule this one twins (`twin_of`), on this schedule: its tile
        and knobs, loaded as this schedule loads where it takes one kind; None for a variant of
        another schedule. Whether the twin is valid is `validate`'s to say."""
        if v.schedule != self.twin_of:
            return None
        return v.with_(schedule=self.name, loads=self.loads[0] if len(self.loads) == 1 else v.loads)


_SM90A = WGMMA_ARCHS
_MMA = ("mma",)

# Every warp takes each KV tile in turn; the naive and flash families' loops name it too. It
# stages an FP8 cache's rows with cp.async and dequantizes them.
LOCKSTEP = TileSchedule(
    name="lockstep", template="mma.cu.j2", families=FAMILIES, archs=None, block_ns=MMA_BLOCK_NS, warps=None,
    stages=ANY_STAGES, loads=LOADS, combines=COMBINES, partials=PARTIALS, mma_pv=True, paired=False,
    partial_rows=True, layout=lockstep_layout, mbarriers=stage_mbarriers, load_mbarriers=stage_mbarriers,
    stack=no_stack, rows=(), fp8_kv_loads=("cp_async",), seesaw_loop=False, pair_merge=True, prefetches=True,
    tile_a_block=False, twin_of=None, gathered_loads=("cp_async",), fuzz_weight=6)
# TMA loads, two stages, both products on wgmma: the lockstep loop's tile on sm_90a in pairs.
SEESAW = TileSchedule(
    name="seesaw", template="mma.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,), stages=(2,),
    loads=("tma",), combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True, partial_rows=True,
    layout=lockstep_layout, mbarriers=seesaw_mbarriers, load_mbarriers=seesaw_load_mbarriers, stack=no_stack,
    rows=(), fp8_kv_loads=(), seesaw_loop=True, pair_merge=True, prefetches=False, tile_a_block=False,
    twin_of=LOCKSTEP.name, fuzz_weight=2)
# Rows that are not a multiple of 64 as wgmma's N; its stages' mbarriers live in its 1 KB blocks.
TRANSPOSED = TileSchedule(
    name="transposed", template="mma_transposed.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,),
    stages=(2,), loads=LOADS, combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True, partial_rows=True,
    layout=transposed_layout, mbarriers=no_mbarriers, load_mbarriers=no_mbarriers, stack=transposed_stack,
    rows=TRANSPOSED_ROWS, fp8_kv_loads=(), seesaw_loop=False, pair_merge=False, prefetches=False,
    tile_a_block=False, twin_of=None, fuzz_weight=2)
# One tile a block of the cluster, loaded by cp.async; nothing partial is written.
P_EXCHANGE = TileSchedule(
    name="p_exchange", template="mma_exchange.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,),
    stages=(1,), loads=("cp_async",), combines=("cluster",), partials=("fp32",), mma_pv=False, paired=False,
    partial_rows=False, layout=exchange_layout, mbarriers=exchange_mbarriers, load_mbarriers=no_mbarriers,
    stack=no_stack, rows=EXCHANGE_ROWS, fp8_kv_loads=(), seesaw_loop=False, pair_merge=False, prefetches=True,
    tile_a_block=True, twin_of=None)

# The seesaw's tile pairs over an e4m3 cache, warp-specialized: a producer warpgroup lands each
# tile's FP8 bytes with TMA in the back of its 16-bit stage and widens them in place while the
# seesaw's two warpgroups run the products (templates/mma_ws_producer.cuh.j2). It reads FP8
# caches only (a 16-bit cache runs the seesaw); the dispatcher does not pick it yet.
FP8_WS = TileSchedule(
    name="fp8_ws", template="mma.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,), stages=(2,),
    loads=("tma",), combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True, partial_rows=True,
    layout=widened_layout, mbarriers=ws_mbarriers, load_mbarriers=ws_landing_mbarriers, stack=no_stack, rows=(),
    fp8_kv_loads=("tma",), seesaw_loop=True, pair_merge=True, prefetches=False, tile_a_block=False, twin_of=None,
    kv_formats=("e4m3",), producer_warps=FP8_WS_PRODUCER_WARPS, fuzz_weight=2)

# e4m3 queries over an e4m3 cache, both products on e4m3 wgmma: fp8_ws's producer lands each tile
# with TMA and transposes its value dims into a key-major copy, the 8-bit B operand P·V needs,
# while the seesaw's two warpgroups run the products (templates/mma_ws_producer.cuh.j2). The
# dispatcher runs e4m3 queries over an e4m3 cache on it (`policy.fp8_tile`).
FP8_MMA = TileSchedule(
    name="fp8_mma", template="mma.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,), stages=(2,),
    loads=("tma",), combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True, partial_rows=True,
    layout=fp8_products_layout, mbarriers=ws_mbarriers, load_mbarriers=ws_landing_mbarriers, stack=no_stack,
    rows=(), fp8_kv_loads=("tma",), seesaw_loop=True, pair_merge=True, prefetches=False, tile_a_block=False,
    twin_of=None, kv_formats=("e4m3",), q_formats=("e4m3",), producer_warps=FP8_WS_PRODUCER_WARPS, fuzz_weight=2)

# The seesaw's tile pairs over a ds_mla cache, warp-specialized as fp8_ws: the producer warpgroup
# loads each row from its own address into registers, widens it there and stores the 16-bit tile
# (templates/mma_fp8_ldg.cuh.j2), so gathered keys take it and no FP8 byte lands in shared memory.
FP8_LDG = TileSchedule(
    name="fp8_ldg", template="mma.cu.j2", families=_MMA, archs=_SM90A, block_ns=(64,), warps=(8,), stages=(2,),
    loads=("cp_async",), combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True, partial_rows=True,
    layout=ldg_layout, mbarriers=ws_mbarriers, load_mbarriers=ws_landing_mbarriers, stack=no_stack, rows=(),
    fp8_kv_loads=("cp_async",), seesaw_loop=True, pair_merge=True, prefetches=False, tile_a_block=False,
    twin_of=None, kv_formats=("ds_mla",), gathered_loads=("cp_async",), producer_warps=FP8_WS_PRODUCER_WARPS,
    kv_template="mma_fp8_ldg.cuh.j2", fuzz_weight=2)

SCHEDULES: dict[str, TileSchedule] = {s.name: s for s in (LOCKSTEP, SEESAW, TRANSPOSED, P_EXCHANGE, FP8_WS, FP8_MMA,
                                                          FP8_LDG)}


def schedule_of(v: Variant) -> TileSchedule:
    """`v`'s schedule (SCHEDULES[v.schedule])."""
    return SCHEDULES[v.schedule]


def stack_budget(v: Variant) -> int:
    """Bytes of stack (spills) `v`'s kernels may take (`TileSchedule.stack`)."""
    return schedule_of(v).stack(v)
