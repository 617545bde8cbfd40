"""Loading cubins onto a device and launching them on a raw CUDA stream.

Kernels are launched with the packed parameter block: no CuPy arrays, no allocations, no host
synchronization, so launches work on any stream, torch's included, and inside CUDA graph
capture. Launches go through cuLaunchKernel in CuPy's compiled driver bindings (ctypes'
argument conversion costs more per launch: docs/performance.md, "Host cost").

MLAGEN_PDL=1 (read when a shape is first prepared) launches sm_90+ kernels with programmatic
dependent launch instead (cuLaunchKernelEx through ctypes, which CuPy does not bind): a
launch's blocks are scheduled while the kernel before it drains, and the kernels wait for that
kernel's writes before reading anything (`pdl_prologue` in templates/common.cuh.j2). It is off
by default for eager calls, which pay host time per call for it (docs/performance.md). Short
launches (`policy.dependent_in_graphs`: P exchanges, S=9 up to 16384 keys on the H200) go
that way by default while their stream is captured into a graph, where the host time does not
count (`KernelLaunch.pdl_captured`); long and batched ones, which it slows by up to 7%, launch
plainly. MLAGEN_PDL=0 launches every kernel plainly.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..codegen.build import build
from ..dsl.spec import Problem, Variant
from ..plan.params import DEPENDENT_OFFSET, PARAMS_SIZE, pack_into
from ..plan.validate import KernelPlan

DEFAULT_SMEM_LIMIT = 48 * 1024   # above this a kernel must opt in to more dynamic shared memory
PDL_MIN_CAPABILITY = 90          # griddepcontrol, and the launch attribute, need sm_90
PDL: bool = os.environ.get("MLAGEN_PDL", "") not in ("", "0")     # every sm_90+ launch
PDL_NEVER: bool = os.environ.get("MLAGEN_PDL", "") == "0"           # not even captured P exchanges
_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Function(Protocol):
    """What a launch takes of a loaded kernel (a cupy Function): its CUfunction handle."""

    ptr: int


@dataclass(frozen=True)
class Loaded:
    plan: KernelPlan
    main: Function          # cupy Function of the main kernel
    module: object          # keeps the CUmodule alive
    blocks_per_sm: int      # occupancy of the main kernel (what the split count plans waves with)


_loaded: dict[tuple[Problem, Variant, int], Loaded] = {}
_lock = threading.Lock()


def _driver():
    from cupy.cuda import driver

    return driver


def is_loaded(problem: Problem, variant: Variant, device_index: int) -> bool:
    """Whether `load` already holds (problem, variant) on the device: its next load is free."""
    return (problem, variant, device_index) in _loaded


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
        occupancy = plan.arch.blocks_per_sm(plan.launch_threads, plan.smem_bytes, regs)
        loaded = Loaded(plan=plan, main=main, module=module, blocks_per_sm=occupancy)
        _loaded[key] = loaded
        return loaded


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """The launch of one shape, as cuLaunchKernel's leading arguments (function, grid xyz,
    block xyz, dynamic shared memory), computed once so that a launch only adds the stream;
    `pdl`: launch it as a programmatic dependent of the stream's previous kernel; `pdl_captured`:
    so only while the stream is captured into a graph (short launches, which it speeds up, and
    where its host time per launch does not count; docs/performance.md, "Programmatic dependent
    launch")."""

    args: tuple[int, ...]
    name: str
    pdl: bool = False
    pdl_captured: bool = False    # as a programmatic dependent when the stream is being captured


def kernel_launch(loaded: Loaded, grid: tuple[int, int, int], in_graphs: bool = False) -> KernelLaunch:
    """The kernel on `grid` (merge blocks included when split); `in_graphs`: a launch short
    enough to go as a programmatic dependent whenever its stream is captured."""
    plan = loaded.plan
    dependent = plan.arch.capability >= PDL_MIN_CAPABILITY
    return KernelLaunch(args=(loaded.main.ptr, *grid, plan.launch_threads, 1, 1, plan.smem_bytes),
                        name=plan.main_kernel,
                        pdl=PDL and dependent, pdl_captured=dependent and in_graphs and not PDL_NEVER)


@functools.cache
def _launch_kernel() -> Callable[..., None]:
    """CuPy's cuLaunchKernel, bound once (the import costs host time on every call otherwise)."""
    return _driver().launchKernel


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, then a 64-byte value union at offset 8."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CONFIG_HEAD = struct.Struct("<7I4xQ")   # LaunchConfig up to its stream: one pack per launch
_PDL_ATTRIBUTE = LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_PDL_ATTRIBUTE.value[0] = 1          # programmaticStreamSerializationAllowed


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


@functools.cache
def _launch_kernel_ex() -> Callable[..., int]:
    """The driver's cuLaunchKernelEx (returns a CUresult)."""
    fn = _libcuda().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p] * 4     # config, function, kernelParams, extra: addresses
    fn.restype = ctypes.c_int
    return fn


def _error_name(code: int) -> str:
    """The driver's name of CUresult `code` (e.g. CUDA_ERROR_INVALID_VALUE)."""
    name = ctypes.c_char_p()
    if _libcuda().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


class _ParamsBuffer(threading.local):
    """One parameter block (and launch config) per thread, reused by every launch: the driver
    copies the parameters when a launch returns (also under graph capture), and a per-thread
    buffer keeps two threads launching at once from packing into the same bytes."""

    def __init__(self) -> None:
        self.block = ctypes.create_string_buffer(PARAMS_SIZE)
        self.argv = (ctypes.c_void_p * 1)(ctypes.addressof(self.block))   # kernelParams: void*[1]
        self.address = ctypes.addressof(self.argv)
        self.config = LaunchConfig(attrs=ctypes.pointer(_PDL_ATTRIBUTE), num_attrs=1)
        self.config_address = ctypes.addressof(self.config)


_params = _ParamsBuffer()
_DEPENDENT = struct.Struct("<i")


def launch(kernel: KernelLaunch, stream: int, pointers: tuple[int, ...], rest: tuple[int | float, ...]) -> None:
    """Pack the parameter block (see `mlagen.plan.params.pack_into`) and launch the kernel on `stream`."""
    params = _params
    pack_into(params.block, 0, *pointers, *rest)
    if kernel.pdl or (kernel.pdl_captured and _capturing(stream)):
        _DEPENDENT.pack_into(params.block, DEPENDENT_OFFSET, 1)
        _launch_dependent(kernel, stream, params)
        return
    try:
        _launch_kernel()(*kernel.args, stream, params.address, 0)
    except RuntimeError as e:   # CuPy's CUDADriverError names the error, not the kernel
        raise RuntimeError(f"cuLaunchKernel of {kernel.name} failed: {e}") from e


def _capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a CUDA graph (cudaStreamIsCapturing)."""
    from cupy.cuda import runtime

    return runtime.streamIsCapturing(stream) != 0


def _launch_dependent(kernel: KernelLaunch, stream: int, params: _ParamsBuffer) -> None:
    """cuLaunchKernelEx with the programmatic-stream-serialization attribute."""
    args = kernel.args
    _CONFIG_HEAD.pack_into(params.config, 0, *args[1:], stream)   # grid, block, shared memory, stream
    code = _launch_kernel_ex()(params.config_address, args[0], params.address, None)
    if code:
        raise RuntimeError(f"cuLaunchKernelEx of {kernel.name} failed: {_error_name(code)}")
