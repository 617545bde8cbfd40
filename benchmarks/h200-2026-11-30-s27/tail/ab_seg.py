"""A/B of SEGMENT_TILES in one process: each value's launches timed in turn, round after round."""
import sys
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from ab_trees import use_templates, row_cells, print_times
import mlagen.validate  # noqa: F401
validate = sys.modules["mlagen.validate"]
from mlagen.timing import measure
from mlagen.workload import mlagen_call

rounds, targets = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
for row in sys.argv[3:]:
    row_text, work, _ = row_cells(row + "=x/dispatch")
    times = {t: [] for t in targets}
    for _ in range(rounds):
        for t in targets:
            validate.SEGMENT_TILES = t
            use_templates(Path("."))
            times[t].append(measure(mlagen_call(work, None), work.sets).us)
    for t, us in times.items():
        print_times(row_text, f"segment_tiles {t}", us)
    del work
    torch.cuda.empty_cache()
