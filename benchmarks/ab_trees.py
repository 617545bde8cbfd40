"""A/B of template trees in one process: the same inputs, the cells timed in turn, round after round.

Memory-bound rows move by 2-4% from one process to the next, since each process's buffers land on
different physical pages; within one process two kernels compare to within ~1%. A tree is a
directory holding a `templates/` folder, such as a checkout of another commit
(`git archive REV templates | tar -x -C DIR`) or a copy with one edit.
Every cell renders, compiles and loads its kernel from its tree's templates (the disk cache keys
the source, so each tree's kernels compile once); the Python package is this one's.

    python3 benchmarks/ab_trees.py ROUNDS LABEL=DIR,... 'H,B,S,prefix[:FP8][:MASK]=LABEL/VARIANT|...' ...
    python3 benchmarks/ab_trees.py 3 main=.,new=/tmp/new \\
        '16,64,4,4096=main/mma_ht16_qt4_bn64_w8_st2_sp2_p16_tma_ss_sm90a|main/dispatch|new/dispatch' \\
        '8,16,9,16384:e4m3=main/dispatch|new/dispatch' '64,8,9,4096:tree=main/dispatch|new/dispatch'

A cell's VARIANT is a variant name or `dispatch` (the dispatcher's pick). A row's `:FP8` suffix
(one of e4m3, ds_mla, e4m3-q: `mlagen bench --fp8`'s cases) times it on the inputs quantized, and
a `:MASK` suffix (causal, the default, tree or tree-per-request: `mlagen bench --mask`'s) under
that mask.

Prints each cell's µs per round (CUDA graph replay, the bench's inputs, rotated past the L2) and
its best.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from bench_cli import parser, require_gpu

from mlagen.codegen import render
from mlagen.dsl.spec import parse_variant
from mlagen.runtime import launch, op
from mlagen.tools.grids import Row, parse_row
from mlagen.tools.timing import l2_bytes, measure
from mlagen.tools.workload import FP8_CASES, MASKS, InputSet, Workload, make_workload, mlagen_call, with_fp8


def use_templates(tree: Path) -> None:
    """Render from `tree`/templates from now on, dropping every kernel rendered, loaded or planned."""
    templates = tree.resolve() / "templates"
    if not templates.is_dir():
        raise SystemExit(f"{tree}: no templates/ folder in it")
    render._SOURCE_TREE_TEMPLATES = templates
    render.environment.cache_clear()
    render.render.cache_clear()
    launch._loaded.clear()
    op._prepare.cache_clear()
    op._calls.clear()


Cell = tuple[str, str]   # (tree label, variant name or "dispatch")


def row_suffixes(row_text: str) -> tuple[str, str | None, str]:
    """'H,B,S,prefix[:FP8][:MASK]' as ('H,B,S,prefix', the FP8 case or None, the mask), checked."""
    row_only, *suffixes = row_text.split(":")
    case = mask = None
    for suffix in suffixes:
        if suffix in FP8_CASES and case is None:
            case = suffix
        elif suffix in MASKS and mask is None:
            mask = suffix
        else:
            raise SystemExit(f"{row_text!r}: expected after ':' an FP8 case (one of {sorted(FP8_CASES)}) or a mask "
                             f"(one of {list(MASKS)}), each at most once")
    return row_only, case, mask or "causal"


def parse_cells(spec: str, trees: dict[str, Path] | None = None) -> tuple[str, Row, list[Cell]]:
    """'H,B,S,prefix[:FP8][:MASK]=tree/variant|...': the row's text, the row and its cells, each
    variant checked by name and each tree among `trees` (when given)."""
    if "=" not in spec:
        raise SystemExit(f"{spec!r}: expected H,B,S,prefix[:FP8][:MASK]=TREE/VARIANT|...")
    row_text, cells_text = spec.split("=", 1)
    row_only, _, _ = row_suffixes(row_text)
    cells: list[Cell] = []
    for text in cells_text.split("|"):
        tree, _, variant = text.partition("/")
        if not variant or (trees is not None and tree not in trees):
            raise SystemExit(f"{text!r}: expected TREE/VARIANT with TREE one of {sorted(trees or [])}")
        try:
            if variant != "dispatch":
                parse_variant(variant)
            row = parse_row(row_only)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        cells.append((tree, variant))
    return row_text, row, cells


def row_cells(spec: str) -> tuple[str, Workload, list[Cell]]:
    """'H,B,S,prefix[:FP8][:MASK]=tree/variant|...': the row's text, its workload (the bench's,
    under the mask, quantized for an FP8 case) and its cells."""
    row_text, row, cells = parse_cells(spec)
    l2 = l2_bytes(torch.cuda.current_device())
    _, case, mask = row_suffixes(row_text)
    work = make_workload(row, 64, mask, "bf16", l2)
    return row_text, with_fp8(work, case, l2) if case else work, cells


def cell_call(work: Workload, trees: dict[str, Path], cell: Cell) -> Callable[[InputSet], object]:
    """The cell's call on `work`, rendered from its tree's templates."""
    tree, variant = cell
    use_templates(trees[tree])
    return mlagen_call(work, None if variant == "dispatch" else parse_variant(variant))


def print_times(row_text: str, name: str, us: list[float], label: str = "") -> None:
    print(f"{row_text:16s} {name:64s} {label}" + " ".join(f"{t:8.2f}" for t in us)
          + f"   best {min(us):8.2f}", flush=True)


def parse_trees(text: str) -> dict[str, Path]:
    """'LABEL=DIR,...' as {label: directory}."""
    try:
        return {k: Path(v) for k, v in (t.split("=", 1) for t in text.split(","))}
    except ValueError:
        raise SystemExit(f"{text!r}: expected LABEL=DIR,...") from None


def parse_args(script: str, doc: str | None, argv: list[str]) -> tuple[int, dict[str, Path], list[str]]:
    """ROUNDS LABEL=DIR,... ROW=CELLS... (this script's and cold_code.py's command line), checked."""
    p = parser(script, doc)
    p.add_argument("rounds", type=int, help="rounds: every cell timed once a round")
    p.add_argument("trees", type=parse_trees, help="LABEL=DIR,...: trees holding templates/")
    p.add_argument("rows", nargs="+", help="H,B,S,prefix=LABEL/VARIANT|...")
    args = p.parse_args(argv)
    for label, tree in args.trees.items():
        if not (tree / "templates").is_dir():
            p.error(f"tree {label}={tree} holds no templates/ folder")
    for row in args.rows:
        parse_cells(row, args.trees)
    return args.rounds, args.trees, args.rows


def main(rounds: int, trees: dict[str, Path], rows: list[str]) -> None:
    for spec in rows:
        row_text, work, cells = row_cells(spec)
        times: dict[Cell, list[float]] = {cell: [] for cell in cells}
        for _ in range(rounds):
            for cell in cells:
                times[cell].append(measure(cell_call(work, trees, cell), work.sets).us)
        for (tree, variant), us in times.items():
            print_times(row_text, tree + "/" + variant, us)
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parsed = parse_args(__file__, __doc__, sys.argv[1:])
    require_gpu(__file__)
    main(*parsed)
