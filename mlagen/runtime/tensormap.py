"""The KV cache's TMA descriptor for `Variant.loads` "tma" kernels, kept in device memory.

A tma kernel loads its KV tiles with `cp.async.bulk.tensor.3d` boxes of [64 dims, block_n rows,
1 page] from a descriptor of the cache as [num_pages][page_size][D] (the driver's
cuTensorMapEncodeTiled, 128-byte swizzle: the layout the wgmma kernels read). The parameter block
carries the descriptor's device address (`kv_map`). Outside graph capture a descriptor is
encoded once per cache tensor (its address, shape, strides and dtype) and copied to the device
before the call returns, so a launch on any stream may read it; a call under capture then uses
it as it is. A cache first met under capture gets a slot of its own for captured graphs: each
capture records a copy into it from pinned host memory, a node ahead of its kernels, so a graph
writes it before every replay (graphs that share it write the same bytes), and an eager call
never reads it before a replay has written it. The slots come from an arena that the device's
first eager descriptor sets up beside it (`mlagen.runtime.lasting`, outside any private pool:
torch.compile's CUDA graph trees copy a non-static cache to an address of their own before they
record, and refuse a buffer kept in their pool); past `CAPTURE_SLOTS` caches, the graph's own pool
holds the slot. Descriptors are never freed: a graph may still use one; there is one or two per
cache tensor, and an engine has a few.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

from ..plan.mma_plan import TENSOR_MAP_BYTES, TMA_BOX_DIMS
from . import lasting

# The cache's element kinds: (CU_TENSOR_MAP_DATA_TYPE_*, bytes). An e4m3 cache is read as bytes
# (UINT8), in boxes as wide in bytes as a 16-bit one's (templates/mma_ws_producer.cuh.j2).
_KINDS = {"bf16": (9, 2), "fp16": (6, 2), "e4m3": (0, 1)}   # BFLOAT16, FLOAT16, UINT8
_BOX_BYTES = TMA_BOX_DIMS * 2    # a box row: 64 16-bit dims, 128 bytes (the 128-byte swizzle's span)
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
CAPTURE_SLOTS = 64               # descriptors per device for caches first met under capture

# (device, address, num_pages, page_size, D, page stride, row stride, dtype, rows per box) ->
# (device tensor, pinned host tensor it is copied from): descriptors copied outside capture
_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# the same for caches first met under capture: captured graphs copy into these
_captured: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


class _Slots:
    """CAPTURE_SLOTS descriptor buffers of one device, handed out once each to `_captured`."""

    def __init__(self, device: torch.device) -> None:
        self.buffers = torch.empty(CAPTURE_SLOTS, TENSOR_MAP_BYTES, dtype=torch.uint8, device=device)
        self.used = 0

    def take(self) -> torch.Tensor | None:
        if self.used == CAPTURE_SLOTS:
            return None
        self.used += 1
        return self.buffers[self.used - 1]


_slots: dict[int, _Slots] = {}


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def encode(address: int, num_pages: int, page_size: int, head_dim: int, strides: tuple[int, int], dtype: str,
           box_rows: int) -> bytes:
    """The 128-byte descriptor of a [num_pages][page_size][head_dim] cache of `dtype` elements
    ("bf16", "fp16" or "e4m3") at `address` with element strides (page, row) `strides`, for boxes
    of [128 bytes of a row, box_rows rows, 1 page]."""
    kind, elem_bytes = _KINDS[dtype]
    desc = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 3)(head_dim, page_size, num_pages)
    byte_strides = (ctypes.c_uint64 * 2)(strides[1] * elem_bytes, strides[0] * elem_bytes)
    box = (ctypes.c_uint32 * 3)(_BOX_BYTES // elem_bytes, box_rows, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    code = _encode_tiled()(ctypes.byref(desc), kind, 3, ctypes.c_void_p(address), dims, byte_strides, box,
                           unit, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if code:
        raise RuntimeError(f"cuTensorMapEncodeTiled for kv_cache [{num_pages}, {page_size}, {head_dim}] with "
                           f"strides {strides}: CUresult {code}")
    return bytes(desc)


def _host(desc: bytes) -> torch.Tensor:
    """Descriptor `desc` in pinned host memory, the source of its copies to the device."""
    return torch.frombuffer(bytearray(desc), dtype=torch.uint8).pin_memory()


def _device(index: int) -> torch.device:
    return torch.device("cuda", index)


def _eager_buffer(device: int) -> torch.Tensor:
    """A device buffer for one descriptor, outside any private pool; the device's capture slots
    are set up with the first one."""
    cuda = _device(device)

    def build() -> torch.Tensor:
        if device not in _slots:
            _slots[device] = _Slots(cuda)
        return torch.empty(TENSOR_MAP_BYTES, dtype=torch.uint8, device=cuda)

    return lasting.make(build, device)


def _capture_buffer(device: int) -> torch.Tensor:
    """A device buffer for one descriptor under capture: the next free slot of the device's
    arena, else one from the graph's pool."""
    slots = _slots.get(device)
    slot = slots.take() if slots is not None else None
    return slot if slot is not None else torch.empty(TENSOR_MAP_BYTES, dtype=torch.uint8, device=_device(device))


def device_map(device: int, address: int, num_pages: int, page_size: int, head_dim: int, strides: tuple[int, int],
               dtype: str, box_rows: int) -> int:
    """Device address of the descriptor of the cache at `address` on CUDA device `device`:
    encoded and copied the first time this cache is seen (see the module's text for graph
    capture). The runtime calls it per launch: a hit outside capture is one dict lookup on the
    values it already holds."""
    key = (device, address, num_pages, page_size, head_dim, strides, dtype, box_rows)
    held = _maps.get(key)
    if held is not None:             # written before this call: eager calls and graphs read it as is
        return held[0].data_ptr()
    capturing = torch.cuda.is_current_stream_capturing()
    table = _captured if capturing else _maps
    held = table.get(key)
    if held is None:
        desc = _host(encode(address, num_pages, page_size, head_dim, strides, dtype, box_rows))
        held = table[key] = (_capture_buffer(device) if capturing else _eager_buffer(device), desc)
    # under capture a node of the graph; outside, finished before the return (other streams'
    # launches may read it next)
    held[0].copy_(held[1], non_blocking=capturing)
    return held[0].data_ptr()
