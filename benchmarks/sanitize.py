"""A handful of paged, ragged, tree-masked shapes through every family, each output checked against
the reference: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py --skip _tr_ [--cases 0-2]
    compute-sanitizer --tool synccheck python3 benchmarks/sanitize.py --only _tr_,feature+fp8_ws,feature+fp8_mma,fp8_ldg
    python3 benchmarks/sanitize.py --list [--arch sm_90]     # what would run; no GPU needed

--only / --skip keep the variants whose names do / do not contain one of their comma-separated
parts ("dispatched" names the dispatcher's pick), --cases the cases numbered so (`--list` numbers them): racecheck takes
seconds a pair, minutes in all. racecheck does not pair bar.arrive
with bar.sync, so it reports the transposed tile's (`_tr_`) hand-offs between warpgroups as
hazards: run_gpu.sh checks that tile with synccheck instead, and tests/test_gpu_verify.py with a
bitwise-repeatability test. The engine features run last (named "feature+FEATURE"), on the
dispatcher's pick: batch-invariant splits, FP8 caches of both formats and e4m3 queries, and
the two ranks of a context-parallel pair (their per-request shard masks), merged; and the mma
family's FP8 tiles (`fp8_tile`: a balanced split with 16-bit partials on sm_90a, a fixed split on
mma.sync elsewhere) and, on sm_90a, that tile on the warp-specialized fp8_ws schedule, with
e4m3 queries on the fp8_mma schedule and over a ds_mla cache on the fp8_ldg schedule (their
producer warpgroup's hand-offs are mbarriers, which racecheck follows); and gathered keys (sparse
verify) on the dispatcher's one-token tile, on the naive kernel, over pages of 64 and of 61 keys,
and on sm_90a on the one-token tile of the fp8_ldg schedule. Attention sinks and the merge are torch ops:
nothing there for the sanitizer. Prints one line per (case, variant) and a count at the end.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from bench_cli import parser, require_gpu

import mlagen
from mlagen.dsl.spec import Problem, Variant, naive, parse_variant
from mlagen.plan.schedules import FP8_LDG, FP8_MMA, FP8_WS
from mlagen.tools.testing import AnyCase, assert_matches, make_case, make_sparse_case, pinned_balanced_ranges

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

# Lengths of 1, 2, 3 and 8 batch-invariant splits (2048 keys a split, at most 8).
INVARIANT = dict(batch=4, seqlen_q=9, heads=64, prefixes=[300, 3000, 5000, 16000], page_size=64, mask="causal")
# Ragged rows: twelve requests of 0..9 real rows (query tiles of 4 positions: three slots to deal
# them round), some crossing range ends.
RAGGED = dict(batch=12, seqlen_q=9, heads=16, prefixes=[900, 0, 2000, 70, 1500, 300, 2600, 5, 1200, 800, 0, 1700],
              page_size=64, mask="tree", per_request_tree=True)
RAGGED_COUNTS = [9, 0, 4, 1, 9, 6, 2, 9, 5, 3, 7, 8]
# The ragged features' variants: the seesaw's, and the transposed tile's (its name holds `_tr_`,
# so that racecheck skips it and synccheck takes it, as for the tile's other cases).
RAGGED_VARIANTS = {"ragged_rows": "mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_rg_sm90a",
                   "ragged_rows_tr_": "mma_ht16_qt2_bn64_w8_st2_spb_p16_tr_rg_sm90a"}
# Gathered keys (sparse verify): 128 heads (two row groups a token) over 64-key pages, a request
# without slots, a quarter of the slots unused; and 16 heads over 61-key pages (no power of two).
GATHERED = dict(batch=3, seqlen_q=2, heads=128, topk=300, pages=12, page_size=64, lengths=[300, 0, 129])
GATHERED_ODD_PAGES = dict(batch=2, seqlen_q=3, heads=16, topk=200, pages=9, page_size=61, lengths=[77, 200])
# (feature, case, make_case's extra arguments): each runs on the dispatcher's pick (ragged rows:
# on RAGGED_VARIANTS).
FEATURES = [("invariant", INVARIANT, {}), ("invariant", CASES[0], {}),
            ("fp8_e4m3", CASES[1], {"kv_format": "e4m3"}), ("fp8_ds_mla", CASES[0], {"kv_format": "ds_mla"}),
            ("q_e4m3", CASES[2], {"kv_format": "e4m3", "q_format": "e4m3"}),
            ("cp_shards", CASES[0] | {"per_request_tree": True}, {}), ("cp_shards", CASES[1], {}),
            ("fp8_tile", CROSSING, {"kv_format": "e4m3"}), ("fp8_tile", CASES[0], {"kv_format": "ds_mla"}),
            ("fp8_ws", CROSSING, {"kv_format": "e4m3"}), ("fp8_ws", CASES[1], {"kv_format": "e4m3"}),
            ("fp8_mma", CROSSING, {"kv_format": "e4m3", "q_format": "e4m3"}),
            ("fp8_mma", CASES[1], {"kv_format": "e4m3", "q_format": "e4m3"}),
            ("ragged_rows", RAGGED, {}), ("ragged_rows_tr_", RAGGED, {}),
            ("fp8_ldg", CASES[0], {"kv_format": "ds_mla"}),
            ("gathered", GATHERED, {"kv_format": "ds_mla"}), ("gathered", GATHERED_ODD_PAGES, {}),
            ("gathered_naive", GATHERED_ODD_PAGES, {"kv_format": "e4m3"}),
            ("gathered_fp8_ldg", GATHERED, {"kv_format": "ds_mla"})]
# The gathered features' cases are make_sparse_case's (each token over its own listed rows).
GATHERED_FEATURES = ("gathered", "gathered_naive", "gathered_fp8_ldg")

# The features that run on an sm_90a schedule, and that schedule: the FP8 tile (`fp8_tile`) on it,
# or for gathered keys the one-token tile (GATHERED_TILE).
SM90A_FEATURES = {"fp8_ws": FP8_WS, "fp8_mma": FP8_MMA, "fp8_ldg": FP8_LDG, "gathered_fp8_ldg": FP8_LDG}
GATHERED_TILE = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2, kv_split="adaptive",
                        partials="fp32", arch="sm_90a")

Run = tuple[dict, list[Variant | None], int | None]   # (case, variants, balanced ranges pinned or None)


def variants_for(arch: str) -> tuple[list[Variant | None], list[Variant]]:
    """(the variants every case runs, None standing for the dispatcher's pick; the P exchange's,
    which run the SHORT case only) on a GPU of compile target `arch`."""
    variants: list[Variant | None] = [
        naive(arch=arch), None,
        Variant(family="flash", head_tile=8, q_tile=3, block_n=64, warps=4, stages=2, kv_split=3, arch=arch),
        Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2, kv_split=3, arch=arch),
        Variant(family="mma", head_tile=8, q_tile=1, block_n=64, warps=4, stages=1, kv_split=1, arch=arch),
        Variant(family="mma", head_tile=8, q_tile=4, block_n=64, warps=4, stages=2, kv_split="balanced", arch=arch)]
    if arch != "sm_90":
        return variants, []
    # sm_90a: P·V on wgmma or mma.sync; balanced, cluster split; each split also with 16-bit
    # partial rows; TMA loads, and the seesaw on them
    for knobs in ({}, {"mma_pv": True}, {"kv_split": "balanced"}, {"combine": "cluster"}, {"partials": "16bit"},
                  {"kv_split": "balanced", "partials": "16bit"}, {"combine": "cluster", "partials": "16bit"},
                  {"loads": "tma"}, {"kv_split": "balanced", "loads": "tma"}, {"mma_pv": True, "loads": "tma"},
                  {"loads": "tma", "schedule": "seesaw"},
                  {"kv_split": "balanced", "loads": "tma", "schedule": "seesaw", "partials": "16bit"}):
        variants.append(Variant(family="mma", head_tile=8, q_tile=8, block_n=64, warps=8, stages=2,
                                arch="sm_90a", **({"kv_split": 2} | knobs)))
    # the short rows' kernel: its epilogue stages 64 output rows over nearly all its shared memory
    for part16 in (False, True):
        variants.append(Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1,
                                mma_pv=True, partials="16bit" if part16 else "fp32", arch="sm_90a"))
    # the transposed tile: 72 rows (all of the shared memory; its q tile overhangs S=3 and 5)
    # and 32, with a fixed and a balanced split, and TMA loads (whose mbarriers share #0/#1)
    for tile, knobs in (((8, 9), {"kv_split": 2}), ((8, 9), {"kv_split": "balanced", "partials": "16bit"}),
                        ((8, 4), {"kv_split": "balanced"}), ((8, 9), {"kv_split": 2, "loads": "tma"}),
                        ((8, 9), {"kv_split": "balanced", "partials": "16bit", "loads": "tma"})):
        variants.append(Variant(family="mma", head_tile=tile[0], q_tile=tile[1], block_n=64, warps=8, stages=2,
                                arch="sm_90a", schedule="transposed", **knobs))
    # the P exchange (the SHORT case only): 5 tiles in 5 and in 8 blocks
    exchange = [Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1, arch="sm_90a",
                        kv_split=k, combine="cluster", schedule="p_exchange") for k in (5, 8)]
    return variants, exchange


def name_of(variant: Variant | None) -> str:
    return variant.name if variant is not None else "dispatched"


def wanted(name: str, only: str | None, skip: str | None) -> bool:
    """Whether `name` contains one of `only`'s comma-separated parts (when given) and none of
    `skip`'s (when given)."""
    def has(parts: str) -> bool:
        return any(part in name for part in parts.split(","))
    return (only is None or has(only)) and (skip is None or not has(skip))


def select(variants: list, only: str | None, skip: str | None) -> list:
    """The variants whose names are `wanted`."""
    return [v for v in variants if wanted(name_of(v), only, skip)]


def plan_runs(variants: list[Variant | None], exchange: list[Variant]) -> list[Run]:
    """Every case with its variants. CROSSING and EQUAL run the balanced work list's aligned
    layout with one range per resident slot on a 132-SM H200, and its packed layout (ranges
    crossing requests) with 6 and 5 ranges."""
    balanced = [v for v in variants if v is not None and v.kv_split == "balanced"]
    return ([(c, variants, None) for c in CASES] + [(CROSSING, balanced, None), (CROSSING, balanced, 6)]
            + [(EQUAL, balanced, None), (EQUAL, balanced, 5)]
            + [(SHORT, exchange, None), (SHORT | {"mask": "causal"}, exchange, None)])


def fits(shape: dict, variant: Variant | None) -> bool:
    """Whether `variant` runs on the case: its head tile divides the heads, TMA boxes fit a page."""
    return variant is None or not (shape["heads"] % variant.head_tile
                                   or (variant.loads == "tma" and shape["page_size"] % variant.block_n))


def problem_of(shape: dict) -> Problem:
    return Problem(heads=shape["heads"], page_size=shape["page_size"], mask=shape["mask"], lse=True)


def case_numbers(text: str) -> set[int]:
    """'0-2', '3,5' or '4': the case numbers (ranges inclusive)."""
    numbers: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("--cases", type=case_numbers, metavar="N-M,...", help="only these cases (default: all)")
    p.add_argument("--only", metavar="PART,...", help="only the variants whose names contain one of the PARTs")
    p.add_argument("--skip", metavar="PART,...", help="all but the variants whose names contain one of the PARTs")
    p.add_argument("--list", action="store_true", help="print the (case, variant) pairs and exit; no GPU needed")
    p.add_argument("--arch", default="sm_90", help="compile target for --list (default sm_90, the H200's)")
    return p.parse_args(argv)


def fp8_tile(kv_format: str, arch: str) -> Variant:
    """The FP8 tile `fp8_tile` runs on a GPU of compile target `arch`: on sm_90 a 64-row wgmma tile
    with a balanced split and 16-bit partials (ds_mla's rows fit one stage), else an mma.sync
    tile with a fixed split."""
    if arch == "sm_90":
        return Variant(family="mma", head_tile=8, q_tile=8, block_n=64, warps=8, stages=2 if kv_format == "e4m3" else 1,
                       kv_split="balanced", partials="16bit", arch="sm_90a")
    return Variant(family="mma", head_tile=8, q_tile=4, block_n=32, warps=4, stages=1, kv_split=2, arch=arch)


def run_feature(feature: str, case: AnyCase, arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `case` with `feature` on, on a GPU of compile target `arch`: through the
    dispatcher, or for `fp8_tile` through the FP8 tile (`fp8_ws` and `fp8_mma`: on that schedule),
    for `gathered_naive` through the naive kernel."""
    if feature in GATHERED_FEATURES:
        variant = (naive(arch) if feature == "gathered_naive" else
                   SM90A_FEATURES[feature].adopt(GATHERED_TILE) if feature in SM90A_FEATURES else None)
        return mlagen.verify_attention(case.q, case.kv_cache, variant=variant, return_lse=True, **case.kwargs())
    args = (case.q, case.kv_cache, case.block_table, case.cache_seqlens)
    if feature == "fp8_tile":
        fmt = mlagen.kv_format_of(case.kv_cache, case.kv_scale).name
        return mlagen.verify_attention(*args, variant=fp8_tile(fmt, arch), return_lse=True, **case.kwargs())
    if feature in SM90A_FEATURES:
        fmt = mlagen.kv_format_of(case.kv_cache, case.kv_scale).name
        return mlagen.verify_attention(*args, variant=SM90A_FEATURES[feature].adopt(fp8_tile(fmt, arch)),
                                       return_lse=True, **case.kwargs())
    if feature == "invariant":
        return mlagen.verify_attention(*args, return_lse=True, batch_invariant=True, **case.kwargs())
    if feature in RAGGED_VARIANTS:
        # Each request's rows before its last RAGGED_COUNTS[b] are padding, whose outputs are
        # unspecified: they are taken from the dense run, and the real ones checked with them.
        counts = torch.tensor(RAGGED_COUNTS, dtype=torch.int32, device=case.q.device)
        dense, dense_lse = mlagen.verify_attention(*args, return_lse=True, **case.kwargs())
        got, got_lse = mlagen.verify_attention(*args, return_lse=True, q_counts=counts,
                                               variant=parse_variant(RAGGED_VARIANTS[feature]), **case.kwargs())
        S = case.q.shape[1]
        real = torch.arange(S, device=case.q.device)[None, :] >= S - counts.long()[:, None]   # [B, S]
        return torch.where(real[:, :, None, None], got, dense), torch.where(real[:, None, :], got_lse, dense_lse)
    if feature == "cp_shards":
        merged = None
        for rank in range(2):
            kv, table, _ = mlagen.cp_shard_cache(case.kv_cache, case.block_table, case.cache_seqlens,
                                                 rank=rank, world=2)
            part = mlagen.verify_attention_cp_shard(case.q, kv, table, case.cache_seqlens, rank=rank, world=2,
                                                    **case.kwargs())
            merged = part if merged is None else mlagen.merge_states(*merged, *part)
        return merged
    return mlagen.verify_attention(*args, return_lse=True, **case.kwargs())   # FP8 inputs


def main(only: str | None, skip: str | None, arch: str, listing: bool, cases: set[int] | None = None) -> int:
    variants, exchange = variants_for(arch)
    runs = plan_runs(select(variants, only, skip), select(exchange, only, skip))
    checked = 0
    for i, (shape, case_variants, ranges) in enumerate(runs):
        if cases is not None and i not in cases:
            continue
        case = None if listing else make_case(seed=i, **shape)
        with pinned_balanced_ranges(ranges) if ranges else contextlib.nullcontext():
            for v in case_variants:
                if not fits(shape, v):
                    continue
                if case is not None:
                    out, lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                       variant=v, return_lse=True, **case.kwargs())
                    torch.cuda.synchronize()
                    assert_matches(out, lse, case)
                print(f"case {i} {name_of(v)}: {'listed' if listing else 'ok'}", flush=True)
                checked += 1
    for i, (feature, shape, extra) in enumerate(FEATURES, start=len(runs)):
        name = f"feature+{feature}"
        if (cases is not None and i not in cases) or not wanted(name, only, skip):
            continue
        if feature in SM90A_FEATURES and arch != "sm_90":
            continue
        if not listing:
            case = (make_sparse_case if feature in GATHERED_FEATURES else make_case)(seed=i, **shape, **extra)
            out, lse = run_feature(feature, case, arch)
            torch.cuda.synchronize()
            assert_matches(out, lse, case)
        print(f"case {i} {name}: {'listed' if listing else 'ok'}", flush=True)
        checked += 1
    print(f"{checked} (case, variant) pairs {'listed' if listing else 'checked'}")
    return checked


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if not args.list:
        require_gpu(__file__)
        from mlagen.runtime.op import device_info

        args.arch = device_info(torch.cuda.current_device())[0]
    main(args.only, args.skip, args.arch, args.list, args.cases)
