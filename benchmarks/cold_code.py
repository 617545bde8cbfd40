"""Graph replay with the SMs' instruction caches cold: each call behind a kernel that runs
~240 KB of straight-line code on every SM, timed as (that kernel + the call) - that kernel.

`mlagen bench` replays the same kernel back to back, so from the second call on its code sits
in every SM's instruction caches. In a model the attention kernel runs between other layers'
kernels, which evict it, so a change to a kernel's code layout (what `hot_loop.py` reports) can
show in Nsight Compute's stalls on instruction fetch and in a single launch while graph replay
stays flat: this times that cold regime. The trees and cells are ab_trees.py's:

    python3 benchmarks/cold_code.py ROUNDS main=.,new=/tmp/new \\
        '16,64,4,4096=main/mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a|new/dispatch'

Prints each cell's warm (plain replay) and cold µs per round, and the flush kernel's own µs. The
flush kernel's time is not the same alone and behind a call (alone it finds its code in the L2),
so a cold figure is the call plus a constant: compare cells, not absolute times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy
import torch
from ab_trees import Cell, cell_call, parse_args, print_times, row_cells
from bench_cli import require_gpu

from mlagen.tools.timing import measure

CHAINS, STEPS = 4, 2048          # ~15K instructions, ~240 KB of SASS (FFMAs and the MOVs of their constants)


def flush_source() -> str:
    """The CUDA source of `icache_flush`: CHAINS x STEPS multiply-adds with distinct constants, so
    neither a loop nor folding can shrink it; its result is stored so none of it is dead."""
    body = []
    for s in range(STEPS):
        for c in range(CHAINS):
            body.append(f"x{c} = fmaf(x{c}, {1.0 + (s * CHAINS + c + 1) * 1e-7:.9f}f, "
                        f"{(s * CHAINS + c + 1) * 1e-9:.12f}f);")
    decl = " ".join(f"float x{c} = seed + {c};" for c in range(CHAINS))
    total = " + ".join(f"x{c}" for c in range(CHAINS))
    return (f'extern "C" __global__ void icache_flush(float* out, float seed) {{\n {decl}\n '
            + "\n ".join(body) + f"\n if ({total} == 12345.0f) out[threadIdx.x] = {total};\n}}\n")


def flush_kernel() -> cupy.RawKernel:
    """The flush kernel, launched as one 128-thread block per SM: one warp per scheduler."""
    return cupy.RawKernel(flush_source(), "icache_flush")


def main(rounds: int, trees: dict[str, Path], rows: list[str]) -> None:
    flush = flush_kernel()
    sink = cupy.zeros(1024, dtype=cupy.float32)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def evict() -> None:
        stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream())   # the capture stream too
        flush((sms,), (128,), (sink, cupy.float32(1.0)), stream=stream)

    for spec in rows:
        row_text, work, cells = row_cells(spec)
        warm: dict[Cell, list[float]] = {cell: [] for cell in cells}
        cold: dict[Cell, list[float]] = {cell: [] for cell in cells}
        alone: list[float] = []
        for _ in range(rounds):
            alone.append(measure(lambda s: evict(), work.sets).us)
            for cell in cells:
                call = cell_call(work, trees, cell)
                warm[cell].append(measure(call, work.sets).us)
                cold[cell].append(measure(lambda s, call=call: (evict(), call(s)), work.sets).us - alone[-1])
        print_times(row_text, "flush kernel alone", alone)
        for cell in cells:
            print_times(row_text, cell[0] + "/" + cell[1], warm[cell], "warm ")
            print_times(row_text, cell[0] + "/" + cell[1], cold[cell], "cold ")
        del work
        torch.cuda.empty_cache()


if __name__ == "__main__":
    parsed = parse_args(__file__, __doc__, sys.argv[1:])
    require_gpu(__file__)
    main(*parsed)
