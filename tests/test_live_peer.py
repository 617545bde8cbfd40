"""FlashMLA as a live peer, on CPU: benchmarks/build_flashmla.py's checks, commands and stages over
a stand-in checkout, and mlagen.tools.live_peer's loader and calls (a stand-in flash_mla package
records what the bench passes). The GPU run of both is run_gpu.sh's `peers` step."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch
from scripts import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import build_flashmla as build  # noqa: E402

from mlagen.tools import live_peer  # noqa: E402
from mlagen.tools.workload import InputSet  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "build_flashmla.py"


@pytest.fixture
def checkout(tmp_path):
    """A stand-in FlashMLA checkout: the files the build reads, each kernel source a line."""
    root = tmp_path / "FlashMLA"
    for source in build.KERNEL_SOURCES:
        (root / source).parent.mkdir(parents=True, exist_ok=True)
        (root / source).write_text("// kernel\n")
    (root / "csrc" / "api").mkdir(parents=True)
    (root / "csrc" / "api" / "sparse_decode.h").write_text("// api\n")
    (root / "csrc" / "cutlass" / "include" / "cute").mkdir(parents=True)
    (root / "csrc" / "cutlass" / "include" / "cute" / "tensor.hpp").write_text("// cute\n")
    (root / "flash_mla").mkdir()
    (root / "flash_mla" / "__init__.py").write_text("")
    return root


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_missing_checkout_and_cutlass_exit_with_one_line(tmp_path, checkout):
    done = _run("--flashmla", str(tmp_path / "absent"))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"build_flashmla.py: no FlashMLA checkout at {tmp_path / 'absent'} "
                                        f"(git clone https://github.com/deepseek-ai/FlashMLA {tmp_path / 'absent'})"]
    (checkout / "csrc" / "cutlass" / "include" / "cute" / "tensor.hpp").unlink()
    done = _run("--flashmla", str(checkout))
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1
    assert "csrc/cutlass has no CUTLASS headers" in done.stderr and "submodule update --init" in done.stderr


def test_dry_run_prints_one_sm90a_compile_per_kernel(checkout):
    done = _run("--flashmla", str(checkout), "--stage", "objects", "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"objects: 0 up to date, {len(build.KERNEL_SOURCES)} to compile"
    commands = lines[1:]
    assert len(commands) == len(build.KERNEL_SOURCES)
    for source, command in zip(build.KERNEL_SOURCES, commands, strict=True):
        assert command.startswith("nvcc ") and f"-c {checkout / source} " in command
        assert "arch=compute_90a,code=sm_90a" in command and "-fPIC" in command
        assert "-DFLASH_MLA_DISABLE_FP16" in command and f"-I{checkout / 'csrc/cutlass/include'}" in command
    outputs = {build.object_path(checkout, s) for s in build.KERNEL_SOURCES}
    assert len(outputs) == len(build.KERNEL_SOURCES) and all(o.parent == checkout / "build" for o in outputs)


def test_objects_newer_than_their_sources_are_kept(checkout):
    fresh, *rest = build.KERNEL_SOURCES
    build.build_dir(checkout).mkdir()
    build.object_path(checkout, fresh).write_text("object")
    assert not build.stale(checkout, fresh) and all(build.stale(checkout, s) for s in rest)
    source_time = (checkout / fresh).stat().st_mtime
    os.utime(build.object_path(checkout, fresh), (source_time - 10, source_time - 10))
    assert build.stale(checkout, fresh)


def test_a_failed_compile_names_its_command_and_the_compilers_lines(checkout, tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'error: no such thing' >&2\nexit 2\n")
    nvcc.chmod(0o755)
    done = _run("--flashmla", str(checkout), "--stage", "objects", "--nvcc", str(nvcc), "--jobs", "2")
    assert done.returncode == 1
    assert done.stderr.count("build_flashmla.py: ") == len(build.KERNEL_SOURCES)
    assert done.stderr.count("error: no such thing") == len(build.KERNEL_SOURCES)
    assert f"FAILED   {build.KERNEL_SOURCES[0]}" in done.stdout


def test_module_stage_needs_the_objects(checkout):
    done = _run("--flashmla", str(checkout), "--stage", "module")
    assert done.returncode == 1 and "objects missing (run --stage objects first)" in done.stderr


def test_stubs_define_every_sm100_entry_that_sparse_decode_names():
    """The stubs stand in for each sm100 kernel FlashMLA's sparse dispatch names, so the module
    links without them; each raises naming its kernel. The binding binds both decode entries."""
    assert build.STUBS.count("template<> void") == 3
    for name in ("ModelType::V32", "ModelType::MODEL1", "SparseAttnFwdMode::DecodeWithSplitKV, 512"):
        assert name in build.STUBS
    assert build.STUBS.count("not_built(\"sm100") == 3 and "template<>" not in build.BINDING
    assert '"sparse_decode_fwd", &sparse_attn_decode_interface' in build.BINDING
    assert '"dense_decode_fwd", &dense_attn_decode_interface' in build.BINDING


def test_default_checkout_is_ignored_by_git():
    done = subprocess.run(["git", "check-ignore", "-q", str(build.DEFAULT_CHECKOUT / "build" / "x.o")], cwd=ROOT)
    assert done.returncode == 0


# ---- mlagen.tools.live_peer

def test_loader_says_why_there_is_no_peer(tmp_path, checkout, monkeypatch):
    monkeypatch.delenv(live_peer.FLASHMLA_ENV, raising=False)
    missing = live_peer.load_flashmla(tmp_path / "absent")
    assert missing.module is None and missing.reason.startswith(f"no FlashMLA checkout at {tmp_path / 'absent'} (")
    assert f"then run python3 benchmarks/build_flashmla.py --flashmla {tmp_path / 'absent'})" in missing.reason
    unbuilt = live_peer.load_flashmla(checkout)
    assert unbuilt.module is None and unbuilt.reason.startswith(f"FlashMLA at {checkout} is not built")
    assert "build_flashmla.py" in unbuilt.reason


def test_checkout_path_prefers_the_argument_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(live_peer.FLASHMLA_ENV, raising=False)
    assert live_peer.checkout_path() == live_peer.DEFAULT_CHECKOUT
    monkeypatch.setenv(live_peer.FLASHMLA_ENV, str(tmp_path))
    assert live_peer.checkout_path() == tmp_path
    assert live_peer.checkout_path(tmp_path / "given") == tmp_path / "given"


class _Recorder(types.SimpleNamespace):
    """A stand-in flash_mla: get_mla_metadata hands out one plan; each call is recorded."""

    def __init__(self):
        super().__init__(calls=[], plans=0)

    def get_mla_metadata(self):
        self.plans += 1
        return object(), None

    def flash_mla_with_kvcache(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return torch.zeros(1), torch.zeros(1)


def test_dense_call_passes_flashmlas_layout_and_one_plan():
    fake = _Recorder()
    pages, page, dim = 3, 64, 576
    s = InputSet(q=torch.zeros(2, 4, 8, dim), kv_cache=torch.zeros(pages, page, dim),
                 block_table=torch.zeros(2, 2, dtype=torch.int32), cache_seqlens=torch.full((2,), 100),
                 tree_mask=None, out=torch.zeros(2, 4, 8, 512))
    call = live_peer.dense_call(fake, 0.25, causal=True)
    call(s)
    call(s)
    assert fake.plans == 1 and len(fake.calls) == 2
    (args, kwargs), _ = fake.calls
    assert args[0] is s.q and args[1].shape == (pages, page, 1, dim) and args[1].data_ptr() == s.kv_cache.data_ptr()
    assert args[2] is s.block_table and args[3] is s.cache_seqlens and args[4] == 512
    assert args[5] is fake.calls[1][0][5]            # the same plan object both times
    assert kwargs == {"softmax_scale": 0.25, "causal": True}


def test_sparse_call_passes_fp8_rows_and_indices():
    fake = _Recorder()
    s = types.SimpleNamespace(q=torch.zeros(1, 2, 64, 576), kv_cache=torch.zeros(5, 64, 656, dtype=torch.uint8),
                              indices=torch.zeros(1, 2, 128, dtype=torch.int32))
    live_peer.sparse_call(fake, 0.5)(s)
    (args, kwargs), = fake.calls
    assert args[1].dtype == torch.float8_e4m3fn and args[1].shape == (5, 64, 1, 656)
    assert args[2] is None and args[3] is None and args[4] == 512
    assert kwargs["indices"] is s.indices and kwargs["is_fp8_kvcache"] and not kwargs["causal"]
    assert kwargs["softmax_scale"] == 0.5
    s.q = torch.zeros(1, 2, 16, 576)
    with pytest.raises(ValueError, match="FlashMLA's sparse decode takes 64 or 128 heads .*, got 16"):
        live_peer.sparse_call(fake, 0.5)(s)
    assert len(fake.calls) == 1                           # FlashMLA itself was not called


# ---- on a GPU, with a FlashMLA build: both kernels on the same inputs

def _live_or_skip() -> live_peer.LivePeer:
    live = live_peer.load_flashmla()
    if live.module is None:
        pytest.skip(f"FlashMLA is not loaded: {live.reason}")
    return live


@pytest.mark.gpu
def test_live_flashmla_dense_decode_matches_mlagen():
    """FlashMLA's dense decode and mlagen's dispatched pick agree on a bench row's inputs, so the
    bench's live column times the same attention."""
    from mlagen.tools.grids import Row
    from mlagen.tools.timing import l2_bytes
    from mlagen.tools.workload import make_workload, mlagen_call

    live = _live_or_skip()
    work = make_workload(Row(64, 3, 4, 1000), 64, "causal", "bf16", l2_bytes(0))
    s = work.sets[0]
    ours = mlagen_call(work, None)(s)
    ours = (ours[0] if isinstance(ours, tuple) else ours).float()
    theirs = live_peer.dense_call(live.module, work.scale, causal=True)(s).float()
    assert theirs.shape == ours.shape
    assert (theirs - ours).abs().max().item() <= 2e-2 * ours.abs().max().item()


@pytest.mark.gpu
def test_live_flashmla_sparse_decode_matches_mlagen():
    from mlagen import verify_attention
    from mlagen.tools.sparse_bench import SparseRow, sparse_inputs

    live = _live_or_skip()
    (s,) = sparse_inputs(SparseRow(64, 2, 2, 256), 1024, 1, "cuda")
    scale = 576 ** -0.5
    ours = verify_attention(s.q, s.kv_cache, indices=s.indices, causal=False, softmax_scale=scale).float()
    theirs = live_peer.sparse_call(live.module, scale)(s).float()
    assert (theirs - ours).abs().max().item() <= 2e-2 * ours.abs().max().item()
