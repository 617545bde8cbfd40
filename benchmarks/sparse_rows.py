"""Time sparse verify rows (DeepSeek Sparse Attention) on a grid of your choosing: each query token
attends to its own topk rows of DeepSeek's 656-byte FP8 cache, through the dispatcher's pick and
named variants, and FlashMLA's sparse decode kernel on the same inputs where a FlashMLA build
loads (benchmarks/build_flashmla.py; `mlagen.tools.live_peer`). `mlagen bench --sparse` runs the
default grid; this script takes any.

    python3 benchmarks/sparse_rows.py [--heads H ...] [--seqlen-q S ...] [--batch B ...]
                                      [--topk K] [--cache-keys N] [--variant NAME ...] [--flashmla DIR]

Defaults: H 64 128, S 1 2 4, B 1 8 32 128, topk 2048, 65536 cached keys a request. Request b's
tokens list random rows (distinct within a token) of its own region of the cache, on 64-key
pages. Prints `mlagen.tools.sparse_bench`'s table: per row, for the dispatcher's pick and each
named variant, µs per call under CUDA graph replay (index sets rotated past the L2), TFLOP/s (2 B
S H topk (576 + 512) flop) and the time over the floor (the products at the bf16 matmul rate, or
the gathered rows at the copy bandwidth, whichever is longer); then FlashMLA's µs, dispatch /
FlashMLA and the largest output difference between the two, or why FlashMLA did not run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench_cli import parser, require_gpu, variant_name

from mlagen.dsl.spec import parse_variant
from mlagen.tools.sparse_bench import CACHE_KEYS, SparseConfig, SparseRow, markdown, run_sparse, sparse_grid


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlen-q", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--cache-keys", type=int, default=CACHE_KEYS, help="cached keys a request's tokens pick from")
    p.add_argument("--variant", type=variant_name, action="append", default=[],
                   help="a variant to time after the dispatcher's pick (repeatable)")
    p.add_argument("--flashmla", type=Path, metavar="DIR",
                   help="the FlashMLA checkout built with build_flashmla.py (default $MLAGEN_FLASHMLA, else "
                   "./third_party/FlashMLA)")
    args = p.parse_args(argv)
    for name in ("heads", "seqlen_q", "batch"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected values >= 1")
    if not 1 <= args.topk <= args.cache_keys:
        p.error(f"--topk: got {args.topk}, expected 1..--cache-keys={args.cache_keys}")
    return args


def rows(args) -> list[SparseRow]:
    return sparse_grid(args.heads, args.seqlen_q, args.batch, args.topk)


def main(args) -> None:
    config = SparseConfig(cache_keys=args.cache_keys, extra=tuple(parse_variant(n) for n in args.variant),
                          flashmla=args.flashmla)
    print(markdown(run_sparse(rows(args), config)), end="", flush=True)


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(arguments)
