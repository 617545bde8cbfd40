"""The split-KV workspace of a call: the splits' partial results and, per row group, the
counter its merge blocks wait on (see templates/split_counters.cuh.j2).

The counters must be zero when a launch starts; every launch leaves them zero. So:

- Eager calls reuse their buffers per (device, stream), the counters zeroed once when
  allocated: work on a stream runs in order, so a call's launch never overlaps the previous
  one on that stream, and reusing skips a torch.empty and a memset per call. Other streams get
  their own. These buffers, and the arenas below, are made by `mlagen.runtime.lasting`, outside
  any private memory pool: torch.compile's CUDA graph trees warm a function up with its
  allocations routed into their pool, and refuse a buffer kept there.
- A call being captured in a CUDA graph takes its partials from torch's allocator (the graph's
  private pool) and its counters from a zeroed arena that eager calls set up on the device:
  slices handed out once and never again, so no two graphs, and no graph and eager call,
  share anything. Without arena room (no eager call yet on the device, or exhausted) the
  capture records a memset of its own counters instead, which the graph repeats per replay.

Every path is tested under torch.compile's modes, CUDA graph trees included, and under
engine-style captures (tests/test_gpu_compile.py).

The buffers are torch tensors, counted in torch's memory statistics; `release()` drops the
eager ones (torch's caching allocator then holds the memory until `torch.cuda.empty_cache()`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import lasting

ARENA_COUNTERS = 1 << 16      # uint32 counters per arena (256 KB)
_MAX_STREAMS = 64


@dataclass(frozen=True, slots=True)
class Layout:
    """A split call's workspace: part_o [rows, Dl] (fp32, or the output's dtype with
    `Variant.partials`), then part_ml [rows, 2] fp32, as `numel` float32 elements, and its uint32
    counters, one per row group."""

    numel: int
    part_ml_offset: int      # bytes from the start of part_o
    counters: int

    @classmethod
    def of(cls, rows: int, row_bytes: int, row_groups: int) -> Layout:
        """For `rows` partial rows (`SplitPlan.partial_rows`) of `row_bytes` bytes of values each
        (Dl times `SplitPlan.part_elem_bytes`; a multiple of 8, so part_ml stays float2-aligned)."""
        return cls(numel=rows * (row_bytes + 8) // 4, part_ml_offset=rows * row_bytes, counters=row_groups)


class _Arena:
    """Zeroed counters handed out once each, for captured calls."""

    def __init__(self, device: torch.device) -> None:
        self.counters = torch.zeros(ARENA_COUNTERS, dtype=torch.int32, device=device)
        torch.cuda.current_stream(device).synchronize()   # zero before any stream reads it
        self.used = 0

    def take(self, n: int) -> int | None:
        if self.used + n > ARENA_COUNTERS:
            return None
        self.used += n
        return self.counters.data_ptr() + 4 * (self.used - n)


# (device index, raw stream handle) -> the eager calls' buffers, as (partials, counters, partials
# address, counters address, partials size, counters size): plain ints for the per-call checks.
# Handles are per device (the default stream is 0 on every device), hence the pair. Bounded:
# code that creates a stream per request would otherwise keep buffers per stream it ever used.
# The counters are their own tensor so that no call's partials land where another call's
# counters are.
_buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int, int, int, int]] = {}
# device index -> arenas, the last one current; earlier ones stay alive for the graphs using them.
_arenas: dict[int, list[_Arena]] = {}


def get(device: int, stream: int, layout: Layout, torch_device: torch.device) -> tuple[object, int, int]:
    """(object to keep referenced until the launch is queued, partials address, counters
    address) for a call queued on `stream` of `device`."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return _for_capture(device, layout, torch_device)
    bufs = _buffers.get((device, stream))
    if bufs is None or bufs[4] < layout.numel or bufs[5] < layout.counters:
        bufs = _grow(device, stream, layout, torch_device, bufs)
    return bufs, bufs[2], bufs[3]


def _for_capture(device: int, layout: Layout, torch_device: torch.device) -> tuple[object, int, int]:
    partials = torch.empty(layout.numel, dtype=torch.float32, device=torch_device)
    arenas = _arenas.get(device)
    counters = arenas[-1].take(layout.counters) if arenas else None
    if counters is None:
        # Recorded into the graph: its replays zero these counters first.
        held = torch.zeros(layout.counters, dtype=torch.int32, device=torch_device)
        return (partials, held), partials.data_ptr(), held.data_ptr()
    return partials, partials.data_ptr(), counters


def _grow(device: int, stream: int, layout: Layout, torch_device: torch.device,
          bufs: tuple | None) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    if bufs is None and len(_buffers) >= _MAX_STREAMS:
        _buffers.clear()   # stream-ordered frees: work queued on those streams stays valid

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        # On `stream` (lasting.make), so torch's allocator ties the memory to it: freed memory (a
        # smaller buffer replaced here) is reused on it only after queued work.
        partials = bufs[0] if bufs is not None and bufs[4] >= layout.numel else \
            torch.empty(layout.numel, dtype=torch.float32, device=torch_device)
        counters = bufs[1] if bufs is not None and bufs[5] >= layout.counters else \
            torch.zeros(layout.counters, dtype=torch.int32, device=torch_device)
        arenas = _arenas.setdefault(device, [])
        if not arenas or arenas[-1].used * 2 > ARENA_COUNTERS:
            arenas.append(_Arena(torch_device))
        return partials, counters

    partials, counters = lasting.make(build, device)
    bufs = _buffers[(device, stream)] = (partials, counters, partials.data_ptr(), counters.data_ptr(),
                                         partials.numel(), counters.numel())
    return bufs


def release() -> None:
    """Drop the eager calls' buffers (calls allocate new ones as needed). Arenas stay: captured
    graphs may use them."""
    _buffers.clear()
