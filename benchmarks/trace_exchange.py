"""Per-block timeline of one launch of a P exchange (`Variant.p_exchange`): when each block's
Q and tile have landed, its scores are done, every tile's row maxima are in, its value slices
are in, the last peer's P slot is in, its value product is done, and when it ends.

Stamps (globaltimer, every one: the phases are short and the SM clock of a single cold launch
is not known) are patched into the rendered source of this run only, at landmarks of
templates/mma_exchange.cu.j2; a landmark that moved fails loudly. Thread 0 stamps, so "last P
in" is the last slot its warpgroup waited for. On the GPU machine:

    python3 benchmarks/trace_exchange.py 64 1 9 256 mma_ht64_qt1_bn64_w8_st1_sp8_cl_px_sm90a
    python3 benchmarks/trace_exchange.py 64 1 9 256 VARIANT --source > patched.cu   # no GPU

The case comes from trace_blocks.patched_row (a spare page column in the block table), so the
cluster must hold one more tile than the keys need (sp8 for 265 keys, not sp5).
"""

from __future__ import annotations

import sys

from bench_cli import require_gpu
from trace_blocks import header, patched_row, patched_source, row_parser, traced_blocks

START, P_DONE, LOADED, SCORED, MAXIMA_IN, LAST_P_IN, SLICES_IN, END = range(8)
COLUMNS = (("loaded", LOADED), ("scored", SCORED), ("maxima in", MAXIMA_IN), ("slices in", SLICES_IN),
           ("last P in", LAST_P_IN), ("P V done", P_DONE))
PATCHES = [   # (landmark, replacement): the first occurrence of each
    ("row0 = 16 * (warp % 4) + g;   // rows row0, row0 + 8\n", f"row0 = 16 * (warp % 4) + g;\n  TR({START});\n"),
    ("    __syncthreads();\n    asm volatile(\"wgmma.fence",
     f"    __syncthreads(); TR({LOADED});\n    asm volatile(\"wgmma.fence"),
    ("  asm volatile(\"barrier.cluster.wait.aligned;\\n\" ::: \"memory\");",
     f"  TR({SCORED}); asm volatile(\"barrier.cluster.wait.aligned;\\n\" ::: \"memory\");"),
    ("  mbar_wait(bar_m, 0);\n", f"  mbar_wait(bar_m, 0); TR({MAXIMA_IN});\n"),
    ("      mbar_wait(bar_p(i), 0);", f"      mbar_wait(bar_p(i), 0); TR({LAST_P_IN});"),
    ("  __syncthreads();\n\n  auto row_sum", f"  __syncthreads(); TR({SLICES_IN});\n\n  auto row_sum"),
    ("    asm volatile(\"wgmma.wait_group.sync.aligned 0;\\n\" ::: \"memory\");\n#pragma unroll\n    for (int half",
     f"    asm volatile(\"wgmma.wait_group.sync.aligned 0;\\n\" ::: \"memory\"); TR({P_DONE});\n"
     "#pragma unroll\n    for (int half"),
    ("  // This block's slots must stay", f"  __syncthreads(); TR({END});\n  // This block's slots must stay"),
]


def patch(source: str) -> str:
    """`source` (a P exchange's) with the stamps, every one from globaltimer."""
    for landmark, replacement in PATCHES:
        if landmark not in source:
            raise SystemExit(f"landmark not found (the template changed): {landmark!r}")
        source = source.replace(landmark, replacement, 1)
    return header(globaltimer_only=True) + source


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str) -> None:
    loaded, call = patched_row(lambda plan, source: patch(source), heads, batch, seqlen_q, prefix, variant)
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
    p.add_argument("--source", action="store_true", help="print the patched source and exit (no GPU)")
    args = p.parse_args(argv)
    if args.variant is None:
        p.error("a P exchange variant name is needed")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.source:
        print(patched_source(args.variant, args.heads, lambda plan, source: patch(source)), end="")
        raise SystemExit(0)
    require_gpu(__file__)
    main(args.heads, args.batch, args.seqlen_q, args.prefix, args.variant)
