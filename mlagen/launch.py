"""Loading cubins onto a device and launching them on a raw CUDA stream.

Kernels are launched with cuLaunchKernel through CuPy's driver bindings (a compiled wrapper;
ctypes' argument conversion measured ~1 µs more per launch) with the packed parameter block: no
CuPy arrays, no allocations, no host synchronization, so launches work on any stream, torch's
included, and inside CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .build import build
from .params import PARAMS_SIZE, pack_into
from .spec import Problem, Variant
from .validate import KernelPlan

DEFAULT_SMEM_LIMIT = 48 * 1024   # above this a kernel must opt in to more dynamic shared memory


@dataclass(frozen=True)
class Loaded:
    plan: KernelPlan
    main: object            # cupy Function of the main kernel
    module: object          # keeps the CUmodule alive
    blocks_per_sm: int      # occupancy of the main kernel (what the split count plans waves with)


_loaded: dict[tuple[Problem, Variant, int], Loaded] = {}
_lock = threading.Lock()


def _driver():
    from cupy.cuda import driver

    return driver


def load(problem: Problem, variant: Variant, device_index: int) -> Loaded:
    """Compile (through the disk cache) and load one (problem, variant) on a device, once."""
    key = (problem, variant, device_index)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    with _lock:
        if (hit := _loaded.get(key)) is not None:
            return hit
        import cupy

        built = build(problem, variant)
        plan = built.plan
        driver = _driver()
        with cupy.cuda.Device(device_index):
            module = cupy.cuda.function.Module()
            module.load(built.module.cubin)
            main = module.get_function(plan.main_kernel)
            if plan.smem_bytes > DEFAULT_SMEM_LIMIT:
                driver.funcSetAttribute(main.ptr,
                                        driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        plan.smem_bytes)
            # The loaded function's own count: a cache entry's parsed ptxas log can lack it
            # (seen once on the H200 for an entry a precompile worker wrote).
            regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, main.ptr)
        occupancy = plan.arch.blocks_per_sm(plan.threads, plan.smem_bytes, regs)
        loaded = Loaded(plan=plan, main=main, module=module, blocks_per_sm=occupancy)
        _loaded[key] = loaded
        return loaded


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """The launch of one shape, as cuLaunchKernel's leading arguments (function, grid xyz,
    block xyz, dynamic shared memory), computed once so that a launch only adds the stream."""

    args: tuple[int, ...]
    name: str


def kernel_launch(loaded: Loaded, grid: tuple[int, int, int]) -> KernelLaunch:
    """The kernel on `grid` (merge blocks included when split)."""
    plan = loaded.plan
    return KernelLaunch(args=(loaded.main.ptr, *grid, plan.threads, 1, 1, plan.smem_bytes), name=plan.main_kernel)


@functools.cache
def _launch_kernel() -> Callable[..., None]:
    """CuPy's cuLaunchKernel, bound once (the import costs host time on every call otherwise)."""
    return _driver().launchKernel


class _ParamsBuffer(threading.local):
    """One parameter block per thread, reused by every launch: cuLaunchKernel copies the
    parameters when it returns (also under graph capture), and a per-thread buffer keeps two
    threads launching at once from packing into the same bytes."""

    def __init__(self) -> None:
        self.block = ctypes.create_string_buffer(PARAMS_SIZE)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.block))   # kernelParams: void*[1]
        self.address = ctypes.addressof(self.argv)


_params = _ParamsBuffer()


def launch(kernel: KernelLaunch, stream: int, pointers: tuple[int, ...], rest: tuple[int | float, ...]) -> None:
    """Pack the parameter block (see `mlagen.params.pack_into`) and launch the kernel on `stream`."""
    params = _params
    pack_into(params.block, 0, *pointers, *rest)
    try:
        _launch_kernel()(*kernel.args, stream, params.address, 0)
    except RuntimeError as e:   # CuPy's CUDADriverError names the error, not the kernel
        raise RuntimeError(f"cuLaunchKernel of {kernel.name} failed: {e}") from e
