"""Loading cubins onto a device and launching them on a raw CUDA stream.

Kernels are launched with cuLaunchKernel (through CuPy's driver bindings) with the packed
parameter block: no CuPy arrays, no allocations, no host synchronization, so launches work
on any stream, torch's included, and inside CUDA graph capture.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from .build import build
from .spec import Problem, Variant
from .validate import KernelPlan

_DEFAULT_SMEM_LIMIT = 48 * 1024   # above this a kernel must opt in to more dynamic shared memory


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
            if plan.smem_bytes > _DEFAULT_SMEM_LIMIT:
                driver.funcSetAttribute(main.ptr,
                                        driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        plan.smem_bytes)
            combine = module.get_function(plan.combine_kernel) if plan.uses_split else None
        regs = built.module.resources[plan.main_kernel].registers
        occupancy = plan.arch.blocks_per_sm(plan.threads, plan.smem_bytes, regs)
        loaded = Loaded(plan=plan, main=main, combine=combine, module=module, blocks_per_sm=occupancy)
        _loaded[key] = loaded
        return loaded


def launch(loaded: Loaded, grid: tuple[int, int, int], combine_grid: tuple[int, int, int] | None,
           stream: int, params: bytes) -> None:
    """cuLaunchKernel of the main kernel, then (combine_grid given) of the combine kernel, on
    `stream`, both with the one parameter block `params` (the driver copies it at launch)."""
    buf = ctypes.create_string_buffer(params, len(params))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    argp = ctypes.addressof(argv)
    plan = loaded.plan
    launch_kernel = _driver().launchKernel
    launch_kernel(loaded.main.ptr, grid[0], grid[1], grid[2], plan.threads, 1, 1, plan.smem_bytes,
                  stream, argp, 0)
    if combine_grid is not None:
        launch_kernel(loaded.combine.ptr, combine_grid[0], combine_grid[1], combine_grid[2],
                      plan.combine_threads, 1, 1, 0, stream, argp, 0)
