"""Device buffers that outlive the call that makes them (the split workspace kept per stream, the
counter arenas, TMA descriptors), allocated where no private memory pool can claim them.

torch's caching allocator can route every allocation of a thread into a private pool:
`torch.cuda.use_mem_pool` does, and so does `torch.compile(mode="reduce-overhead")` while its
CUDA graph trees run a function eagerly to warm it up. A buffer the op keeps across calls that
lands in such a pool stays alive there without being an output of anything, and the graph trees
refuse it ("tensors in the cudagraph pool not tracked as outputs"). So these buffers are made on
a helper thread, which no pool routes, with the calling thread's device and current stream: the
allocator then ties them to that stream exactly as if the caller had made them, so freeing one
later is ordered after the work queued on it.

Only calls that create or grow a kept buffer come here (the first call per stream, a larger
workspace, a new cache's descriptor), so the thread hand-off is paid once, not per call. Never under graph
capture: in torch's default capture mode another thread's cudaMalloc breaks the capture, so
captured calls take what they need from the graph's own pool, or from arenas made here before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlagen-lasting")
        return _executor


def make(build: Callable[[], T], device: int) -> T:
    """`build()`, run on the helper thread with CUDA device `device` current and, as its current
    stream, the calling thread's current stream of that device. Tensors it allocates come from
    torch's default pool, tied to that stream; work it queues runs on that stream."""
    stream = torch.cuda.current_stream(device)

    def run() -> T:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return build()

    return _helper().submit(run).result()
