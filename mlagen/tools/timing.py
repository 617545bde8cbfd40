"""Device timing: CUDA graph replay with CUDA events, L2-busting rotation, and the ceilings.

`measure` captures many calls in one CUDA graph, each on the next of several input sets whose
total exceeds the L2, so no call finds its data cached by the one before; it replays the graph
a few times and reports the median per call. That is what serving engines pay: they run these
kernels inside graphs, so launch gaps do not count. The host side of a call is measured apart
(`host_us_per_call`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from .floor import Ceilings

T = TypeVar("T")
DEFAULT_L2_BYTES = 60 << 20     # H200's L2, if the device does not say
MAX_SETS = 256


@dataclass(frozen=True)
class TimingConfig:
    target_ms: float = 15.0     # device time of one replay the call count aims for
    reps: int = 10              # replays timed (fewer when replays are long: budget_ms)
    max_calls: int = 1000       # calls captured in one graph at most
    budget_ms: float = 400.0    # timed replays of one measurement, in total, about


@dataclass(frozen=True)
class Measurement:
    us: float                   # median device time per call
    calls: int                  # calls per replay
    replays: int                # replays timed; 0: only the first estimate (see give_up_us)


def l2_bytes(device: int) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0)) or DEFAULT_L2_BYTES


def rotation_count(set_bytes: int, l2: int) -> int:
    """Input sets to rotate among so that they total at least twice the L2."""
    return max(2, min(MAX_SETS, math.ceil(2 * l2 / max(set_bytes, 1))))


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def failure_text(e: BaseException) -> str:
    """What a cell, a trial or a peer that failed keeps of the exception: its type and message, at
    most 300 characters (reports show the first line)."""
    return f"{type(e).__name__}: {e}"[:300]


def measure(fn: Callable[[T], object], sets: Sequence[T], config: TimingConfig = TimingConfig(),
            give_up_us: float | None = None) -> Measurement:
    """Median device µs per `fn(set)`, rotating over `sets`. Exceptions from `fn` propagate
    (the first calls run eagerly, outside any capture, so a failing call fails there).

    Every set runs once eagerly before the capture, as a serving engine's warm-up meets its
    tensors before it captures them: a TMA kernel's descriptor for a KV cache first met under
    capture is a copy node of the graph ahead of the kernel (`mlagen.runtime.tensormap`), which also
    keeps the kernel from starting as a programmatic dependent. Warming two sets of ~20 puts
    that node ahead of most calls, ~2 µs each.

    give_up_us: if the eager estimate already exceeds it, return the estimate (replays=0):
    the tuner's way of not spending graph time on a candidate that cannot win.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):           # warm-up off the capture stream, as torch advises
        for s in sets[:2]:
            fn(s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    probe = min(len(sets), 4)
    start, end = _events()
    start.record()
    for s in sets[:probe]:
        fn(s)
    end.record()
    end.synchronize()
    estimate = start.elapsed_time(end) * 1000 / probe    # launch gaps included: an upper bound
    if give_up_us is not None and estimate > give_up_us:
        return Measurement(us=estimate, calls=probe, replays=0)
    for s in sets[probe:]:                   # the rest of the sets once, before the capture
        fn(s)
    torch.cuda.synchronize()

    calls = max(len(sets), min(config.max_calls, math.ceil(config.target_ms * 1000 / max(estimate, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(sets[i % len(sets)])
    graph.replay()                           # warm-up replay, not timed
    torch.cuda.synchronize()
    replay_ms = calls * estimate / 1000
    reps = max(3, min(config.reps, int(config.budget_ms / max(replay_ms, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return Measurement(us=statistics.median(times) * 1000 / calls, calls=calls, replays=reps)


def host_us_per_call(fn: Callable[[], object], calls: int = 2000, chunk: int = 100) -> float:
    """Host µs per `fn()`: a host timer around `calls` calls, synchronizing between chunks (not
    timed) so the launch queue never fills and device time never leaks into the figure."""
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(max(1, calls // chunk)):
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / (max(1, calls // chunk) * chunk) * 1e6


def _median_ms(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = _events()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting the bytes read and written."""
    with torch.cuda.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(device: int, n: int = 8192) -> float:
    """Flop/s of an n^3 bf16 torch.matmul on random data."""
    with torch.cuda.device(device):
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        ms = _median_ms(lambda: torch.matmul(a, b))
    return 2 * n**3 / (ms * 1e-3)


def fp8_matmul_rate(device: int, n: int = 8192) -> float | None:
    """Flop/s of an n^3 e4m3 x e4m3 -> bf16 matmul (torch._scaled_mm), or None where the GPU or
    this torch has none (before sm_89)."""
    with torch.cuda.device(device):
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()     # column-major, as it must be
        one = torch.ones((), device="cuda")
        try:
            ms = _median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        except (RuntimeError, AttributeError):
            return None
    return 2 * n**3 / (ms * 1e-3)


def measure_ceilings(device: int, fp8: bool = False) -> Ceilings:
    """The copy bandwidth and the bf16 matmul rate; with `fp8` also the e4m3 matmul rate."""
    return Ceilings(copy_bytes_per_s=copy_bandwidth(device), matmul_flops_per_s=matmul_rate(device),
                    fp8_matmul_flops_per_s=fp8_matmul_rate(device) if fp8 else None)
