"""The registry of the mma family's schedules (`Variant.schedule`): for each, the variants it
accepts, its layout (shared memory included) and its template.

A schedule is how a block runs its KV tiles: in lockstep (templates/mma.cu.j2), as the seesaw's
tile pairs (mma.cu.j2 with templates/mma_seesaw.cuh.j2), as the transposed tile
(templates/mma_transposed.cu.j2) or as the P exchange of a cluster split
(templates/mma_exchange.cu.j2). `TileSchedule.check` says which of a schedule's rules a variant
breaks, `TileSchedule.layout` derives the block's layout and shared memory by its own rules. The
naive and flash families run their own loops and take the "lockstep" schedule only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..dsl.spec import COMBINES, LOADS, PARTIALS, Problem, Variant
from .mma_plan import MMA_BLOCK_NS, MmaLayout, exchange_layout, lockstep_layout, transposed_layout

ANY_STAGES = (1, 2, 3, 4)       # pipeline depths `validate` accepts for any tile


@dataclass(frozen=True)
class TileSchedule:
    """One schedule of the mma family: what it accepts and how it lays out its block.

    name: its `Variant.schedule` value.
    template: the main kernel's template in templates/.
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
    layout: its layout, shared memory included, or a message saying which rule the variant
        breaks (after `check`).
    """

    name: str
    template: str
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

    @property
    def split_unit(self) -> int:
        """KV tiles a split, or a balanced range, gets together: 2 for a paired schedule, else 1."""
        return 2 if self.paired else 1

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


_SM90A = ("sm_90a",)

SCHEDULES: dict[str, TileSchedule] = {s.name: s for s in (
    TileSchedule(name="lockstep", template="mma.cu.j2", archs=None, block_ns=MMA_BLOCK_NS, warps=None,
                 stages=ANY_STAGES, loads=LOADS, combines=COMBINES, partials=PARTIALS, mma_pv=True, paired=False,
                 partial_rows=True, layout=lockstep_layout),
    # TMA loads, two stages, both products on wgmma; the tile of the lockstep loop on sm_90a.
    TileSchedule(name="seesaw", template="mma.cu.j2", archs=_SM90A, block_ns=(64,), warps=(8,), stages=(2,),
                 loads=("tma",), combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True,
                 partial_rows=True, layout=lockstep_layout),
    TileSchedule(name="transposed", template="mma_transposed.cu.j2", archs=_SM90A, block_ns=(64,), warps=(8,),
                 stages=(2,), loads=LOADS, combines=("merge",), partials=PARTIALS, mma_pv=False, paired=True,
                 partial_rows=True, layout=transposed_layout),
    # One tile a block of the cluster, loaded by cp.async; nothing partial is written.
    TileSchedule(name="p_exchange", template="mma_exchange.cu.j2", archs=_SM90A, block_ns=(64,), warps=(8,),
                 stages=(1,), loads=("cp_async",), combines=("cluster",), partials=("fp32",), mma_pv=False,
                 paired=False, partial_rows=False, layout=exchange_layout),
)}


def schedule_of(v: Variant) -> TileSchedule:
    """`v`'s schedule (SCHEDULES[v.schedule])."""
    return SCHEDULES[v.schedule]

