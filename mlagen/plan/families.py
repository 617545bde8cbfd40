"""The registry of the kernel families (`Variant.family`): everything a family is, in one entry
each.

A family is how a block computes its rows: the naive family runs one block per query row
(templates/naive.cu.j2), the flash family a tile of rows on scalar FMA (templates/flash.cu.j2),
the mma family a tile of rows on the tensor cores, its tile loop as its schedule lays it out
(`schedules.TileSchedule`). An entry holds its template, its block (`KernelFamily.block`: the
rules its variants follow and the block they make), the settings it takes, the inputs it reads,
whether its kernels prefetch, and how the tuner and the fuzzer draw its variants. Code outside
this module asks an entry (`family_of`) rather than comparing family names, so a family arrives
as one entry here and its template; its name, the DSL's vocabulary, is `dsl.spec.Family`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..dsl.arch import MAX_ACCUMULATORS, Arch, accumulator_budget
from ..dsl.errors import SpecError, require, require_smem
from ..dsl.spec import MAX_SEQLEN_Q, Problem, Variant
from .mma_plan import STAGE_PAD, MmaLayout, kv_stage_bytes
from .schedules import schedule_of

CHUNK = 8                  # elements per 16-byte load
FLASH_BLOCK_NS = (32, 64)  # block_n values the flash family accepts (each lane owns block_n/32 keys)


@dataclass(frozen=True)
class Block:
    """A variant's block as its family lays it out (`KernelFamily.block`).

    threads: threads of the main kernel's block.
    rows: query rows it holds, q_tile * head_tile.
    rows_pad: rows rounded up to what the family's thread mapping covers.
    rows_per_warp: rows each warp owns.
    row_elems: a q or KV row's padded length in shared memory, in elements.
    smem_bytes: dynamic shared memory of the main kernel.
    mma: the tensor-core family's warp layout; None for the others.
    """

    threads: int
    rows: int
    rows_pad: int
    rows_per_warp: int
    row_elems: int
    smem_bytes: int
    mma: MmaLayout | None = None


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family: its template and block, what it takes and reads, and how the tuner and
    the fuzzer treat it.

    name: its `Variant.family` value.
    template: the main kernel's template in templates/; None: its schedule's
        (`TileSchedule.template`).
    tiled: whether a block holds a tile of head_tile x q_tile rows and a row group's keys may be
        split, their partial rows merged; else a block holds one query row, whose keys it reads
        whole (one split, no workspace, a grid of one block per (head, query, request)).
    knobs: whether its variants take the settings beyond the plain tile (the balanced split,
        `combine` "cluster", `partials` "16bit", `loads` "tma", `mma_pv`, the schedules other
        than lockstep), as its schedule's entry accepts them (`TileSchedule.check`); a family
        without takes each setting's default.
    fp8_q: whether it reads e4m3 queries (`Problem.fp8_q`).
    gathers: whether it reads gathered keys (`Problem.keys` "gathered": each query row's own
        listed cache rows, sparse verify): the naive family, and the mma family on the schedules
        that load them (`TileSchedule.gathered_loads`).
    fp8_kv: how it reads an FP8 cache: "rows" (it dequantizes each row as it reads it),
        "staged" (its schedules that stage a tile's FP8 rows and dequantize them into the 16-bit
        tile, `TileSchedule.fp8_kv_loads`) or "" (it reads 16-bit caches only).
    prefetches: whether its kernels, launched as programmatic dependents, may prefetch their Q
        rows and first KV tile into L2 where their schedule does (`TileSchedule.prefetches`).
    tensor_cores: whether its products run on the tensor cores (mma.sync, wgmma): the
        dispatcher's tensor-core heuristic tiles it (`policy.heuristic_mma`).
    specializes: whether its code differs on the arch-specific targets (sm_90a's wgmma and TMA),
        so that the tuner also searches it on those its device runs.
    fuzz_weight: its share of the fuzzer's family draws (`fuzz.draw_variant`).
    block: its rules and block for a (problem, variant) on an arch; raises `SpecError` naming the
        rule the variant breaks.
    """

    name: str
    template: str | None
    tiled: bool
    knobs: bool
    fp8_q: bool
    gathers: bool
    fp8_kv: Literal["rows", "staged", ""]
    prefetches: bool
    tensor_cores: bool
    specializes: bool
    fuzz_weight: int
    block: Callable[[Problem, Variant, Arch], Block]

    def template_for(self, v: Variant) -> str:
        """File name of `v`'s main kernel's template in templates/: the family's, or its
        schedule's (`TileSchedule.template`)."""
        return self.template or schedule_of(v).template


def _naive_block(p: Problem, v: Variant, arch: Arch) -> Block:
    for field, value in (("head_tile", v.head_tile), ("q_tile", v.q_tile), ("kv_split", v.kv_split),
                         ("stages", v.stages)):
        require(value == 1, f"variant.{field}", value, "1 for the naive family (one block per row)")
    # q row as fp32, then every warp's (m, l, acc[Dl]) for the final cross-warp merge.
    smem = p.head_dim * 4 + v.warps * (p.dl + 2) * 4
    require_smem(arch, smem, v.name)
    return Block(threads=v.warps * 32, rows=1, rows_pad=1, rows_per_warp=1, row_elems=p.head_dim, smem_bytes=smem)


def _check_tiles(p: Problem, v: Variant) -> None:
    require(isinstance(v.head_tile, int) and v.head_tile >= 1 and p.heads % v.head_tile == 0,
            "variant.head_tile", v.head_tile, f"a divisor of problem.heads={p.heads}")
    require(isinstance(v.q_tile, int) and 1 <= v.q_tile <= MAX_SEQLEN_Q, "variant.q_tile",
            v.q_tile, f"an int in 1..{MAX_SEQLEN_Q}")
    require(isinstance(v.stages, int) and 1 <= v.stages <= 4, "variant.stages", v.stages,
            "an int in 1..4")


def _flash_block(p: Problem, v: Variant, arch: Arch) -> Block:
    _check_tiles(p, v)
    require(v.block_n in FLASH_BLOCK_NS, "variant.block_n", v.block_n,
            f"{' or '.join(map(str, FLASH_BLOCK_NS))} for the flash family (each lane owns block_n/32 keys)")
    rows = v.q_tile * v.head_tile
    rpw = -(-rows // v.warps)
    acc = rpw * p.dl // 32
    budget = accumulator_budget(v.warps)
    require(acc <= budget, "variant", v.name,
            f"at most {budget} fp32 accumulators per thread with {v.warps} warps; q_tile*head_tile/warps="
            f"{rpw} rows per warp x dl/32={p.dl // 32} gives {acc}: use "
            + ("more warps or " if budget == MAX_ACCUMULATORS else "") + "a smaller tile")
    rows_pad = rpw * v.warps
    row_elems = p.head_dim + CHUNK  # one 16-byte pad per row: lanes reading 16 B rows hit 8 banks apart
    smem = (rows_pad * row_elems * 2 + v.stages * v.block_n * row_elems * 2
            + rows_pad * v.block_n * 4 + MAX_SEQLEN_Q * 8)
    require_smem(arch, smem, v.name)
    return Block(threads=v.warps * 32, rows=rows, rows_pad=rows_pad, rows_per_warp=rpw, row_elems=row_elems,
                 smem_bytes=smem)


def _mma_block(p: Problem, v: Variant, arch: Arch) -> Block:
    """The mma family's block: its schedule's rules (`schedules.SCHEDULES`), its layout, TMA
    loads and the cluster split checked."""
    _check_tiles(p, v)
    if not arch.mma:
        raise SpecError("variant.arch", arch.name, "an arch with mma.sync bf16/fp16 (sm_80 or newer)")
    schedule = schedule_of(v)
    rule = schedule.check(v)
    if rule is not None:
        raise SpecError("variant.schedule", v.schedule, rule)
    layout = schedule.block_layout(p, v)
    if isinstance(layout, str):
        raise SpecError("variant", v.name, layout)
    require_smem(arch, layout.smem_bytes, v.name)
    if v.loads == "tma":
        require(layout.wgmma, "variant.loads", v.loads, f"'cp_async' on {arch.name}: TMA tile loads are for "
                "sm_90a's kernels")
        require(p.page_size % v.block_n == 0, "variant.loads", v.loads,
                f"'cp_async' for page_size={p.page_size}: a TMA tile is one page's run of block_n={v.block_n} rows")
    if v.combine == "cluster" and schedule.partial_rows:      # the P exchange stages no output rows
        require(arch.capability >= 90, "variant.combine", v.combine,
                f"'merge' on {arch.name}: thread-block clusters need sm_90 or newer")
        # The cluster's blocks stage their output rows (fp32, or 16-bit partials) over the Q and
        # KV buffers (the template's STAGE_EPILOGUE, which static_asserts the same sum) for their
        # peers to read.
        staged = layout.m_pad * (p.dl + STAGE_PAD) * (2 if v.partials == "16bit" else 4)
        buffers = layout.m_pad * p.head_dim * 2 + kv_stage_bytes(p, v)
        require(staged <= buffers, "variant.combine", v.combine,
                f"False for this tile: the {staged} bytes of staged output rows need Q and KV "
                f"buffers that large, these have {buffers} (more stages or a wider KV tile)")
    return Block(threads=v.warps * 32, rows=v.q_tile * v.head_tile, rows_pad=layout.m_pad,
                 rows_per_warp=layout.rows_w, row_elems=p.head_dim, smem_bytes=layout.smem_bytes, mma=layout)


# One block per query row, its warps sharing the keys; it dequantizes FP8 rows as it reads them
# and reads any row's address, so it also runs gathered keys.
NAIVE = KernelFamily(
    name="naive", template="naive.cu.j2", tiled=False, knobs=False, fp8_q=True, gathers=True, fp8_kv="rows",
    prefetches=False, tensor_cores=False, specializes=False, fuzz_weight=1, block=_naive_block)
# Head-tiled, split-KV, scalar FMA.
FLASH = KernelFamily(
    name="flash", template="flash.cu.j2", tiled=True, knobs=False, fp8_q=False, gathers=False, fp8_kv="",
    prefetches=False, tensor_cores=False, specializes=False, fuzz_weight=1, block=_flash_block)
# Head-tiled, split-KV, tensor cores (mma.sync; wgmma and TMA on sm_90a), its loop the schedule's.
MMA = KernelFamily(
    name="mma", template=None, tiled=True, knobs=True, fp8_q=False, gathers=True, fp8_kv="staged", prefetches=True,
    tensor_cores=True, specializes=True, fuzz_weight=3, block=_mma_block)

FAMILIES: dict[str, KernelFamily] = {f.name: f for f in (NAIVE, FLASH, MMA)}


def family_of(v: Variant) -> KernelFamily:
    """`v`'s family (FAMILIES[v.family])."""
    return FAMILIES[v.family]


def named(families: list[KernelFamily], joined: str = " or ") -> str:
    """The names of `families`, quoted and joined (for `SpecError`'s expectations)."""
    return joined.join(repr(f.name) for f in families)
