"""Time a ragged batch: requests of different lengths under one block table, as a serving batch
mixes short and long contexts. The bench's rows give every request the same length; here the
balanced split's ranges (counted from the real lengths) meet what they were built for.

    python3 benchmarks/ragged.py [H B S min_keys max_keys [variant ...]]   (default 64 32 9 256 16384)

Lengths are log-uniform in [min_keys, max_keys] (seeded), the block table is sized for the
longest, pages are scattered. Prints, per variant (default: the dispatcher's pick, then its tile
with the adaptive and with the balanced split), the device µs per call under CUDA graph replay
(inputs rotated past the L2) and the largest difference from the dispatcher's output.
"""

from __future__ import annotations

import math
import sys

import torch
from bench_cli import parser, require_gpu, variant_name

from mlagen.dispatch.policy import DispatchPolicy
from mlagen.dsl.spec import Problem, Variant, parse_variant
from mlagen.runtime.op import device_info, device_name, device_policy, pick_variant
from mlagen.tools.grids import Row
from mlagen.tools.timing import l2_bytes, measure, rotation_count
from mlagen.tools.workload import DL, DR, InputSet, Workload, mlagen_call, problem_for

PAGE_SIZE = 64


def ragged_lengths(batch: int, seqlen_q: int, min_keys: int, max_keys: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [batch] lengths, log-uniform in [min_keys, max_keys] and at least seqlen_q, on gen's device."""
    u = torch.rand(batch, generator=gen, device=gen.device)
    lengths = torch.exp(math.log(min_keys) + u * (math.log(max_keys) - math.log(min_keys))).to(torch.int32)
    return lengths.clamp(min=seqlen_q)


def ragged_workload(heads: int, batch: int, seqlen_q: int, min_keys: int, max_keys: int, seed: int = 0) -> Workload:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = ragged_lengths(batch, seqlen_q, min_keys, max_keys, gen)
    pages = -(-max_keys // PAGE_SIZE)
    dt = torch.bfloat16

    def one() -> InputSet:
        return InputSet(
            q=torch.randn(batch, seqlen_q, heads, DL + DR, generator=gen, device="cuda").to(dt),
            kv_cache=torch.randn(batch * pages, PAGE_SIZE, DL + DR, generator=gen, device="cuda").to(dt),
            block_table=torch.randperm(batch * pages, generator=gen, device="cuda").to(torch.int32).view(batch, pages),
            cache_seqlens=lengths, tree_mask=None,
            out=torch.empty(batch, seqlen_q, heads, DL, dtype=dt, device="cuda"))

    sets = [one()]
    sets += [one() for _ in range(rotation_count(sets[0].nbytes, l2_bytes(0)) - 1)]
    row = Row(heads, batch, seqlen_q, max_keys - seqlen_q)
    return Workload(row=row, problem=problem_for(row, PAGE_SIZE, "causal", "bf16"), sets=sets,
                    visible=torch.empty(0), scale=1.0 / math.sqrt(DL + DR))   # no eager call here: no mask


def compared(problem: Problem, seqlen_q: int, batch: int, kv_capacity: int, arch: str, gpu: str,
             dispatch: DispatchPolicy, names: list[str]) -> tuple[Variant, list[Variant]]:
    """(the dispatcher's pick on the device of `dispatch`, the variants timed after it): `names`, or
    the pick's tile with the adaptive and with the balanced split (none for a family without those
    splits)."""
    picked = pick_variant(problem, seqlen_q, batch, kv_capacity, kv_capacity, arch, gpu, None, policy=dispatch)
    if names:
        return picked, [parse_variant(name) for name in names]
    if picked.family != "mma":
        return picked, []
    return picked, [picked.with_(kv_split="adaptive", combine="merge"),
                    picked.with_(kv_split="balanced", combine="merge")]


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    for name, default in (("heads", 64), ("batch", 32), ("seqlen_q", 9), ("min_keys", 256), ("max_keys", 16384)):
        p.add_argument(name, type=int, nargs="?", default=default)
    p.add_argument("variants", nargs="*", type=variant_name, help="variant names to time after the dispatcher's pick")
    return p.parse_args(argv)


def main(heads: int, batch: int, seqlen_q: int, min_keys: int, max_keys: int, variants: list[str]) -> None:
    work = ragged_workload(heads, batch, seqlen_q, min_keys, max_keys)
    lengths = work.sets[0].cache_seqlens.tolist()
    print(f"H={heads} B={batch} S={seqlen_q}: {sum(lengths)} keys in all, lengths {min(lengths)}-{max(lengths)} "
          f"(median {sorted(lengths)[batch // 2]}), block table for {work.kv_capacity}; {len(work.sets)} input sets")
    first = work.sets[0]
    picked, others = compared(work.problem, seqlen_q, batch, work.kv_capacity, device_info(0)[0], device_name(0),
                              device_policy(0), variants)
    mlagen_call(work, None)(first)
    reference = first.out.float().clone()
    for variant in (None, *others):
        call = mlagen_call(work, variant)
        call(first)
        diff = (first.out.float() - reference).abs().max().item()
        label = variant.name if variant else f"dispatch: {picked.name}"
        print(f"{label:60s} {measure(call, work.sets).us:8.1f} µs   max |diff| vs dispatch {diff:.2e}")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(**vars(args))
