"""Run one benchmark row a few times, for a profiler to look at one launch of its kernels.

    ncu --clock-control none -k regex:_main --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \\
        python3 benchmarks/profile_row.py 64 1 9 65536 [variant name; default: the dispatcher's]
"""

from __future__ import annotations

import sys

import torch

import mlagen
from mlagen.spec import parse_variant
from mlagen.testing import make_case


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str | None = None, calls: int = 4) -> None:
    case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=[prefix] * batch,
                     page_size=64, mask="causal", seed=0, spare_pages=1)
    for _ in range(calls):
        mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                softmax_scale=case.scale, variant=parse_variant(variant) if variant else None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]), *sys.argv[5:6])
