"""Per-block timeline of one launch of a P exchange (`Variant.p_exchange`): when each block's
Q and tile have landed, its scores are done, every tile's row maxima are in, its value slices
are in, the last peer's P slot is in, its value product is done, and when it ends.

Stamps (globaltimer, every one: the phases are short and the SM clock of a single cold launch
is not known) are the trace points of templates/mma_exchange.cu.j2 (`MLAGEN_TRACE(point)`,
nothing in an untraced kernel): this run's source defines MLAGEN_TRACE_ON and each point's
stamp (`EXCHANGE_POINTS`) ahead of the rendered kernel. Thread 0 stamps, so "last P in" is the
last slot its warpgroup waited for. On the GPU machine:

    python3 benchmarks/trace_exchange.py 64 1 9 256 mma_ht64_qt1_bn64_w8_st1_sp8_cl_px_sm90a
    python3 benchmarks/trace_exchange.py 64 1 9 256 VARIANT --source > traced.cu   # no GPU

The case comes from trace_blocks.traced_row (a spare page column in the block table), so the
cluster must hold one more tile than the keys need (sp8 for 265 keys, not sp5).
"""

from __future__ import annotations

import sys

from bench_cli import require_gpu
from trace_blocks import header, row_parser, traced, traced_blocks, traced_row, traced_source

from mlagen.plan.validate import KernelPlan

START, P_DONE, LOADED, SCORED, MAXIMA_IN, LAST_P_IN, SLICES_IN, END = range(8)
COLUMNS = (("loaded", LOADED), ("scored", SCORED), ("maxima in", MAXIMA_IN), ("slices in", SLICES_IN),
           ("last P in", LAST_P_IN), ("P V done", P_DONE))
# Each trace point's stamp, by thread 0 of the block; the end waits for the whole block first.
EXCHANGE_POINTS = {
    "start": f"TR({START})",
    "loaded": f"TR({LOADED})",                  # Q and the block's tile landed
    "scored": f"TR({SCORED})",                  # its scores' maxima sent, before the cluster's barrier
    "maxima_in": f"TR({MAXIMA_IN})",            # every tile's row maxima
    "p_in": f"TR({LAST_P_IN})",                 # each peer's P slot (the last one stays)
    "slices_in": f"TR({SLICES_IN})",            # the value slices
    "pv_done": f"TR({P_DONE})",                 # a column block's P V (the last one stays)
    "end": f"__syncthreads(); TR({END})",
}


def exchange_trace(plan: KernelPlan, source: str) -> str:
    """`plan`'s rendered `source` (a P exchange's), traced: every stamp from globaltimer."""
    if not plan.variant.p_exchange:
        raise SystemExit(f"{plan.name} is not a P exchange: trace_blocks.py traces the other mma kernels")
    return traced(source, header(globaltimer_only=True), EXCHANGE_POINTS, tuple(EXCHANGE_POINTS))


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str) -> None:
    loaded, call = traced_row(exchange_trace, heads, batch, seqlen_q, prefix, variant)
    rows = traced_blocks(loaded, call)
    t0 = min(r[START] for _, r in rows)
    print(loaded.plan.name, "blocks", len(rows))
    print("block  start | " + " ".join(f"{name:>9}" for name, _ in COLUMNS) + "       end  (µs from the block's start)")
    for i, r in sorted(rows, key=lambda row: row[1][START]):
        cells = " ".join(f"{(r[k] - r[START]) / 1e3 if r[k] else float('nan'):9.2f}" for _, k in COLUMNS)
        print(f"{i:5d} {(r[START] - t0) / 1e3:6.2f} | {cells} {(r[END] - r[START]) / 1e3:9.2f}")
    print(f"launch span (first block start to last block end): {max((r[END] - t0) / 1e3 for _, r in rows):.2f} µs")


def parse_args(argv: list[str]):
    p = row_parser(__file__, __doc__, "a P exchange variant (`_px_`)")
    p.add_argument("--source", action="store_true", help="print the traced source and exit (no GPU)")
    args = p.parse_args(argv)
    if args.variant is None:
        p.error("a P exchange variant name is needed")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.source:
        print(traced_source(args.variant, args.heads, exchange_trace), end="")
        raise SystemExit(0)
    require_gpu(__file__)
    main(args.heads, args.batch, args.seqlen_q, args.prefix, args.variant)
