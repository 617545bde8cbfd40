"""Per-block timeline of one launch of an mma kernel: when each block starts, when its first KV
tile has landed, when it has the balanced split's work list, when it enters its first segment
(its work found: the range lookups come before), when its tile loop ends and when it is done (split blocks;
a cluster split's blocks also when their cluster has staged its rows), or when it enters the
merge, when its wait for the splits ends and when it is done (merge blocks).

The stamps (globaltimer at a block's start and end, clock64 between) are the trace points of
templates/mma.cu.j2, mma_transposed.cu.j2, mma_seesaw.cuh.j2, mma_ops.cuh.j2 and merge.cuh.j2
(`MLAGEN_TRACE(point)`, nothing in an untraced kernel): this run's source defines
MLAGEN_TRACE_ON and each point's stamps (`BLOCK_POINTS`) ahead of the rendered kernel. The
seesaw's tile loop has no tile_landed point: that column shows nan. The last lines give the
split and merge blocks' start, stamps and end as min/median/max over the launch. On the GPU
machine:

    python3 benchmarks/trace_blocks.py 64 1 9 256 [variant name; default: the dispatcher's] [--warm] [--gt]
    python3 benchmarks/trace_blocks.py 64 1 9 256 VARIANT --source > traced.cu   # no GPU: the traced source

The launch traced is cold (its code and inputs out of the caches, as in a model between other
layers' kernels), or with --warm right after an untraced one (as in the bench's graph replay).

Clock64 deltas are shown in µs at 1.98 GHz (the H200's boost clock under load); with --gt every
stamp comes from globaltimer instead (32 ns steps), which needs no clock rate. The summary lines
name the stamps by slot: 2 tile 0 landed, 3 loop end, 4 merge wait over, 5 done, 8 entry,
9 work list, 10 rows staged, 11 partial stores issued, 12 Q landed (TMA kernels).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping

import cupy
import numpy as np
import torch
from bench_cli import parser, require_gpu, variant_name

import mlagen
import mlagen.codegen.build as build
from mlagen.codegen.render import render
from mlagen.dsl.spec import Problem, Variant, parse_variant
from mlagen.plan.schedules import schedule_of
from mlagen.plan.validate import KernelPlan, validate
from mlagen.runtime import launch
from mlagen.tools.testing import make_case

SLOTS, MAX_BLOCKS, GHZ = 13, 8192, 1.98
START, CLOCK0, TILE0, LOOP_END, MERGE_WAIT, DONE, CLUSTER_MET, END, ENTRY, WORK_LIST = range(10)
STAGED, WRITTEN = 10, 11   # a split block's rows staged, its partial stores issued (before its count)
Q_LANDED = 12              # a TMA kernel's Q rows landed (its cp.async group), in its first segment
# --gt: every stamp from globaltimer (32 ns steps on the H200), so the phases need no clock rate:
# clock64 runs at the SM clock, which under graph replay is not always the 1.98 GHz boost.

# A trace point in the rendered source: `MLAGEN_TRACE(name);` on a line of its own.
TRACE_POINT = re.compile(r"^\s*MLAGEN_TRACE\((\w+)\);", re.MULTILINE)

# Each trace point's stamps, by thread 0 of the block: TR overwrites its slot, TR_FIRST keeps the
# block's first (a balanced range's later segments pass the point again).
BLOCK_POINTS = {
    "start": f"TR({START}); TR({CLOCK0})",
    "work_list": f"TR({WORK_LIST})",                   # a balanced split's work list, every block
    "merge_begin": f"TR({ENTRY})",
    "merge_wait": f"TR({MERGE_WAIT})",                 # the merge's wait for the splits' partials over
    "merge_end": f"TR({DONE}); TR({END})",
    "segment": f"TR_FIRST({ENTRY})",
    "q_landed": f"TR_FIRST({Q_LANDED})",               # a TMA kernel's Q copies waited for
    "tile_landed": f"if (kb == kb_begin) TR({TILE0})",   # a segment's first tile (the block's last segment's)
    "loop_end": f"TR({LOOP_END})",
    "cluster_met": f"TR({CLUSTER_MET})",               # the cluster's blocks have staged their rows
    "cluster_done": f"TR({DONE}); TR({END})",
    "staged": f"TR({STAGED})",                         # the barrier after the rows are staged
    "written": f"TR({WRITTEN})",                       # their stores issued
    "counted": f"TR({DONE}); TR({END})",               # the split's count (a pair's block ends later)
    "pair_done": f"TR({DONE}); TR({END})",             # a pair's merge after the range
}
REQUIRED_POINTS = ("start", "segment", "loop_end")   # in every mma kernel but the P exchange


def points_of(source: str) -> list[str]:
    """The trace points of a rendered `source`, in order, each once."""
    return list(dict.fromkeys(TRACE_POINT.findall(source)))


def traced(source: str, prelude: str, points: Mapping[str, str], required: tuple[str, ...] = ()) -> str:
    """`source` with MLAGEN_TRACE_ON, `prelude` (the stamps' buffer and macros) and each of its
    trace points defined ahead of it: those in `points` as their code (statements in the scope
    of the point, the last one's semicolon the template's), the others as nothing. A point of
    `required` missing from the source exits."""
    found = points_of(source)
    missing = [point for point in required if point not in found]
    if missing:
        raise SystemExit(f"trace points not in the kernel (the template changed): {', '.join(missing)}")
    lines = [f"#define MLAGEN_TRACE_{point} {points[point]}" if point in points
             else f"#define MLAGEN_TRACE_{point}" for point in found]
    return "#define MLAGEN_TRACE_ON\n" + prelude + "\n".join(lines) + "\n" + source


def header(globaltimer_only: bool = False) -> str:
    """The trace buffer and the TR macros: starts and ends from globaltimer, the stamps between
    from clock64 unless `globaltimer_only`."""
    stamp = "tr_gt()" if globaltimer_only else f"(k) == {START} || (k) == {END} ? tr_gt() : clock64()"
    return (f"__device__ unsigned long long mlagen_trace[{MAX_BLOCKS * SLOTS}];\n"
            "__device__ __forceinline__ unsigned long long tr_gt() {\n"
            "  unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
            "#define TR_ID ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)\n"
            f"#define TR(k) do {{ if (threadIdx.x == 0) mlagen_trace[TR_ID * {SLOTS} + (k)] = {stamp}; }} while (0)\n"
            f"#define TR_FIRST(k) do {{ if (threadIdx.x == 0 && !mlagen_trace[TR_ID * {SLOTS} + (k)]) "
            f"mlagen_trace[TR_ID * {SLOTS} + (k)] = {'tr_gt()' if globaltimer_only else 'clock64()'}; }} while (0)\n")


def block_trace(plan: KernelPlan, source: str, globaltimer_only: bool = False) -> str:
    """`plan`'s rendered `source`, traced: the trace buffer and each block's stamps (`header`)."""
    if plan.variant.p_exchange:
        raise SystemExit("a P exchange kernel: benchmarks/trace_exchange.py traces those")
    if plan.variant.family != "mma":
        raise SystemExit("not an mma kernel (naive or flash): trace_blocks.py traces mma kernels; pass an mma variant")
    return traced(source, header(globaltimer_only), BLOCK_POINTS, REQUIRED_POINTS)


def formats_of(variant: Variant | None) -> tuple[str, str]:
    """The first cache and query formats `variant`'s schedule reads; 16-bit ones for None."""
    if variant is None:
        return "dtype", "dtype"
    schedule = schedule_of(variant)
    return (schedule.kv_formats or ("dtype",))[0], schedule.q_formats[0]


def traced_row(trace: Callable[[KernelPlan, str], str], heads: int, batch: int, seqlen_q: int, prefix: int,
               variant: str | None = None) -> tuple[object, Callable[[], None]]:
    """One benchmark row (page 64, causal) through the dispatched kernel or `variant`, its source
    traced by `trace(plan, source)`: called three times (compiled, loaded, warm); returns the
    loaded kernel and a function that calls it again. The inputs are in the first cache and query
    formats the variant's schedule reads (16-bit ones for the dispatched kernel). Kernels built
    after this one render as usual."""
    render = build.render
    build.render = lambda plan: trace(plan, render(plan))
    try:
        v = parse_variant(variant) if variant else None
        kv_format, q_format = formats_of(v)
        case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=[prefix] * batch,
                         page_size=64, mask="causal", seed=0, kv_format=kv_format, q_format=q_format)

        def call() -> None:
            mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens, variant=v,
                                    **case.kwargs())

        for _ in range(3):
            call()
        torch.cuda.synchronize()
    finally:
        build.render = render
    return list(launch._loaded.values())[-1], call


def device_array(loaded, name: str, shape: tuple[int, ...]) -> cupy.ndarray:
    """The loaded kernel's __device__ array `name` of uint64, as a cupy array of `shape`."""
    size = 8 * int(np.prod(shape))
    memory = cupy.cuda.UnownedMemory(loaded.module.get_global_var(name), size, loaded.module)
    return cupy.ndarray(shape, dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(memory, 0))


def traced_blocks(loaded, call: Callable[[], None], warm: bool = False) -> list[tuple[int, list[int]]]:
    """One launch through `call` of the traced kernel `loaded`: (block, its SLOTS stamps) for
    every block that stamped its start. Cold: the inputs out of the L2 and a torch kernel run
    just before, so the SMs' instruction caches hold its code, not this one's. Warm: right after
    an untraced launch on the same inputs, as each call of a graph replay follows the last."""
    trace = device_array(loaded, "mlagen_trace", (MAX_BLOCKS, SLOTS))
    if warm:
        call()                          # the launch before, untraced
    else:
        # Inputs out of the L2 by reading (not writing) a buffer twice its size: a write would
        # leave dirty lines whose write-back then competes with the traced launch's stores.
        flush = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        flush.sum(dtype=torch.int64).item()
    torch.cuda.synchronize()
    trace[:] = 0
    call()
    torch.cuda.synchronize()
    return [(i, [int(x) for x in r]) for i, r in enumerate(trace.get()) if r[START]]


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str | None = None, warm: bool = False,
         gt: bool = False) -> None:
    loaded, call = traced_row(lambda plan, source: block_trace(plan, source, gt), heads, batch, seqlen_q, prefix,
                              variant)
    rows = traced_blocks(loaded, call, warm)
    t0 = min(r[START] for _, r in rows)

    def us(r: list[int], k: int) -> float:
        if not r[k]:
            return float("nan")
        return (r[k] - r[START]) / 1e3 if gt else (r[k] - r[CLOCK0]) / (GHZ * 1e3)

    print(loaded.plan.name, "blocks", len(rows))
    print("kind  block  start  wall | split: entry, tile 0 landed, loop end, [cluster staged,] done | merge: entry, "
          "wait over, done"
          "  (µs; start and wall from globaltimer, the rest from block start)")
    lines = []
    for i, r in rows:
        wall = (r[END] - r[START]) / 1e3
        if wall < 0.3:
            continue                    # a spare merge-slab block: exits at once
        merge = bool(r[MERGE_WAIT])
        met = f" {us(r, CLUSTER_MET):6.2f}" if r[CLUSTER_MET] else ""
        phases = (f"{'':31}| {us(r, ENTRY):6.2f} {us(r, MERGE_WAIT):6.2f} {us(r, DONE):6.2f}" if merge else
                  f"{us(r, ENTRY):6.2f} {us(r, TILE0):6.2f} {us(r, LOOP_END):6.2f}{met} {us(r, DONE):6.2f}  |")
        lines.append((merge, (r[START] - t0) / 1e3, f"{'merge' if merge else 'split'} {i:5d} "
                                                     f"{(r[START] - t0) / 1e3:6.2f} {wall:5.2f} | {phases}"))
    for *_, text in sorted(lines):
        print(text)
    span = max((r[END] - t0) / 1e3 for _, r in rows)
    print(f"launch span (first block start to last block end): {span:.2f} µs")
    for kind, stamps in (("split", (WORK_LIST, ENTRY, Q_LANDED, TILE0, LOOP_END, STAGED, WRITTEN, DONE)),
                         ("merge", (WORK_LIST, ENTRY, MERGE_WAIT, DONE))):
        mine = [r for _, r in rows if bool(r[MERGE_WAIT]) == (kind == "merge") and (r[END] - r[START]) >= 300]
        if not mine:
            continue
        cells = []
        for name, at in (("start", [(r[START] - t0) / 1e3 for r in mine]),
                         *((f"stamp {k}", [(r[START] - t0) / 1e3 + us(r, k) for r in mine]) for k in stamps),
                         ("end", [(r[END] - t0) / 1e3 for r in mine])):
            q = np.nanpercentile(at, [0, 50, 100])
            cells.append(f"{name} {q[0]:.1f}/{q[1]:.1f}/{q[2]:.1f}")
        print(f"{kind} blocks ({len(mine)}), µs after the first start, min/median/max: " + ", ".join(cells))


def row_parser(script: str, doc: str | None, variant_help: str):
    """The command line the tracers share: H B S prefix [variant]."""
    p = parser(script, doc)
    for name in ("heads", "batch", "seqlen_q", "prefix"):
        p.add_argument(name, type=int)
    p.add_argument("variant", nargs="?", type=variant_name, help=variant_help)
    return p


def traced_source(variant: str, heads: int, trace: Callable[[KernelPlan, str], str]) -> str:
    """`variant`'s rendered source for `heads` heads (page 64, causal, the formats its schedule
    reads), traced by `trace`: what a traced launch compiles, shown without a GPU."""
    v = parse_variant(variant)
    plan = validate(Problem(heads=heads).with_formats(*formats_of(v)), v)
    return trace(plan, render(plan))


def parse_args(argv: list[str]):
    p = row_parser(__file__, __doc__, "a variant name (default: the dispatcher's pick)")
    p.add_argument("--warm", action="store_true", help="trace a launch right after an untraced one")
    p.add_argument("--gt", action="store_true", help="every stamp from globaltimer")
    p.add_argument("--source", action="store_true", help="print the traced source of VARIANT and exit (no GPU)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.source:
        if not args.variant:
            raise SystemExit("--source needs a variant name")
        print(traced_source(args.variant, args.heads, lambda plan, source: block_trace(plan, source, args.gt)), end="")
        raise SystemExit(0)
    require_gpu(__file__)
    main(args.heads, args.batch, args.seqlen_q, args.prefix, args.variant, warm=args.warm, gt=args.gt)
