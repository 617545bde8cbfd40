"""Executed SASS instructions and stall samples per opcode, from Nsight Compute's source page as
CSV (one profiled launch). The profile comes from the GPU machine; this part runs anywhere:

    ncu --clock-control none -k regex:_main --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --page source --print-source sass --csv \\
        python3 benchmarks/profile_row.py 64 1 9 65536 > src.csv
    python3 benchmarks/sass_histogram.py src.csv [--top 32]

Prints the total, then per opcode (most executed first) its instructions executed, their share
and its share of the stall samples.
"""

from __future__ import annotations

import collections
import csv
import re
import sys

from bench_cli import parser

_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)")


def histogram(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(executed instructions, stall samples) per opcode of the profiled kernel."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    executed_col = header.index("Instructions Executed")
    stall_col = header.index("Warp Stall Sampling (All Samples)")
    source_col = header.index("Source")
    executed, stalls = collections.Counter(), collections.Counter()
    for r in rows[start + 1:]:
        try:
            n, s = int(r[executed_col].replace(",", "")), int(r[stall_col].replace(",", ""))
        except (IndexError, ValueError):
            continue
        m = _OPCODE.match(r[source_col].strip())
        op = m.group(1) if m else "?"
        executed[op] += n
        stalls[op] += s
    return executed, stalls


def main(path: str, top: int = 32) -> None:
    executed, stalls = histogram(path)
    total, samples = sum(executed.values()), max(1, sum(stalls.values()))
    print(f"{total:,d} instructions executed, {samples:,d} stall samples")
    print(f"{'opcode':10s} {'executed':>13s} {'share':>6s} {'stalls':>7s}")
    for op, n in executed.most_common(top):
        print(f"{op:10s} {n:>13,d} {100 * n / total:5.1f}% {100 * stalls[op] / samples:6.1f}%")


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--top", type=int, default=32, help="opcodes printed (default 32)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    main(args.csv, args.top)
