import glob
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

MATRIX = "compile_matrix"


def pytest_addoption(parser):
    parser.addoption(
        "--compile-matrix", action="store_true",
        help=f"also run the full compile matrix (tests marked {MATRIX}, left out by default; "
             f"-m {MATRIX} runs only those)",
    )


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _may_have_gpu() -> bool:
    """A cheap look for a CUDA device (no torch import): its device node, unless hidden."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


def _tests_named(config) -> bool:
    """Whether every argument names a test (path::name), not a file or folder."""
    return bool(config.args) and all("::" in arg for arg in config.args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without -n, run in parallel (pytest-xdist's `-n auto`, work stealing: the compile tests take
    0.1-3 s each), unless every argument names a test; -n 0 runs in one process, as does a run
    without pytest-xdist installed. A worker (which xdist starts with numprocesses unset) runs its
    share itself: it must not start workers."""
    if hasattr(config, "workerinput") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _tests_named(config):
        return
    if getattr(config.option, "numprocesses", 0) is None:
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "worksteal"


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook: unknown without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per usable core, up to 16, on a machine without
    a GPU, where the run is NVRTC compiles; on a GPU machine none (one process), since the GPU
    tests share one device and time kernels on it. PYTEST_XDIST_AUTO_NUM_WORKERS overrides both."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if _may_have_gpu():
        return 0
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    # The full compile matrix runs with --compile-matrix, when -m names it (-m compile_matrix), or
    # when the arguments name its tests.
    if not (config.getoption("--compile-matrix") or MATRIX in (config.option.markexpr or "") or _tests_named(config)):
        matrix = [item for item in items if item.get_closest_marker(MATRIX)]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if not item.get_closest_marker(MATRIX)]
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine: bash benchmarks/run_gpu.sh")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
