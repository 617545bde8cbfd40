"""benchmarks/flashmla_sparse_tests.py on CPU: its command line, its one-line exits without a
FlashMLA checkout, without a GPU or without a package FlashMLA's tests import, the shim that
turns FlashMLA's `import flash_mla` into mlagen.compat.flash_mla, and a whole run over a stand-in
checkout whose test file has FlashMLA's shape (gen_testcase, test_flash_mla, lib): the groups,
seeds, skip reasons, failures and the written counts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from scripts import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))      # the script and its bench_cli
import flashmla_sparse_tests as script  # noqa: E402

from mlagen.compat import flash_mla as compat  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "flashmla_sparse_tests.py"

# A stand-in for FlashMLA's tests/: a test file of the same name with gen_testcase() and
# test_flash_mla(p), and a lib.py, both importing flash_mla as FlashMLA's do. Case i's outcome:
# "pass", "wrong" (is_correct False) or "raise".
FAKE_TEST_FILE = '''
import dataclasses

import flash_mla
import lib


@dataclasses.dataclass
class Raw:
    """The fields of FlashMLA's RawTestParamForDecode that the runner reads, and an outcome."""
    d_qk: int = 576
    num_runs: int = 0
    is_all_indices_invalid: bool = False
    have_zero_seqlen_k: bool = False
    extra_s_k: int | None = None
    extra_topk: int | None = None
    have_extra_topk_length: bool = False
    seed: int = -1
    outcome: str = "pass"

    def to_test_param(self):
        return self


SEEN = []


def gen_testcase():
    return [Raw(), Raw(d_qk=512), Raw(d_qk=512, extra_s_k=512, extra_topk=64), Raw(outcome="wrong"),
            Raw(is_all_indices_invalid=True), Raw(outcome="raise"), Raw(d_qk=512, have_zero_seqlen_k=True),
            Raw(num_runs=10),
            Raw(d_qk=512, num_runs=10, extra_s_k=16384, extra_topk=512, have_extra_topk_length=True)]


def test_flash_mla(p):
    SEEN.append(p)
    meta, _ = flash_mla.get_mla_metadata()
    print(f"case {p.seed}: metadata from {type(meta).__module__}")
    if p.outcome == "raise":
        raise RuntimeError("kernel said no")
    return lib.Result(p.outcome == "pass")
'''

FAKE_LIB = '''
import dataclasses

import flash_mla


@dataclasses.dataclass
class Result:
    is_correct: bool
'''


@pytest.fixture
def clean_imports():
    """Leaves sys.modules and sys.path as they were: the shim and FlashMLA's modules go again."""
    modules, path = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - modules:
        del sys.modules[name]
    sys.path[:] = path


@pytest.fixture
def checkout(tmp_path, clean_imports):
    """A stand-in FlashMLA checkout: its test folder with the sparse test file and lib.py."""
    tests = tmp_path / "FlashMLA" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_flash_mla_sparse_decoding.py").write_text(textwrap.dedent(FAKE_TEST_FILE))
    (tests / "lib.py").write_text(textwrap.dedent(FAKE_LIB))
    return tmp_path / "FlashMLA"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_help_says_how_to_get_the_checkout():
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    assert "git clone https://github.com/deepseek-ai/FlashMLA third_party/FlashMLA" in done.stdout
    for option in ("--flashmla DIR", "--group", "--cases A:B", "--out FILE"):
        assert option in done.stdout


def test_missing_checkout_exits_with_one_line(tmp_path):
    done = _run("--flashmla", str(tmp_path / "nowhere"))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"flashmla_sparse_tests.py: no FlashMLA checkout at {tmp_path / 'nowhere'} "
                                  f"({script.TEST_FILE} missing); get one with `git clone "
                                  "https://github.com/deepseek-ai/FlashMLA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would run")
def test_without_a_gpu_exits_with_one_line(checkout):
    done = _run("--flashmla", str(checkout))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("flashmla_sparse_tests.py needs a CUDA GPU")


def test_default_checkout_is_ignored_by_git():
    assert script.DEFAULT_CHECKOUT == ROOT / "third_party" / "FlashMLA"
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "third_party/FlashMLA/tests/lib.py"])
    assert ignored.returncode == 0


def test_cases_argument():
    assert script.case_range("3:9") == range(3, 9)
    assert script.case_range("3:") == range(3, sys.maxsize)
    assert script.case_range(":5") == range(0, 5)
    with pytest.raises(SystemExit):
        script.parse_args(["--cases", "7"])
    with pytest.raises(SystemExit):
        script.parse_args(["--group", "speed"])


def test_shim_maps_flash_mla_onto_mlagen(clean_imports):
    """`import flash_mla` (and lib's, and the test file's, names in it) reach mlagen.compat.flash_mla,
    even where FlashMLA's own module was imported first."""
    sys.modules["flash_mla"] = types.ModuleType("flash_mla")      # FlashMLA's, as if installed
    assert script.install_shim() is compat
    import flash_mla
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    assert flash_mla is compat
    assert get_mla_metadata is compat.get_mla_metadata and flash_mla_with_kvcache is compat.flash_mla_with_kvcache
    assert isinstance(flash_mla.get_mla_metadata()[0], compat.FlashMLASchedMeta)


def test_load_tests_imports_through_the_shim(checkout):
    module = script.load_tests(script.find_test_file(checkout))
    assert module.flash_mla is compat and module.lib.flash_mla is compat
    assert sys.path[0] == str(checkout / "tests")


def test_missing_package_exits_naming_it(checkout):
    path = checkout / "tests" / "test_flash_mla_sparse_decoding.py"
    path.write_text("import rich_but_not_installed_here\n" + path.read_text())
    with pytest.raises(SystemExit, match=r"^flashmla_sparse_tests.py: FlashMLA's tests import "
                                         r"'rich_but_not_installed_here', which is not installed here"):
        script.load_tests(path)


def test_groups_follow_flashmlas_list_order():
    """Correctness cases until the first corner case (all indices invalid or empty requests),
    corner cases until the first timed one, performance after; a case with the corner flags off
    after the first corner case (a sink-only corner case) stays corner."""
    Case = types.SimpleNamespace
    cases = [Case(num_runs=0, is_all_indices_invalid=False, have_zero_seqlen_k=False),
             Case(num_runs=0, is_all_indices_invalid=True, have_zero_seqlen_k=False),
             Case(num_runs=0, is_all_indices_invalid=False, have_zero_seqlen_k=False),
             Case(num_runs=0, is_all_indices_invalid=False, have_zero_seqlen_k=True),
             Case(num_runs=10, is_all_indices_invalid=False, have_zero_seqlen_k=False)]
    assert script.case_groups(cases) == ["correctness", "corner", "corner", "corner", "performance"]


def test_skip_reasons_name_what_mlagen_lacks():
    def case(**fields):
        return types.SimpleNamespace(**{"d_qk": 576, "extra_s_k": None, "extra_topk": None,
                                        "have_extra_topk_length": False, **fields})

    assert script.skip_reason(case()) is None
    assert script.skip_reason(case(d_qk=512)) == "FlashMLA's d_qk 512 FP8 layout is not built in mlagen"
    assert script.skip_reason(case(extra_s_k=512, extra_topk=64)) is None        # the extra cache runs
    assert script.skip_reason(case(d_qk=512, extra_topk=64, have_extra_topk_length=True)) == (
        "FlashMLA's d_qk 512 FP8 layout is not built in mlagen")


@pytest.fixture
def cpu_run(monkeypatch):
    """main() without its GPU parts: no GPU check, FlashMLA's torch settings left alone, a named GPU."""
    monkeypatch.setattr(script, "require_gpu", lambda name: None)
    monkeypatch.setattr(script, "use_flashmla_torch_settings", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Stand-in GPU")


def test_run_counts_each_group_and_writes_them(checkout, cpu_run, tmp_path, capsys):
    out = tmp_path / "counts.txt"
    assert script.main(["--flashmla", str(checkout), "--out", str(out)]) == 1        # two cases failed
    module = sys.modules["test_flash_mla_sparse_decoding"]
    assert [(p.seed, p.num_runs) for p in module.SEEN] == [(0, 0), (3, 0), (4, 0), (5, 0), (7, 0)]
    text = out.read_text()
    assert capsys.readouterr().out.endswith(text)
    lines = text.splitlines()
    assert lines[0] == f"FlashMLA's {script.TEST_FILE} (commit unknown) on mlagen.compat.flash_mla, Stand-in GPU"
    assert lines[1:6] == ["group          passed  failed  skipped",
                          "correctness         1       1        2",
                          "corner              1       1        1",
                          "performance         1       0        1",
                          "all                 3       2        4"]
    d512 = "FlashMLA's d_qk 512 FP8 layout is not built in mlagen"
    assert lines[6:10] == [
        "skipped:",
        f"  correctness       2  {d512}",
        f"  corner            1  {d512}",
        f"  performance       1  {d512}"]
    assert lines[10].startswith("performance: 1 cases, timing not run: FlashMLA times its own kernels")
    failed = "\n".join(lines[11:])
    assert lines[11] == "failed:"
    assert "  [3] correctness: Raw(" in failed and "      out or lse off FlashMLA's tolerances" in failed
    assert "      | case 3: metadata from mlagen.compat.flash_mla" in failed     # FlashMLA's output, kept
    assert "  [5] corner: Raw(" in failed and "      RuntimeError: kernel said no" in failed
    assert "case 0:" not in failed                                               # passed: not kept


def test_run_of_one_group_and_a_range(checkout, cpu_run, capsys):
    assert script.main(["--flashmla", str(checkout), "--group", "corner", "--group", "performance",
                        "--cases", "4:8"]) == 1
    module = sys.modules["test_flash_mla_sparse_decoding"]
    assert [p.seed for p in module.SEEN] == [4, 5, 7]
    out = capsys.readouterr().out
    assert "correctness         0       0        0" in out and "corner              1       1        1" in out
    assert "performance         1       0        0" in out
    assert script.main(["--flashmla", str(checkout), "--cases", ":1"]) == 0


def test_commit_is_the_checkouts_own(tmp_path):
    """A clone names its commit; an exported tree inside another repository names none (not the
    outer repository's)."""
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    assert script.checkout_commit(tmp_path) == f"commit {head.stdout.strip()}"
    (tmp_path / "FlashMLA").mkdir()
    assert script.checkout_commit(tmp_path / "FlashMLA") == "commit unknown"
