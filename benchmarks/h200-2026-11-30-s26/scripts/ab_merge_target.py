"""A/B of MERGE_TARGET_BLOCKS (merge blocks a split launch aims for) in one process: each value's
launches timed in turn, round after round (session 26). From the repository root:

    python3 benchmarks/h200-2026-11-30-s26/scripts/ab_merge_target.py ROUNDS 128,64,27 64,1,9,4096 ...
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
from ab_trees import print_times, row_cells, use_templates  # noqa: E402

import mlagen.validate  # noqa: E402, F401  (the module: the package exports a function of that name)
from mlagen.timing import measure  # noqa: E402
from mlagen.workload import mlagen_call  # noqa: E402

validate = sys.modules["mlagen.validate"]
rounds, targets = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
for row in sys.argv[3:]:
    row_text, work, _ = row_cells(row + "=x/dispatch")
    times: dict[int, list[float]] = {t: [] for t in targets}
    for _ in range(rounds):
        for t in targets:
            validate.MERGE_TARGET_BLOCKS = t
            use_templates(Path("."))            # drops the planned launches, whose merge blocks are counted
            times[t].append(measure(mlagen_call(work, None), work.sets).us)
    for t, us in times.items():
        print_times(row_text, f"target {t}", us)
    del work
    torch.cuda.empty_cache()
