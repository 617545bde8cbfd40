"""Writing results: a bench result as a terminal table (rich), JSON, markdown and a PNG plot; the
results of `mlagen tune` and `mlagen fuzz` as a terminal table, markdown and JSON.

Bench time cells read "µs (×floor)": the median device time per call and its ratio to the row's
floor. Named variants (`mlagen bench --variant`) get a column each, after the families; the side
cells (the dispatcher's pick under each further `--mask`, batch-invariant mode's pick) a time
column and a column of their ratio over the dispatched time each, in the summary too. An FP8
cell's "×floor" is over its own floor (its format's bytes; e4m3 queries' flops at the FP8 rate).
No cell of a terminal table is ever cut short: a cell too long for its column folds onto more lines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from .bench import (
    DISPATCH,
    DISPATCH_SLACK,
    EAGER,
    FP8,
    FP8_COMPUTE_ROWS,
    FP8_FLOOR_TARGET,
    FP8_MEMORY_ROWS,
    FP8_TARGET,
    INVARIANT,
    INVARIANT_TARGET,
    BenchResult,
    RowResult,
    fp8_case_of,
    mask_cell,
)
from .peers import PEER_GPU
from .tables import markdown_table, text_table
from .workload import FP8_CASES

if TYPE_CHECKING:
    from .fuzz import Outcome, Report
    from .tune import RowTune, Trial

FILES = ("bench.json", "bench.md", "bench.png")


def _timed_columns(result: BenchResult) -> list[str]:
    """Cell names with a time column of their own: the families, then the named variants."""
    return [*result.families, *result.extra]


def _ratio_column(result: BenchResult, name: str) -> str:
    """The header of a side cell's ratio over the dispatched time: "tree/causal", "invariant/dispatch"."""
    masks = {mask_cell(m): m for m in result.other_masks}
    return f"{masks[name]}/{result.base_mask}" if name in masks else f"{name}/{DISPATCH}"


def _side_columns(result: BenchResult) -> list[str]:
    return [c for n in result.side_cells for c in (f"{n} µs", _ratio_column(result, n))]


def _columns(result: BenchResult) -> list[str]:
    return ["H", "B", "S", "prefix", "floor µs", *[f"{n} µs" for n in _timed_columns(result)], "naive/flash",
            "eager µs", "dispatch µs", "dispatch vs best", *_side_columns(result), "FlashMLA µs",
            "dispatch vs FlashMLA", "dispatch variant"]


def _time(row: RowResult, name: str) -> str:
    cell = row.cells.get(name)
    if cell is None:
        return "—"
    if cell.us is None:
        return "failed" if cell.error else "—"
    floor = row.floor_of(name)
    return f"{cell.us:.1f} ({cell.us / floor:.1f}×)" if floor > 0 else f"{cell.us:.1f}"


def _ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x is not None else "—"


def row_cells(result: BenchResult, row: RowResult) -> list[str]:
    """One row of the table as text, in `_columns` order."""
    dispatch = row.cells.get(DISPATCH)
    return [str(row.heads), str(row.batch), str(row.seqlen_q), str(row.prefix), f"{row.floor_us:.1f}",
            *[_time(row, n) for n in _timed_columns(result)], _ratio(row.speedup), _time(row, EAGER),
            _time(row, DISPATCH), _ratio(row.dispatch_vs_best) + ("" if row.dispatch_ok else " !"),
            *[c for n in result.side_cells for c in (_time(row, n), _ratio(row.over_dispatch(n)))],
            f"{row.flashmla_us:.1f}" if row.flashmla_us is not None else "—", _ratio(row.dispatch_vs_flashmla),
            dispatch.variant if dispatch else "—"]


def _header_lines(result: BenchResult) -> list[str]:
    m = result.meta
    lines = [f"{m.get('gpu', '?')} ({m.get('arch', '?')}, {m.get('sm_count', '?')} SMs), driver "
             f"{m.get('driver', '?')}, torch {m.get('torch', '?')}, cupy {m.get('cupy', '?')}, "
             f"NVRTC {m.get('nvrtc', '?')}, {m.get('date_utc', '?')}",
             f"page size {m.get('page_size')}, mask {m.get('mask')}{_other_masks(result)}, {m.get('dtype')}; "
             f"ceilings measured now: copy {m.get('copy_tbps', 0):.2f} TB/s (read+write), bf16 matmul "
             f"{m.get('matmul_tflops', 0):.0f} TFLOP/s"]
    host = m.get("host")
    if host:
        lines.append(f"host cost of verify_attention (dispatched, {host['row']}): "
                     f"{host['us_per_call_out_given']:.1f} µs/call with out=, "
                     f"{host['us_per_call_allocating']:.1f} µs/call allocating (target < 20)")
    if "flashmla" in m:
        lines.append(f"FlashMLA: {m['flashmla']}")
    peers = sorted((r.dispatch_vs_flashmla, r.row) for r in result.rows if r.dispatch_vs_flashmla is not None)
    if peers:
        lines.append(f"dispatch vs FlashMLA over the {len(peers)} rows with its figure: best {peers[0][0]:.2f}×, "
                     f"median {peers[len(peers) // 2][0]:.2f}×, worst {peers[-1][0]:.2f}× ({peers[-1][1]})")
    if result.invariant:
        lines.append(_invariant_line(result))
    if result.fp8:
        lines += _fp8_lines(result)
    lines.append(f"'!': the dispatched variant is slower than naive or torch eager, or more than "
                 f"{DISPATCH_SLACK - 1:.0%} slower than the best variant timed for the row"
                 + (" (named variants included)" if result.extra else ""))
    return lines


def _other_masks(result: BenchResult) -> str:
    """The header's note of the further masks, '' without them."""
    if not result.other_masks:
        return ""
    return (f" (the dispatcher's pick also under {', '.join(result.other_masks)}, on the same inputs: "
            f"{', '.join(mask_cell(m) for m in result.other_masks)})")


def _invariant_line(result: BenchResult) -> str:
    """The header's line on batch-invariant mode: its pick over the dispatched one on the serving
    grid's batched rows, against INVARIANT_TARGET."""
    ratios = sorted((x, r.row) for r in result.rows if "serving" in r.grids and r.batch > 1
                    and (x := r.over_dispatch(INVARIANT)) is not None)
    line = (f"{INVARIANT}: batch-invariant mode's pick (verify_attention(batch_invariant=True)); "
            f"target at most {INVARIANT_TARGET:.2f}× dispatch on the serving grid's batched rows")
    if not ratios:
        return line + " (none timed)"
    over = sum(x > INVARIANT_TARGET for x, _ in ratios)
    return (line + f": over the {len(ratios)} timed, median {ratios[len(ratios) // 2][0]:.2f}×, worst "
            f"{ratios[-1][0]:.2f}× ({ratios[-1][1]}), {over} over the target")


def _fp8_lines(result: BenchResult) -> list[str]:
    """The header's lines on the FP8 cells: what they time, then per case its worst ratio over
    bf16 dispatch (and over its own floor) on the rows its target covers: the memory-bound rows
    for a cache-only case, the compute-bound rows for e4m3 queries."""
    m = result.meta
    rate = f"{m['fp8_matmul_tflops']:.0f} TFLOP/s" if m.get("fp8_matmul_tflops") else "not measured: the bf16 rate"
    lines = [f"fp8:CASE: the dispatcher's pick on the same inputs quantized (e4m3: a flat e4m3 cache; ds_mla: "
             f"DeepSeek's 656-byte rows; e4m3-q: e4m3 queries over an e4m3 cache), fp8:CASE:tile the mma tile that "
             f"reads the FP8 cache; × its own floor (its bytes; "
             f"e4m3 queries' flops at the FP8 matmul rate, {rate}); targets at most {FP8_TARGET:.2f}× bf16 dispatch, "
             f"and {FP8_FLOOR_TARGET:.2f}× the FP8 floor on the memory-bound rows"]
    for name in (c for c in result.side_cells if c.startswith(FP8)):
        memory = FP8_CASES[fp8_case_of(name)][1] == "dtype"
        rows = [r for r in result.rows if r.row in (FP8_MEMORY_ROWS if memory else FP8_COMPUTE_ROWS)]
        ratios = sorted((x, r.row) for r in rows if (x := r.over_dispatch(name)) is not None)
        slower = sum(1 for r in result.rows if (r.over_dispatch(name) or 0) > 1)
        what = f"{name} on the {'memory' if memory else 'compute'}-bound rows"
        if not ratios:
            lines.append(f"{what}: none timed")
            continue
        over = sum(x > FP8_TARGET for x, _ in ratios)
        line = (f"{what}: worst {ratios[-1][0]:.2f}× bf16 ({ratios[-1][1]}), {over} of {len(ratios)} over "
                f"{FP8_TARGET:.2f}×")
        if memory:
            floors = [r.us(name) / r.floor_of(name) for r in rows if r.us(name)]
            line += f"; worst {max(floors):.2f}× the FP8 floor"
        lines.append(line + f"; rows slower than bf16 on the whole run: {slower}")
    return lines


def rich_table(result: BenchResult) -> Table:
    """The terminal table: a failed cell and a dispatched pick flagged with '!' in red."""
    return text_table("mlagen bench: device µs per call (× floor)", _columns(result),
                      [row_cells(result, r) for r in result.rows],
                      red=lambda col, cell: cell == "failed" or (col == "dispatch vs best" and cell.endswith(" !")),
                      caption="\n".join(_header_lines(result)), right=lambda col: col != "dispatch variant")


SUMMARY_COLUMNS = ("H", "B", "S", "prefix", "floor µs", "mlagen µs", "× floor", "torch eager µs", "FlashMLA µs",
                   "mlagen / FlashMLA")


def summary_cells(result: BenchResult, row: RowResult) -> list[str]:
    """One row of the summary table: the dispatched kernel's time beside the floor and the peers,
    then each side cell's ratio over it."""
    def us(name: str) -> str:
        cell = row.cells.get(name)
        return f"{cell.us:.1f}" if cell is not None and cell.us is not None else "—"

    dispatch = row.cells.get(DISPATCH)
    x_floor = (f"{dispatch.us / row.floor_us:.2f}" if dispatch is not None and dispatch.us is not None
               and row.floor_us > 0 else "—")
    return [str(row.heads), str(row.batch), str(row.seqlen_q), str(row.prefix), f"{row.floor_us:.1f}", us(DISPATCH),
            x_floor, us(EAGER), f"{row.flashmla_us:.1f}" if row.flashmla_us is not None else "—",
            _ratio(row.dispatch_vs_flashmla), *[_ratio(row.over_dispatch(n)) for n in result.side_cells]]


def summary_markdown(result: BenchResult) -> list[str]:
    """The summary table's markdown lines (the README's performance table is a copy of them): the
    side cells' ratio columns only where the result has side cells."""
    return markdown_table([*SUMMARY_COLUMNS, *(_ratio_column(result, n) for n in result.side_cells)],
                          [summary_cells(result, r) for r in result.rows])


def markdown(result: BenchResult) -> str:
    """bench.md: the run's facts, the summary table (the dispatched kernel against the floor and the
    peers), then every timed cell."""
    out = ["# mlagen bench", "", *[f"- {line}" for line in _header_lines(result)], "", "## Summary", "",
           *summary_markdown(result), "", "## Every cell", "",
           *markdown_table(_columns(result), [row_cells(result, r) for r in result.rows])]
    failures = [(r, n, c.error) for r in result.rows for n, c in r.cells.items() if c.error]
    failures += [(r, "FlashMLA", r.flashmla_error) for r in result.rows if r.flashmla_error]
    if failures:
        out += ["", "## Failures", ""]
        out += [f"- {r.row} {n}: {err.splitlines()[0] if err else ''}" for r, n, err in failures]
    return "\n".join(out) + "\n"


def to_json(result: BenchResult) -> str:
    data = result.to_dict()
    for r, d in zip(result.rows, data["rows"], strict=True):
        d["derived"] = {"speedup_naive_over_flash": r.speedup, "dispatch_vs_best": r.dispatch_vs_best,
                        "dispatch_ok": r.dispatch_ok, "dispatch_vs_flashmla": r.dispatch_vs_flashmla,
                        "x_floor": {n: c.us / r.floor_of(n) for n, c in r.cells.items() if c.us and r.floor_of(n)}}
    return json.dumps(data, indent=1) + "\n"


def from_json(text: str) -> BenchResult:
    data = json.loads(text)
    for d in data["rows"]:
        d.pop("derived", None)
    return BenchResult.from_dict(data)


def _peer_label(rows: list[RowResult]) -> str:
    """FlashMLA's legend entry: plain when timed live in the run, else naming the stored figures' GPU."""
    if any(r.flashmla_live for r in rows):
        return "FlashMLA"
    return f"FlashMLA ({PEER_GPU.removeprefix('NVIDIA ')}, stored)"


def plot(result: BenchResult, path: Path) -> None:
    """Time vs prefix, log-log, one panel per (H, B, S) group; the floor dashed; FlashMLA as x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[RowResult]] = {}
    for r in sorted(result.rows, key=lambda r: (r.heads, r.batch, r.seqlen_q, r.prefix)):
        groups.setdefault(r.row.group, []).append(r)
    ncols = min(4, max(1, len(groups)))
    nrows = -(-len(groups) // ncols) if groups else 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    names = [*_timed_columns(result), EAGER, DISPATCH, *result.side_cells]   # one colour each, the same in every panel
    for ax, (group, rows) in zip(axes.flat, groups.items(), strict=False):
        prefixes = [r.prefix for r in rows]
        for i, name in enumerate(names):
            pts = [(r.prefix, r.us(name)) for r in rows if r.us(name)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, color=f"C{i}", label=name)
        ax.plot(prefixes, [r.floor_us for r in rows], "k--", marker="_", ms=14, lw=1, label="floor")
        peers = [(r.prefix, r.flashmla_us) for r in rows if r.flashmla_us]
        if peers:
            ax.plot(*zip(*peers, strict=True), "x", color="gray", label=_peer_label(rows))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("prefix (keys)")
        ax.set_ylabel("µs per call")
        ax.grid(True, which="both", alpha=0.3)
    if groups:
        _legend(list(axes.flat[:len(groups)]), names)
    m = result.meta
    fig.suptitle(f"mlagen bench, {m.get('gpu', '?')}, {m.get('date_utc', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend(axes: list, names: list[str]) -> None:
    """One legend, on the first panel, naming the lines of every panel (a panel may lack some):
    `names` in order, then the rest (floor, peers)."""
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    labels = sorted(handles, key=lambda label: names.index(label) if label in names else len(names))
    axes[0].legend([handles[label] for label in labels], labels, fontsize=7)


def write_all(result: BenchResult, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and bench.png in out_dir (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FILES]
    paths[0].write_text(to_json(result))
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


# `mlagen tune`: one row per shape and mask.
TUNE_COLUMNS = ("H", "B", "S", "prefix", "mask", "heuristic µs", "table µs", "best µs", "gain", "best variant",
                "tried", "failed")


def _us(trial: Trial | None) -> float | None:
    return trial.us if trial is not None and math.isfinite(trial.us) else None


def tune_cells(r: RowTune) -> list[str]:
    """One shape's row, in TUNE_COLUMNS order: the heuristic's pick, the table's previous pick and
    the best timed, each in µs per call ('—': none, or it failed); 'none ran': no candidate ran."""
    heuristic, best = _us(r.heuristic), _us(r.best)
    gain = heuristic / best if heuristic is not None and best is not None else None

    def us(x: float | None) -> str:
        return f"{x:.1f}" if x is not None else "—"
    return [str(r.row.heads), str(r.row.batch), str(r.row.seqlen_q), str(r.row.prefix), r.mask, us(heuristic),
            us(_us(r.incumbent_trial)), us(best) if best is not None else "none ran",
            f"{gain:.2f}×" if gain is not None else "—", r.best.variant.name, str(len(r.trials)),
            str(sum(not math.isfinite(t.us) for t in r.trials))]


def tune_table(results: Sequence[RowTune]) -> Table:
    return text_table(f"mlagen tune: {len(results)} shapes", TUNE_COLUMNS, [tune_cells(r) for r in results],
                      red=lambda col, cell: col == "best µs" and cell == "none ran",
                      right=lambda col: col not in ("mask", "best variant"))


def tune_markdown(path: Path, results: Sequence[RowTune]) -> str:
    return "\n".join([f"# mlagen tune: {len(results)} shapes", "", f"- table file: {path}", "",
                      *markdown_table(TUNE_COLUMNS, [tune_cells(r) for r in results])]) + "\n"


def tune_json(path: Path, results: Sequence[RowTune]) -> str:
    """The table file written and each shape's trials; a time is µs per call, null where it failed."""
    def trial(t: Trial | None) -> dict | None:
        return None if t is None else {"variant": t.variant.name, "us": _us(t), "error": t.error}
    shapes = []
    for r in results:
        heuristic, best = _us(r.heuristic), _us(r.best)
        shapes.append({"heads": r.row.heads, "batch": r.row.batch, "seqlen_q": r.row.seqlen_q, "prefix": r.row.prefix,
                       "mask": r.mask, "key": r.key, "heuristic": trial(r.heuristic), "table": trial(r.incumbent_trial),
                       "best": trial(r.best),
                       "gain": heuristic / best if heuristic is not None and best is not None else None,
                       "trials": [trial(t) for t in r.trials]})
    return json.dumps({"table": str(path), "shapes": shapes}, indent=1) + "\n"


# `mlagen fuzz`: one row per kernel checked (random variants in one row).
FUZZ_COLUMNS = ("kernel", "ok", "skipped", "failed")


def fuzz_cells(report: Report) -> list[list[str]]:
    return [[name, str(report.count("ok", name)), str(report.count("skip", name)), str(report.count("fail", name))]
            for name in dict.fromkeys(o.kernel for o in report.outcomes)]


def fuzz_table(report: Report, title: str) -> Table:
    return text_table(title, FUZZ_COLUMNS, fuzz_cells(report), red=lambda col, cell: col == "failed" and cell != "0",
                      right=lambda col: col != "kernel")


def fuzz_markdown(report: Report, title: str, replay: Callable[[Outcome], str]) -> str:
    out = [f"# {title}", "", *markdown_table(FUZZ_COLUMNS, fuzz_cells(report)), "", report.summary()]
    if report.stopped:
        out.append(f"stopped early: {report.stopped}")
    if report.failures:
        out += ["", "## Failures", ""]
        out += [f"- seed {o.shape.seed} {o.shape} {o.variant}: {o.message.splitlines()[0] if o.message else ''} "
                f"(replay: `{replay(o)}`)" for o in report.failures]
    return "\n".join(out) + "\n"


def fuzz_json(report: Report, meta: dict, replay: Callable[[Outcome], str]) -> str:
    """meta (the seeds, the device's arch) with the counts per kernel, the summary and every
    failure with the command that replays it."""
    kernels = [dict(zip(("kernel", "ok", "skipped", "failed"), (c[0], *map(int, c[1:])), strict=True))
               for c in fuzz_cells(report)]
    failures = [{"seed": o.shape.seed, "shape": str(o.shape), "variant": o.variant, "message": o.message,
                 "replay": replay(o)} for o in report.failures]
    return json.dumps({**meta, "shapes": report.shapes, "elapsed_s": report.elapsed_s, "summary": report.summary(),
                       "stopped": report.stopped, "kernels": kernels, "failures": failures}, indent=1) + "\n"
