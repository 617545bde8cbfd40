"""C++ launchers (mlagen.launcher): the header's text, its host helpers against the Python
plan and dispatch (compiled and run on the CPU), and the examples/cpp_launcher build.
Compiling needs nvcc; running the example needs a GPU (tests/test_gpu_dropin.py)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlagen.dispatch import num_splits
from mlagen.launcher import _c_expr, emit_launcher, header_name, namespace, render_launcher
from mlagen.params import FIELDS
from mlagen.spec import Problem, Variant, naive
from mlagen.validate import SpecError, validate

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit) to compile C++")

PLANS = [
    validate(Problem(heads=16, mask="causal", lse=True), naive(arch="sm_80")),
    validate(Problem(heads=64, page_size=16, mask="none"), Variant(head_tile=8, q_tile=4, arch="sm_90")),
    validate(Problem(heads=8, dtype="fp16", page_size=1, mask="tree", lse=True),
             Variant(head_tile=4, q_tile=4, kv_split=3, warps=8, stages=1, arch="sm_120")),
    validate(Problem(heads=64), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, kv_split="balanced",
                                        arch="sm_90a")),
    validate(Problem(heads=64, lse=True), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, kv_split=4,
                                                  cluster=True, arch="sm_90a")),
    validate(Problem(heads=16, dtype="fp16"), Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8,
                                                      arch="sm_90a", part16=True)),
]
# (batch, seqlen_q, max_pages, sm_count, blocks_per_sm)
SHAPES = [(1, 1, 1, 132, 1), (1, 9, 64, 132, 2), (3, 33, 5, 188, 1), (64, 4, 300, 78, 3), (2, 64, 2048, 132, 1),
          (1, 9, 1024, 132, 1)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.variant.name)
def test_header_fills_every_field_once(plan):
    text = render_launcher(plan)
    struct = re.search(r"struct alignas\(8\) VerifyParams \{(.*?)\};", text, re.S).group(1)
    declared = [re.search(r"(\w+);", line.split("//")[0]) for line in struct.splitlines()]
    assert [m.group(1) for m in declared if m] == [f.name for f in FIELDS]
    for f in FIELDS:
        assert len(re.findall(rf"\bp\.{f.name} = ", text)) == 1, f.name
    assert f"namespace {namespace(plan)} {{" in text
    assert f"constexpr int kMaxMergeBlocks = {plan.max_merge_blocks};" in text
    # programmatic dependent launch only where the kernel has griddepcontrol (sm_90+)
    pdl = "true" if plan.arch.capability >= 90 else "false"
    assert f"constexpr bool kProgrammaticLaunch = {pdl};" in text and "cudaLaunchKernelExC(&config" in text


def test_emit_launcher_writes_beside_the_kernel(tmp_path):
    path = emit_launcher(PLANS[1], tmp_path)
    assert path == tmp_path / header_name(PLANS[1]) and path.read_text() == render_launcher(PLANS[1])
    mtime = path.stat().st_mtime_ns
    emit_launcher(PLANS[1], tmp_path)
    assert path.stat().st_mtime_ns == mtime, "an unchanged header is not rewritten"


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.variant.name)
def test_header_grid_is_the_plans_grid(plan):
    """The header's grid is plan.grid_expr() translated to C: evaluate it with C's integer
    division and compare with plan.grid (no nvcc needed)."""
    # merge_blocks(batch, seqlen_q), the header's function, stands for the plan's value
    grid = re.search(r"return dim3\((.*)\);", render_launcher(plan)).group(1)
    exprs = grid.replace("merge_blocks(batch, seqlen_q)", "merge_blocks").split(", ")
    assert exprs == [_c_expr(e).replace("merge_blocks(batch, seqlen_q)", "merge_blocks") for e in plan.grid_expr()]
    for batch, seqlen_q, *_ in SHAPES:
        for n in ((1, 7) if plan.uses_split else (1,)):
            env = {"batch": batch, "seqlen_q": seqlen_q, "num_splits": n}
            if plan.uses_split:
                env["merge_blocks"] = plan.merge_blocks(batch, seqlen_q)
            # C's a ? b : c as Python's conditional expression
            py = [re.sub(r"^(.+?) \? (.+?) : (.+)$", r"(\2) if (\1) else (\3)", e.replace("/", "//")) for e in exprs]
            got = tuple(eval(e, {}, dict(env)) for e in py)
            assert got == plan.grid(batch, seqlen_q, n)


@pytest.mark.parametrize("expr", ["max(S, 2)", "ceil(S / q)", "S % 3", "H * S"])
def test_untranslatable_grid_expression_is_refused(expr):
    with pytest.raises(ValueError, match="cannot translate grid expression"):
        _c_expr(expr)


def _compile(args: list[str], cwd: Path) -> None:
    done = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_nvcc
def test_host_helpers_match_python(tmp_path):
    # All three headers in one host-only translation unit: the shared struct is defined once.
    lines = ["#include <cstdio>"] + [f'#include "{emit_launcher(p, tmp_path).name}"' for p in PLANS]
    lines.append("int main() {")
    for p in PLANS:
        ns = f"mlagen::{namespace(p)}"
        for B, S, pages, sms, occ in SHAPES:
            lines.append(
                f"  {{ const int n = {ns}::default_num_splits({B}, {S}, {pages}, {sms}, {occ});"
                f" const dim3 g = {ns}::grid({B}, {S}, n);"
                f' std::printf("%d %u %u %u %zu %zu\\n", n, g.x, g.y, g.z,'
                f" {ns}::workspace_bytes({B}, {S}, n), {ns}::counters_bytes({B}, {S}, n)); }}")
    lines.append("  return 0;\n}")
    (tmp_path / "helpers.cpp").write_text("\n".join(lines) + "\n")
    _compile(["-std=c++17", "-o", "helpers", "helpers.cpp"], tmp_path)
    got = subprocess.run([str(tmp_path / "helpers")], capture_output=True, text=True, check=True).stdout.split("\n")
    k = 0
    for p in PLANS:
        for B, S, pages, sms, occ in SHAPES:
            n = num_splits(p.variant, p.problem.heads, B, S, pages * p.problem.page_size, sms, occ)
            ws = p.partial_rows(B, S, n) * (p.problem.dl * (2 if p.variant.part16 else 4) + 2 * 4)
            counters = 4 * p.row_groups(B, S) if p.split_launch(n) else 0
            want = [n, *p.grid(B, S, n), ws, counters]
            assert [int(x) for x in got[k].split()] == want, (p.variant.name, B, S, pages, sms, occ)
            k += 1


@needs_nvcc
def test_cpp_example_builds(tmp_path):
    done = subprocess.run(["make", "-C", str(ROOT / "examples" / "cpp_launcher"), f"BUILD={tmp_path}",
                            f"PYTHON={sys.executable}", "ARCH=sm_80"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "verify_example").exists()


def test_launcher_refuses_tma_variants():
    """The C++ launcher does not encode the cache's TMA descriptor: a tma variant is refused by name."""
    plan = validate(Problem(heads=64), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a",
                                               tma=True))
    with pytest.raises(SpecError, match="variant.tma: got True, expected False for the C\\+\\+ launcher"):
        render_launcher(plan)
