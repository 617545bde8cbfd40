"""Inside one block of a seesaw kernel (`Variant.seesaw`): when each warpgroup reaches each step
of each pair of KV tiles, so that the time of a pair splits into waits, matrix work and softmax.

Clock64 stamps, taken by the first thread of each warpgroup, are patched into the rendered
source of this run only, at landmarks of templates/mma_seesaw.cuh.j2; a landmark that moved
fails loudly. On the GPU machine:

    python3 benchmarks/trace_seesaw.py 64 1 9 65536 [variant name; default: the dispatcher's]

The variant must be a seesaw one. Printed: each phase's mean over the pairs of the blocks
(first and last pair left out: they carry the prologue and the tail), where a balanced range
moves on to its next request what its segment boundary spends (BOUNDARY: the epilogue's steps,
stamped by thread 0, then the next segment's Q and first K0), then the pairs of one block, and
where the blocks' loops sit in the launch. The row is launched a few times first so
that the clocks have ramped; the traced launch's SM clock is measured (clock64 against the
global timer, which is also stamped at each pair's start) and converts the clock64 deltas to µs.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_blocks import device_array, patched_row  # noqa: E402

MAX_BLOCKS, MAX_PAIRS, EVENTS, WARMUP = 512, 96, 24, 20
GLOBAL = 7  # the event slot (unused by STEPS) that holds the global timer at each pair's start
# (warpgroup, event): the landmark after which it is stamped. Each landmark occurs once.
STEPS = [
    ((0, 0), "        mbar_wait(bars + 8 * K0_HI, parity);\n", "K0 landed"),
    ((0, 1), "        scores(s, buf0);\n", "S0 issued"),
    (
        (0, 2),
        "        named_sync(S0_ISSUED, 256);                         // S1 queues behind S0 on the tensor cores\n"
        "        wait_all();\n",
        "S0 done",
    ),
    ((0, 3), "        mbar_arrive(bars + 8 * P0_FULL);\n", "P0 stored (softmax 0 done)"),
    ((0, 4), "        pv_regs(s, buf0);\n        wait_all();\n", "P0 V0_L done"),
    ((0, 5), "        mbar_wait(bars + 8 * P1_FULL, parity);\n", "P1 received"),
    ((0, 6), "        pv_smem(buf1);\n        wait_all();\n", "P1 V1_L done"),
    ((1, 0), "      } else {\n        named_sync(S0_ISSUED, 256);\n", "S0 issued (seen)"),
    ((1, 1), "        mbar_wait(bars + 8 * K1_REST, parity);\n", "K1 landed"),
    ((1, 2), "        scores(s, buf1);\n", "S1 issued"),
    ((1, 3), "        wait_all();                                         // S1 done", "S1 done"),
    ((1, 4), "        mbar_wait(bars + 8 * P0_FULL, parity);\n", "P0 received (S1 masked)"),
    ((1, 5), "        mbar_arrive(bars + 8 * P1_FULL);\n", "P1 stored (softmax 1 done)"),
    ((1, 6), "        mbar_arrive(bars + 8 * P1_FULL);\n        wait_all();\n", "P0 V0_R done"),
    ((1, 7), "        pv_regs(s, buf1);\n        wait_all();\n", "P1 V1_R done"),
]
# Slot 16 + k: a segment's boundary, stamped by thread 0 into the segment's last pair (the
# next segment's prologue: into the previous one's). (k, landmark, label, stamp before it?)
BOUNDARY = [
    (0, "    cp_async_commit();\n    cp_async_wait<0>();\n    __syncthreads();\n", "epilogue begun (synced)", False),
    (1, "      __syncthreads();\n      for (int row = warp; row < ROWS; row += WARPS) {\n", "rows staged", True),
    (2, "    if (!direct) count_split_done(p, b, x, splits);\n", "rows stored (issued)", True),
    (3, "    if (!direct) count_split_done(p, b, x, splits);\n", "released (fence, count)", False),
    (4, "    __syncthreads();                                        // Q and the tree-mask rows\n",
     "next segment: Q landed", False),
]
HEADER = (
    f"__device__ unsigned long long mlagen_ss_trace[{MAX_BLOCKS * MAX_PAIRS * EVENTS}];\n"
    "#define SS_BLOCK ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)\n"
    "#define SS_PAIR (t_base / 2 + pi)   // the block's pairs so far: a balanced split's segments follow on\n"
    f"#define TS(w, e) do {{ if (wt == 0 && SS_BLOCK < {MAX_BLOCKS} && SS_PAIR < {MAX_PAIRS}) "
    f"mlagen_ss_trace[(SS_BLOCK * {MAX_PAIRS} + SS_PAIR) * {EVENTS} + 8 * (w) + (e)] = clock64(); }} "
    "while (0)\n"
    '#define GT() do { unsigned long long g; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g)); '
    f"if (wt == 0 && SS_BLOCK < {MAX_BLOCKS} && SS_PAIR < {MAX_PAIRS}) "
    f"mlagen_ss_trace[(SS_BLOCK * {MAX_PAIRS} + SS_PAIR) * {EVENTS} + {GLOBAL}] = g; }} while (0)\n"
    f"#define TB(k) do {{ if (threadIdx.x == 0 && tiles_done > 0 && SS_BLOCK < {MAX_BLOCKS} && "
    f"tiles_done / 2 <= {MAX_PAIRS}) "
    f"mlagen_ss_trace[(SS_BLOCK * {MAX_PAIRS} + tiles_done / 2 - 1) * {EVENTS} + 16 + (k)] = clock64(); }} while (0)\n"
)


def patch(source: str) -> str:
    """`source` with a stamp after each landmark of STEPS (in a seesaw kernel's rendered source)."""
    # longest landmark first: warpgroup 1's "P0 V0_R done" landmark holds its "P1 stored" one
    for (w, e), landmark, _ in sorted(STEPS, key=lambda s: -len(s[1])):
        if source.count(landmark) != 1:
            raise SystemExit(f"landmark not found once (the template changed): {landmark!r}")
        end = source.index(landmark) + len(landmark)
        line_end = source.index("\n", end - 1) + 1 if not landmark.endswith("\n") else end
        stamp = "TS(0, 0); GT();" if (w, e) == (0, 0) else f"TS({w}, {e});"
        source = source[:line_end] + f"        {stamp}\n" + source[line_end:]
    for k, landmark, _, before in BOUNDARY:
        if source.count(landmark) != 1:
            raise SystemExit(f"landmark not found once (the template changed): {landmark!r}")
        at = source.index(landmark) + (0 if before else len(landmark))
        source = source[:at] + f"    TB({k});\n" + source[at:]
    return HEADER + source


def phases(stamps: list[list[int]], ghz: float) -> dict[str, list[float]]:
    """Per pair (the first and last left out), the µs between consecutive steps of each
    warpgroup, and the pair's period (warpgroup 0's K0 landed to the next pair's); clock64
    deltas at `ghz`."""
    names = {key: label for key, _, label in STEPS}
    out: dict[str, list[float]] = {}
    for i in range(1, len(stamps) - 1):
        cur, nxt = stamps[i], stamps[i + 1]
        for w, count in ((0, 7), (1, 8)):
            for e in range(1, count):
                a, b = cur[8 * w + e - 1], cur[8 * w + e]
                out.setdefault(f"wg{w}: {names[(w, e - 1)]} -> {names[(w, e)]}", []).append((b - a) / (ghz * 1e3))
        out.setdefault("pair period (wg0 K0 landed to the next)", []).append((nxt[0] - cur[0]) / (ghz * 1e3))
        out.setdefault("wg0: P1 V1_L done -> next K0 landed", []).append((nxt[0] - cur[6]) / (ghz * 1e3))
    return out


def boundaries(stamps: list[list[int]], ghz: float) -> dict[str, list[float]]:
    """Per segment boundary of one block (a pair with boundary stamps and a pair after it), the µs
    from warpgroup 0's last P1 V1_L through the epilogue's steps to the next segment's Q and its
    first K0 landing; clock64 deltas at `ghz`."""
    labels = ["wg0 P1 V1_L done"] + [label for _, _, label, _ in BOUNDARY] + ["next segment: K0 landed"]
    out: dict[str, list[float]] = {}
    for cur, nxt in zip(stamps[:-1], stamps[1:], strict=True):
        if not cur[16]:
            continue
        times = [cur[6]] + cur[16 : 16 + len(BOUNDARY)] + [nxt[0]]
        for i in range(1, len(times)):
            out.setdefault(f"{labels[i - 1]} -> {labels[i]}", []).append((times[i] - times[i - 1]) / (ghz * 1e3))
        out.setdefault("boundary in all (P1 V1_L done -> next K0 landed)", []).append((nxt[0] - cur[6]) / (ghz * 1e3))
    return out


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str | None = None) -> None:
    loaded, call = patched_row(
        lambda plan, source: patch(source) if plan.variant.seesaw else source, heads, batch, seqlen_q, prefix, variant
    )
    if not loaded.plan.variant.seesaw:
        raise SystemExit(f"{loaded.plan.name} is not a seesaw variant: pass one")
    trace = device_array(loaded, "mlagen_ss_trace", (MAX_BLOCKS, MAX_PAIRS, EVENTS))
    for _ in range(WARMUP):
        call()
    trace[:] = 0
    call()
    torch.cuda.synchronize()
    blocks = [[[int(x) for x in pair] for pair in block if pair[0]] for block in trace.get()]
    blocks = [b for b in blocks if len(b) >= 3]
    if not blocks:
        raise SystemExit("no block ran 3 pairs or more: pick a longer row")
    # each block's clock64 against the global timer (ns) between its first and last pair
    ghz = statistics.median((b[-1][0] - b[0][0]) / (b[-1][GLOBAL] - b[0][GLOBAL]) for b in blocks)
    merged: dict[str, list[float]] = {}
    for b in blocks:
        for name, values in phases(b, ghz).items():
            merged.setdefault(name, []).extend(values)
    print(
        loaded.plan.name,
        f"blocks with 3+ pairs: {len(blocks)}, pairs timed: {sum(len(b) - 2 for b in blocks)}, SM clock {ghz:.2f} GHz",
    )
    t0 = min(b[0][GLOBAL] for b in blocks)
    for what, values in (
        ("first pair starts (µs after the earliest)", [(b[0][GLOBAL] - t0) / 1e3 for b in blocks]),
        ("last pair starts (µs)", [(b[-1][GLOBAL] - t0) / 1e3 for b in blocks]),
        ("pairs per block", [len(b) for b in blocks]),
    ):
        print(f"{what:50} min {min(values):7.2f}  median {statistics.median(values):7.2f}  max {max(values):7.2f}")
    print(f"{'phase (µs, mean over pairs; min, max)':70} mean    min    max")
    for name, values in merged.items():
        print(f"{name:70} {sum(values) / len(values):5.2f}  {min(values):5.2f}  {max(values):5.2f}")
    edges: dict[str, list[float]] = {}
    for b in blocks:
        for name, values in boundaries(b, ghz).items():
            edges.setdefault(name, []).extend(values)
    if edges:
        count = len(next(iter(edges.values())))
        print(f"{f'segment boundaries ({count}; µs, mean; min, max)':70} mean    min    max")
        for name, values in edges.items():
            print(f"{name:70} {sum(values) / len(values):5.2f}  {min(values):5.2f}  {max(values):5.2f}")
    first = blocks[0]
    print("block 0, per pair: each step's µs after that pair's wg0 K0 landed (wg0 steps | wg1 steps)")
    for i, pair in enumerate(first):
        wg0 = " ".join(f"{(pair[e] - pair[0]) / (ghz * 1e3):5.2f}" for e in range(1, 7))
        wg1 = " ".join(f"{(pair[8 + e] - pair[0]) / (ghz * 1e3):5.2f}" for e in range(8))
        print(f"pair {i:3d}: {wg0} | {wg1}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:5]), *sys.argv[5:6])
