"""Writing a bench result: the terminal table (rich), JSON, markdown and a PNG plot.

Time cells read "µs (×floor)": the median device time per call and its ratio to the row's floor.
Named variants (`mlagen bench --variant`) get a column each, after the families.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from .bench import DISPATCH, DISPATCH_SLACK, EAGER, BenchResult, RowResult

FILES = ("bench.json", "bench.md", "bench.png")


def _timed_columns(result: BenchResult) -> list[str]:
    """Cell names with a time column of their own: the families, then the named variants."""
    return [*result.families, *result.extra]


def _columns(result: BenchResult) -> list[str]:
    return ["H", "B", "S", "prefix", "floor µs", *[f"{n} µs" for n in _timed_columns(result)], "naive/flash",
            "eager µs", "dispatch µs", "dispatch vs best", "FlashMLA µs", "dispatch vs FlashMLA", "dispatch variant"]


def _time(row: RowResult, name: str) -> str:
    cell = row.cells.get(name)
    if cell is None:
        return "—"
    if cell.us is None:
        return "failed" if cell.error else "—"
    return f"{cell.us:.1f} ({cell.us / row.floor_us:.1f}×)" if row.floor_us > 0 else f"{cell.us:.1f}"


def _ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x is not None else "—"


def row_cells(result: BenchResult, row: RowResult) -> list[str]:
    """One row of the table as text, in `_columns` order."""
    dispatch = row.cells.get(DISPATCH)
    return [str(row.heads), str(row.batch), str(row.seqlen_q), str(row.prefix), f"{row.floor_us:.1f}",
            *[_time(row, n) for n in _timed_columns(result)], _ratio(row.speedup), _time(row, EAGER),
            _time(row, DISPATCH), _ratio(row.dispatch_vs_best) + ("" if row.dispatch_ok else " !"),
            f"{row.flashmla_us:.1f}" if row.flashmla_us is not None else "—", _ratio(row.dispatch_vs_flashmla),
            dispatch.variant if dispatch else "—"]


def _header_lines(result: BenchResult) -> list[str]:
    m = result.meta
    lines = [f"{m.get('gpu', '?')} ({m.get('arch', '?')}, {m.get('sm_count', '?')} SMs), driver "
             f"{m.get('driver', '?')}, torch {m.get('torch', '?')}, cupy {m.get('cupy', '?')}, "
             f"NVRTC {m.get('nvrtc', '?')}, {m.get('date_utc', '?')}",
             f"page size {m.get('page_size')}, mask {m.get('mask')}, {m.get('dtype')}; ceilings measured "
             f"now: copy {m.get('copy_tbps', 0):.2f} TB/s (read+write), bf16 matmul "
             f"{m.get('matmul_tflops', 0):.0f} TFLOP/s"]
    host = m.get("host")
    if host:
        lines.append(f"host cost of verify_attention (dispatched, {host['row']}): "
                     f"{host['us_per_call_out_given']:.1f} µs/call with out=, "
                     f"{host['us_per_call_allocating']:.1f} µs/call allocating (target < 20)")
    peers = sorted((r.dispatch_vs_flashmla, r.row) for r in result.rows if r.dispatch_vs_flashmla is not None)
    if peers:
        lines.append(f"dispatch vs FlashMLA over the {len(peers)} rows with its figure: best {peers[0][0]:.2f}×, "
                     f"median {peers[len(peers) // 2][0]:.2f}×, worst {peers[-1][0]:.2f}× ({peers[-1][1]})")
    lines.append(f"'!': the dispatched variant is slower than naive or torch eager, or more than "
                 f"{DISPATCH_SLACK - 1:.0%} slower than the best variant timed for the row"
                 + (" (named variants included)" if result.extra else ""))
    return lines


def rich_table(result: BenchResult) -> Table:
    table = Table(title="mlagen bench: device µs per call (× floor)", caption="\n".join(_header_lines(result)))
    for col in _columns(result):
        table.add_column(col, justify="left" if col == "dispatch variant" else "right")
    vs_best = _columns(result).index("dispatch vs best")
    for row in result.rows:
        cells = row_cells(result, row)
        if not row.dispatch_ok:
            cells[vs_best] = f"[red]{cells[vs_best]}[/red]"
        table.add_row(*[c.replace("failed", "[red]failed[/red]") for c in cells])
    return table


def markdown(result: BenchResult) -> str:
    cols = _columns(result)
    out = ["# mlagen bench", "", *[f"- {line}" for line in _header_lines(result)], "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(row_cells(result, r)) + " |" for r in result.rows]
    failures = [(r, n, c.error) for r in result.rows for n, c in r.cells.items() if c.error]
    if failures:
        out += ["", "## Failures", ""]
        out += [f"- {r.row} {n}: {err.splitlines()[0] if err else ''}" for r, n, err in failures]
    return "\n".join(out) + "\n"


def to_json(result: BenchResult) -> str:
    data = result.to_dict()
    for r, d in zip(result.rows, data["rows"], strict=True):
        d["derived"] = {"speedup_naive_over_flash": r.speedup, "dispatch_vs_best": r.dispatch_vs_best,
                        "dispatch_ok": r.dispatch_ok, "dispatch_vs_flashmla": r.dispatch_vs_flashmla,
                        "x_floor": {n: c.us / r.floor_us for n, c in r.cells.items() if c.us and r.floor_us}}
    return json.dumps(data, indent=1) + "\n"


def from_json(text: str) -> BenchResult:
    data = json.loads(text)
    for d in data["rows"]:
        d.pop("derived", None)
    return BenchResult.from_dict(data)


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
    names = [*_timed_columns(result), EAGER, DISPATCH]      # one colour each, the same in every panel
    for ax, (group, rows) in zip(axes.flat, groups.items(), strict=False):
        prefixes = [r.prefix for r in rows]
        for i, name in enumerate(names):
            pts = [(r.prefix, r.us(name)) for r in rows if r.us(name)]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, color=f"C{i}", label=name)
        ax.plot(prefixes, [r.floor_us for r in rows], "k--", marker="_", ms=14, lw=1, label="floor")
        peers = [(r.prefix, r.flashmla_us) for r in rows if r.flashmla_us]
        if peers:
            ax.plot(*zip(*peers, strict=True), "x", color="gray", label="FlashMLA (H200)")
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
