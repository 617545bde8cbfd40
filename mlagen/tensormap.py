"""The KV cache's TMA descriptor for `Variant.tma` kernels, kept in device memory.

A tma kernel loads its KV tiles with `cp.async.bulk.tensor.3d` boxes of [64 dims, block_n rows,
1 page] from a descriptor of the cache as [num_pages][page_size][D] (the driver's
cuTensorMapEncodeTiled, 128-byte swizzle: the layout the wgmma kernels read). The parameter block
carries the descriptor's device address (`kv_map`). Outside graph capture a descriptor is
encoded once per cache tensor (its address, shape, strides and dtype) and copied to the device
before the call returns, so a launch on any stream may read it. Under capture the copy from
pinned host memory becomes a node of the graph, ahead of its kernels, into a buffer of that
capture's own: it is written only when the graph replays, so it is not shared with other
calls. Descriptors are never freed: a graph may still use one, and an engine has a few cache
tensors and graphs.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

MAP_BYTES = 128                  # sizeof(CUtensorMap)
_DTYPE = {"bf16": 9, "fp16": 6}  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 / _FLOAT16
_ELEM_BYTES = 2                  # both of them
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
BOX_DIMS = 64                    # dims per box: one 128-byte swizzled column block

# (device, address, num_pages, page_size, D, page stride, row stride, dtype, rows per box) ->
# (device tensor, pinned host tensor it was copied from): descriptors copied outside capture
_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# the same pairs for copies recorded in captured graphs, which hold their addresses
_captured: list[tuple[torch.Tensor, torch.Tensor]] = []


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def encode(address: int, num_pages: int, page_size: int, head_dim: int, strides: tuple[int, int], dtype: str,
           box_rows: int) -> bytes:
    """The 128-byte descriptor of a [num_pages][page_size][head_dim] cache at `address` with
    element strides (page, row) `strides`, for boxes of [64 dims, box_rows rows, 1 page]."""
    desc = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 3)(head_dim, page_size, num_pages)
    byte_strides = (ctypes.c_uint64 * 2)(strides[1] * _ELEM_BYTES, strides[0] * _ELEM_BYTES)
    box = (ctypes.c_uint32 * 3)(BOX_DIMS, box_rows, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    code = _encode_tiled()(ctypes.byref(desc), _DTYPE[dtype], 3, ctypes.c_void_p(address), dims, byte_strides, box,
                           unit, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    if code:
        raise RuntimeError(f"cuTensorMapEncodeTiled for kv_cache [{num_pages}, {page_size}, {head_dim}] with "
                           f"strides {strides}: CUresult {code}")
    return bytes(desc)


def device_map(device: int, address: int, num_pages: int, page_size: int, head_dim: int, strides: tuple[int, int],
               dtype: str, box_rows: int) -> int:
    """Device address of the descriptor of the cache at `address` on CUDA device `device`:
    encoded and copied the first time this cache is seen outside capture, and for each call
    under capture (see the module's text). The runtime calls it per launch: a hit is one dict
    lookup on the values it already holds."""
    key = (device, address, num_pages, page_size, head_dim, strides, dtype, box_rows)
    held = _maps.get(key)
    if held is not None:
        return held[0].data_ptr()
    host = torch.frombuffer(bytearray(encode(address, num_pages, page_size, head_dim, strides, dtype, box_rows)),
                            dtype=torch.uint8).pin_memory()
    dev = torch.empty(MAP_BYTES, dtype=torch.uint8, device=torch.device("cuda", device))
    if torch.cuda.is_current_stream_capturing():
        dev.copy_(host, non_blocking=True)
        _captured.append((dev, host))
    else:
        dev.copy_(host)              # synchronous: other streams' launches may read it next
        _maps[key] = (dev, host)
    return dev.data_ptr()
