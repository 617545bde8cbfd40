"""The split-KV workspace: fp32 partial results one call's main kernel writes and its combine
kernel reads, both queued on one stream.

Eager calls reuse one buffer per (device, stream): work on a stream runs in order, so a call's
kernels never overlap the previous call's on that stream, and reusing skips a torch.empty per
call (~3 µs of host time on the H200 machine). Calls on different streams get different
buffers, so concurrent streams never share one. Under CUDA graph capture each call takes its
own buffer from torch's allocator (the graph's private pool): a graph never shares its
workspace with eager calls or with other graphs.

The buffers are torch tensors, so they count in torch's memory statistics; `release()` drops
them (torch's caching allocator then holds the memory until `torch.cuda.empty_cache()`).
"""

from __future__ import annotations

import torch

# (device index, raw stream handle) -> buffer. Handles are per device (the default stream is 0
# on every device), hence the pair. Bounded: code that creates a stream per request would
# otherwise keep a buffer per stream it ever used.
_buffers: dict[tuple[int, int], torch.Tensor] = {}
_MAX_STREAMS = 64


def get(device: int, stream: int, numel: int, torch_device: torch.device) -> torch.Tensor:
    """A float32 CUDA tensor of at least `numel` elements for a call queued on `stream` of
    `device`; the caller keeps it referenced until its launches are queued."""
    if torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(numel, dtype=torch.float32, device=torch_device)
    key = (device, stream)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        if buf is None and len(_buffers) >= _MAX_STREAMS:
            _buffers.clear()   # stream-ordered frees: work queued on those streams stays valid
        # The current stream is `stream`, so torch's allocator ties the memory to it: freed
        # memory (a smaller buffer replaced here) is reused on it only after queued work.
        buf = _buffers[key] = torch.empty(numel, dtype=torch.float32, device=torch_device)
    return buf


def release() -> None:
    """Drop every reused workspace buffer (calls allocate new ones as needed)."""
    _buffers.clear()
