"""Benchmark inputs on the GPU and the calls timed on them (shared by bench and tune).

Every request of a row has the same length N = prefix + S; its pages are scattered over the
cache in a random order, as a serving engine's allocator leaves them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..dsl.spec import Problem, Variant
from ..runtime.op import verify_attention
from .eager import eager_attention, eager_visible
from .grids import Row
from .timing import rotation_count

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DL, DR = 512, 64


@dataclass
class InputSet:
    q: torch.Tensor              # [B, S, H, Dl+Dr]
    kv_cache: torch.Tensor       # [B * pages, page_size, Dl+Dr]
    block_table: torch.Tensor    # [B, pages] int32
    cache_seqlens: torch.Tensor  # [B] int32, all N
    tree_mask: torch.Tensor | None
    out: torch.Tensor            # [B, S, H, Dl]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.kv_cache, self.out))


@dataclass
class Workload:
    row: Row
    problem: Problem
    sets: list[InputSet]
    visible: torch.Tensor        # bool [S, N], for torch eager
    scale: float

    @property
    def kv_capacity(self) -> int:
        return self.sets[0].block_table.shape[1] * self.problem.page_size


def draft_tree(seqlen_q: int) -> torch.Tensor:
    """A fixed binary draft tree as a bool [S, S] ancestor mask: token k's parent is (k-1)//2."""
    mask = torch.zeros(seqlen_q, seqlen_q, dtype=torch.bool)
    for k in range(seqlen_q):
        mask[k, k] = True
        if k:
            mask[k] |= mask[(k - 1) // 2]
    return mask


def problem_for(row: Row, page_size: int, mask: str, dtype: str) -> Problem:
    return Problem(heads=row.heads, dl=DL, dr=DR, dtype=dtype, page_size=page_size, mask=mask)


def make_workload(row: Row, page_size: int, mask: str, dtype: str, l2: int, seed: int = 0) -> Workload:
    """Enough input sets of `row` on the current device to exceed twice the L2 together."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, S, H, N = row.batch, row.seqlen_q, row.heads, row.keys
    pages = -(-N // page_size)
    dt = TORCH_DTYPES[dtype]
    tree = draft_tree(S).cuda() if mask == "tree" else None

    def one() -> InputSet:
        return InputSet(
            q=torch.randn(B, S, H, DL + DR, generator=gen, device="cuda").to(dt),
            kv_cache=torch.randn(B * pages, page_size, DL + DR, generator=gen, device="cuda").to(dt),
            block_table=torch.randperm(B * pages, generator=gen, device="cuda").to(torch.int32).view(B, pages),
            cache_seqlens=torch.full((B,), N, dtype=torch.int32, device="cuda"),
            tree_mask=tree, out=torch.empty(B, S, H, DL, dtype=dt, device="cuda"))

    sets = [one()]
    sets += [one() for _ in range(rotation_count(sets[0].nbytes, l2) - 1)]
    return Workload(row=row, problem=problem_for(row, page_size, mask, dtype), sets=sets,
                    visible=eager_visible(N, S, mask == "causal", tree, "cuda"),
                    scale=1.0 / math.sqrt(DL + DR))


def mlagen_call(work: Workload, variant: Variant | None,
                max_seqlen_k: int | None = None) -> Callable[[InputSet], object]:
    """One `verify_attention` on a set; variant None: the dispatcher's choice (planned for
    max_seqlen_k keys when given)."""
    causal = work.problem.mask == "causal"

    def call(s: InputSet) -> object:
        return verify_attention(s.q, s.kv_cache, s.block_table, s.cache_seqlens, softmax_scale=work.scale,
                                causal=causal, tree_mask=s.tree_mask, variant=variant, out=s.out,
                                check_values=False, max_seqlen_k=max_seqlen_k)
    return call


def eager_call(work: Workload) -> Callable[[InputSet], object]:
    """The torch eager reference as a user writes it, on a set."""
    keys = work.row.keys

    def call(s: InputSet) -> object:
        return eager_attention(s.q, s.kv_cache, s.block_table, keys, work.visible, work.scale, DL)
    return call
