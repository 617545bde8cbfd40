"""`mlagen bench`: every family, torch eager, the floor and the peers, per benchmark row.

Per row, under the base mask (the first of `BenchConfig.masks`): each family's variant as the
dispatcher would pick it within that family (tuned table, else the family default), the
variants named with `--variant` (A/B columns), the dispatcher's own choice, torch eager, the
floor from the ceilings measured in the same run, and FlashMLA's figure where the peer table
(`mlagen.tools.peers`) has the row. Beside them, on the same inputs: the dispatcher's pick under
each further mask (cell `dispatch:<mask>`) and, when asked, batch-invariant mode's pick
(`INVARIANT`) and the dispatcher's pick on the same inputs in FP8 (cell `fp8:<case>`,
measured against a floor of its own bytes and matrix rate). A cell that raises, or a named
variant that is invalid for the row's problem, shows its error; the run goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..codegen.precompile import code_identity, precompile
from ..dispatch.policy import DispatchPolicy, batch_invariant_variant, choose_variant, family_variant, fp8_tile
from ..dsl.errors import SpecError
from ..dsl.spec import FAMILIES, Problem, Variant
from ..plan.families import FLASH, NAIVE
from ..plan.schedules import FP8_WS
from ..plan.validate import is_valid, validate
from ..runtime.op import device_info, device_name, device_policy, verify_attention
from .floor import Ceilings, floor_us
from .grids import Row
from .live_peer import LivePeer, dense_call, load_flashmla
from .peers import PEER_GPU, peer
from .stamp import stamp
from .timing import TimingConfig, failure_text, host_us_per_call, l2_bytes, measure, measure_ceilings
from .workload import (
    FP8_CASES,
    Workload,
    eager_call,
    fp8_problem,
    make_workload,
    mlagen_call,
    problem_for,
    with_fp8,
    with_mask,
)

EAGER, DISPATCH = "eager", "dispatch"
INVARIANT = "invariant"    # the cell of batch-invariant mode's pick (`verify_attention(batch_invariant=True)`)
DISPATCH_SLACK = 1.05      # the dispatched choice may be this much slower than the best
INVARIANT_TARGET = 1.25    # batch-invariant mode's aim on the serving grid's batched rows: at most this x dispatch
FP8 = "fp8:"               # the prefix of an FP8 cell: "fp8:e4m3"
TILE = ":tile"             # the suffix of an FP8 tile's cell: "fp8:e4m3:tile" (`policy.fp8_tile`)
WS = ":ws"                 # the suffix of the fp8_ws schedule's cell: "fp8:e4m3:ws" (`ws_twin`)
# FP8's aims, on the rows where each case's bytes or flops bound the time: at most FP8_TARGET x
# the bf16 dispatched time, and (memory-bound rows) at most FP8_FLOOR_TARGET x the FP8 floor.
FP8_TARGET = 0.6
FP8_FLOOR_TARGET = 1.3
FP8_MEMORY_ROWS = (Row(8, 16, 9, 16384), Row(16, 64, 4, 4096), Row(64, 128, 1, 4096), Row(64, 64, 2, 8192))
FP8_COMPUTE_ROWS = (Row(64, 32, 9, 4096), Row(128, 32, 4, 4096), Row(64, 1, 9, 65536))


def mask_cell(mask: str) -> str:
    """The cell of the dispatcher's pick under a further mask: "dispatch:tree"."""
    return f"{DISPATCH}:{mask}"


def fp8_cell(case: str) -> str:
    """The cell of the dispatcher's pick on FP8 case `case`'s inputs (`FP8_CASES`): "fp8:e4m3"."""
    return FP8 + case


def fp8_cells(case: str) -> list[str]:
    """FP8 case `case`'s cells: the dispatcher's pick (for e4m3 queries the fp8_mma tile where one
    fits, which is `policy.fp8_tile`), and for 16-bit queries the mma tile that reads the FP8
    cache (`policy.fp8_tile`) and, over a cache the fp8_ws schedule reads, the dispatcher's pick
    on that schedule (`ws_twin`) where a row has one."""
    kv_format, q_format = FP8_CASES[case]
    if q_format != "dtype":
        return [fp8_cell(case)]
    ws = [fp8_cell(case) + WS] if FP8_WS.reads(kv_format) else []
    return [fp8_cell(case), fp8_cell(case) + TILE, *ws]


def fp8_case_of(name: str) -> str:
    """The FP8 case of an FP8 cell: "fp8:e4m3:tile" -> "e4m3"."""
    return name[len(FP8):].removesuffix(TILE).removesuffix(WS)


def ws_twin(problem: Problem, v: Variant) -> Variant | None:
    """`v` on the fp8_ws schedule, its split, rows and tile kept (`TileSchedule.adopt`), where
    that is valid for `problem`: the warp-specialized FP8 tile beside the dispatcher's pick, which
    the dispatcher does not run yet; else None."""
    if not FP8_WS.takes(v):
        return None
    ws = FP8_WS.adopt(v)
    return ws if is_valid(problem, ws) else None


def is_side_cell(name: str) -> bool:
    """Whether a cell times the dispatcher's pick under a further mask, in batch-invariant mode
    or on FP8 inputs: it is no candidate for the row's base problem."""
    return name == INVARIANT or name.startswith((mask_cell(""), FP8))


@dataclass
class Cell:
    us: float | None = None     # median device µs per call; None: not run or failed
    variant: str = ""           # the mlagen variant run ("" for torch eager)
    error: str = ""             # why it has no time


@dataclass
class RowResult:
    heads: int
    batch: int
    seqlen_q: int
    prefix: int
    grids: list[str]
    floor_us: float
    cells: dict[str, Cell]      # family names, named variants, "eager", "dispatch", side cells (`is_side_cell`)
    flashmla_us: float | None = None
    flashmla_live: bool = False  # flashmla_us timed in this run on the row's inputs, else the stored figure
    flashmla_error: str = ""     # why FlashMLA, loaded for the run, has no live figure on the row
    fp8_floor_us: dict[str, float] = field(default_factory=dict)   # {FP8 cell: its floor}

    def floor_of(self, name: str) -> float:
        """The floor cell `name` is measured against: an FP8 cell's own, else the row's."""
        return self.fp8_floor_us.get(name, self.floor_us)

    @property
    def row(self) -> Row:
        return Row(self.heads, self.batch, self.seqlen_q, self.prefix)

    def us(self, name: str) -> float | None:
        cell = self.cells.get(name)
        return cell.us if cell is not None else None

    @property
    def speedup(self) -> float | None:
        """naive / flash."""
        naive, flash = self.us(NAIVE.name), self.us(FLASH.name)
        return naive / flash if naive and flash else None

    @property
    def best_us(self) -> float | None:
        """The fastest mlagen variant timed for this row's base problem (every family, every
        named variant and the dispatcher's)."""
        times = [c.us for n, c in self.cells.items() if n != EAGER and not is_side_cell(n) and c.us is not None]
        return min(times) if times else None

    def over_dispatch(self, name: str) -> float | None:
        """Cell `name`'s time over the dispatched one (e.g. "dispatch:tree": the tree mask's cost
        over the base mask's)."""
        t, d = self.us(name), self.us(DISPATCH)
        return t / d if t and d else None

    @property
    def dispatch_vs_best(self) -> float | None:
        d, best = self.us(DISPATCH), self.best_us
        return d / best if d and best else None

    @property
    def dispatch_vs_flashmla(self) -> float | None:
        """The dispatched time over FlashMLA's figure for this row (`peers.PEERS`)."""
        d = self.us(DISPATCH)
        return d / self.flashmla_us if d and self.flashmla_us else None

    @property
    def dispatch_ok(self) -> bool:
        """At least as fast as naive and torch eager, and within 5% of the best variant."""
        d = self.us(DISPATCH)
        if d is None:
            return False
        slower = [other for other in (self.us(NAIVE.name), self.us(EAGER)) if other is not None and d > other]
        return not slower and (self.dispatch_vs_best or math.inf) <= DISPATCH_SLACK


@dataclass
class BenchResult:
    meta: dict                  # stamp, ceilings, options, host cost
    families: list[str]         # family columns, in FAMILIES order
    rows: list[RowResult] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)     # named variant columns (`--variant`), in order
    other_masks: list[str] = field(default_factory=list)   # the masks after the base one: a `mask_cell` each
    invariant: bool = False                            # whether rows have an INVARIANT cell
    fp8: list[str] = field(default_factory=list)       # the FP8 cases timed: an `fp8_cell` each

    @property
    def base_mask(self) -> str:
        return self.meta.get("mask", "causal")

    @property
    def side_cells(self) -> list[str]:
        """The side cells' names (`is_side_cell`), in column order: an FP8 case's cells that some
        row holds (results written before a cell existed lack it)."""
        fp8 = [c for case in self.fp8 for c in fp8_cells(case)]
        return [*map(mask_cell, self.other_masks), *([INVARIANT] if self.invariant else []),
                *[c for c in fp8 if any(c in r.cells for r in self.rows)]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BenchResult:
        rows = [RowResult(**{**r, "cells": {k: Cell(**c) for k, c in r["cells"].items()}}) for r in data["rows"]]
        # results written before --variant, the mask axis, --batch-invariant or --fp8 lack those keys
        return cls(meta=data["meta"], families=list(data["families"]), rows=rows, extra=list(data.get("extra", [])),
                   other_masks=list(data.get("other_masks", [])), invariant=bool(data.get("invariant", False)),
                   fp8=list(data.get("fp8", [])))


@dataclass(frozen=True)
class BenchConfig:
    page_size: int = 64
    masks: tuple[str, ...] = ("causal",)   # `workload.MASKS`: the base mask, then those timing dispatch alone
    dtype: str = "bf16"
    timing: TimingConfig = TimingConfig()
    host_calls: int = 2000
    extra: tuple[Variant, ...] = ()     # named variants timed on every row, besides the families
    batch_invariant: bool = False       # also time batch-invariant mode's pick (INVARIANT) on the base mask
    fp8: tuple[str, ...] = ()           # FP8 cases (`FP8_CASES`) whose dispatched pick to time on the base mask
    flashmla: Path | None = None        # the FlashMLA checkout to time live (`live_peer.checkout_path`)

    @property
    def mask(self) -> str:
        """The base mask: every cell but the further masks' is timed under it."""
        return self.masks[0]


def spec_error(problem: Problem, variant: Variant) -> str:
    """'' when `variant` is valid for `problem` (checked without a GPU), else why not."""
    try:
        validate(problem, variant)
    except SpecError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def row_variants(problem: Problem, row: Row, page_size: int, arch: str, gpu: str, dispatch: DispatchPolicy,
                 extra: Sequence[Variant] = ()) -> dict[str, Variant]:
    """{family, named variant or "dispatch": variant} for a row on a `gpu` of `arch` whose
    dispatch figures `dispatch` holds; families with no valid variant and named variants invalid
    for `problem` (see `invalid_cells`) left out."""
    cap = row.kv_capacity(page_size)
    chosen = {f: family_variant(problem, row.seqlen_q, row.batch, cap, arch, gpu, f, dispatch) for f in FAMILIES}
    found = {f: v for f, v in chosen.items() if v is not None}
    found |= {v.name: v for v in extra if not spec_error(problem, v)}
    found[DISPATCH] = choose_variant(problem, row.seqlen_q, row.batch, cap, arch, gpu, policy=dispatch)
    return found


def side_variants(row: Row, config: BenchConfig, arch: str, gpu: str,
                  dispatch: DispatchPolicy) -> dict[str, tuple[str, Problem, Variant]]:
    """{side cell: (mask, problem, variant)} for a row: the dispatcher's pick under each mask of
    `config.masks` after the first (`mask_cell`), then with `config.batch_invariant` the variant
    `verify_attention(batch_invariant=True)` runs under the base mask (INVARIANT), then the
    dispatcher's pick on each of `config.fp8`'s inputs under the base mask, the mma tile that
    reads them where one fits and the pick on the fp8_ws schedule where it runs (`fp8_cells`)."""
    cap = row.kv_capacity(config.page_size)
    side = {}
    for mask in config.masks[1:]:
        problem = problem_for(row, config.page_size, mask, config.dtype)
        side[mask_cell(mask)] = (mask, problem, choose_variant(problem, row.seqlen_q, row.batch, cap, arch, gpu,
                                                               policy=dispatch))
    if config.batch_invariant:
        problem = problem_for(row, config.page_size, config.mask, config.dtype)
        side[INVARIANT] = (config.mask, problem, batch_invariant_variant(problem, row.seqlen_q, arch, dispatch))
    for case in config.fp8:
        problem = fp8_problem(problem_for(row, config.page_size, config.mask, config.dtype), case)
        side[fp8_cell(case)] = (config.mask, problem, choose_variant(problem, row.seqlen_q, row.batch, cap, arch, gpu,
                                                                     policy=dispatch))
        tile = fp8_tile(problem, row.seqlen_q, arch, dispatch)
        if tile is not None and fp8_cell(case) + TILE in fp8_cells(case):
            side[fp8_cell(case) + TILE] = (config.mask, problem, tile)
        ws = ws_twin(problem, side[fp8_cell(case)][2]) or (tile and ws_twin(problem, tile))
        if ws is not None:
            side[fp8_cell(case) + WS] = (config.mask, problem, ws)
    return side


def invalid_cells(problem: Problem, extra: Sequence[Variant]) -> dict[str, Cell]:
    """{name: failed cell} for the named variants that are invalid for `problem`."""
    return {v.name: Cell(variant=v.name, error=err) for v in extra if (err := spec_error(problem, v))}


class RowPlan(NamedTuple):
    """What `run_bench` times on one row."""

    row: Row
    grids: tuple[str, ...]
    problem: Problem                                    # the base mask's
    variants: dict[str, Variant]                        # `row_variants`
    side: dict[str, tuple[str, Problem, Variant]]       # `side_variants`

    @property
    def jobs(self) -> list[tuple[Problem, Variant]]:
        """Every (problem, variant) the row launches."""
        return [(self.problem, v) for v in self.variants.values()] + [(p, v) for _, p, v in self.side.values()]


def plan_rows(rows: list[tuple[Row, tuple[str, ...]]], config: BenchConfig, arch: str, gpu: str,
              dispatch: DispatchPolicy) -> list[RowPlan]:
    """The rows as `run_bench` times them on a `gpu` of `arch` whose dispatch figures `dispatch`
    holds."""
    plans = []
    for row, grids in rows:
        problem = problem_for(row, config.page_size, config.mask, config.dtype)
        plans.append(RowPlan(row, grids, problem,
                             row_variants(problem, row, config.page_size, arch, gpu, dispatch, config.extra),
                             side_variants(row, config, arch, gpu, dispatch)))
    return plans


def compile_jobs(plans: list[RowPlan]) -> list[tuple[Problem, Variant]]:
    """Every (problem, variant) that the planned rows launch."""
    return [job for plan in plans for job in plan.jobs]


def run_bench(rows: list[tuple[Row, tuple[str, ...]]], config: BenchConfig, progress=None) -> BenchResult:
    """Time every row on the current CUDA device. `progress`: an optional rich Progress."""
    device = torch.cuda.current_device()
    arch, _ = device_info(device)
    gpu = device_name(device)
    dispatch = device_policy(device)
    meta = stamp(device) | {"page_size": config.page_size, "mask": config.mask, "dtype": config.dtype}
    ceilings = measure_ceilings(device, fp8=any(FP8_CASES[c][1] == "e4m3" for c in config.fp8))
    meta |= {"copy_tbps": ceilings.copy_bytes_per_s / 1e12, "matmul_tflops": ceilings.matmul_flops_per_s / 1e12}
    if ceilings.fp8_matmul_flops_per_s:
        meta["fp8_matmul_tflops"] = ceilings.fp8_matmul_flops_per_s / 1e12
    l2 = l2_bytes(device)

    plans = plan_rows(rows, config, arch, gpu, dispatch)
    families = [f for f in FAMILIES if any(f in plan.variants for plan in plans)]
    jobs = compile_jobs(plans)
    compile_task = progress.add_task("compiling", total=None) if progress else None

    def compiled(total: int) -> None:
        if progress:
            progress.update(compile_task, total=total, advance=1)
    errors = precompile(jobs, on_done=compiled)
    row_task = progress.add_task("timing rows", total=len(plans)) if progress else None

    result = BenchResult(meta=meta, families=families, extra=[v.name for v in config.extra],
                         other_masks=list(config.masks[1:]), invariant=config.batch_invariant, fp8=list(config.fp8))
    live = load_flashmla(config.flashmla, device)
    meta["flashmla"] = peer_source(live, config)
    live_peer = runs_live(live, config)
    stored_applies = shows_stored(config) and not live_peer   # one source for the column's whole run
    for row, grids, problem, variants, side in plans:
        if progress:
            progress.update(row_task, description=f"timing H={row.heads} B={row.batch} S={row.seqlen_q} "
                                                  f"prefix={row.prefix}")
        peer_us, peer_error = None, ""
        try:
            work = make_workload(row, config.page_size, config.mask, config.dtype, l2)
        except Exception as e:   # e.g. out of memory: every cell of the row fails, the run goes on
            cells = {n: Cell(error="inputs: " + failure_text(e)) for n in [*variants, EAGER, *side]}
        else:
            cells = _time_row(work, config.mask, problem, variants, side, errors, config.timing, l2)
            if live_peer:
                peer_us, peer_error = _time_live_peer(live, work, config)
            del work
        cells |= invalid_cells(problem, config.extra)
        p = peer(row.heads, row.batch, row.seqlen_q, row.prefix)
        stored = p.flashmla_us if p and stored_applies else None
        result.rows.append(RowResult(
            heads=row.heads, batch=row.batch, seqlen_q=row.seqlen_q, prefix=row.prefix, grids=list(grids),
            floor_us=floor_us(row.heads, row.batch, row.seqlen_q, row.keys, ceilings), cells=cells,
            flashmla_us=peer_us if peer_us is not None else stored, flashmla_live=peer_us is not None,
            flashmla_error=peer_error,
            fp8_floor_us=fp8_floors(row, config, ceilings)))
        torch.cuda.empty_cache()
        if progress:
            progress.advance(row_task)

    if rows:
        meta["host"] = _host_cost(rows[0][0], config)
    return result


def runs_live(live: LivePeer, config: BenchConfig) -> bool:
    """Whether FlashMLA runs live on the rows: built and loaded, on the inputs its dense decode
    takes (bf16, a causal mask or none; it has no tree masks and this build no fp16)."""
    return live.module is not None and config.dtype == "bf16" and config.mask in ("causal", "none")


def shows_stored(config: BenchConfig) -> bool:
    """Whether the stored FlashMLA figures describe the rows: they were measured on one GPU
    (`peers.PEER_GPU`), page 64, bf16, causal."""
    return (torch.cuda.get_device_name() == PEER_GPU and config.page_size == 64 and config.dtype == "bf16"
            and config.mask == "causal")


def peer_source(live: LivePeer, config: BenchConfig) -> str:
    """Where the FlashMLA column comes from, in words, for the report."""
    if runs_live(live, config):
        return f"timed live on the same inputs (FlashMLA built at {live.source})"
    why = live.reason or f"FlashMLA does not take {config.dtype} under the {config.mask} mask"
    if shows_stored(config):
        return f"stored figures measured on the {PEER_GPU} (not live: {why})"
    return f"none (not live: {why}; the stored figures are for the {PEER_GPU}, page 64, bf16, causal)"


def _time_live_peer(live: LivePeer, work: Workload, config: BenchConfig) -> tuple[float | None, str]:
    """(FlashMLA's µs on the row's input sets, "") or, where its call raises (a shape it refuses),
    (None, why: `failure_text`)."""
    call = dense_call(live.module, work.scale, causal=config.mask == "causal")
    try:
        return measure(call, work.sets, config.timing).us, ""
    except Exception as e:   # FlashMLA asserts and TORCH_CHECKs its own limits: the row has no live figure
        torch.cuda.empty_cache()
        return None, failure_text(e)


def fp8_floors(row: Row, config: BenchConfig, ceilings: Ceilings) -> dict[str, float]:
    """{FP8 cell: its floor} for the cases of `config.fp8` (`floor.floor_us` of their formats)."""
    return {cell: floor_us(row.heads, row.batch, row.seqlen_q, row.keys, ceilings, kv_format=FP8_CASES[c][0],
                           q_format=FP8_CASES[c][1]) for c in config.fp8 for cell in fp8_cells(c)}


def _time_row(work: Workload, mask: str, problem: Problem, variants: dict[str, Variant],
              side: dict[str, tuple[str, Problem, Variant]], compile_errors: dict[tuple[Problem, Variant], str],
              timing: TimingConfig, l2: int) -> dict[str, Cell]:
    """Cells of one row whose inputs `work` are under `mask`: the base problem's variants, torch
    eager, then the side cells, each further mask on `work`'s input sets (`with_mask`), each FP8
    case on `work`'s sets quantized (`with_fp8`, at least twice the L2 `l2`). Each distinct
    (inputs, variant) is timed once."""
    works = {mask: work}
    by_variant: dict[tuple[str, Variant, str], Cell] = {}   # the dispatcher's pick is often a family's variant

    def run(inputs: str, v: Variant, how: str) -> float:
        if inputs not in works:
            works[inputs] = with_fp8(work, inputs[len(FP8):], l2) if inputs.startswith(FP8) else with_mask(work, inputs)
        # "variant": v named; "invariant": as verify_attention(batch_invariant=True) runs, its launch
        # sizing each request's splits by its length (v named alone runs its fixed split); "op": as
        # verify_attention picks, for FP8 inputs
        call = mlagen_call(works[inputs], v if how == "variant" else None, batch_invariant=how == INVARIANT)
        return measure(call, works[inputs].sets, timing).us

    def timed(inputs: str, p: Problem, v: Variant, how: str = "variant") -> Cell:
        if (inputs, v, how) not in by_variant:
            by_variant[inputs, v, how] = _timed(lambda: run(inputs, v, how), v.name,
                                                compile_errors.get(code_identity(p, v), ""))
        return by_variant[inputs, v, how]

    cells = {name: timed(mask, problem, v) for name, v in variants.items()}
    cells[EAGER] = _timed(lambda: measure(eager_call(work), work.sets, timing).us, "", "")
    for name, (m, p, v) in side.items():
        if name.startswith(FP8):      # the FP8 case's inputs; its tile named, else as verify_attention picks
            cells[name] = timed(fp8_cell(fp8_case_of(name)), p, v, "variant" if name.endswith((TILE, WS)) else "op")
        else:
            cells[name] = timed(m, p, v, INVARIANT if name == INVARIANT else "variant")
    return cells


def _timed(run: Callable[[], float], variant: str, compile_error: str) -> Cell:
    """A cell from `run()` (µs); a compile error or an exception becomes the cell's error."""
    if compile_error:
        return Cell(variant=variant, error=compile_error)
    try:
        return Cell(us=run(), variant=variant)
    except Exception as e:
        torch.cuda.empty_cache()
        return Cell(variant=variant, error=failure_text(e))


def _host_cost(row: Row, config: BenchConfig) -> dict[str, object]:
    """Host µs of one dispatched `verify_attention` call, with and without a given `out`."""
    work = make_workload(row, config.page_size, config.mask, config.dtype, l2=0)   # two sets: enough
    s = work.sets[0]
    with_out = mlagen_call(work, None)
    causal = config.mask == "causal"
    return {
        "row": str(row), "calls": config.host_calls,
        "us_per_call_out_given": host_us_per_call(lambda: with_out(s), config.host_calls),
        "us_per_call_allocating": host_us_per_call(
            lambda: verify_attention(s.q, s.kv_cache, s.block_table, s.cache_seqlens, softmax_scale=work.scale,
                                     causal=causal, tree_mask=s.tree_mask, check_values=False),
            config.host_calls),
    }
