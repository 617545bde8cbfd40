"""Time ragged draft counts through `verify_attention_varlen` against the same work with uniform
counts: a serving batch's requests verify drafts of different sizes.

    python3 benchmarks/ragged_drafts.py [H B S prefix] [--mask tree|causal]   (default 64 32 16 4096 tree)

Request b drafts s_b tokens, drawn uniformly from 1..S (seeded), after `prefix` cached keys; with
--mask tree each request has its own random EAGLE-style tree. The uniform batch has the same
requests and the same number of query tokens in all, spread evenly (s_b within one of the mean).
Prints the device µs per call of both under CUDA graph replay (inputs rotated past the L2), the
ratio ragged / uniform (target at most 1.10) and the dense `verify_attention` time of the uniform
batch padded to its largest count, for scale.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from bench_cli import parser, require_gpu

from mlagen.runtime.op import verify_attention
from mlagen.runtime.varlen import verify_attention_varlen
from mlagen.tools.testing import random_tree
from mlagen.tools.timing import l2_bytes, measure, rotation_count
from mlagen.tools.workload import DL, DR

PAGE_SIZE = 64
TARGET = 1.10       # ragged / uniform


def ragged_counts(batch: int, seqlen_q: int, gen: torch.Generator) -> list[int]:
    """Draft counts uniform in 1..seqlen_q (a CPU generator)."""
    return (torch.randint(1, seqlen_q + 1, (batch,), generator=gen)).tolist()


def even_counts(batch: int, total: int) -> list[int]:
    """`total` query tokens over `batch` requests, each count within one of total / batch."""
    base, extra = divmod(total, batch)
    return [base + (b < extra) for b in range(batch)]


def packed_trees(counts: list[int], width: int, gen: torch.Generator) -> torch.Tensor:
    """bool [B, width, width]: request b's random s_b x s_b tree in the top-left corner (the rest
    False: `verify_attention_varlen` ignores it)."""
    out = torch.zeros(len(counts), width, width, dtype=torch.bool)
    for b, s in enumerate(counts):
        out[b, :s, :s] = random_tree(s, gen)
    return out


@dataclass
class Batch:
    """One varlen batch on the GPU, in input sets to rotate over."""

    counts: list[int]
    sets: list[dict]            # keyword arguments of verify_attention_varlen

    @property
    def width(self) -> int:
        return max(self.counts)


def make_batch(heads: int, counts: list[int], prefix: int, mask: str, seed: int) -> Batch:
    """Paged KV of prefix + s_b keys per request on scattered pages, packed queries, and (tree)
    per-request masks, in enough sets to exceed twice the L2."""
    cpu = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, width, total = len(counts), max(counts), sum(counts)
    pages = -(-(prefix + width) // PAGE_SIZE)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([prefix + s for s in counts], dtype=torch.int32, device="cuda")
    tree = packed_trees(counts, width, cpu).cuda() if mask == "tree" else None

    def one() -> dict:
        return dict(
            q=torch.randn(total, heads, DL + DR, generator=gen, device="cuda").to(torch.bfloat16),
            kv_cache=torch.randn(B * pages, PAGE_SIZE, DL + DR, generator=gen, device="cuda").to(torch.bfloat16),
            block_table=torch.randperm(B * pages, generator=gen, device="cuda").to(torch.int32).view(B, pages),
            cache_seqlens=lengths, cu_seqlens_q=cu, max_seqlen_q=width, causal=mask == "causal", tree_mask=tree,
            softmax_scale=1.0 / math.sqrt(DL + DR), check_values=False)

    sets = [one()]
    nbytes = sum(t.numel() * t.element_size() for t in (sets[0]["q"], sets[0]["kv_cache"]))
    sets += [one() for _ in range(rotation_count(nbytes, l2_bytes(0)) - 1)]
    return Batch(counts=counts, sets=sets)


def varlen_us(batch: Batch) -> float:
    return measure(lambda s: verify_attention_varlen(**s), batch.sets).us


def dense_us(batch: Batch) -> float:
    """The uniform batch's work as one dense call padded to its largest count (causal, for scale)."""
    first = batch.sets[0]
    B, S = len(batch.counts), batch.width
    q = torch.randn(B, S, *first["q"].shape[1:], device="cuda").to(torch.bfloat16)
    sets = [dict(q=q, kv_cache=s["kv_cache"], block_table=s["block_table"], cache_seqlens=s["cache_seqlens"],
                 softmax_scale=s["softmax_scale"], check_values=False) for s in batch.sets]
    return measure(lambda s: verify_attention(**s), sets).us


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    for name, default in (("heads", 64), ("batch", 32), ("seqlen_q", 16), ("prefix", 4096)):
        p.add_argument(name, type=int, nargs="?", default=default)
    p.add_argument("--mask", choices=("tree", "causal"), default="tree", help="the requests' masks")
    args = p.parse_args(argv)
    if not 1 <= args.seqlen_q <= 64:
        p.error(f"S: got {args.seqlen_q}, expected 1..64 (a tree mask holds 64 draft tokens)")
    return args


def main(heads: int, batch: int, seqlen_q: int, prefix: int, mask: str) -> None:
    counts = ragged_counts(batch, seqlen_q, torch.Generator().manual_seed(0))
    uniform_counts = even_counts(batch, sum(counts))
    ragged, uniform = (make_batch(heads, c, prefix, mask, seed) for seed, c in ((1, counts), (2, uniform_counts)))
    r, u = varlen_us(ragged), varlen_us(uniform)
    print(f"H={heads} B={batch} S<={seqlen_q} prefix={prefix} {mask}: {sum(counts)} query tokens; "
          f"ragged counts {min(counts)}-{max(counts)}, uniform {min(uniform_counts)}-{max(uniform_counts)}")
    print(f"ragged varlen  {r:8.1f} µs")
    print(f"uniform varlen {u:8.1f} µs")
    print(f"uniform dense  {dense_us(uniform):8.1f} µs   (causal, padded to {uniform.width})")
    print(f"ragged / uniform {r / u:.3f} (target at most {TARGET:.2f})")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(**vars(args))
