"""The KV cache's TMA descriptor request (mlagen/runtime/tensormap.py), checked without a driver: the
arguments handed to cuTensorMapEncodeTiled, and the error a refusal raises."""

import ctypes

import pytest

from mlagen.runtime import tensormap


class FakeEncode:
    """Stands in for the driver's cuTensorMapEncodeTiled: records its arguments, fills the
    descriptor with a pattern and returns `code`."""

    def __init__(self, code: int = 0):
        self.code, self.calls = code, []

    def __call__(self, desc, dtype, rank, address, dims, strides, box, unit, interleave, swizzle, l2, fill):
        words = ctypes.cast(desc, ctypes.POINTER(ctypes.c_uint64))
        for i in range(16):
            words[i] = i + 1
        self.calls.append(dict(dtype=dtype, rank=rank, address=address.value, dims=list(dims),
                               strides=list(strides[:rank - 1]), box=list(box[:rank]), unit=list(unit[:rank]),
                               interleave=interleave, swizzle=swizzle, fill=fill))
        return self.code


@pytest.mark.parametrize("dtype, code", [("bf16", 9), ("fp16", 6)])
def test_descriptor_describes_the_cache_as_pages_of_rows(monkeypatch, dtype, code):
    fake = FakeEncode()
    monkeypatch.setattr(tensormap, "_encode_tiled", lambda: fake)
    desc = tensormap.encode(0x7F0000001000, num_pages=300, page_size=64, head_dim=576, strides=(64 * 584, 584),
                            dtype=dtype, box_rows=64)
    assert len(desc) == tensormap.TENSOR_MAP_BYTES == 128
    assert desc[:8] == (1).to_bytes(8, "little")              # the bytes the driver wrote
    (call,) = fake.calls
    assert call == dict(dtype=code, rank=3, address=0x7F0000001000,
                        dims=[576, 64, 300],                  # innermost first: dims, rows, pages
                        strides=[584 * 2, 64 * 584 * 2],      # bytes between rows, between pages
                        box=[64, 64, 1],                      # one 128-byte column block of a tile
                        unit=[1, 1, 1], interleave=0, swizzle=3, fill=0)   # 128-byte swizzle, zero fill


def test_a_refused_descriptor_names_the_cache(monkeypatch):
    monkeypatch.setattr(tensormap, "_encode_tiled", lambda: FakeEncode(code=1))
    with pytest.raises(RuntimeError, match=r"kv_cache \[10, 32, 576\] with strides \(18432, 576\): CUresult 1"):
        tensormap.encode(0x1000, 10, 32, 576, (32 * 576, 576), "bf16", 32)


def test_device_map_buffers_per_cache_eager_and_captured(monkeypatch):
    """One buffer per cache outside capture, written before the call returns; a cache first met
    under capture gets one buffer that every capture copies into again (a node of each graph):
    from the graph's pool before any eager descriptor, else a slot of the device's arena, each
    slot handed out once. Once an eager call has written the cache's buffer, captures use it with
    no copy. CPU tensors stand in for the device and pinned buffers."""
    import torch

    fake, copies = FakeEncode(), []
    monkeypatch.setattr(tensormap, "_encode_tiled", lambda: fake)
    monkeypatch.setattr(tensormap, "_maps", {})
    monkeypatch.setattr(tensormap, "_captured", {})
    monkeypatch.setattr(tensormap, "_slots", {})
    monkeypatch.setattr(tensormap, "_device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(tensormap, "_host", lambda desc: torch.tensor(list(desc), dtype=torch.uint8))
    made = []
    monkeypatch.setattr(tensormap.lasting, "make", lambda build, device: made.append(device) or build())
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False:
                        copies.append(non_blocking) or real_copy(self, src))
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cache = dict(num_pages=8, page_size=64, head_dim=576, strides=(64 * 576, 576), dtype="bf16", box_rows=64)

    def address(ptr: int) -> int:
        return tensormap.device_map(0, ptr, **cache)

    first = address(0x1000)
    assert address(0x1000) == first                       # a second capture: the same buffer...
    assert copies == [True, True] and len(fake.calls) == 1   # ...written again by its own node
    assert len(tensormap._captured) == 1 and not tensormap._maps and not made and not tensormap._slots
    capturing[0] = False
    eager = address(0x1000)
    assert eager != first and copies[-1] is False         # eager: its own buffer, copied synchronously
    assert made == [0]                                    # made outside any pool, with the device's slots
    (dev, host), = tensormap._maps.values()
    assert torch.equal(dev, host) and dev.data_ptr() == eager
    capturing[0] = True
    assert address(0x1000) == eager and len(copies) == 3   # captured after: no copy recorded
    slots = tensormap._slots[0]
    assert address(0x2000) == slots.buffers[0].data_ptr() and len(tensormap._captured) == 2   # another cache: a slot
    assert address(0x2000) == slots.buffers[0].data_ptr() and slots.used == 1
    assert address(0x3000) == slots.buffers[1].data_ptr()
    slots.used = tensormap.CAPTURE_SLOTS
    assert address(0x4000) not in {s.data_ptr() for s in slots.buffers}   # slots spent: the graph's pool
