"""Inside one block of a paired kernel (`Variant.seesaw`, `Variant.transposed`): when each
warpgroup reaches each step of each pair of KV tiles, so that the time of a pair splits into
waits, matrix work and softmax.

Clock64 stamps, taken by the first thread of each warpgroup, at the trace points of
templates/mma_seesaw.cuh.j2 or templates/mma_transposed.cu.j2 (`MLAGEN_TRACE(point)`, nothing
in an untraced kernel; a `Schedule` each): this run's source defines MLAGEN_TRACE_ON and each
point's stamp ahead of the rendered kernel. On the GPU machine:

    python3 benchmarks/trace_seesaw.py 64 1 9 65536 [variant name; default: the dispatcher's]
    python3 benchmarks/trace_seesaw.py 8 16 9 16384 mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a
    python3 benchmarks/trace_seesaw.py 8 16 9 16384 VARIANT --source > traced.cu   # no GPU

The variant must run the seesaw's tile pairs (the seesaw, fp8_ws and fp8_mma schedules: their
inputs are in the formats the schedule reads) or the transposed tile. Printed: each phase's mean over the pairs of
the blocks (first and last pair left out: they carry the prologue and the tail), where a
balanced range moves on to its next request what its segment boundary spends (the epilogue's
steps, stamped by thread 0, then the next segment's prologue), then the pairs of one block, and
where the blocks' loops sit in the launch. The row is launched a few times first so that the
clocks have ramped; the traced launch's SM clock is measured (clock64 against the global timer,
which is also stamped at each pair's start) and converts the clock64 deltas to µs.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

import torch
from bench_cli import require_gpu
from trace_blocks import device_array, row_parser, traced, traced_row, traced_source

from mlagen.dsl.spec import Variant, parse_variant
from mlagen.plan.schedules import TRANSPOSED as TRANSPOSED_TILE
from mlagen.plan.schedules import schedule_of as registered_schedule
from mlagen.plan.validate import KernelPlan

MAX_BLOCKS, MAX_PAIRS, WARMUP = 512, 96, 20


@dataclass(frozen=True)
class Schedule:
    """The stamps of one paired schedule, at its template's trace points. A step is ((warpgroup,
    event), point, label): stamped at the point by the first thread of that warpgroup, or of both
    when the warpgroup is None (code the two run alike: the stamp then reads `me`); each
    warpgroup's steps, in the order listed, are its pair's sequence. A boundary step is (k, point,
    label), by thread 0 into the segment's last pair. A pair's stamps are `events` slots:
    warpgroup w's event e at stride * w + e, the global timer at `global_slot`, boundary step k at
    boundary_slot + k. `pair` is the block's pair index so far (C), and `last_pair` that of the
    last pair before a segment's boundary; `state` is code run at points, (point, code), e.g. a
    pair counter."""

    steps: tuple[tuple[tuple[int | None, int], str, str], ...]
    boundary: tuple[tuple[int, str, str], ...]
    stride: int
    global_slot: int
    boundary_slot: int
    events: int
    pair: str
    last_pair: str
    state: tuple[tuple[str, str], ...] = ()

    def sequence(self, w: int) -> list[tuple[int, str]]:
        """Warpgroup w's steps in order: (slot, label)."""
        return [(self.stride * w + e, label) for (ww, e), _, label in self.steps if ww in (None, w)]

    def points(self) -> dict[str, str]:
        """Each trace point's code: a step's stamp (warpgroup 0's first step also stamps the
        global timer), a boundary step's, or state."""
        first = next(key for key, _, _ in self.steps if key[0] in (None, 0))   # warpgroup 0's first step
        out: dict[str, str] = {}
        for (w, e), point, _ in self.steps:
            timer = "" if (w, e) != first else "; GT()" if w is not None else "; if (me == 0) GT()"
            out[point] = f"TS({'me' if w is None else w}, {e}){timer}"
        out.update((point, f"TB({k})") for k, point, _ in self.boundary)
        out.update(self.state)
        if len(out) != len(self.steps) + len(self.boundary) + len(self.state):
            raise ValueError("two stamps of a schedule share a trace point")
        return out

    def header(self) -> str:
        at = f"(SS_BLOCK * {MAX_PAIRS} + SS_PAIR) * {self.events}"
        mine = f"wt == 0 && SS_BLOCK < {MAX_BLOCKS} && SS_PAIR < {MAX_PAIRS}"
        last = f"({self.last_pair})"
        return (
            f"__device__ unsigned long long mlagen_ss_trace[{MAX_BLOCKS * MAX_PAIRS * self.events}];\n"
            f"__device__ int mlagen_ss_pairs[{2 * MAX_BLOCKS}];   // per block and warpgroup: the state's pair count\n"
            "#define SS_BLOCK ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x)\n"
            f"#define SS_PAIR ({self.pair})   // the block's pairs so far: a balanced split's segments follow on\n"
            f"#define TS(w, e) do {{ if ({mine}) mlagen_ss_trace[{at} + {self.stride} * (w) + (e)] = clock64(); }} "
            "while (0)\n"
            '#define GT() do { unsigned long long g; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g)); '
            f"if ({mine}) mlagen_ss_trace[{at} + {self.global_slot}] = g; }} while (0)\n"
            f"#define TB(k) do {{ if (threadIdx.x == 0 && SS_BLOCK < {MAX_BLOCKS} && {last} >= 0 && "
            f"{last} < {MAX_PAIRS}) mlagen_ss_trace[(SS_BLOCK * {MAX_PAIRS} + {last}) * {self.events} + "
            f"{self.boundary_slot} + (k)] = clock64(); }} while (0)\n"
        )


# Boundary steps 2 and 3 of both templates: a split segment ends through merge.cuh.j2's
# count_split_done, after its rows are stored.
RELEASE = (
    (2, "counting", "rows stored (issued)"),
    (3, "counted", "released (fence, count)"),
)

# The seesaw (templates/mma_seesaw.cuh.j2): each warpgroup's own code, all of it. Its boundary
# step 1 is the barrier after its rows are staged (templates/mma.cu.j2's epilogue), before they
# are ended (or, in a 16-bit kernel's pair, kept for after the range).
SEESAW = Schedule(
    steps=(
        ((0, 0), "k0_landed", "K0 landed"),
        ((0, 1), "s0_issued", "S0 issued"),
        ((0, 2), "s0_done", "S0 done"),
        ((0, 3), "p0_stored", "P0 stored (softmax 0 done)"),
        ((0, 4), "p0_v0l_done", "P0 V0_L done"),
        ((0, 5), "p1_received", "P1 received"),
        ((0, 6), "p1_v1l_done", "P1 V1_L done"),
        ((1, 0), "s0_seen", "S0 issued (seen)"),
        ((1, 1), "k1_landed", "K1 landed"),
        ((1, 2), "s1_issued", "S1 issued"),
        ((1, 3), "s1_done", "S1 done"),
        ((1, 4), "p0_received", "P0 received (S1 masked)"),
        ((1, 5), "p1_stored", "P1 stored (softmax 1 done)"),
        ((1, 6), "p0_v0r_done", "P0 V0_R done"),
        ((1, 7), "p1_v1r_done", "P1 V1_R done"),
    ),
    boundary=(
        (0, "epilogue", "epilogue begun (synced)"),
        (1, "stage_sync", "rows staged"),
        *RELEASE,
        (4, "q_ready", "next segment: Q landed"),
    ),
    stride=8, global_slot=7, boundary_slot=16, events=24,
    pair="t_base / 2 + pi", last_pair="mlagen_ss_pairs[2 * SS_BLOCK]",
    # The epilogue (end_segment) sees none of the segment's locals: the last pair's index goes
    # through global memory, written and read by thread 0 (-1 until a segment's tile loop ends).
    state=(("start", f"if (threadIdx.x == 0 && SS_BLOCK < {MAX_BLOCKS}) mlagen_ss_pairs[2 * SS_BLOCK] = -1"),
           ("loop_end",
            f"if (threadIdx.x == 0 && SS_BLOCK < {MAX_BLOCKS}) mlagen_ss_pairs[2 * SS_BLOCK] = tiles_done / 2 - 1")),
)

# The transposed tile (templates/mma_transposed.cu.j2): the scores and the softmax are code both
# warpgroups run (`me` picks the tile), the P.V hand-offs each warpgroup's own. Its segments
# keep no count of tiles before them, so the trace keeps one: each warpgroup's thread 0 counts
# the block's pairs before the segment in global memory (the kernel's segment function sees none
# of the kernel's locals).
TRANSPOSED = Schedule(
    steps=(
        ((1, 8), "ma_received", "m_A received"),
        ((1, 9), "pv_a_right_done", "P_A V_A done (FREE0)"),
        ((None, 0), "tile_landed", "tile landed"),
        ((None, 1), "scores_done", "scores done"),
        ((None, 2), "max_voted", "masked, max voted"),
        ((None, 3), "max_handed", "max handed over"),
        ((None, 4), "max_read", "P exponentiated, max read"),
        ((None, 5), "pt_stored", "P^T stored"),
        ((0, 6), "pv_a_left_done", "own P_A V_A done"),
        ((0, 7), "free0_seen", "wg1's P_A V_A done (FREE0)"),
        ((0, 8), "next_a_issued", "next A issued"),
        ((0, 9), "mb_received", "m_B received"),
        ((0, 10), "pv_b_left_done", "P_B V_B done"),
        ((1, 6), "pv_b_right_done", "P_B V_B done"),
        ((1, 7), "next_b_issued", "next B issued"),
    ),
    boundary=(
        (0, "epilogue", "epilogue begun (synced)"),
        (1, "stage_sync", "rows staged"),
        *RELEASE,
        (4, "q_ready", "next segment: Q and its first tiles landed"),
    ),
    stride=12, global_slot=23, boundary_slot=24, events=32,
    pair="mlagen_ss_pairs[2 * SS_BLOCK + me] + pi", last_pair="mlagen_ss_pairs[2 * SS_BLOCK] - 1",
    state=(("pairs_before", f"if (wt == 0 && SS_BLOCK < {MAX_BLOCKS}) mlagen_ss_pairs[2 * SS_BLOCK + me] = 0"),
           ("loop_end", f"if (wt == 0 && SS_BLOCK < {MAX_BLOCKS}) mlagen_ss_pairs[2 * SS_BLOCK + me] += pairs")),
)


def schedule_of(variant: Variant) -> Schedule | None:
    """The schedule whose trace points `variant`'s template has, or None for an unpaired kernel."""
    loop = registered_schedule(variant)
    return SEESAW if loop.seesaw_loop else TRANSPOSED if loop is TRANSPOSED_TILE else None


def paired_trace(plan: KernelPlan, source: str) -> str:
    """`plan`'s rendered `source` traced for its schedule; unchanged for an unpaired variant
    (`main` then refuses it)."""
    schedule = schedule_of(plan.variant)
    if schedule is None:
        return source
    return traced(source, schedule.header(), schedule.points(), tuple(schedule.points()))


def phases(stamps: list[list[int]], ghz: float, schedule: Schedule) -> dict[str, list[float]]:
    """Per pair (the first and last left out), the µs between consecutive steps of each
    warpgroup, and the pair's period (warpgroup 0's first step to the next pair's); clock64
    deltas at `ghz`."""
    out: dict[str, list[float]] = {}
    seq0 = schedule.sequence(0)
    (first, first_label), (last, last_label) = seq0[0], seq0[-1]
    for i in range(1, len(stamps) - 1):
        cur, nxt = stamps[i], stamps[i + 1]
        for w in (0, 1):
            seq = schedule.sequence(w)
            for (a, la), (b, lb) in zip(seq[:-1], seq[1:], strict=True):
                out.setdefault(f"wg{w}: {la} -> {lb}", []).append((cur[b] - cur[a]) / (ghz * 1e3))
        us = (nxt[first] - cur[first]) / (ghz * 1e3), (nxt[first] - cur[last]) / (ghz * 1e3)
        out.setdefault(f"pair period (wg0 {first_label} to the next)", []).append(us[0])
        out.setdefault(f"wg0: {last_label} -> next {first_label}", []).append(us[1])
    return out


def boundaries(stamps: list[list[int]], ghz: float, schedule: Schedule) -> dict[str, list[float]]:
    """Per segment boundary of one block (a pair with boundary stamps and a pair after it), the µs
    from warpgroup 0's last step through the epilogue's steps to the next segment's first step;
    clock64 deltas at `ghz`."""
    seq0 = schedule.sequence(0)
    (first, first_label), (last, last_label) = seq0[0], seq0[-1]
    labels = ([f"wg0 {last_label}"] + [label for _, _, label in schedule.boundary]
              + [f"next segment: {first_label}"])
    b0, count = schedule.boundary_slot, len(schedule.boundary)
    out: dict[str, list[float]] = {}
    for cur, nxt in zip(stamps[:-1], stamps[1:], strict=True):
        if not cur[b0]:
            continue
        times = [cur[last]] + cur[b0 : b0 + count] + [nxt[first]]
        for i in range(1, len(times)):
            out.setdefault(f"{labels[i - 1]} -> {labels[i]}", []).append((times[i] - times[i - 1]) / (ghz * 1e3))
        out.setdefault(f"boundary in all ({last_label} -> next {first_label})", []).append(
            (nxt[first] - cur[last]) / (ghz * 1e3))
    return out


def main(heads: int, batch: int, seqlen_q: int, prefix: int, variant: str | None = None) -> None:
    loaded, call = traced_row(paired_trace, heads, batch, seqlen_q, prefix, variant)
    schedule = schedule_of(loaded.plan.variant)
    if schedule is None:
        raise SystemExit(f"{loaded.plan.name} is neither a seesaw nor a transposed variant: pass one")
    trace = device_array(loaded, "mlagen_ss_trace", (MAX_BLOCKS, MAX_PAIRS, schedule.events))
    for _ in range(WARMUP):
        call()
    trace[:] = 0
    call()
    torch.cuda.synchronize()
    first = schedule.sequence(0)[0][0]
    blocks = [[[int(x) for x in pair] for pair in block if pair[first]] for block in trace.get()]
    blocks = [b for b in blocks if len(b) >= 3]
    if not blocks:
        raise SystemExit("no block ran 3 pairs or more: pick a longer row")
    # each block's clock64 against the global timer (ns) between its first and last pair
    timer = schedule.global_slot
    ghz = statistics.median((b[-1][first] - b[0][first]) / (b[-1][timer] - b[0][timer]) for b in blocks)
    merged: dict[str, list[float]] = {}
    for b in blocks:
        for name, values in phases(b, ghz, schedule).items():
            merged.setdefault(name, []).extend(values)
    print(
        loaded.plan.name,
        f"blocks with 3+ pairs: {len(blocks)}, pairs timed: {sum(len(b) - 2 for b in blocks)}, SM clock {ghz:.2f} GHz",
    )
    t0 = min(b[0][timer] for b in blocks)
    for what, values in (
        ("first pair starts (µs after the earliest)", [(b[0][timer] - t0) / 1e3 for b in blocks]),
        ("last pair starts (µs)", [(b[-1][timer] - t0) / 1e3 for b in blocks]),
        ("pairs per block", [len(b) for b in blocks]),
    ):
        print(f"{what:50} min {min(values):7.2f}  median {statistics.median(values):7.2f}  max {max(values):7.2f}")
    print(f"{'phase (µs, mean over pairs; min, max)':70} mean    min    max")
    for name, values in merged.items():
        print(f"{name:70} {sum(values) / len(values):5.2f}  {min(values):5.2f}  {max(values):5.2f}")
    edges: dict[str, list[float]] = {}
    for b in blocks:
        for name, values in boundaries(b, ghz, schedule).items():
            edges.setdefault(name, []).extend(values)
    if edges:
        count = len(next(iter(edges.values())))
        print(f"{f'segment boundaries ({count}; µs, mean; min, max)':70} mean    min    max")
        for name, values in edges.items():
            print(f"{name:70} {sum(values) / len(values):5.2f}  {min(values):5.2f}  {max(values):5.2f}")
    label = schedule.sequence(0)[0][1]
    print(f"block 0, per pair: each step's µs after that pair's wg0 {label} (wg0 steps | wg1 steps)")
    for i, pair in enumerate(blocks[0]):
        wg0, wg1 = (" ".join(f"{(pair[slot] - pair[first]) / (ghz * 1e3):5.2f}" for slot, _ in schedule.sequence(w))
                    for w in (0, 1))
        print(f"pair {i:3d}: {wg0} | {wg1}")


def parse_args(argv: list[str]):
    p = row_parser(__file__, __doc__, "a seesaw or transposed variant (default: the dispatcher's pick)")
    p.add_argument("--source", action="store_true", help="print the traced source of VARIANT and exit (no GPU)")
    args = p.parse_args(argv)
    if args.source and (args.variant is None or schedule_of(parse_variant(args.variant)) is None):
        p.error("--source needs a variant of the seesaw's tile pairs (_ss_, _ws_, _f8_) or the transposed tile (_tr_)")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.source:
        print(traced_source(args.variant, args.heads, paired_trace), end="")
        raise SystemExit(0)
    require_gpu(__file__)
    main(args.heads, args.batch, args.seqlen_q, args.prefix, args.variant)
