"""Benchmark inputs on the GPU and the calls timed on them (shared by bench and tune).

Every request of a row has the same length N = prefix + S; its pages are scattered over the
cache in a random order, as a serving engine's allocator leaves them. A workload's mask is one
of MASKS: causal, none, one random draft tree shared by the batch ("tree") or one per request
("tree-per-request"); `with_mask` puts the same inputs under another mask, and `with_fp8` puts
them in an FP8 format (FP8_CASES).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..dsl.spec import Problem, Variant
from ..runtime.kv_formats import quantize_kv, quantize_q
from ..runtime.op import verify_attention
from .eager import eager_attention, eager_visible
from .grids import Row
from .testing import random_tree
from .timing import rotation_count

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DL, DR = 512, 64
PER_REQUEST = "tree-per-request"
# A workload's mask -> the kernel's (`Problem.mask`): both tree masks run the tree kernels.
PROBLEM_MASKS: dict[str, str] = {"causal": "causal", "none": "none", "tree": "tree", PER_REQUEST: "tree"}
MASKS: tuple[str, ...] = tuple(PROBLEM_MASKS)
# FP8 inputs `with_fp8` makes: name -> (Problem.kv_format, Problem.q_format). "e4m3" and "ds_mla"
# quantize the cache only; "e4m3-q" the queries too, over an e4m3 cache.
FP8_CASES: dict[str, tuple[str, str]] = {"e4m3": ("e4m3", "dtype"), "ds_mla": ("ds_mla", "dtype"),
                                         "e4m3-q": ("e4m3", "e4m3")}


@dataclass
class InputSet:
    q: torch.Tensor              # [B, S, H, Dl+Dr]
    kv_cache: torch.Tensor       # [B * pages, page_size, Dl+Dr]
    block_table: torch.Tensor    # [B, pages] int32
    cache_seqlens: torch.Tensor  # [B] int32, all N
    tree_mask: torch.Tensor | None   # bool [S, S] (tree), [B, S, S] (tree-per-request), else None
    out: torch.Tensor            # [B, S, H, Dl]
    kv_scale: torch.Tensor | None = None   # an e4m3 cache's scale, fp32 [1]
    q_scale: torch.Tensor | None = None    # e4m3 queries' scale, fp32 [1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.kv_cache, self.out))


@dataclass
class Workload:
    row: Row
    problem: Problem
    sets: list[InputSet]
    visible: torch.Tensor | None  # bool [S, N], for torch eager; None under per-request trees (it takes one mask)
    scale: float

    @property
    def kv_capacity(self) -> int:
        return self.sets[0].block_table.shape[1] * self.problem.page_size


def draft_tree(seqlen_q: int, batch: int | None = None, seed: int = 0) -> torch.Tensor:
    """Random EAGLE-style draft trees as bool ancestor masks on the CPU (`testing.random_tree`):
    one tree [S, S] when `batch` is None, else one per request [batch, S, S]. Token 0 is the root;
    token k's parent is drawn uniformly from 0..k-1; token k sees itself and its ancestors. The
    same seed draws the same trees."""
    gen = torch.Generator().manual_seed(seed)
    if batch is None:
        return random_tree(seqlen_q, gen)
    return torch.stack([random_tree(seqlen_q, gen) for _ in range(batch)])


def tree_for(row: Row, mask: str, device: torch.device | str, seed: int = 0) -> torch.Tensor | None:
    """The tree mask `mask` (one of MASKS) puts on `row`'s inputs, on `device`: bool [S, S] for
    "tree", [B, S, S] for "tree-per-request", None for causal and none."""
    if PROBLEM_MASKS[mask] != "tree":
        return None
    return draft_tree(row.seqlen_q, row.batch if mask == PER_REQUEST else None, seed).to(device)


def _visible(row: Row, mask: str, tree: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """Bool [S, N] on `device` for torch eager (`eager_visible`); None under per-request trees."""
    if mask == PER_REQUEST:
        return None
    return eager_visible(row.keys, row.seqlen_q, mask == "causal", tree, device)


def problem_for(row: Row, page_size: int, mask: str, dtype: str) -> Problem:
    """The kernel's problem for `row` under `mask` (one of MASKS)."""
    return Problem(heads=row.heads, dl=DL, dr=DR, dtype=dtype, page_size=page_size, mask=PROBLEM_MASKS[mask])


def make_workload(row: Row, page_size: int, mask: str, dtype: str, l2: int, seed: int = 0) -> Workload:
    """Enough input sets of `row` on the current device to exceed twice the L2 together, under
    `mask` (one of MASKS); `seed` draws the inputs and the trees."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, S, H, N = row.batch, row.seqlen_q, row.heads, row.keys
    pages = -(-N // page_size)
    dt = TORCH_DTYPES[dtype]
    tree = tree_for(row, mask, "cuda", seed)

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
                    visible=_visible(row, mask, tree, "cuda"), scale=1.0 / math.sqrt(DL + DR))


def with_mask(work: Workload, mask: str, seed: int = 0) -> Workload:
    """`work` under `mask` (one of MASKS): the same input sets (q, KV cache, block table, lengths
    and out, shared, not copied), only the mask and the problem swapped; `seed` draws the trees."""
    device = work.sets[0].q.device
    tree = tree_for(work.row, mask, device, seed)
    return Workload(row=work.row, problem=work.problem.with_(mask=PROBLEM_MASKS[mask]),
                    sets=[replace(s, tree_mask=tree) for s in work.sets],
                    visible=_visible(work.row, mask, tree, device), scale=work.scale)


def fp8_case(kv_format: str, q_format: str) -> str | None:
    """The FP8 case (FP8_CASES) of a cache and query format; None for 16-bit inputs. Raises
    ValueError for a pair no case holds (e4m3 queries over a 16-bit or ds_mla cache)."""
    if (kv_format, q_format) == ("dtype", "dtype"):
        return None
    for case, formats in FP8_CASES.items():
        if formats == (kv_format, q_format):
            return case
    raise ValueError(f"no FP8 case holds a {kv_format} cache with {q_format} queries: one of "
                     f"{', '.join(f'{k}/{q}' for k, q in FP8_CASES.values())}")


def fp8_problem(problem: Problem, case: str) -> Problem:
    """`problem` on FP8 case `case`'s inputs (FP8_CASES; `Problem.with_formats`)."""
    return problem.with_formats(*FP8_CASES[case])


def with_fp8(work: Workload, case: str, l2: int) -> Workload:
    """`work`'s inputs in FP8 case `case` (one of FP8_CASES): each set's cache quantized
    (`quantize_kv`), with "e4m3-q" its queries too (`quantize_q`; out in bf16).
    The sets are new tensors, cycling over `work`'s sets until they total twice the L2 `l2`;
    the block tables, lengths and masks are shared."""
    kv_format, q_format = FP8_CASES[case]

    def one(s: InputSet) -> InputSet:
        cache, kv_scale = quantize_kv(s.kv_cache, kv_format)
        if q_format == "dtype":
            return replace(s, kv_cache=cache, kv_scale=kv_scale)
        q8, q_scale = quantize_q(s.q)
        return replace(s, q=q8, kv_cache=cache, kv_scale=kv_scale,
                       q_scale=q_scale, out=torch.empty(s.out.shape, dtype=torch.bfloat16, device=s.out.device))

    sets = [one(work.sets[0])]
    sets += [one(work.sets[i % len(work.sets)]) for i in range(1, rotation_count(sets[0].nbytes, l2))]
    return Workload(row=work.row, problem=fp8_problem(work.problem, case), sets=sets, visible=work.visible,
                    scale=work.scale)


def mlagen_call(work: Workload, variant: Variant | None, max_seqlen_k: int | None = None,
                batch_invariant: bool = False) -> Callable[[InputSet], object]:
    """One `verify_attention` on a set; variant None: the dispatcher's choice (planned for
    max_seqlen_k keys when given), or batch-invariant mode's with batch_invariant."""
    causal = work.problem.mask == "causal"

    def call(s: InputSet) -> object:
        return verify_attention(s.q, s.kv_cache, s.block_table, s.cache_seqlens, softmax_scale=work.scale,
                                causal=causal, tree_mask=s.tree_mask, variant=variant, out=s.out,
                                check_values=False, max_seqlen_k=max_seqlen_k, batch_invariant=batch_invariant,
                                kv_scale=s.kv_scale, q_scale=s.q_scale)
    return call


def eager_call(work: Workload) -> Callable[[InputSet], object]:
    """The torch eager reference as a user writes it, on a set. Raises ValueError under
    per-request trees: `eager_attention` takes one [S, N] mask for the batch."""
    keys = work.row.keys
    if work.visible is None:
        raise ValueError("torch eager takes one [S, N] mask for the batch, not per-request trees")

    def call(s: InputSet) -> object:
        return eager_attention(s.q, s.kv_cache, s.block_table, keys, work.visible, work.scale, DL)
    return call
