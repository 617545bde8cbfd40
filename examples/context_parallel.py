"""Context-parallel MLA verify attention over NCCL, one rank per GPU.

    torchrun --nproc-per-node 4 examples/context_parallel.py [--interleave 16] [--mask tree]

Each rank holds its interleaved shard of every request's KV cache (global token t on rank
(t // interleave) % world), computes its (out, lse) with `mlagen.verify_attention_cp_shard`,
all-gathers the ranks' results and merges them with `mlagen.merge_states`. Rank 0 checks the
merge against the unsharded op and the fp64 reference. With fewer than two CUDA GPUs it says
why it skips and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import mlagen
from mlagen.tools.testing import compare_rows, make_case, mismatch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the problem's shape, the mask and the interleave size."""
    parser = argparse.ArgumentParser(prog="context_parallel.py", description=__doc__.splitlines()[0])

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"got {value}, expected an int >= 1")
        return value

    parser.add_argument("--interleave", type=positive, default=1, help="tokens per rank in a row (default 1)")
    parser.add_argument("--mask", choices=("causal", "tree", "none"), default="causal")
    parser.add_argument("--batch", type=positive, default=4)
    parser.add_argument("--seqlen-q", type=positive, default=9, help="draft tokens per request (default 9)")
    parser.add_argument("--heads", type=positive, default=16)
    parser.add_argument("--page-size", type=positive, default=64)
    parser.add_argument("--max-prefix", type=positive, default=4000, help="longest prefix before the draft")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def skip_reason() -> str | None:
    """Why this machine cannot run the example (fewer than two CUDA GPUs, no NCCL), or None."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return f"it needs at least 2 CUDA GPUs, {count} visible"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def run(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> bool:
    """One rank's part; returns whether the merged result matches (on every rank: rank 0's
    verdict is broadcast)."""
    # Every rank draws the same problem on the CPU (one generator, the same values), then cuts
    # its shard out of it; an engine writes each rank's tokens into its shard directly.
    gen = torch.Generator().manual_seed(args.seed)
    prefixes = torch.randint(0, args.max_prefix + 1, (args.batch,), generator=gen).tolist()
    case = make_case(batch=args.batch, seqlen_q=args.seqlen_q, heads=args.heads, prefixes=prefixes,
                     page_size=args.page_size, mask=args.mask, seed=args.seed, device="cpu")
    case = dataclasses.replace(case, **{f.name: getattr(case, f.name).to(device) for f in dataclasses.fields(case)
                                        if isinstance(getattr(case, f.name), torch.Tensor)})
    kv_cache, block_table, _ = mlagen.cp_shard_cache(case.kv_cache, case.block_table, case.cache_seqlens,
                                                     rank=rank, world=world, interleave=args.interleave)
    out, lse = mlagen.verify_attention_cp_shard(case.q, kv_cache, block_table, case.cache_seqlens, rank=rank,
                                                world=world, interleave=args.interleave, softmax_scale=case.scale,
                                                causal=case.causal, tree_mask=case.tree_mask)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out)
    dist.all_gather(lses, lse)
    merged, merged_lse = outs[0].float(), lses[0]
    for other, other_lse in zip(outs[1:], lses[1:], strict=True):
        merged, merged_lse = mlagen.merge_states(merged, merged_lse, other, other_lse)
    merged = merged.to(out.dtype)
    ok = torch.ones(1, device=device)
    if rank == 0:
        expected, expected_lse = mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                                         return_lse=True, **case.kwargs())
        problems = {"the unsharded op": compare_rows(merged, merged_lse.transpose(1, 2), expected,
                                                     expected_lse.transpose(1, 2)),
                    "the fp64 reference": mismatch(merged, merged_lse, case)}
        for name, problem in problems.items():
            print(f"{world} ranks, interleave {args.interleave}, {args.mask} mask, lengths "
                  f"{case.cache_seqlens.tolist()}: merged vs {name}: {problem or 'ok'}")
        ok.fill_(all(p is None for p in problems.values()))
    dist.broadcast(ok, src=0)
    return bool(ok.item())


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when the merge matches (or the example skips), 1 when it does not, 2 when
    it is not started by torchrun."""
    args = parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"context_parallel.py skipped: {reason}")
        return 0
    if "LOCAL_RANK" not in os.environ:
        print("context_parallel.py: start it with torchrun --nproc-per-node W (one process per GPU)", file=sys.stderr)
        return 2
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        ok = run(args, dist.get_rank(), dist.get_world_size(), device)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
