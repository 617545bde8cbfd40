"""Host cost of one eager `verify_attention` call, in µs, on the GPU machine:

    python3 benchmarks/host_cost.py [--calls 2000]

One shape (batch 1, 9 draft tokens, 64 heads, a 256-key prefix, 64-key pages), dispatched:
out= given, allocating, return_lse, tree mask; CALLS calls each after a warm-up, timed on the
host (`mlagen.tools.timing.host_us_per_call`: synchronizes between chunks of 100 calls, untimed, so
device time never leaks in). Then the out= case again with the launches bound through ctypes
to libcuda's cuLaunchKernel instead of CuPy's compiled wrapper, which the runtime uses (the
difference is what a ctypes call costs per launch), and a cProfile of the out= case, top 15 by
own time.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import pstats
import sys
from collections.abc import Callable

import torch
from bench_cli import parser, require_gpu

import mlagen
from mlagen.runtime import launch, op
from mlagen.tools.testing import Case, make_case
from mlagen.tools.timing import host_us_per_call

SHAPE = dict(batch=1, seqlen_q=9, heads=64, prefixes=[256], page_size=64)


def _ctypes_launch_kernel() -> Callable[..., None]:
    """cuLaunchKernel through ctypes, with CuPy's launchKernel's arguments and error check."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    u, p = ctypes.c_uint, ctypes.c_void_p
    fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
    fn.restype = ctypes.c_int

    def launch_kernel(*args: int) -> None:
        rc = fn(*args)
        if rc:
            raise RuntimeError(f"cuLaunchKernel: CUresult {rc}")
    return launch_kernel


def cases(device: str = "cuda") -> tuple[dict[str, Callable[[], object]], Case]:
    """The timed calls by name, and the causal case they share (its `out` tensor as out=)."""
    causal = make_case(mask="causal", seed=0, device=device, **SHAPE)
    tree = make_case(mask="tree", seed=1, device=device, **SHAPE)
    out = causal.q.new_empty(*causal.q.shape[:3], causal.dl)
    args = (causal.q, causal.kv_cache, causal.block_table, causal.cache_seqlens)
    kw = dict(softmax_scale=causal.scale, check_values=False)
    return {
        "out= given": lambda: mlagen.verify_attention(*args, out=out, **kw),
        "allocating": lambda: mlagen.verify_attention(*args, **kw),
        "return_lse": lambda: mlagen.verify_attention(*args, return_lse=True, **kw),
        "tree mask, out= given": lambda: mlagen.verify_attention(
            tree.q, tree.kv_cache, tree.block_table, tree.cache_seqlens, tree_mask=tree.tree_mask, out=out,
            softmax_scale=tree.scale, check_values=False),
    }, causal


def remembered_call(fn: Callable[[], object]) -> op._Call:
    """What the runtime remembers of `fn`'s call (its kernel launch and split layout): the one
    entry its memo holds after `fn` runs alone."""
    op._calls.clear()
    fn()
    if len(op._calls) != 1:
        raise RuntimeError(f"expected one remembered call, found {len(op._calls)}")
    return next(iter(op._calls.values()))


def describe(call: op._Call) -> str:
    grid = call.kernel.args[1:4]
    return f"kernel: {call.kernel.name}, grid {grid}" + (" (split, merge blocks inside)" if call.layout
                                                          else " (one split)")


def parse_args(argv: list[str]):
    p = parser(__file__, __doc__)
    p.add_argument("--calls", type=int, default=2000, help="calls timed per case (default 2000)")
    return p.parse_args(argv)


def main(calls: int) -> list[tuple[str, float]]:
    timed, _ = cases()
    for fn in timed.values():   # compile, load and remember each signature first
        fn()
    torch.cuda.synchronize()
    kernel = describe(remembered_call(timed["out= given"]))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {kernel}")
    rows = [(name, host_us_per_call(fn, calls)) for name, fn in timed.items()]

    cupy_launch = launch._launch_kernel
    ctypes_launch = _ctypes_launch_kernel()
    launch._launch_kernel = lambda: ctypes_launch
    try:
        rows.append(("out= given, ctypes cuLaunchKernel", host_us_per_call(timed["out= given"], calls)))
    finally:
        launch._launch_kernel = cupy_launch

    print(f"\n{'case':38s} {'µs/call':>8s}")
    for name, us in rows:
        print(f"{name:38s} {us:8.2f}")

    profile = cProfile.Profile()
    chunks = max(1, calls // 100)
    for _ in range(chunks):   # chunks, synchronized outside the profile as above
        profile.enable()
        for _ in range(100):
            timed["out= given"]()
        profile.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(f"\ncProfile, out= given, {100 * chunks} calls (seconds in all):\n{text.getvalue()}")
    return rows


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    require_gpu(__file__)
    main(args.calls)
