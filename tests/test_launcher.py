"""C++ launchers (mlagen.tools.launcher): the header's text, its host helpers against the Python
plan and dispatch (compiled and run on the CPU), and the examples/cpp_launcher build.
Compiling needs nvcc; running the example needs a GPU (tests/test_gpu_dropin.py)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlagen.codegen.render import render
from mlagen.dispatch import policy
from mlagen.dispatch.policy import dependent_in_graphs, num_splits, policy_for
from mlagen.dsl.arch import nvcc_arch_flags
from mlagen.dsl.spec import Problem, Variant, naive, parse_variant
from mlagen.plan import params
from mlagen.plan.params import FIELDS, POINTER_NAMES
from mlagen.plan.validate import SEGMENT_TILES, validate
from mlagen.tools.launcher import _c_expr, emit_launcher, header_name, namespace, render_launcher

ROOT = Path(__file__).resolve().parent.parent
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit) to compile C++")

TMA_PLAN = validate(Problem(heads=64, lse=True),
                    Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2, kv_split="balanced",
                            arch="sm_90a", partials="16bit", loads="tma", schedule="seesaw"))
PLANS = [
    validate(Problem(heads=16, mask="causal", lse=True), naive(arch="sm_80")),
    validate(Problem(heads=64, page_size=16, mask="none"), Variant(head_tile=8, q_tile=4, arch="sm_90")),
    validate(Problem(heads=8, dtype="fp16", page_size=1, mask="tree", lse=True),
             Variant(head_tile=4, q_tile=4, kv_split=3, warps=8, stages=1, arch="sm_120")),
    validate(Problem(heads=64), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, kv_split="balanced",
                                        arch="sm_90a")),
    validate(Problem(heads=64, lse=True), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, kv_split=4,
                                                  combine="cluster", arch="sm_90a")),
    validate(Problem(heads=16, dtype="fp16"), Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8,
                                                      arch="sm_90a", partials="16bit")),
    validate(Problem(heads=64), Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=2,
                                        arch="sm_90a", partials="16bit", loads="tma",
                                        schedule="seesaw")),   # adaptive, pairs
    validate(Problem(heads=16, lse=True), Variant(family="mma", head_tile=16, q_tile=4, block_n=64, warps=8,
                                                  kv_split="balanced", arch="sm_90a", partials="16bit",
                                                  rows="ragged")),   # partial rows over whole query tiles
    TMA_PLAN,
    validate(Problem(heads=16, dtype="fp16", page_size=128), Variant(family="mma", head_tile=16, q_tile=4, block_n=64,
                                                                     warps=8, arch="sm_90a", loads="tma")),
    # gathered keys (sparse verify): the one-token tile over 61-key pages of ds_mla rows, and naive
    validate(Problem(heads=128, page_size=61, mask="none", keys="gathered", kv_format="ds_mla", lse=True),
             Variant(family="mma", head_tile=64, q_tile=1, block_n=64, warps=8, stages=1, arch="sm_90a")),
    validate(Problem(heads=16, mask="none", keys="gathered"), naive(arch="sm_90")),
]
# (batch, seqlen_q, max_pages, sm_count, blocks_per_sm)
SHAPES = [(1, 1, 1, 132, 1), (1, 9, 64, 132, 2), (3, 33, 5, 188, 1), (64, 4, 300, 78, 3), (2, 64, 2048, 132, 1),
          (1, 9, 1024, 132, 1), (1, 9, 66, 132, 1)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.variant.name)
def test_header_fills_every_field_once(plan):
    text = render_launcher(plan)
    struct = re.search(r"struct alignas\(8\) VerifyParams \{(.*?)\};", text, re.S).group(1)
    declared = [re.search(r"(\w+);", line.split("//")[0]) for line in struct.splitlines()]
    assert [m.group(1) for m in declared if m] == [f.name for f in FIELDS]
    for f in FIELDS:
        assert len(re.findall(rf"\bp\.{f.name} = ", text)) == 1, f.name
    assert f"namespace {namespace(plan)} {{" in text
    assert f"constexpr int kMaxMergeBlocks = {plan.split.max_merge_blocks};" in text
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
    """The header's grid is KernelPlan.grid_expr() translated to C: evaluate it with C's integer
    division and compare with KernelPlan.grid (no nvcc needed)."""
    # merge_blocks(batch, seqlen_q), the header's function, stands for the plan's value
    grid = re.search(r"return dim3\((.*)\);", render_launcher(plan)).group(1)
    exprs = grid.replace("merge_blocks(batch, seqlen_q)", "merge_blocks").split(", ")
    assert exprs == [_c_expr(e).replace("merge_blocks(batch, seqlen_q)", "merge_blocks") for e in plan.grid_expr()]
    for batch, seqlen_q, *_ in SHAPES:
        for n in ((1, 7) if plan.uses_split else (1,)):
            env = {"batch": batch, "seqlen_q": seqlen_q, "num_splits": n}
            if plan.uses_split:
                env["merge_blocks"] = plan.split.merge_blocks(batch, seqlen_q)
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
                f' std::printf("%d %u %u %u %zu %zu %d\\n", n, g.x, g.y, g.z,'
                f" {ns}::workspace_bytes({B}, {S}, n), {ns}::counters_bytes({B}, {S}, n),"
                f" (int){ns}::default_programmatic({B}, {S}, {pages}, {sms})); }}")
    lines.append("  return 0;\n}")
    (tmp_path / "helpers.cpp").write_text("\n".join(lines) + "\n")
    _compile(["-std=c++17", "-o", "helpers", "helpers.cpp"], tmp_path)
    got = subprocess.run([str(tmp_path / "helpers")], capture_output=True, text=True, check=True).stdout.split("\n")
    k = 0
    for p in PLANS:
        for B, S, pages, sms, occ in SHAPES:
            device = policy_for(p.variant.arch, sms)          # the C++ header takes the SM count at run time
            n = num_splits(p.variant, p.problem.heads, B, S, pages * p.problem.page_size, device, occ)
            ws = p.split.partial_rows(B, S, n) * (p.problem.dl * (2 if p.split.part16 else 4) + 2 * 4)
            counters = 4 * p.split.row_groups(B, S) if p.split.split_launch(n) else 0
            programmatic = p.arch.capability >= 90 and dependent_in_graphs(
                p.variant, p.problem.heads, S, B, pages * p.problem.page_size, device)
            want = [n, *p.grid(B, S, n), ws, counters, int(programmatic)]
            assert [int(x) for x in got[k].split()] == want, (p.variant.name, B, S, pages, sms, occ)
            k += 1


@needs_nvcc
@pytest.mark.parametrize("options", [pytest.param(["ARCH=sm_80"], marks=pytest.mark.compile_matrix),
                                     ["ARCH=sm_90a", "TMA=1", "SEESAW=1", "PART16=1"]])
def test_cpp_example_builds(tmp_path, options):
    """The example builds for a plain target and for sm_90a's TMA seesaw kernel (its launcher
    encodes the tensor map; the wgmma kernel needs the arch-specific target without PTX). Each
    build runs nvcc on a whole kernel (5-7 s): the plain one is in the compile matrix."""
    done = subprocess.run(["make", "-C", str(ROOT / "examples" / "cpp_launcher"), f"BUILD={tmp_path}",
                            f"PYTHON={sys.executable}", *options], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "verify_example").exists()


def test_nvcc_flags_keep_arch_specific_targets_without_ptx():
    assert nvcc_arch_flags("sm_90") == "-arch=sm_90"
    assert nvcc_arch_flags("sm_90a") == "-gencode arch=compute_90a,code=sm_90a"
    assert "nvcc -gencode arch=compute_90a,code=sm_90a --use_fast_math" in render_launcher(TMA_PLAN)


@needs_nvcc
def test_an_arch_specific_kernel_built_for_another_target_names_the_flags(tmp_path):
    """An emitted sm_90a kernel under `-arch=sm_90a` (which also builds compute_90 PTX, without
    wgmma) stops at its own #error naming the right flags, not at ptxas; with them it builds."""
    (tmp_path / "k.cu").write_text(render(TMA_PLAN))
    done = subprocess.run([NVCC, "-arch=sm_90a", "-c", "k.cu"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert "this kernel is for sm_90a alone; build it with nvcc -gencode arch=compute_90a,code=sm_90a" in done.stderr
    assert "ptxas" not in done.stderr
    _compile([*nvcc_arch_flags("sm_90a").split(), "-c", "k.cu"], tmp_path)
    assert "#error" not in render(PLANS[1])                      # sm_90: no guard


def test_tma_header_encodes_the_runtimes_tensor_map():
    """A TMA variant's header encodes the descriptor mlagen/runtime/tensormap.py does (dtype, 3 dims,
    64-dim x block_n-row boxes, 128-byte swizzle), and `launch` passes kv_map on; other headers
    take kv_map too and pass null."""
    text = render_launcher(TMA_PLAN)
    assert "constexpr bool kUsesTma = true;" in text and "inline cudaError_t make_kv_map(" in text
    assert "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3," in text and "const cuuint32_t box[3] = {64, 64, 1};" in text
    assert "CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B" in text
    assert "p.kv_map = kUsesTma ? kv_map : nullptr;" in text
    assert "CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3," in render_launcher(PLANS[-3])
    plain = render_launcher(PLANS[1])
    assert "constexpr bool kUsesTma = false;" in plain and "<cuda.h>" not in plain
    assert "make_kv_map(const void*, long long, long long, int, void*) { return cudaSuccess; }" in plain
    assert ("bool programmatic = false, const void* kv_map = nullptr,\n"
            "    float kv_scale = 1.0f, const float* kv_scale_ptr = nullptr, const float* q_scale_ptr = nullptr,\n"
            "    const int* q_counts = nullptr, const int* indices = nullptr, long long idx_stride_b = 0,\n"
            "    long long idx_stride_s = 0, int topk = 0, const int* topk_length = nullptr)") in plain
    assert "p.q_counts = q_counts;" in plain and "p.indices = kGathered ? indices : nullptr;" in plain
    gathered = render_launcher(PLANS[-2])
    assert "constexpr bool kGathered = true;" in gathered and "max_pages = ceil(topk / 61)" in gathered
    assert "(kGathered ? !indices || topk < 1 : !block_table || !cache_seqlens)" in gathered
    # the fp8_ws schedule's e4m3 cache: bytes, 128-byte boxes, 16-byte aligned strides, 384 threads
    ws = render_launcher(validate(Problem(kv_format="e4m3"),
                                  parse_variant("mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ws_sm90a")))
    assert "CU_TENSOR_MAP_DATA_TYPE_UINT8, 3," in ws and "const cuuint32_t box[3] = {128, 64, 1};" in ws
    assert "constexpr cuuint64_t kElemBytes = 1;" in ws and "kv_stride_row % 16 != 0" in ws
    assert "constexpr int kThreads = 384;" in ws and "constexpr int kThreads = 256;" in text


def test_header_refuses_a_balanced_launch_past_its_work_list():
    """The header's launch refuses, as the runtime does, a balanced launch whose block table could
    take the device's int work list past policy.BALANCED_LIST_POSITIONS."""
    text = render_launcher(TMA_PLAN)
    assert f"constexpr long long kBalancedListPositions = {policy.BALANCED_LIST_POSITIONS};" in text
    assert "constexpr int kBlockN = 64;" in text and f"constexpr int kSegmentTiles = {SEGMENT_TILES};" in text
    assert ("if (kBalanced && (long long)batch * (table_tiles(max_pages) + kSegmentTiles) > "
            "kBalancedListPositions)") in text
    assert "return ((long long)max_pages * kPageSize + kBlockN - 1) / kBlockN;" in text


@needs_nvcc
def test_tma_arguments_are_refused_before_any_cuda_call(tmp_path):
    """make_kv_map and launch refuse a missing or misaligned tensor map, cache or stride with
    cudaErrorInvalidValue, without a driver (this runs on the CPU; the GPU test of
    examples/cpp_launcher makes and uses a valid one)."""
    ns = f"mlagen::{namespace(TMA_PLAN)}"
    D = TMA_PLAN.problem.head_dim
    calls = [f"{ns}::make_kv_map(kv, {64 * D}, {D}, 4, map + 16)",          # map not 64-byte aligned
             f"{ns}::make_kv_map(nullptr, {64 * D}, {D}, 4, map)",
             f"{ns}::make_kv_map(kv + 8, {64 * D}, {D}, 4, map)",           # cache not 16-byte aligned
             f"{ns}::make_kv_map(kv, {64 * D}, {D} + 4, 4, map)",           # row stride not 16 bytes
             f"{ns}::make_kv_map(kv, {32 * D}, {D}, 4, map)",               # pages overlap
             f"{ns}::make_kv_map(kv, {64 * D}, {D}, 0, map)",
             f"{ns}::launch(kv, 8, 8, 8, kv, {64 * D}, {D}, 4, (const int*)kv, 8, 1, (const int*)kv, nullptr, 0, 0, "
             "kv, 8, 8, 8, (float*)kv, 1, 1, 1.f, 1, kv, (unsigned*)kv, 0, false, nullptr)",
             # a valid map, but 2 requests of 2^31 tiles: past what the balanced work list counts
             f"{ns}::launch(kv, 8, 8, 8, kv, {64 * D}, {D}, 4, (const int*)kv, 8, 2147483647, (const int*)kv, nullptr, "
             "0, 0, kv, 8, 8, 8, (float*)kv, 2, 1, 1.f, 1, kv, (unsigned*)kv, 0, false, map)"]
    lines = ["#include <cstdio>", f'#include "{emit_launcher(TMA_PLAN, tmp_path).name}"',
             f'extern "C" void {TMA_PLAN.main_kernel}(mlagen::VerifyParams) {{}}   // never launched here',
             "int main() {",
             "  alignas(64) static unsigned char buf[4096];", "  unsigned char *map = buf, *kv = buf;"]
    lines += [f'  std::printf("%d\\n", (int){c});' for c in calls] + ["  return 0;\n}"]
    (tmp_path / "tma_args.cpp").write_text("\n".join(lines) + "\n")
    _compile(["-std=c++17", "-o", "tma_args", "tma_args.cpp"], tmp_path)
    got = subprocess.run([str(tmp_path / "tma_args")], capture_output=True, text=True, check=True).stdout.split()
    assert got == ["1"] * len(calls)   # cudaErrorInvalidValue


def test_pointers_are_packed_by_their_field_names():
    """`params.pointers` orders a dict keyed by the pointer fields' names as the struct does, and
    refuses a dict that misses one."""
    values = {name: 16 * (i + 1) for i, name in enumerate(reversed(POINTER_NAMES))}
    assert params.pointers(values) == tuple(values[name] for name in POINTER_NAMES)
    with pytest.raises(KeyError):
        params.pointers({name: 0 for name in POINTER_NAMES[1:]})
