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

from mlagen.dispatch import choose_variant
from mlagen.grids import Row
from mlagen.inputs import key_bound
from mlagen.runtime import device_info, device_name
from mlagen.timing import l2_bytes, measure
from mlagen.workload import Workload, make_workload, mlagen_call


def widened(work: Workload, table_keys: int) -> Workload:
    """The same inputs under block tables of table_keys keys (the extra entries are never read)."""
    pages = -(-table_keys // work.problem.page_size)
    sets = []
    for s in work.sets:
        extra = max(0, pages - s.block_table.shape[1])
        table = torch.cat([s.block_table, s.block_table[:, :1].expand(-1, extra)], dim=1).contiguous()
        sets.append(dataclasses.replace(s, block_table=table))
    return dataclasses.replace(work, sets=sets)


def main(heads: int = 64, batch: int = 1, seqlen_q: int = 9, prefix: int = 256, table_keys: int = 131072) -> None:
    row = Row(heads, batch, seqlen_q, prefix)
    narrow = make_workload(row, 64, "causal", "bf16", l2_bytes(0))
    wide = widened(narrow, table_keys)
    arch, gpu = device_info(0)[0], device_name(0)
    print(f"H={heads} B={batch} S={seqlen_q} prefix={prefix}: {row.keys} keys a request; wide table "
          f"{wide.kv_capacity} keys; {len(narrow.sets)} input sets")
    first = narrow.sets[0]
    mlagen_call(narrow, None)(first)
    reference = first.out.float().clone()
    runs = [("narrow table", narrow, None, narrow.kv_capacity), ("wide table", wide, None, wide.kv_capacity),
            (f"wide table, max_seqlen_k={row.keys}", wide, row.keys, min(wide.kv_capacity, key_bound(row.keys)))]
    for label, work, bound, planned in runs:
        call = mlagen_call(work, None, bound)
        call(work.sets[0])
        diff = (work.sets[0].out.float() - reference).abs().max().item()
        picked = choose_variant(work.problem, seqlen_q, batch, planned, arch, gpu)
        print(f"{label:40s} {measure(call, work.sets).us:8.1f} µs  {picked.name:50s} max |diff| {diff:.2e}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:6]))
