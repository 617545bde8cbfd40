"""Does a row's dispatched time depend on what ran just before it? The bench times naive, flash,
the mma pick and torch eager on each row in that order; session 21 found its batched rows 2-4%
slower than a process that times only the dispatched kernel (benchmarks/NOTES.md, "v47").

For each row this times the dispatched kernel (graph replay, the bench's inputs and timing)
alone, then right after each of the bench's other cells, then after a pause, and prints each
figure with the wall time it was taken at, so a clock log (nvidia-smi -lms) lines up with it:

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \\
        --format=csv -lms 100 > clocks.csv &
    python3 benchmarks/bench_order.py 16,64,4,4096 8,16,9,16384
"""

from __future__ import annotations

import sys
import time

import torch

from mlagen.bench import DISPATCH, row_variants
from mlagen.grids import parse_row
from mlagen.runtime import device_info, device_name
from mlagen.timing import l2_bytes, measure
from mlagen.workload import eager_call, make_workload, mlagen_call, problem_for

PAUSE_S = 3.0


def main(rows: list[str]) -> None:
    device = torch.cuda.current_device()
    arch, _ = device_info(device)
    gpu = device_name(device)
    t0 = time.time()

    def log(what: str, us: float) -> None:
        print(f"{time.time():.2f} (+{time.time() - t0:6.1f} s) {what:40s} {us:10.2f}", flush=True)

    for text in rows:
        row = parse_row(text)
        problem = problem_for(row, 64, "causal", "bf16")
        work = make_workload(row, 64, "causal", "bf16", l2_bytes(device))
        dispatch = mlagen_call(work, None)
        print(f"== {text}", flush=True)
        for _ in range(2):
            log("dispatch, alone", measure(dispatch, work.sets).us)
        others = {name: mlagen_call(work, v) for name, v in row_variants(problem, row, 64, arch, gpu).items()
                  if name != DISPATCH}
        others["eager"] = eager_call(work)
        for name, call in others.items():
            log(name, measure(call, work.sets).us)
            log(f"dispatch, right after {name}", measure(dispatch, work.sets).us)
        time.sleep(PAUSE_S)
        log(f"dispatch, after {PAUSE_S:.0f} s idle", measure(dispatch, work.sets).us)
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
