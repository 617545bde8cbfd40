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
    combine: object | None  # cupy Function of the combine kernel (split families)
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
            combine = module.get_function(plan.combine_kernel) if plan.uses_split else None
            # The loaded function's own count: a cache entry's parsed ptxas log can lack it
            # (seen once on the H200 for an entry a precompile worker wrote).
            regs = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, main.ptr)
        occupancy = plan.arch.blocks_per_sm(plan.threads, plan.smem_bytes, regs)
        loaded = Loaded(plan=plan, main=main, combine=combine, module=module, blocks_per_sm=occupancy)
        _loaded[key] = loaded
        return loaded


@dataclass(frozen=True, slots=True)
class Kernels:
    """The launches of one shape, as cuLaunchKernel's leading arguments (function, grid xyz,
    block xyz, dynamic shared memory), computed once so that a launch only adds the stream."""

    main: tuple[int, ...]
    main_name: str
    combine: tuple[int, ...] | None     # None: one split, no combine launch
    combine_name: str | None


def kernels(loaded: Loaded, grid: tuple[int, int, int],
            combine_grid: tuple[int, int, int] | None) -> Kernels:
    """The main kernel on `grid`, then (combine_grid given) the combine kernel on it."""
    plan = loaded.plan
    main = (loaded.main.ptr, *grid, plan.threads, 1, 1, plan.smem_bytes)
    if combine_grid is None:
        return Kernels(main=main, main_name=plan.main_kernel, combine=None, combine_name=None)
    combine = (loaded.combine.ptr, *combine_grid, plan.combine_threads, 1, 1, 0)
    return Kernels(main=main, main_name=plan.main_kernel, combine=combine, combine_name=plan.combine_kernel)


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


def launch(kernels: Kernels, stream: int, pointers: tuple[int, ...], rest: tuple[int | float, ...]) -> None:
    """Pack the parameter block (see `mlagen.params.pack_into`) and launch the main kernel,
    then the combine kernel if any, on `stream`, both with that one block."""
    params = _params
    pack_into(params.block, 0, *pointers, *rest)
    launch_kernel = _launch_kernel()
    try:
        launch_kernel(*kernels.main, stream, params.address, 0)
    except RuntimeError as e:   # CuPy's CUDADriverError names the error, not the kernel
        raise RuntimeError(f"cuLaunchKernel of {kernels.main_name} failed: {e}") from e
    if kernels.combine is not None:
        try:
            launch_kernel(*kernels.combine, stream, params.address, 0)
        except RuntimeError as e:
            raise RuntimeError(f"cuLaunchKernel of {kernels.combine_name} failed: {e}") from e
