"""Run one benchmark row (page 64, causal) a few times, for a profiler to look at one launch of
its kernel:

    ncu --clock-control none -k regex:_main --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python3 benchmarks/profile_row.py 64 1 9 65536 [variant name; default: the dispatcher's]

Prints the variant it ran and how many calls.
"""

from __future__ import annotations

import sys

import torch
from bench_cli import parser, require_gpu, variant_name

import mlagen
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.runtime.op import device_info, device_name, device_policy, pick_variant
from mlagen.tools.testing import make_case


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    for name in ("heads", "batch", "seqlen_q", "prefix"):
        p.add_argument(name, type=int)
    p.add_argument("variant", nargs="?", type=variant_name, help="a variant name (default: the dispatcher's pick)")
    p.add_argument("--calls", type=int, default=4, help="launches (default 4: ncu skips 2, profiles 1)")
    return p.parse_args(argv)


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str | None = None, calls: int = 4) -> None:
    v = parse_variant(variant) if variant else None
    case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=[prefix] * batch,
                     page_size=64, mask="causal", seed=0, spare_pages=1)
    for _ in range(calls):
        mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                softmax_scale=case.scale, variant=v)
    torch.cuda.synchronize()
    capacity = case.block_table.shape[1] * 64
    ran = pick_variant(Problem(heads=heads, page_size=64), seqlen_q, batch, capacity, capacity,
                       device_info(0)[0], device_name(0), v, policy=device_policy(0))
    print(f"{calls} calls of {ran.name} on H={heads} B={batch} S={seqlen_q} prefix={prefix}")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(**vars(args))
