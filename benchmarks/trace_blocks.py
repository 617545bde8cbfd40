"""Per-block timeline of one launch of an mma kernel: when each block starts, when its first KV
tile has landed, when it has the balanced split's work list, when it enters its first segment
(its work found: the range lookups come before), when its tile loop ends and when it is done (split blocks;
a cluster split's blocks also when their cluster has staged its rows), or when it enters the
merge, when its wait for the splits ends and when it is done (merge blocks).

Stamps (globaltimer at a block's start and end, clock64 between) are patched into the rendered
source of this run only, at landmarks of templates/mma.cu.j2 (or mma_transposed.cu.j2) and
merge.cuh.j2 or of the cluster split's epilogue (the seesaw's tile loop has no tile-0
landmark: that column shows nan); a landmark that moved fails loudly. The last lines give the
split and merge blocks' start, stamps and end as min/median/max over the launch. On the GPU
machine:

    python3 benchmarks/trace_blocks.py 64 1 9 256 [variant name; default: the dispatcher's] [--warm] [--gt]
    python3 benchmarks/trace_blocks.py 64 1 9 256 VARIANT --source > patched.cu   # no GPU: the patched source

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
from collections.abc import Callable

import cupy
import numpy as np
import torch
from bench_cli import parser, require_gpu, variant_name

import mlagen
import mlagen.codegen.build as build
from mlagen.codegen.render import render
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.validate import KernelPlan, validate
from mlagen.runtime import launch
from mlagen.tools.testing import make_case

SLOTS, MAX_BLOCKS, GHZ = 13, 8192, 1.98
START, TILE0, LOOP_END, MERGE_WAIT, DONE, CLUSTER_MET, END, ENTRY, WORK_LIST = 0, 2, 3, 4, 5, 6, 7, 8, 9   # 1: clock64
STAGED, WRITTEN = 10, 11   # a split block's rows staged, its partial stores issued (before its count)
Q_LANDED = 12              # a TMA kernel's Q rows landed (its cp.async group), in its first segment
# --gt: every stamp from globaltimer (32 ns steps on the H200), so the phases need no clock rate:
# clock64 runs at the SM clock, which under graph replay is not always the 1.98 GHz boost.


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


PATCHES = [   # (landmark, replacement): the first occurrence of each
    (re.compile(r"(merge_block\(p(?:, wl)?\);)"), rf"{{ TR({ENTRY}); \1 TR({DONE}); TR({END}); }}"),   # the merge call
    ("  auto segment = [&](int b, int x, int t0, int t1, int split, bool direct, int splits) {\n",
     f"  auto segment = [&](int b, int x, int t0, int t1, int split, bool direct, int splits) {{ TR_FIRST({ENTRY});\n"),
    ("__syncthreads();   // the partials thread 0 acquired",
     f"TR({MERGE_WAIT}); __syncthreads();   // the partials thread 0 acquired"),
    # tile kb landed: the cp.async loop's barrier (its comment dropped), the TMA loop's wait, or
    # the transposed tile's warpgroup barrier (thread 0's warpgroup: tile kb_begin)
    (re.compile(r"(__syncthreads\(\);)\s+// tile kb landed; tile kb-1 fully used|(mbar_wait\(full\(kb\), [^;\n]*;)"
                r"|(named_sync\(WG0 \+ me, 128\);)\s+// its rows have landed"),
     lambda m: f"{m.group(1) or m.group(2) or m.group(3)} if (kb == kb_begin) TR({TILE0});"),
    (re.compile(r"(    // ---- epilogue: (?:row|column) sums)"), rf"    TR({LOOP_END});\n\1"),
    (re.compile(r"(    if \(!direct(?: && !in_pair)?\) count_split_done\([^\n]*;)"),   # a pair's block ends later
     rf"\1\n    TR({DONE}); TR({END});"),
]
CLUSTER_PATCHES = [PATCHES[1], *PATCHES[3:5]] + [   # no merge blocks, no counter: the cluster barriers instead
    ("      cluster_sync();\n      constexpr int CR",
     f"      cluster_sync(); TR({CLUSTER_MET});\n      constexpr int CR"),
    ("      cluster_sync();\n    } else {", f"      cluster_sync(); TR({DONE}); TR({END});\n    }} else {{"),
]


# Stamped where the kernel has one: a balanced split's work list computed (every block), a pair's
# merge done.
OPTIONAL_PATCHES = [   # (a 16-bit kernel's work list takes the lanes' tiles too)
    (re.compile(r"(  const WorkList wl = balanced_ranges\(p, (?:lt, )?lane\);)"), rf"\1 TR({WORK_LIST});"),
    # a pair's merge after the range: its block ends there, not at its count
    (re.compile(r"(    end_pair<[^;]*;)"), rf"\1 TR({DONE}); TR({END});"),
    # a part16 split's staged rows: after the barrier that staged them, around their stores
    (re.compile(r"(finish_staged_rows<ROWS, HT, WARPS>\(p, split, direct[^;]*;)"),
     rf"{{ TR({STAGED}); \1 TR({WRITTEN}); }}"),
    # a TMA kernel's wait for Q's copies (the lockstep loop's first tile, or before the seesaw's loop)
    (re.compile(r"(cp_async_wait<0>\(\);)(\s+// Q's copies)"), rf"\1 TR_FIRST({Q_LANDED});\2"),
]
# The transposed tile's rows staged (the barrier before its row loop) and its partial stores
# issued (before its count): its epilogue has no finish_staged_rows.
TRANSPOSED_PATCHES = [
    ("    __syncthreads();\n    for (int row = warp; row < N; row += THREADS / 32) {",
     f"    __syncthreads(); TR({STAGED});\n    for (int row = warp; row < N; row += THREADS / 32) {{"),
    ("\n    if (!direct) count_split_done(p, b, x, splits);\n",
     f"\n    TR({WRITTEN});\n    if (!direct) count_split_done(p, b, x, splits);\n"),
]
SEESAW_MARK = "s < 4 ? 1 : 128"   # the seesaw's mbarrier set-up (templates/mma.cu.j2)
TRANSPOSED_MARK = "// family mma, transposed tile"
EXCHANGE_MARK = "// family mma, P exchange"


def patch(source: str, globaltimer_only: bool = False) -> str:
    """The rendered `source` with the trace buffer and stamps at its landmarks (`header`)."""
    if EXCHANGE_MARK in source:
        raise SystemExit("a P exchange kernel: benchmarks/trace_exchange.py traces those")
    if "// family mma" not in source:
        raise SystemExit("not an mma kernel (naive or flash): trace_blocks.py traces mma kernels; pass an mma variant")
    start = source.index("const int wmq = warp % WMQ" if "const int wmq" in source else "const int me = __shfl_sync")
    start = source.index("\n", start) + 1
    source = source[:start] + f"  TR({START}); TR(1);\n" + source[start:]
    seesaw = SEESAW_MARK in source
    for landmark, replacement in CLUSTER_PATCHES if "cluster_sync();" in source else PATCHES:
        if seesaw and landmark == PATCHES[3][0]:
            continue                    # the seesaw's tile loop has no such barrier: tile 0 shows as nan
        if isinstance(landmark, re.Pattern):     # text that differs by split or kernel
            source, found = landmark.subn(replacement, source, count=1)
        else:
            found = landmark in source
            source = source.replace(landmark, replacement, 1)
        if not found:
            raise SystemExit(f"landmark not found (the template changed): {landmark!r}")
    for landmark, replacement in OPTIONAL_PATCHES:
        source = landmark.sub(replacement, source, count=1)
    if TRANSPOSED_MARK in source:
        for landmark, replacement in TRANSPOSED_PATCHES:
            if landmark not in source:
                raise SystemExit(f"landmark not found (the template changed): {landmark!r}")
            source = source.replace(landmark, replacement, 1)
    return header(globaltimer_only) + source


def patched_row(patch: Callable[[KernelPlan, str], str], heads: int, batch: int, seqlen_q: int, prefix: int,
                variant: str | None = None) -> tuple[object, Callable[[], None]]:
    """One benchmark row (page 64, causal) through the dispatched kernel or `variant`, its source
    rewritten by `patch(plan, source)`: called three times (compiled, loaded, warm); returns the
    loaded kernel and a function that calls it again. Kernels built after this one render as usual."""
    render = build.render
    build.render = lambda plan: patch(plan, render(plan))
    try:
        case = make_case(batch=batch, seqlen_q=seqlen_q, heads=heads, prefixes=[prefix] * batch,
                         page_size=64, mask="causal", seed=0)
        v = parse_variant(variant) if variant else None

        def call() -> None:
            mlagen.verify_attention(case.q, case.kv_cache, case.block_table, case.cache_seqlens,
                                    softmax_scale=case.scale, variant=v)

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
    """One launch through `call` of the patched kernel `loaded`: (block, its SLOTS stamps) for
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
    loaded, call = patched_row(lambda plan, source: patch(source, gt), heads, batch, seqlen_q, prefix, variant)
    rows = traced_blocks(loaded, call, warm)
    t0 = min(r[START] for _, r in rows)

    def us(r: list[int], k: int) -> float:
        if not r[k]:
            return float("nan")
        return (r[k] - r[START]) / 1e3 if gt else (r[k] - r[1]) / (GHZ * 1e3)

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


def patched_source(variant: str, heads: int, patch: Callable[[KernelPlan, str], str]) -> str:
    """`variant`'s rendered source for `heads` heads (page 64, causal), rewritten by `patch`: what
    a traced launch compiles, shown without a GPU."""
    plan = validate(Problem(heads=heads), parse_variant(variant))
    return patch(plan, render(plan))


def parse_args(argv: list[str]):
    p = row_parser(__file__, __doc__, "a variant name (default: the dispatcher's pick)")
    p.add_argument("--warm", action="store_true", help="trace a launch right after an untraced one")
    p.add_argument("--gt", action="store_true", help="every stamp from globaltimer")
    p.add_argument("--source", action="store_true", help="print the patched source of VARIANT and exit (no GPU)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.source:
        if not args.variant:
            raise SystemExit("--source needs a variant name")
        print(patched_source(args.variant, args.heads, lambda plan, source: patch(source, args.gt)), end="")
        raise SystemExit(0)
    require_gpu(__file__)
    main(args.heads, args.batch, args.seqlen_q, args.prefix, args.variant, warm=args.warm, gt=args.gt)
