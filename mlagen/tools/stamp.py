"""What a benchmark or tuning result was measured on: GPU, driver, library versions, date."""

from __future__ import annotations

import datetime
import subprocess


def _driver_version() -> str:
    """The NVIDIA driver version (nvidia-smi), else the CUDA driver API version."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        import cupy

        return f"CUDA driver API {cupy.cuda.runtime.driverGetVersion()}"


def stamp(device: int) -> dict[str, object]:
    """GPU name, arch, SMs, L2 bytes, driver, torch/cupy/NVRTC versions and the UTC date."""
    import cupy
    import torch

    from ..codegen.compiler import nvrtc_version
    from ..runtime.op import device_info

    props = torch.cuda.get_device_properties(device)
    arch, sm_count = device_info(device)
    return {
        "gpu": props.name, "arch": arch, "sm_count": sm_count,
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
        "driver": _driver_version(), "torch": torch.__version__, "cupy": cupy.__version__,
        "nvrtc": ".".join(map(str, nvrtc_version())),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
