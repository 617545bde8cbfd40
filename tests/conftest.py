import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))   # tests/dropin_cases.py

settings.register_profile(
    "default", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
settings.register_profile("quick", parent=settings.get_profile("default"), max_examples=15)
settings.register_profile("gpu", parent=settings.get_profile("default"), max_examples=40)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine: bash benchmarks/run_gpu.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
