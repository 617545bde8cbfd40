"""What a block table sized for a long context costs, and what `max_seqlen_k` wins back.

    python3 benchmarks/wide_table.py [H B S prefix table_keys]   (default 64 1 9 256 131072)

Serving engines size block tables for their longest context, and the dispatcher plans from a
table's width unless the call passes `max_seqlen_k`. This times the dispatcher's pick (CUDA
graph replay, inputs rotated past the L2) three ways on the same requests:
- with a table just wide enough;
- with a table of table_keys keys;
- with that wide table plus max_seqlen_k.
It prints the variant each one runs and the largest difference from the first one's output.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from bench_cli import parser, require_gpu

from mlagen.dispatch.policy import DispatchPolicy
from mlagen.dsl.spec import Problem, Variant
from mlagen.runtime.inputs import key_bound
from mlagen.runtime.op import device_info, device_name, device_policy, pick_variant
from mlagen.tools.grids import Row
from mlagen.tools.timing import l2_bytes, measure
from mlagen.tools.workload import Workload, make_workload, mlagen_call

PAGE_SIZE = 64


def widened(work: Workload, table_keys: int) -> Workload:
    """The same inputs under block tables of table_keys keys (the extra entries are never read)."""
    pages = -(-table_keys // work.problem.page_size)
    sets = []
    for s in work.sets:
        extra = max(0, pages - s.block_table.shape[1])
        table = torch.cat([s.block_table, s.block_table[:, :1].expand(-1, extra)], dim=1).contiguous()
        sets.append(dataclasses.replace(s, block_table=table))
    return dataclasses.replace(work, sets=sets)


def plans(problem: Problem, row: Row, narrow_keys: int, wide_keys: int, arch: str, gpu: str,
          dispatch: DispatchPolicy) -> list[tuple[str, int, int | None, Variant]]:
    """(label, table capacity, max_seqlen_k or None, the variant the runtime picks on the device of
    `dispatch`) of each run."""
    runs = [("narrow table", narrow_keys, None), ("wide table", wide_keys, None),
            (f"wide table, max_seqlen_k={row.keys}", wide_keys, row.keys)]
    out = []
    for label, capacity, bound in runs:
        planned = capacity if bound is None else min(capacity, key_bound(bound))
        out.append((label, capacity, bound,
                    pick_variant(problem, row.seqlen_q, row.batch, planned, capacity, arch, gpu, None,
                                 policy=dispatch)))
    return out


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    for name, default in (("heads", 64), ("batch", 1), ("seqlen_q", 9), ("prefix", 256), ("table_keys", 131072)):
        p.add_argument(name, type=int, nargs="?", default=default)
    return p.parse_args(argv)


def main(heads: int, batch: int, seqlen_q: int, prefix: int, table_keys: int) -> None:
    row = Row(heads, batch, seqlen_q, prefix)
    narrow = make_workload(row, PAGE_SIZE, "causal", "bf16", l2_bytes(0))
    wide = widened(narrow, table_keys)
    print(f"H={heads} B={batch} S={seqlen_q} prefix={prefix}: {row.keys} keys a request; wide table "
          f"{wide.kv_capacity} keys; {len(narrow.sets)} input sets")
    first = narrow.sets[0]
    mlagen_call(narrow, None)(first)
    reference = first.out.float().clone()
    for label, capacity, bound, picked in plans(narrow.problem, row, narrow.kv_capacity, wide.kv_capacity,
                                                device_info(0)[0], device_name(0), device_policy(0)):
        work = narrow if capacity == narrow.kv_capacity else wide
        call = mlagen_call(work, None, bound)
        call(work.sets[0])
        diff = (work.sets[0].out.float() - reference).abs().max().item()
        print(f"{label:40s} {measure(call, work.sets).us:8.1f} µs  {picked.name:50s} max |diff| {diff:.2e}")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(**vars(args))
