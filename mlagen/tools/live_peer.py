"""FlashMLA as a live peer: its `flash_mla` package from a built checkout, and its calls on the
inputs mlagen times, so that the bench puts both kernels on the same tensors in the same process.

A checkout is built with `benchmarks/build_flashmla.py` (FlashMLA's sm90 dense bf16 decode and
sparse FP8 decode). It is looked for where `--flashmla` points, else in $MLAGEN_FLASHMLA, else
in ./third_party/FlashMLA. FlashMLA runs on sm_90a only; elsewhere, or where no build is found,
the loader returns the reason, and the bench falls back to the stored figures (`peers.PEERS`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ..dsl.kv_layout import LATENT_DIM

FLASHMLA_ENV = "MLAGEN_FLASHMLA"
DEFAULT_CHECKOUT = Path("third_party") / "FlashMLA"
BUILD_HINT = "python3 benchmarks/build_flashmla.py --flashmla {path}"
# The query heads FlashMLA's sm90 sparse decode has kernels for: its scheduler divides by
# heads / 64, so another count ends the process instead of raising.
SPARSE_HEADS = (64, 128)


@dataclass(frozen=True)
class LivePeer:
    """A loaded FlashMLA build, or why there is none (`module` None, `reason` says)."""

    module: ModuleType | None
    source: str            # the checkout it came from, or the reason it did not load

    @property
    def reason(self) -> str:
        return "" if self.module is not None else self.source


def checkout_path(given: Path | None = None) -> Path:
    """Where to look for the FlashMLA checkout: `given`, else $MLAGEN_FLASHMLA, else
    ./third_party/FlashMLA."""
    if given is not None:
        return given
    return Path(os.environ.get(FLASHMLA_ENV) or DEFAULT_CHECKOUT)


def load_flashmla(given: Path | None = None, device: int = 0) -> LivePeer:
    """FlashMLA's `flash_mla` package from the checkout (`checkout_path`), imported with the
    checkout first on sys.path; or the reason it cannot run on CUDA device `device`."""
    path = checkout_path(given).resolve()
    if not (path / "flash_mla" / "__init__.py").is_file():
        return LivePeer(None, f"no FlashMLA checkout at {path} (clone FlashMLA there, or name one with "
                              f"--flashmla or ${FLASHMLA_ENV}, then run {BUILD_HINT.format(path=path)})")
    if not any((path / "flash_mla").glob("cuda*.so")):
        return LivePeer(None, f"FlashMLA at {path} is not built ({BUILD_HINT.format(path=path)})")
    if torch.cuda.get_device_capability(device) != (9, 0):
        return LivePeer(None, f"FlashMLA's built kernels are sm_90a; this GPU is "
                              f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    loaded = sys.modules.get("flash_mla")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(path)):
        return LivePeer(None, f"another module named flash_mla is loaded ({getattr(loaded, '__file__', loaded)})")
    sys.path.insert(0, str(path))
    try:
        module = importlib.import_module("flash_mla")
    except ImportError as e:
        return LivePeer(None, f"FlashMLA at {path} does not import: {e}")
    finally:
        sys.path.remove(str(path))
    return LivePeer(module, str(path))


def dense_call(flash_mla: ModuleType, scale: float, causal: bool) -> Callable:
    """FlashMLA's dense decode as a call on a bench input set (`workload.InputSet`: q [B, S, H,
    576], kv_cache [pages, page_size, 576], block_table, cache_seqlens, out [B, S, H, 512]),
    returning FlashMLA's out. One scheduling plan serves every set of a row: FlashMLA reuses it
    across calls of the same shapes and cache_seqlens, which the sets share."""
    meta, _ = flash_mla.get_mla_metadata()

    def call(s) -> torch.Tensor:
        out, _ = flash_mla.flash_mla_with_kvcache(s.q, s.kv_cache[:, :, None, :], s.block_table, s.cache_seqlens,
                                                  LATENT_DIM, meta, None, softmax_scale=scale, causal=causal)
        return out
    return call


def sparse_call(flash_mla: ModuleType, scale: float) -> Callable:
    """FlashMLA's sparse FP8 decode as a call on a set with q [B, S, H, 576] bf16, kv_cache
    [pages, page_size, 656] uint8 (DeepSeek's FP8 rows) and indices [B, S, topk] int32,
    returning FlashMLA's out [B, S, H, 512]. One scheduling plan serves every set of a row. Raises
    ValueError, before calling FlashMLA, for a head count it has no kernel for (SPARSE_HEADS)."""
    meta, _ = flash_mla.get_mla_metadata()

    def call(s) -> torch.Tensor:
        if s.q.shape[2] not in SPARSE_HEADS:
            raise ValueError(f"FlashMLA's sparse decode takes {' or '.join(map(str, SPARSE_HEADS))} heads (its "
                             f"sm90 kernels'), got {s.q.shape[2]}")
        k_cache = s.kv_cache.view(torch.float8_e4m3fn)[:, :, None, :]
        out, _ = flash_mla.flash_mla_with_kvcache(s.q, k_cache, None, None, LATENT_DIM, meta, None,
                                                  softmax_scale=scale, causal=False, is_fp8_kvcache=True,
                                                  indices=s.indices)
        return out
    return call
