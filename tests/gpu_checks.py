"""Checks the GPU tests share: a skip where a compile target's code does not run on this GPU, and
bitwise repeatability over repeated launches."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from mlagen.dsl.arch import runs_on
from mlagen.runtime.op import device_info


def require_target(arch: str) -> None:
    """Skip the test unless a CUDA GPU is here and runs `arch`'s code (sm_90a: an H100 or H200)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not runs_on(arch, device_info(torch.cuda.current_device())[0]):
        pytest.skip(f"{arch} code does not run on this GPU")


def assert_bitwise_repeatable(launch: Callable[[], Sequence[torch.Tensor]], launches: int = 10) -> None:
    """`launch` gives the same bits every time, `launches` times in all: a race in a kernel's
    hand-offs would show as a result that moves."""
    first = launch()
    for i in range(1, launches):
        again = launch()
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), f"launch {i} differs from the first"
