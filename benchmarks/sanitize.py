"""A handful of paged, ragged, tree-masked shapes through every family, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py [NAME_PART | -NAME_PART]

With NAME_PART, only the variants whose names contain it (racecheck on everything takes minutes);
with -NAME_PART, all but those. racecheck does not pair bar.arrive with bar.sync, so it reports
the transposed tile's (`_tr_`) hand-offs between warpgroups as hazards: run_gpu.sh checks that
tile with synccheck and a bitwise-repeatability test instead (tests/test_gpu_verify.py).
"""

from __future__ import annotations

import contextlib
import sys

import torch

import mlagen
from mlagen.runtime import device_info
from mlagen.spec import Variant, naive
from mlagen.testing import assert_matches, make_case, pinned_balanced_ranges

CASES = [
    dict(batch=3, seqlen_q=5, heads=16, prefixes=[300, 0, 1000], page_size=16, mask="tree", empty=[False, True, False]),
    dict(batch=2, seqlen_q=9, heads=64, prefixes=[129, 700], page_size=64, mask="causal"),
    dict(batch=2, seqlen_q=3, heads=8, prefixes=[70, 5], page_size=1, mask="none"),
]
# Enough tiles that balanced ranges run from one request into the next (an empty one between),
# with several tiles on both sides; for the balanced variants only (racecheck is slow on it).
CROSSING = dict(batch=6, seqlen_q=9, heads=8, prefixes=[2000, 0, 900, 3500, 5, 1400], page_size=64, mask="causal",
                empty=[False, True, False, False, False, False])
# Requests of equal length, as the bench's batched rows have them.
EQUAL = dict(batch=6, seqlen_q=9, heads=8, prefixes=[1500] * 6, page_size=64, mask="causal")
# Short requests, a block table of at most 320 keys, for the P exchange (`_px`) only: it refuses
# wider tables. Requests that fill every block's tile and one that leaves blocks without one.
SHORT = dict(batch=3, seqlen_q=9, heads=64, prefixes=[247, 0, 120], page_size=16, mask="tree",
             empty=[False, True, False])


def main() -> None:
    arch = device_info(torch.cuda.current_device())[0]
    variants = [naive(arch=arch), None,
                Variant(family="flash", head_tile=8, q_tile=3, block_n=64, warps=4, stages=2, kv_split=3, arch=arch),
                Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2, kv_split=3, arch=arch),
                Variant(family="mma", head_tile=8, q_tile=1, block_n=64, warps=4, stages=1, kv_split=1, arch=arch),
                Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2, kv_split="balanced",
                        arch=arch)]
    if torch.cuda.get_device_capability() == (9, 0):   # sm_90a: P·V on wgmma or mma.sync; balanced, cluster
        # split; each split also with 16-bit partial rows; TMA loads, and the seesaw on them
        for knobs in ({}, {"mma_pv": True}, {"kv_split": "balanced"}, {"cluster": True}, {"part16": True},
                      {"kv_split": "balanced", "part16": True}, {"cluster": True, "part16": True},
                      {"tma": True}, {"kv_split": "balanced", "tma": True}, {"mma_pv": True, "tma": True},
                      {"tma": True, "seesaw": True},
                      {"kv_split": "balanced", "tma": True, "seesaw": True, "part16": True}):
            variants.append(Variant(family="mma", head_tile=8, q_tile=8, block_n=64, warps=8, stages=2,
                                    arch="sm_90a", **({"kv_split": 2} | knobs)))
        # the short rows' kernel: its epilogue stages 64 output rows over nearly all its shared memory
        for part16 in (False, True):
            variants.append(Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1,
                                    mma_pv=True, part16=part16, arch="sm_90a"))
        # the transposed tile: 72 rows (all of the shared memory; its q tile overhangs S=3 and 5)
        # and 32, with a fixed and a balanced split, and TMA loads (whose mbarriers share #0/#1)
        for tile, knobs in (((8, 9), {"kv_split": 2}), ((8, 9), {"kv_split": "balanced", "part16": True}),
                            ((8, 4), {"kv_split": "balanced"}), ((8, 9), {"kv_split": 2, "tma": True}),
                            ((8, 9), {"kv_split": "balanced", "part16": True, "tma": True})):
            variants.append(Variant(family="mma", head_tile=tile[0], q_tile=tile[1], block_n=64, warps=8, stages=2,
                                    arch="sm_90a", transposed=True, **knobs))
        # the P exchange (the SHORT case only): 5 tiles in 5 and in 8 blocks, a causal mask
        exchange = [Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1, arch="sm_90a",
                            kv_split=k, cluster=True, p_exchange=True) for k in (5, 8)]
    else:
        exchange = []
    if len(sys.argv) > 1:
        part = sys.argv[1].lstrip("-")
        keep = not sys.argv[1].startswith("-")
        variants = [v for v in variants if (part in (v.name if v else "dispatched")) == keep]
        exchange = [v for v in exchange if (part in v.name) == keep]
    balanced = [v for v in variants if v is not None and v.kv_split == "balanced"]
    # (case, variants, balanced ranges pinned or None): CROSSING and EQUAL run the balanced work
    # list's aligned layout with one range per resident slot on a 132-SM H200, and its packed
    # layout (ranges crossing requests) with 6 and 5 ranges.
    runs = ([(c, variants, None) for c in CASES] + [(CROSSING, balanced, None), (CROSSING, balanced, 6)]
            + [(EQUAL, balanced, None), (EQUAL, balanced, 5)]
            + [(SHORT, exchange, None), (SHORT | {"mask": "causal"}, exchange, None)])
    for i, (shape, case_variants, ranges) in enumerate(runs):
        case = make_case(seed=i, **shape)
        with pinned_balanced_ranges(ranges) if ranges else contextlib.nullcontext():
            for v in case_variants:
                if v is not None and (shape["heads"] % v.head_tile or (v.tma and shape["page_size"] % v.block_n)):
                    continue
                out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                   variant=v, return_lse=True, **case.kwargs())
                torch.cuda.synchronize()
                assert_matches(out, lse, case)
                print(f"case {i} {v.name if v else 'dispatched'}: ok", flush=True)


if __name__ == "__main__":
    main()
