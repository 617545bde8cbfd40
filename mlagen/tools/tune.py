"""`mlagen tune`: search the variant space per shape on this GPU and persist the winners.

Per row (a shape) and mask kind: the dispatcher's pick without a table, then up to `max_candidates` structures
(`mlagen.plan.space`: every family, most promising first) are compiled in parallel processes and
timed here with CUDA graph replay; then the fastest few structures are timed with fixed splits,
and the fastest few after that with their knob twins (16-bit partial rows, `Variant.partials`;
TMA tile loads, `Variant.loads`); the fastest few trials are then timed twice more, and each is
ranked by the median of its timings. The pick the table already holds for the row (the
incumbent) is timed among the candidates, so a new pick replaces it only by beating it in the
same run: one machine start's timings can swap picks that are a few percent apart. A
candidate that fails to compile or run scores infinity. The best overall and the best of each
family go into the table entry of the row's bucket (`mlagen.dispatch.tables`), which dispatch reads.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..codegen.precompile import code_identity, precompile
from ..dispatch import policy, tables
from ..dispatch.policy import DispatchPolicy, balanced_for_batch, num_splits, transposed_tile, untuned_variant
from ..dsl.arch import runs_on, specializations
from ..dsl.errors import SpecError
from ..dsl.spec import Problem, Variant, parse_variant
from ..plan.families import FAMILIES, family_of
from ..plan.space import split_variants, structure_of, structures, twin_variants
from ..plan.validate import is_valid
from ..runtime.op import device_info, device_name, device_policy
from .grids import Row
from .stamp import stamp
from .timing import TimingConfig, failure_text, l2_bytes, measure
from .workload import Workload, fp8_case, make_workload, mlagen_call, problem_for, with_fp8


@dataclass(frozen=True)
class TuneConfig:
    page_size: int = 64
    masks: tuple[str, ...] = ("causal",)
    dtype: str = "bf16"
    kv_format: str = "dtype"      # the cache: q's dtype, or an FP8 format ("e4m3", "ds_mla"; the inputs quantized)
    q_format: str = "dtype"       # the queries: "dtype", or "e4m3" over an e4m3 cache (FP8_CASES' "e4m3-q")
    max_candidates: int = 24      # structures (adaptive split) timed per row and mask
    split_top: int = 3            # the fastest structures whose fixed splits are also timed
    workers: int | None = None    # compile processes; default: one per CPU
    # Lighter than the bench's: a candidate only has to be ranked, not reported.
    timing: TimingConfig = TimingConfig(target_ms=4.0, reps=5, max_calls=400, budget_ms=40.0)
    give_up: float = 3.0          # a candidate whose first estimate is this many times the best so far is
                                  # scored by that estimate, without a graph
    retime_top: int = 3           # the fastest trials, timed again at the end
    retimes: int = 2              # times each, in turns; a trial's figure is the median of its timings


@dataclass
class Trial:
    variant: Variant
    us: float = math.inf          # median device µs per call over its timings; inf: failed
    error: str = ""
    samples: list[float] = field(default_factory=list)   # each timing's µs per call


@dataclass
class RowTune:
    row: Row
    mask: str
    key: str
    trials: list[Trial] = field(default_factory=list)
    incumbent: Variant | None = None     # the table's pick for the row before this run, if it ran here

    @property
    def best(self) -> Trial:
        return min(self.trials, key=lambda t: t.us)

    @property
    def heuristic(self) -> Trial | None:
        """The heuristic's trial (the first one timed), if the heuristic had a variant."""
        # candidates() puts the untuned pick (policy.untuned_variant) first, or an untiled family's
        # variant (naive) when it had none.
        return self.trials[0] if self.trials and family_of(self.trials[0].variant).tiled else None

    @property
    def incumbent_trial(self) -> Trial | None:
        """The trial of the table's previous pick for the row, if there was one."""
        return next((t for t in self.trials if t.variant == self.incumbent), None) if self.incumbent else None

    def entry(self) -> dict:
        """The table entry: the best variant, and the best of each family that ran."""
        families = {}
        for f in FAMILIES:
            ok = [t for t in self.trials if t.variant.family == f and math.isfinite(t.us)]
            if ok:
                t = min(ok, key=lambda t: t.us)
                families[f] = {"variant": t.variant.name, "us": round(t.us, 3)}
        best = self.best
        return {"variant": best.variant.name, "us": round(best.us, 3), "families": families,
                "row": [self.row.heads, self.row.batch, self.row.seqlen_q, self.row.prefix],
                "candidates": len(self.trials), "failed": sum(not math.isfinite(t.us) for t in self.trials)}


def candidates(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str,
               max_candidates: int, dispatch: DispatchPolicy) -> list[Variant]:
    """The dispatcher's pick without a table on the device of `dispatch` first
    (`policy.untuned_variant`), then the transposed tile of all a request's rows where the device
    runs one (`policy.transposed_tile`), the first structure of each untiled family (naive,
    `KernelFamily.tiled`), then the tiled families' structures taking turns, those of a family
    that specializes (`KernelFamily.specializes`) on each arch-specific target the device runs
    too, `max_candidates` at most (naive and those picks included)."""
    found: list[Variant] = []
    try:
        found.append(untuned_variant(problem, seqlen_q, batch, kv_capacity, arch, dispatch))
    except SpecError:
        pass
    transposed = transposed_tile(problem, seqlen_q, arch, dispatch)
    found += [transposed] if transposed is not None else []
    tiled = [f for f in FAMILIES.values() if f.tiled]
    for f in FAMILIES.values():
        if not f.tiled:
            found += structures(problem, seqlen_q, arch, f.name, limit=1)
    share = max(1, max_candidates // max(1, len(tiled)))
    lists = [structures(problem, seqlen_q, arch, f.name, limit=share) for f in tiled]
    # Arch-specific targets the device also runs (sm_90a's wgmma on Hopper) compete too.
    lists += [structures(problem, seqlen_q, target, f.name, limit=share)
              for f in tiled if f.specializes for target in specializations(arch)]
    for i in range(max((len(x) for x in lists), default=0)):
        found += [x[i] for x in lists if i < len(x)]
    return list(dict.fromkeys(found))[:max_candidates]


def with_incumbent(problem: Problem, arch: str, cands: list[Variant],
                   name: str | None) -> tuple[list[Variant], Variant | None]:
    """`cands` with the table's previous pick `name` second (after the untuned pick, which the
    `heuristic µs` column reads first), and that pick; without it when there is none, or when it
    does not parse, validate or run on `arch` (a table of another version or problem)."""
    try:
        v = parse_variant(name) if name else None
    except ValueError:                # SpecError is one
        v = None
    if v is None or not runs_on(v.arch, arch) or not is_valid(problem, v):
        return cands, None
    return list(dict.fromkeys(cands[:1] + [v] + cands[1:])), v


def as_dispatched(problem: Problem, batch: int, variants: list[Variant], dispatch: DispatchPolicy) -> list[Variant]:
    """`variants` as the dispatcher would run them on the device of `dispatch` for a batch of
    `batch` requests (a batch's mma variants take the balanced split: policy.balanced_for_batch),
    each once, in order, so that the table's pick is what was timed."""
    return list(dict.fromkeys(balanced_for_batch(problem, v, batch, dispatch) for v in variants))


def _time(work: Workload, trial: Trial, timing: TimingConfig, give_up_us: float | None) -> None:
    try:
        trial.samples.append(measure(mlagen_call(work, trial.variant), work.sets, timing, give_up_us).us)
        trial.us = statistics.median(trial.samples)
    except Exception as e:       # a candidate that cannot run loses; the search goes on
        trial.error = failure_text(e)
        trial.us = math.inf
        torch.cuda.empty_cache()


def tune_rows(rows: list[Row], config: TuneConfig, progress=None,
              incumbents: dict[str, str] | None = None) -> list[RowTune]:
    """Tune every (row, mask) on the current CUDA device. `progress`: an optional rich Progress;
    `incumbents`: the variant names a table holds, by bucket key (each timed for its row)."""
    device = torch.cuda.current_device()
    arch = device_info(device)[0]
    dispatch = device_policy(device)
    l2 = l2_bytes(device)
    plans = []
    for row in rows:
        for mask in config.masks:
            problem = problem_for(row, config.page_size, mask, config.dtype).with_formats(config.kv_format,
                                                                                          config.q_format)
            capacity = row.kv_capacity(config.page_size)
            cands = as_dispatched(problem, row.batch, candidates(problem, row.seqlen_q, row.batch, capacity, arch,
                                                                   config.max_candidates, dispatch), dispatch)
            key = tables.bucket_key(problem, row.seqlen_q, row.batch, capacity)
            cands, incumbent = with_incumbent(problem, arch, cands, (incumbents or {}).get(key))
            plans.append((row, mask, problem, cands, incumbent))

    compile_task = progress.add_task("compiling candidates", total=None) if progress else None

    def compiled(total: int) -> None:
        if progress:
            progress.update(compile_task, total=total, advance=1)
    errors = precompile([(p, v) for _, _, p, cands, _ in plans for v in cands], config.workers, compiled)

    total = sum(len(cands) for _, _, _, cands, _ in plans)
    time_task = progress.add_task("timing candidates", total=total) if progress else None

    def advance(more: int = 0) -> None:
        """One trial done; `more` trials added to the total."""
        if progress:
            progress.update(time_task, total=progress.tasks[time_task].total + more, advance=0 if more else 1)
    results = []
    for row, mask, _, cands, incumbent in plans:
        if progress:
            progress.update(time_task, description=f"timing H={row.heads} B={row.batch} S={row.seqlen_q} "
                                                   f"prefix={row.prefix} {mask}")
        work = make_workload(row, config.page_size, mask, config.dtype, l2)
        case = fp8_case(config.kv_format, config.q_format)
        if case is not None:
            work = with_fp8(work, case, l2)
        results.append(_tune_one(work, cands, errors, config, dispatch, advance, incumbent))
        del work
        torch.cuda.empty_cache()
    return results


def _run_trials(work: Workload, result: RowTune, variants: list[Variant], errors: dict[tuple[Problem, Variant], str],
                config: TuneConfig, advance: Callable[..., None]) -> None:
    for v in variants:
        trial = Trial(v, error=errors.get(code_identity(work.problem, v), ""))
        if not trial.error:
            best = min((t.us for t in result.trials), default=math.inf)
            _time(work, trial, config.timing, best * config.give_up if math.isfinite(best) else None)
        result.trials.append(trial)
        advance()


def _tune_one(work: Workload, cands: list[Variant], errors: dict[tuple[Problem, Variant], str],
              config: TuneConfig, dispatch: DispatchPolicy, advance: Callable[..., None],
              incumbent: Variant | None = None) -> RowTune:
    """On the device of `dispatch`: structures first, then fixed splits of the fastest few
    structures (same code: compiled already), then the knob twins of the fastest few structures
    (16-bit partials, TMA loads: their own kernels, compiled when first run); last, the fastest
    few trials again."""
    row = work.row
    result = RowTune(row=row, mask=work.problem.mask,
                     key=tables.bucket_key(work.problem, row.seqlen_q, row.batch, work.kv_capacity),
                     incumbent=incumbent)
    _run_trials(work, result, cands, errors, config, advance)

    def fastest(clear_knobs: bool = False) -> list[Variant]:
        """The fastest trial of each of the fastest few structures (with `clear_knobs`, without
        part16 and tma): one structure's splits and twins would otherwise take every place (the
        heuristic's pick is part16 already, and its splits come within a few percent of it)."""
        ranked = sorted((t for t in result.trials if family_of(t.variant).tiled and math.isfinite(t.us)),
                        key=lambda t: t.us)
        picked: dict[Variant, Variant] = {}
        for t in ranked:
            if len(picked) == config.split_top:
                break
            picked.setdefault(structure_of(t.variant),
                              t.variant.with_(partials="fp32", loads="cp_async") if clear_knobs else t.variant)
        return list(picked.values())

    def run_untried(variants: list[Variant]) -> None:
        tried = {t.variant for t in result.trials}
        variants = [v for v in as_dispatched(work.problem, row.batch, variants, dispatch) if v not in tried]
        advance(len(variants))
        _run_trials(work, result, variants, errors, config, advance)

    splits = []
    for v in fastest():
        adaptive = num_splits(v, row.heads, row.batch, row.seqlen_q, work.kv_capacity, dispatch)
        splits += split_variants(work.problem, v, work.kv_capacity, skip=adaptive)
    run_untried(splits)
    run_untried(twin_variants(work.problem, fastest(clear_knobs=True)))
    _retime(work, result, config, advance)
    return result


def _retime(work: Workload, result: RowTune, config: TuneConfig, advance: Callable[..., None]) -> None:
    """Time the fastest few again, in turns, so that each is ranked by the median of its timings:
    one timing of a batched row can come out well off the others (docs/performance.md), and a
    single one would then decide the table's pick."""
    top = sorted((t for t in result.trials if math.isfinite(t.us)), key=lambda t: t.us)[: config.retime_top]
    advance(len(top) * config.retimes)
    for _ in range(config.retimes):
        for trial in top:
            _time(work, trial, config.timing, None)
            advance()


def tune(rows: list[Row], config: TuneConfig, path: Path | None = None, write_default: bool = False,
         progress=None) -> tuple[Path, list[RowTune]]:
    """Tune `rows` and merge the winners into a table file: `path`, else the shipped default of
    this GPU (`write_default`), else the user's table. Returns the path and the row results."""
    device = torch.cuda.current_device()
    arch, _ = device_info(device)
    gpu = device_name(device)
    if path is None:
        path = tables.default_table_path(gpu) if write_default else tables.user_table_path(gpu, arch)
    try:
        table = tables.load_table(path)
        if (table.gpu, table.arch) != (gpu, arch):
            raise ValueError(f"{path} holds a table for {table.gpu} {table.arch}")
    except (OSError, ValueError, KeyError):
        table = tables.Table(gpu=gpu, arch=arch)         # none yet, or another GPU's: start anew
    results = tune_rows(rows, config, progress, {k: e.get("variant", "") for k, e in table.entries.items()})
    for r in results:
        if math.isfinite(r.best.us):
            table.entries[r.key] = r.entry()
    table.meta = stamp(device) | {"page_size": config.page_size, "dtype": config.dtype,
                                  "max_candidates": config.max_candidates, "split_top": config.split_top,
                                  "retimes": config.retimes}
    tables.save_table(table, path)
    policy.reset()
    return path, results
