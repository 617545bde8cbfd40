"""Random shapes on this GPU against the reference: what `mlagen fuzz` runs.

Each seed draws one shape (batch, draft length S, heads, ragged prefixes with empty requests,
page size, mask, dtype, lse) from a `FuzzSpace`; the same seed and space always give the same
shape, so a failure replays from its seed. Every shape runs through the dispatcher's pick, any
named variants and, when asked, a random variant (`draw_variant`), on poisoned outputs and
workspaces, and is compared row by row with the fp64 reference (`mlagen.tools.testing.mismatch`).

A shape's case is built on the device and its fp64 reference computed there once, before any
kernel runs, and shared by every kernel checked on it; a check syncs with the host once for the
kernel and once for the comparison, so once the kernels are compiled a run checks tens of shapes
a second (`Report.summary`). Compiling is what a run on fresh shapes waits for: most shapes of the
default space need a kernel of their own (about a second of NVRTC each), so worker processes
compile the kernels of the shapes coming next while the current ones run (`_CompileAhead`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from ..dispatch.policy import DispatchPolicy
from ..dsl.arch import specializations
from ..dsl.errors import SpecError
from ..dsl.spec import DTYPES, KEYS, KV_FORMATS, LOADS, MASKS, MAX_SEQLEN_Q, Q_FORMATS, Problem, Variant, naive
from ..plan.families import FAMILIES
from ..plan.mma_plan import WGMMA_TILE
from ..plan.schedules import SCHEDULES, TileSchedule
from ..plan.tiles import enumerate_tiles, head_tiles
from ..plan.validate import MAX_CLUSTER, is_valid, validate
from .testing import (
    AnyCase,
    SparseCase,
    Tolerance,
    make_case,
    make_sparse_case,
    mismatch,
    poison_allocator,
    poisoned_out,
)
from .workload import TORCH_DTYPES

# Prefix ceilings a shape draws its requests' prefixes under: empty caches, a tile, a few
# pages, a long context and the space's maximum.
_PREFIX_TOPS = (0, 64, 700, 5000)


@dataclass(frozen=True)
class FuzzSpace:
    """What `draw` picks from. max_work bounds B * S * H * (longest request's keys), which is
    what the fp64 reference pays for."""

    heads: tuple[int, ...] = (8, 16, 32, 64, 128)
    max_batch: int = 8
    max_seqlen_q: int = 64
    max_prefix: int = 20000
    page_sizes: tuple[int, ...] = (1, 16, 64, 128)
    masks: tuple[str, ...] = MASKS
    dtypes: tuple[str, ...] = DTYPES
    max_work: float = 3e9
    kv_formats: tuple[str, ...] = ("dtype",)     # caches to draw: "dtype" (q's), "e4m3", "ds_mla"
    q_formats: tuple[str, ...] = ("dtype",)      # queries to draw: "dtype" (bf16/fp16), "e4m3"
    keys: tuple[str, ...] = ("paged",)           # keys to draw: "paged", "gathered" (sparse verify)

    def __post_init__(self) -> None:
        checks = [
            ("heads", self.heads, bool(self.heads) and all(h >= 1 for h in self.heads), "head counts >= 1"),
            ("max_batch", self.max_batch, self.max_batch >= 1, ">= 1"),
            ("max_seqlen_q", self.max_seqlen_q, self.max_seqlen_q >= 1, ">= 1"),
            ("max_prefix", self.max_prefix, self.max_prefix >= 0, ">= 0"),
            ("page_sizes", self.page_sizes,
             bool(self.page_sizes) and all(p >= 1 and not p & (p - 1) for p in self.page_sizes), "powers of two"),
            ("masks", self.masks, bool(self.masks) and set(self.masks) <= set(MASKS), f"some of {', '.join(MASKS)}"),
            ("dtypes", self.dtypes, bool(self.dtypes) and set(self.dtypes) <= set(DTYPES),
             f"some of {', '.join(DTYPES)}"),
            ("max_work", self.max_work, self.max_work >= min(self.heads, default=1),
             "at least the smallest head count (one key of one query)"),
            ("kv_formats", self.kv_formats, bool(self.kv_formats) and set(self.kv_formats) <= set(KV_FORMATS),
             f"some of {', '.join(KV_FORMATS)}"),
            ("q_formats", self.q_formats, bool(self.q_formats) and set(self.q_formats) <= set(Q_FORMATS),
             f"some of {', '.join(Q_FORMATS)}"),
            ("keys", self.keys, bool(self.keys) and set(self.keys) <= set(KEYS), f"some of {', '.join(KEYS)}"),
        ]
        for name, got, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}: got {got!r}, expected {expected}")


# Slot counts a gathered shape draws its topk from: one key, a few, a tile and some, DeepSeek-V3.2's.
_TOPKS = (1, 7, 64, 200, 2048)


@dataclass(frozen=True)
class Shape:
    """One drawn case: request b holds prefixes[b] + seqlen_q keys, or none where empty[b]; with
    gathered keys, each of its tokens lists topk rows of which it uses topk_lengths[b]."""

    seed: int
    batch: int
    seqlen_q: int
    heads: int
    prefixes: tuple[int, ...]
    empty: tuple[bool, ...]
    page_size: int
    mask: str
    per_request_tree: bool
    lse: bool
    dtype: str
    max_seqlen_k: int | None = None     # the op's host bound on the lengths; may be below them
    table_pages: int = 0                # block table width, when wider than the lengths need
    kv_format: str = "dtype"            # Problem.kv_format: the cache q's dtype, or FP8
    q_format: str = "dtype"             # Problem.q_format: q in `dtype`, or e4m3
    keys: str = "paged"                 # Problem.keys: "paged", or "gathered" (mask "none")
    topk: int = 0                       # gathered keys: slots a token lists
    topk_lengths: tuple[int, ...] = ()  # gathered keys: the slots request b's tokens use

    @property
    def kv_capacity(self) -> int:
        """Keys the case's block table addresses (`make_case`: a spare page column past the
        longest request, or table_pages wide); with gathered keys, the slots a token lists."""
        if self.keys == "gathered":
            return self.topk
        longest = max((0 if e else p + self.seqlen_q) for p, e in zip(self.prefixes, self.empty, strict=True))
        return max(1, -(-longest // self.page_size) + 1, self.table_pages) * self.page_size

    @property
    def problem(self) -> Problem:
        """The kernel problem of the shape (Dl=512, Dr=64; its output dtype by
        `Problem.with_formats`)."""
        return Problem(heads=self.heads, dtype=self.dtype, page_size=self.page_size, mask=self.mask,
                       lse=self.lse, keys=self.keys).with_formats(self.kv_format, self.q_format)

    def case(self, device: str = "cuda") -> AnyCase:
        """The shape's inputs (`mlagen.tools.testing.make_case`, or `make_sparse_case` for
        gathered keys; NaN wherever nothing may be read)."""
        if self.keys == "gathered":
            return make_sparse_case(batch=self.batch, seqlen_q=self.seqlen_q, heads=self.heads, topk=self.topk,
                                    pages=max(2, -(-self.topk // self.page_size)), page_size=self.page_size,
                                    seed=self.seed, lengths=list(self.topk_lengths), dtype=TORCH_DTYPES[self.dtype],
                                    device=device, kv_format=self.kv_format, q_format=self.q_format)
        return make_case(batch=self.batch, seqlen_q=self.seqlen_q, heads=self.heads, prefixes=list(self.prefixes),
                         page_size=self.page_size, mask=self.mask, seed=self.seed, dtype=TORCH_DTYPES[self.dtype],
                         device=device, empty=list(self.empty), per_request_tree=self.per_request_tree,
                         table_pages=self.table_pages, kv_format=self.kv_format, q_format=self.q_format)

    def __str__(self) -> str:
        lengths = ["-" if e else str(p) for p, e in zip(self.prefixes, self.empty, strict=True)]
        tree = " per-request" if self.mask == "tree" and self.per_request_tree else ""
        bound = f" max_seqlen_k={self.max_seqlen_k}" if self.max_seqlen_k is not None else ""
        bound += f" table={self.table_pages} pages" if self.table_pages else ""
        kv = f" kv {self.kv_format}" if self.kv_format != "dtype" else ""
        kv += f" q {self.q_format}" if self.q_format != "dtype" else ""
        if self.keys == "gathered":
            return (f"B={self.batch} S={self.seqlen_q} H={self.heads} gathered topk={self.topk} "
                    f"lengths=[{','.join(map(str, self.topk_lengths))}] page={self.page_size} {self.dtype}{kv}"
                    f"{' lse' if self.lse else ''}")
        return (f"B={self.batch} S={self.seqlen_q} H={self.heads} prefixes=[{','.join(lengths)}] "
                f"page={self.page_size}{tree} {self.mask} {self.dtype}{kv}{' lse' if self.lse else ''}{bound}")


def _prefix(rng: random.Random, top: int, seqlen_q: int) -> int:
    """A prefix under `top`; a third of them put the request's end at a 64-key tile's edge."""
    p = rng.randint(0, top)
    if top >= 64 and rng.random() < 1 / 3:
        p = max(0, (p + seqlen_q) // 64 * 64 - seqlen_q + rng.choice((-1, 0, 1)))
    return min(p, top)


def draw(seed: int, space: FuzzSpace = FuzzSpace()) -> Shape:
    """The shape for `seed`: the same seed and space always give the same shape."""
    rng = random.Random(seed)
    while True:
        batch = rng.randint(1, space.max_batch)
        # Most drafts are short: 1 to 16 tokens three times in four, up to the maximum otherwise.
        short = min(16, space.max_seqlen_q)
        seqlen_q = rng.randint(1, short) if rng.random() < 0.75 else rng.randint(1, space.max_seqlen_q)
        heads = rng.choice(space.heads)
        top = rng.choice([t for t in _PREFIX_TOPS if t < space.max_prefix] + [space.max_prefix])
        prefixes = tuple(_prefix(rng, top, seqlen_q) for _ in range(batch))
        some_empty = rng.random() < 0.3
        empty = tuple(some_empty and rng.random() < 0.3 for _ in range(batch))
        if batch * seqlen_q * heads * (max(prefixes) + seqlen_q) <= space.max_work:
            break
    mask = rng.choice(space.masks)
    # No length bound half the time; else the true longest length, or (a broken promise the op
    # must survive) a smaller one.
    longest = max((0 if e else p + seqlen_q) for p, e in zip(prefixes, empty, strict=True))
    bound = rng.choice([None, None, longest, rng.randint(0, longest)])
    page_size = rng.choice(space.page_sizes)
    # A quarter of the block tables are sized for a long context, as engines size them.
    wide = -(-rng.choice([4096, 32768, 131072]) // page_size) if rng.random() < 0.25 else 0
    table_pages = wide if wide > -(-longest // page_size) + 1 else 0      # wider than make_case's own
    shape = Shape(seed=seed, batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=prefixes, empty=empty,
                  page_size=page_size, mask=mask,
                  per_request_tree=mask == "tree" and rng.random() < 0.5, lse=rng.random() < 0.5,
                  dtype=rng.choice(space.dtypes), max_seqlen_k=bound, table_pages=table_pages)
    # The cache's and then the queries' formats are drawn last, and only from a choice: a seed's
    # shape in the 16-bit space stays what it was.
    kv_format = rng.choice(space.kv_formats) if len(space.kv_formats) > 1 else space.kv_formats[0]
    q_format = rng.choice(space.q_formats) if len(space.q_formats) > 1 else space.q_formats[0]
    shape = dataclasses.replace(shape, kv_format=kv_format, q_format=q_format)
    keys = rng.choice(space.keys) if len(space.keys) > 1 else space.keys[0]
    if keys == "paged":
        return shape
    # Gathered keys: no mask; topk within the work bound; each request's length, 0 where empty.
    topk = rng.choice([t for t in _TOPKS if batch * seqlen_q * heads * t <= space.max_work] or [1])
    lengths = tuple(0 if e else rng.choice([topk, rng.randint(0, topk)]) for e in empty)
    return dataclasses.replace(shape, keys=keys, mask="none", per_request_tree=False, max_seqlen_k=None,
                               table_pages=0, topk=topk, topk_lengths=lengths)


def draw_variant(shape: Shape, arch: str, tries: int = 500) -> Variant | None:
    """A random variant that the DSL accepts for the shape's problem, for `arch` or a target its
    devices also run (sm_90a on sm_90), the same for the same shape (its seed) and arch; None if
    `tries` draws found none. The family is drawn by its `KernelFamily.fuzz_weight`; a tiled
    family's variant starts from a schedule that takes the family, the target and the cache's
    format, drawn by its `TileSchedule.fuzz_weight`, with rows its layout takes
    (`TileSchedule.draw_rows`) and its settings (`TileSchedule.adopt`)."""
    rng = random.Random(f"variant {shape.seed}")
    archs = (arch, *specializations(arch))
    # The family first, by its `KernelFamily.fuzz_weight`, so that easy ones do not crowd.
    family = FAMILIES[rng.choice([f.name for f in FAMILIES.values() for _ in range(f.fuzz_weight)])]
    if shape.problem.fp8_q and not family.fp8_q and not any(_schedules(shape, family.name, a) for a in archs):
        family = next(f for f in FAMILIES.values() if f.fp8_q)                 # a family that reads e4m3 queries
    elif shape.problem.fp8_kv and not family.fp8_kv:
        family = next(f for f in FAMILIES.values() if f.tiled and f.fp8_kv)    # a tiled one that reads FP8 caches
    if shape.problem.gathered and not family.gathers:
        family = next(f for f in FAMILIES.values() if f.tiled and f.gathers)   # a tiled one that reads gathered keys
    for _ in range(tries):
        target = rng.choice(archs)
        if not family.tiled:
            v = naive(arch=target, warps=rng.choice([1, 2, 4, 8]))
        elif _schedules(shape, family.name, target):
            v = _draw_tiled(shape, family.name, family.knobs, target, rng)
        else:
            continue
        if is_valid(shape.problem, v):
            return v
    if shape.problem.fp8_q and not family.fp8_q:         # no tile that reads e4m3 queries fits the shape
        return naive(arch=rng.choice(archs), warps=rng.choice([1, 2, 4, 8]))
    return None


def _schedules(shape: Shape, family: str, target: str) -> list[TileSchedule]:
    """The schedules of `family` on `target` that read the shape's cache and query formats, and
    its gathered keys (`TileSchedule.gathered_loads`)."""
    return [s for s in SCHEDULES.values() if s.serves(shape.problem, Variant(family=family, arch=target))
            and (s.gathered_loads or not shape.problem.gathered)]


def _draw_tiled(shape: Shape, family: str, knobs: bool, target: str, rng: random.Random) -> Variant:
    """A random variant of a tiled family for `target` (`draw_variant`), valid or not."""
    takes = _schedules(shape, family, target)
    schedule = rng.choices(takes, weights=[s.fuzz_weight for s in takes])[0]
    rows = schedule.draw_rows(target) if knobs else ()
    if rows:
        head_tile, q_tile = rng.choice([(h, q) for h, q in enumerate_tiles(shape.heads, MAX_SEQLEN_Q, max(rows))
                                        if h * q in rows])
        block_n, warps, stages = WGMMA_TILE[2], WGMMA_TILE[1], 2
    else:
        head_tile, q_tile = rng.choice(head_tiles(shape.heads)), rng.randint(1, 16)
        block_n, warps, stages = rng.choice([32, 64, 128]), rng.choice([2, 4, 8, 16]), rng.randint(1, 3)
    if shape.problem.gathered:       # a row group of one token; the slots split as keys (no work list)
        q_tile = 1
        head_tile = rng.choice([h for h in head_tiles(shape.heads) if not rows or h in rows] or [head_tile])
    kv_split = rng.choice(["adaptive", 1, 2, 4, 5] if shape.problem.gathered else ["adaptive", "balanced", 1, 2, 4, 5])
    v = Variant(family=family, head_tile=head_tile, q_tile=q_tile, block_n=block_n, warps=warps, stages=stages,
                kv_split=kv_split, arch=target)
    if knobs:
        v = v.with_(partials="16bit" if rng.random() < 0.5 else "fp32", loads=rng.choice(LOADS),
                    combine="cluster" if isinstance(kv_split, int) and rng.random() < 0.3 else "merge",
                    mma_pv=rng.random() < 0.2)
    if schedule.tile_a_block:    # a cluster of one KV tile a block, enough blocks for the table
        tiles = -(-shape.kv_capacity // schedule.block_ns[0])
        v = v.with_(kv_split=max(2, tiles, rng.randint(2, MAX_CLUSTER)))
    return schedule.adopt(v)


# A kernel under test: (case, shape, variant or None for the dispatcher's pick) -> (out, lse or None).
Kernel = Callable[[AnyCase, Shape, Variant | None], tuple[torch.Tensor, torch.Tensor | None]]


def launch(case: AnyCase, shape: Shape, variant: Variant | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`mlagen.verify_attention` on the case, with a NaN `out=` and NaN left in torch's allocator
    for its workspace, synchronized."""
    from ..runtime.op import verify_attention

    poison_allocator(64 << 20, str(case.q.device))
    out = poisoned_out(case)
    if isinstance(case, SparseCase):
        res = verify_attention(case.q, case.kv_cache, variant=variant, return_lse=shape.lse, out=out, **case.kwargs())
    else:
        res = verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=variant,
                               return_lse=shape.lse, out=out, max_seqlen_k=shape.max_seqlen_k, **case.kwargs())
    torch.cuda.synchronize()
    return res if shape.lse else (res, None)


@dataclass(frozen=True)
class Outcome:
    """One shape through one kernel: status "ok", "skip" (the variant does not fit the shape:
    message says why) or "fail" (message says what went wrong)."""

    shape: Shape
    variant: str            # a variant name, or "dispatch"
    status: str
    message: str = ""
    drawn: bool = False     # the variant is a random one (`draw_variant`)

    @property
    def kernel(self) -> str:
        """What a summary counts it under: the variant's name, "dispatch", or "random variants"."""
        return "random variants" if self.drawn else self.variant


# A case's fp64 reference: (out [B, S, H, Dl], lse [B, H, S]).
Expected = tuple[torch.Tensor, torch.Tensor]


def _skipped(shape: Shape, variant: Variant | None) -> Outcome | None:
    """A "skip" outcome if the variant does not fit the shape's problem, else None."""
    if variant is not None:
        try:
            validate(shape.problem, variant)
        except SpecError as e:
            return Outcome(shape, variant.name, "skip", str(e))
    return None


def _run(shape: Shape, variant: Variant | None, kernel: Kernel, case: AnyCase, expected: Expected,
         tol: Tolerance | None) -> Outcome:
    """The kernel on the case, its output compared with `expected`."""
    name = variant.name if variant is not None else "dispatch"
    try:
        out, lse = kernel(case, shape, variant)
    except Exception as e:      # anything the op raises on a valid shape is a finding
        return Outcome(shape, name, "fail", f"{type(e).__name__}: {e}")
    problem = mismatch(out, lse, case, tol, expected)
    return Outcome(shape, name, "fail" if problem else "ok", problem or "")


def check(shape: Shape, variant: Variant | None, *, device: str = "cuda", kernel: Kernel | None = None,
          tol: Tolerance | None = None, case: AnyCase | None = None, expected: Expected | None = None) -> Outcome:
    """Run one shape through `variant` (None: the dispatcher's pick) and compare every row with
    the fp64 reference. kernel: what runs it (None: `launch`, the op itself); tol: None for the
    dtypes' (`mlagen.tools.testing.tolerance`); case, expected: the shape's case and its fp64 reference
    when already built (a shape's checks share them; None: built here, the reference before the
    kernel runs, from untouched inputs)."""
    skipped = _skipped(shape, variant)
    if skipped is not None:
        return skipped
    case = case if case is not None else shape.case(device)
    expected = expected if expected is not None else case.reference(torch.float64)
    return _run(shape, variant, kernel or launch, case, expected, tol)


@dataclass
class Report:
    """What a fuzz run found; stopped says why it ended early (None: every seed ran). shapes: the
    distinct shapes that at least one kernel ran on; elapsed_s: the run's wall time, compiling
    kernels on first use included."""

    outcomes: list[Outcome] = field(default_factory=list)
    stopped: str | None = None
    shapes: int = 0
    elapsed_s: float = 0.0

    def count(self, status: str, kernel: str | None = None) -> int:
        """Outcomes with this status ("ok", "skip" or "fail"), under one `Outcome.kernel` if given."""
        return sum(o.status == status and kernel in (None, o.kernel) for o in self.outcomes)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "fail"]

    @property
    def shapes_per_s(self) -> float:
        """Shapes checked per second of the run (0 before any time passed)."""
        return self.shapes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        """One line: "412 shapes in 20.1 s (20.5 shapes/s), 0 failed" (failed: checks, a shape
        through one kernel)."""
        return (f"{self.shapes} shapes in {self.elapsed_s:.1f} s ({self.shapes_per_s:.1f} shapes/s), "
                f"{self.count('fail')} failed")


def _context_alive() -> bool:
    """False once a kernel fault (an illegal address, say) has lost the CUDA context."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


class _Inputs:
    """A shape's case and fp64 reference, built when a kernel first needs them (never for a shape
    every variant skips) and then shared by the shape's checks."""

    def __init__(self, shape: Shape, device: str) -> None:
        self.shape, self.device = shape, device
        self.case: AnyCase | None = None
        self.expected: Expected | None = None

    def check(self, variant: Variant | None, kernel: Kernel | None) -> Outcome:
        """`check` of the shape through `variant`, on the shared inputs."""
        skipped = _skipped(self.shape, variant)
        if skipped is not None:
            return skipped
        if self.case is None or self.expected is None:
            self.case = self.shape.case(self.device)
            self.expected = self.case.reference(torch.float64)
        return _run(self.shape, variant, kernel or launch, self.case, self.expected, None)


def _outcomes(shape: Shape, variants: Sequence[Variant | None], any_variant: str | None, drawn: Variant | None,
              device: str, kernel: Kernel | None) -> Iterator[Outcome]:
    """The shape through each variant, then (with any_variant, an arch) through `drawn`, its
    random variant for that arch (`draw_variant`; None: none fits); one by one, so a run can stop
    after any of them. The checks share one case and reference."""
    inputs = _Inputs(shape, device)
    for v in variants:
        yield inputs.check(v, kernel)
    if any_variant:
        yield (dataclasses.replace(inputs.check(drawn, kernel), drawn=True) if drawn is not None
               else Outcome(shape, "any", "skip", f"no {any_variant} variant drawn fits this shape", drawn=True))


def _device_index(device: str) -> int:
    """The CUDA device `device` names ("cuda": the current one)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _device_target(device: str) -> tuple[str, str, DispatchPolicy]:
    """(compile target, name, dispatch policy) of a CUDA device, as the dispatcher picks for it."""
    from ..runtime.op import device_info, device_name, device_policy

    index = _device_index(device)
    return device_info(index)[0], device_name(index), device_policy(index)


def dispatched_variant(shape: Shape, arch: str, gpu: str, dispatch: DispatchPolicy) -> Variant:
    """The variant `mlagen.verify_attention` picks for the shape's launch (`launch`: its
    max_seqlen_k bound, its block table) on a `gpu` of `arch` whose dispatch figures (SM count,
    shared memory) `dispatch` holds."""
    from ..runtime.inputs import key_bound
    from ..runtime.op import pick_variant

    table = shape.kv_capacity
    bound = key_bound(shape.max_seqlen_k)
    return pick_variant(shape.problem, shape.seqlen_q, shape.batch, table if bound is None else min(table, bound),
                        table, arch, gpu, None, policy=dispatch)


class _CompileAhead:
    """Compiles the kernels of the shapes coming next in worker processes, into the disk cache
    that their launches load from (`mlagen.codegen.precompile.compile_one`; a launch whose kernel is still
    compiling waits for it on the cache entry's lock). Each distinct code is submitted once; a
    pool that breaks stops the compiling ahead, not the run (the launches compile what they
    need)."""

    def __init__(self, make_pool: Callable[[], Executor], workers: int, arch: str, gpu: str,
                 dispatch: DispatchPolicy, device_index: int = 0) -> None:
        self.make_pool, self.arch, self.gpu, self.dispatch = make_pool, arch, gpu, dispatch
        self.device_index = device_index
        self.pool: Executor | None = None     # made for the first code that needs compiling
        self.lookahead = 4 * workers          # shapes planned ahead of the one running
        self.submitted: set[tuple[Problem, Variant]] = set()

    @classmethod
    def start(cls, workers: int, device: str) -> _CompileAhead:
        """Compiling ahead in `workers` spawned processes (the caller holds a CUDA context: no
        fork), started when a shape first needs a kernel this process has not loaded: a run
        whose kernels are all loaded spends no time starting them."""
        arch, gpu, dispatch = _device_target(device)
        return cls(lambda: ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")),
                   workers, arch, gpu, dispatch, _device_index(device))

    def submit(self, shape: Shape, variants: Sequence[Variant | None], drawn: Variant | None) -> None:
        """Queue the kernels the shape will launch: the dispatcher's pick for a None in
        `variants`, the named variants that fit it, and its random variant `drawn` (if any)."""
        from ..codegen.precompile import code_identity, compile_one
        from ..runtime.launch import is_loaded

        for v in [*variants, *([drawn] if drawn is not None else [])]:
            try:
                v = dispatched_variant(shape, self.arch, self.gpu, self.dispatch) if v is None else v
                key = code_identity(shape.problem, v)
                if key in self.submitted or not is_valid(shape.problem, v) or is_loaded(*key, self.device_index):
                    continue
            except Exception:       # the launch reports what went wrong
                continue
            self.submitted.add(key)
            try:
                if self.pool is None:
                    self.pool = self.make_pool()
                self.pool.submit(compile_one, *key)
            except Exception:       # a broken pool: the launches compile on their own
                self.lookahead = 1
                return

    def close(self) -> None:
        """Drop what is still queued; workers finish the compile in hand."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _compile_workers(requested: int | None, kernel: Kernel | None, device: str) -> int:
    """Processes that compile ahead: as asked, or (None) all cores but one when the op itself runs
    on a CUDA device, at most 15; 0: none."""
    if requested is not None:
        return requested
    if kernel is not None or torch.device(device).type != "cuda":
        return 0
    return max(0, min(15, (os.cpu_count() or 1) - 1))


def fuzz(seeds: Iterable[int], variants: Sequence[Variant | None], space: FuzzSpace = FuzzSpace(), *,
         any_variant: str | None = None, budget_s: float | None = None, device: str = "cuda",
         kernel: Kernel | None = None, alive: Callable[[], bool] | None = None,
         on_outcome: Callable[[Outcome], None] | None = None, compile_workers: int | None = None) -> Report:
    """Every seed's shape through every variant (None: the dispatcher's pick), and with
    any_variant (an arch) through a random variant for that arch too (`draw_variant`), until the
    seeds or the time budget run out, or a failure leaves the CUDA context unusable. kernel: as
    in `check`; alive: whether the CUDA context still works after a failure (None: a synchronize
    tells); on_outcome: called with each outcome as it comes (progress, printing);
    compile_workers: processes compiling the kernels of the next shapes meanwhile (None: all cores
    but one, at most 15, when the op itself runs on a CUDA device, else none). The report counts
    the shapes checked and the time taken (`Report.summary`)."""
    alive = alive or _context_alive
    report = Report()
    start = time.monotonic()
    workers = _compile_workers(compile_workers, kernel, device)
    ahead = _CompileAhead.start(workers, device) if workers else None
    lookahead = ahead.lookahead if ahead is not None else 1
    pending = iter(seeds)
    upcoming: deque[tuple[Shape, Variant | None]] = deque()      # drawn, and their kernels queued
    try:
        while True:
            while len(upcoming) < lookahead and (seed := next(pending, None)) is not None:
                shape = draw(seed, space)
                drawn = draw_variant(shape, any_variant) if any_variant else None
                if ahead is not None:
                    ahead.submit(shape, variants, drawn)
                    lookahead = ahead.lookahead
                upcoming.append((shape, drawn))
            if not upcoming:
                break
            shape, drawn = upcoming.popleft()
            if budget_s is not None and time.monotonic() - start > budget_s:
                report.stopped = f"the time budget ran out before seed {shape.seed}"
                break
            ran = False
            for outcome in _outcomes(shape, variants, any_variant, drawn, device, kernel):
                report.outcomes.append(outcome)
                ran |= outcome.status != "skip"
                if on_outcome is not None:
                    on_outcome(outcome)
                if outcome.status == "fail" and not alive():
                    report.stopped = (f"the CUDA context was lost at seed {shape.seed}; later seeds need a new "
                                      "process")
                    break
            report.shapes += ran
            if report.stopped:
                break
    finally:
        if ahead is not None:
            ahead.close()
        report.elapsed_s = time.monotonic() - start
    return report
