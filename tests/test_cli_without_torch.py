"""mlagen's base install needs no torch: `mlagen emit`, `list`, `show` and `check` run in a
process where torch cannot be imported, `import mlagen` gives the layers below the runtime and
names the runtime extra when a runtime name is used, and pyproject.toml keeps torch in that
extra. Where torch is installed, `import mlagen` registers the custom op."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Run before the command: a meta-path finder that makes `import torch` fail, as on a machine
# without it, then the mlagen command with the arguments after it.
BLOCK_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
"""
RUN_CLI = BLOCK_TORCH + """
sys.argv = ["mlagen", *sys.argv[1:]]
from mlagen.tools.cli import main
main()
"""


def _without_torch(*args: str, code: str = RUN_CLI) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_emit_list_show_check_run_without_torch(tmp_path):
    emitted = _without_torch("emit", "--launcher", "--out", str(tmp_path))
    assert emitted.returncode == 0, emitted.stderr
    assert list((tmp_path / "kimi-k2" / "sm_90").glob("mlagen_*_launch.h"))
    assert emitted.stdout.splitlines()[-1].startswith("6 kernel files for preset kimi-k2")     # 4 sm_90, 2 sm_120
    listed = _without_torch("list")
    assert listed.returncode == 0 and "kimi-k2 on sm_90:" in listed.stdout, listed.stderr
    shown = _without_torch("show", "naive_w4_sm120", "--source", "--compile")
    assert shown.returncode == 0, shown.stderr
    assert "__global__" in shown.stdout and "spill stores" in shown.stderr
    checked = _without_torch("check", "--preset", "kimi-k2", "--arch", "sm_120")
    assert checked.returncode == 0, checked.stderr
    assert "variants compiled for sm_120" in checked.stdout
    for stream in (emitted, listed, shown, checked):
        assert "Traceback" not in stream.stderr


def test_gpu_commands_without_torch_name_the_runtime_extra():
    for command in ("bench", "tune", "fuzz"):
        run = _without_torch(command)
        assert run.returncode == 2 and run.stdout == "", run.stderr
        assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
        assert "needs torch" in run.stderr and "pip install 'mlagen[runtime]'" in run.stderr


def test_import_without_torch_names_the_runtime_extra():
    code = BLOCK_TORCH + """
import mlagen
assert mlagen.validate(mlagen.Problem(), mlagen.naive("sm_90")).name.startswith("mlagen_naive")
for name in ("reference", "verify_attention", "InputError"):
    try:
        getattr(mlagen, name)
    except ImportError as e:
        assert "pip install 'mlagen[runtime]'" in str(e) and f"mlagen.{name}" in str(e), e
    else:
        raise AssertionError(name)
assert not hasattr(mlagen, "no_such_name")
assert "torch" not in sys.modules
print("ok")
"""
    run = _without_torch(code=code)
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr


def test_import_registers_the_custom_op_where_torch_is():
    import torch

    import mlagen

    assert hasattr(torch.ops.mlagen, "verify_attention")
    assert all(hasattr(mlagen, name) for name in mlagen.__all__)


def test_pyproject_keeps_torch_in_the_runtime_extra():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    extras = project["project"]["optional-dependencies"]
    assert not any(d.startswith(("torch", "matplotlib")) for d in deps)
    assert any(d.startswith("cupy") for d in deps)                   # check compiles through NVRTC via CuPy
    assert "torch>=2.4" in extras["runtime"]                         # no pin: a torch installed beside it serves
    assert "mlagen[runtime]" in extras["test"] and any(d.startswith("mypy") for d in extras["test"])
    assert project["project"]["scripts"]["mlagen"] == "mlagen.tools.cli:main"
    assert "py-modules" not in project["tool"]["setuptools"]         # no top-level module `cli` installed
