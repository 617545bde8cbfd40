"""A/B of one of mlagen.validate's or mlagen.dispatch's constants in one process: each value's launches timed in turn,
round after round, on the bench's inputs (CUDA graph replay, rotated past the L2).

    python3 benchmarks/ab_constant.py ROUNDS NAME=V1,V2,... 'H,B,S,prefix' ...
    python3 benchmarks/ab_constant.py 5 MERGE_TARGET_BLOCKS=128,144 8,16,9,16384 8,16,9,8192

NAME is a module-level int of mlagen/validate.py that the rendered kernels or the launch read
(MERGE_TARGET_BLOCKS, SEGMENT_TILES, ...), or of mlagen/dispatch.py when written dispatch.NAME
(dispatch.PDL_TILES_PER_SM). Each value renders and compiles its own kernels, and
the dispatcher's memos are cleared between values. Prints each value's µs per round and its best.
Session 27's runs are in benchmarks/h200-2026-11-30-s27/tail/.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from ab_trees import print_times, row_cells, use_templates

from mlagen import dispatch, launcher
from mlagen.timing import measure
from mlagen.workload import mlagen_call

validate = importlib.import_module("mlagen.validate")   # the package exports a function of that name


def set_constant(name: str, value: int) -> None:
    """mlagen.validate.`name` (or mlagen.dispatch's, as dispatch.NAME) = value, and the copies
    modules imported, every memo dropped."""
    owner, name = (dispatch, name.removeprefix("dispatch.")) if name.startswith("dispatch.") else (validate, name)
    if not isinstance(getattr(owner, name, None), int):
        raise SystemExit(f"{owner.__name__}.{name} is not an int constant")
    old = getattr(owner, name)
    for module in (validate, dispatch, launcher):
        if module is owner or getattr(module, name, None) == old:
            setattr(module, name, value)
    for fn in vars(dispatch).values():
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    use_templates(Path("."))


def main(rounds: int, setting: str, rows: list[str]) -> None:
    name, values_text = setting.split("=", 1)
    values = [int(v) for v in values_text.split(",")]
    for row in rows:
        row_text, work, _ = row_cells(row + "=x/dispatch")
        times: dict[int, list[float]] = {v: [] for v in values}
        for _ in range(rounds):
            for v in values:
                set_constant(name, v)
                times[v].append(measure(mlagen_call(work, None), work.sets).us)
        for v, us in times.items():
            print_times(row_text, f"{name} {v}", us)
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
