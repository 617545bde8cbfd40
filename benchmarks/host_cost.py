"""Host cost of one eager `verify_attention` call, in µs, on the GPU machine:

    PYTHONPATH=. python3 benchmarks/host_cost.py

One shape (batch 1, 9 draft tokens, 64 heads, a 256-key prefix, 64-key pages), dispatched:
out= given, allocating, return_lse, tree mask; 2000 calls each after a warm-up, timed on the
host (`mlagen.timing.host_us_per_call`: synchronizes between chunks of 100 calls, untimed, so
device time never leaks in). Then the out= case again with the launches bound through ctypes
to libcuda's cuLaunchKernel instead of CuPy's compiled wrapper (the A/B behind that choice),
and a cProfile of the out= case, top 15 by own time.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import pstats
from collections.abc import Callable

import torch

import mlagen
from mlagen import launch, runtime
from mlagen.testing import make_case
from mlagen.timing import host_us_per_call

CALLS = 2000
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


def main() -> None:
    causal = make_case(mask="causal", seed=0, **SHAPE)
    tree = make_case(mask="tree", seed=1, **SHAPE)
    out = causal.q.new_empty(*causal.q.shape[:3], causal.dl)
    args = (causal.q, causal.kv_cache, causal.block_table, causal.cache_seqlens)
    kw = dict(softmax_scale=causal.scale, check_values=False)
    cases: dict[str, Callable[[], object]] = {
        "out= given": lambda: mlagen.verify_attention(*args, out=out, **kw),
        "allocating": lambda: mlagen.verify_attention(*args, **kw),
        "return_lse": lambda: mlagen.verify_attention(*args, return_lse=True, **kw),
        "tree mask, out= given": lambda: mlagen.verify_attention(
            tree.q, tree.kv_cache, tree.block_table, tree.cache_seqlens, tree_mask=tree.tree_mask, out=out,
            softmax_scale=tree.scale, check_values=False),
    }
    for fn in cases.values():   # compile, load and remember each signature first
        fn()
    torch.cuda.synchronize()
    _, call = runtime._lookup(*args, None, out, 512, causal.scale, True, False, None)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; kernel: {call.kernel.name}, grid "
          f"{call.kernel.args[1:4]}" + (" (split, merge blocks inside)" if call.layout else " (one split)"))
    rows = [(name, host_us_per_call(fn, CALLS)) for name, fn in cases.items()]

    cupy_launch = launch._launch_kernel
    ctypes_launch = _ctypes_launch_kernel()
    launch._launch_kernel = lambda: ctypes_launch
    try:
        rows.append(("out= given, ctypes cuLaunchKernel", host_us_per_call(cases["out= given"], CALLS)))
    finally:
        launch._launch_kernel = cupy_launch

    print(f"\n{'case':38s} {'µs/call':>8s}")
    for name, us in rows:
        print(f"{name:38s} {us:8.2f}")

    profile = cProfile.Profile()
    for _ in range(CALLS // 100):   # chunks, synchronized outside the profile as above
        profile.enable()
        for _ in range(100):
            cases["out= given"]()
        profile.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(f"\ncProfile, out= given, {CALLS} calls (seconds per {CALLS} calls):\n{text.getvalue()}")


if __name__ == "__main__":
    main()
