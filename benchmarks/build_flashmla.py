"""Build FlashMLA's sm90 decode kernels from a checkout, trimmed to what the bench compares against:
its dense bf16 decode and its sparse FP8 decode (both cache layouts, 64 and 128 heads), with the
scheduling and combine kernels they call. The result is FlashMLA's own `flash_mla` package,
importable with the checkout on sys.path, whose calls reach those kernels.

    git clone https://github.com/deepseek-ai/FlashMLA third_party/FlashMLA
    git -C third_party/FlashMLA submodule update --init csrc/cutlass
    python3 benchmarks/build_flashmla.py [--flashmla DIR] [--stage objects|module|all] [--jobs N] [--dry-run]

Two stages, so that the long one runs where time is cheap:

  objects   nvcc compiles the kernel files to DIR/build/*.o for sm_90a. No torch and no GPU are
            needed: any machine with nvcc 12.9 or later (13.x for a CUDA 13 torch) runs it.
  module    compiles a binding of FlashMLA's dense and sparse decode entry points
            (csrc/api/dense_decode.h, csrc/api/sparse_decode.h) against this machine's torch and
            links it with the objects into DIR/flash_mla/cuda.so. Needs a CUDA build of torch;
            takes about a minute.

FlashMLA's sm100 kernels and its prefill kernels are not built: their entry points in the module
raise, naming the kernel, and FlashMLA's sm90 dispatch never reaches them. fp16 is compiled out
(FLASH_MLA_DISABLE_FP16), as FlashMLA's build allows. Objects that are newer than their sources
are kept, so a rerun compiles only what changed.

Exits 1 with one line saying what is missing when the checkout or its CUTLASS headers are absent,
or when a compile fails (its command and the compiler's last lines printed).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_cli import ROOT, parser

DEFAULT_CHECKOUT = ROOT / "third_party" / "FlashMLA"
STAGES = ("objects", "module", "all")

KERNEL_SOURCES = (
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu",
    "csrc/sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu",
)
INCLUDE_DIRS = ("csrc", "csrc/kerutils/include", "csrc/sm90", "csrc/cutlass/include",
                "csrc/cutlass/tools/util/include")
DEFINES = ("-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16")
NVCC_FLAGS = ("-O3", "-std=c++20", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
              "--use_fast_math", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90a,code=sm_90a")
CXX_FLAGS = ("-O3", "-std=c++20", "-Wno-deprecated-declarations")
MODULE_NAME = "cuda"          # FlashMLA's Python imports its extension as flash_mla.cuda

# The module's binding: FlashMLA's decode entry points under the names its Python calls.
BINDING = """\
#include <pybind11/pybind11.h>

#include "sparse_decode.h"
#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA sm90 decode (dense bf16, sparse FP8), built by mlagen's benchmarks/build_flashmla.py";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
"""

# The kernels this build leaves out that sparse_decode.h's sm100 dispatch names, each defined as
# a call that raises naming it, in a file of their own (a specialization must precede every use
# in its translation unit, and the binding's headers use them).
STUBS = """\
#include <c10/util/Exception.h>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace {
[[noreturn]] void not_built(const char* kernel) {
    TORCH_CHECK(false, kernel, " is not in this FlashMLA build (mlagen's build_flashmla.py builds sm90 decode)");
}
}

namespace sm100::decode::head64 {
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams&) {
    not_built("sm100 sparse decode (head64, V32)");
}
template<> void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams&) {
    not_built("sm100 sparse decode (head64, MODEL1)");
}
}

namespace sm100::fwd_for_small_topk::head128 {
template<> void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
        const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV>&) {
    not_built("sm100 sparse decode (head128, d_qk 512)");
}
}
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser(__file__, __doc__)
    p.add_argument("--flashmla", type=Path, default=DEFAULT_CHECKOUT, metavar="DIR",
                   help=f"the FlashMLA checkout (default {DEFAULT_CHECKOUT.relative_to(ROOT)})")
    p.add_argument("--stage", choices=STAGES, default="all", help="what to build (default all)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="nvcc processes at once (default: the CPU count)")
    p.add_argument("--nvcc", default="nvcc", help="the nvcc to run (default: nvcc on PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    return p.parse_args(argv)


def missing(checkout: Path) -> str | None:
    """What the checkout lacks for this build, or None."""
    if not (checkout / "csrc" / "api" / "sparse_decode.h").is_file():
        return f"no FlashMLA checkout at {checkout} (git clone https://github.com/deepseek-ai/FlashMLA {checkout})"
    if not (checkout / "csrc" / "cutlass" / "include" / "cute" / "tensor.hpp").is_file():
        return (f"{checkout}/csrc/cutlass has no CUTLASS headers "
                f"(git -C {checkout} submodule update --init csrc/cutlass)")
    return None


def build_dir(checkout: Path) -> Path:
    return checkout / "build"


def object_path(checkout: Path, source: str) -> Path:
    """Where a kernel source's object goes: build/ under the checkout, named by its path."""
    return build_dir(checkout) / (source.removeprefix("csrc/").replace("/", "__").removesuffix(".cu") + ".o")


def nvcc_command(checkout: Path, source: str, nvcc: str) -> list[str]:
    includes = [f"-I{checkout / d}" for d in INCLUDE_DIRS]
    return [nvcc, *NVCC_FLAGS, *DEFINES, *includes, "-c", str(checkout / source),
            "-o", str(object_path(checkout, source))]


def stale(checkout: Path, source: str) -> bool:
    obj = object_path(checkout, source)
    return not obj.is_file() or obj.stat().st_mtime < (checkout / source).stat().st_mtime


def run(command: list[str]) -> str | None:
    """Run a compile; None when it succeeds, else the command and the compiler's last lines."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
    return f"{shlex.join(command)}\n{tail}"


def build_objects(checkout: Path, jobs: int, nvcc: str, dry_run: bool) -> list[str]:
    """Compile the stale kernel sources, `jobs` at a time; the failures' reports."""
    build_dir(checkout).mkdir(exist_ok=True)
    todo = [s for s in KERNEL_SOURCES if stale(checkout, s)]
    print(f"objects: {len(KERNEL_SOURCES) - len(todo)} up to date, {len(todo)} to compile", flush=True)
    commands = [nvcc_command(checkout, s, nvcc) for s in todo]
    if dry_run:
        for c in commands:
            print(shlex.join(c))
        return []
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        failures = [f for f in pool.map(run, commands) if f]
    for source in todo:
        print(f"  {'compiled' if not stale(checkout, source) else 'FAILED  '} {source}", flush=True)
    return failures


def build_module(checkout: Path, dry_run: bool) -> list[str]:
    """Compile the binding against this machine's torch and link it with the objects into
    flash_mla/cuda.so; the failures' reports."""
    objects = [object_path(checkout, s) for s in KERNEL_SOURCES]
    absent = [str(o) for o in objects if not o.is_file()]
    if absent:
        return [f"module: objects missing (run --stage objects first): {', '.join(absent)}"]
    binding = build_dir(checkout) / "flashmla_decode_binding.cpp"
    stubs = build_dir(checkout) / "flashmla_sm100_stubs.cpp"
    target = checkout / "flash_mla" / f"{MODULE_NAME}.so"
    if dry_run:
        print(f"module: {binding}, {stubs} + {len(objects)} objects -> {target} (torch.utils.cpp_extension.load)")
        return []
    binding.write_text(BINDING)
    stubs.write_text(STUBS)
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return ["module: this torch finds no CUDA toolkit (CUDA_HOME); the module stage runs on the GPU machine"]
    work = build_dir(checkout) / "module"
    work.mkdir(exist_ok=True)
    # CUDA 13 keeps libcu++ (cuda/std/..., which CUTLASS includes) under include/cccl: nvcc looks
    # there, the host compiler needs it named
    cccl = Path(cpp_extension.CUDA_HOME) / "include" / "cccl"
    try:
        cpp_extension.load(
            name=MODULE_NAME, sources=[str(binding), str(stubs)], build_directory=str(work), with_cuda=True,
            extra_cflags=[*CXX_FLAGS, *DEFINES],
            extra_include_paths=[str(checkout / d) for d in INCLUDE_DIRS] + [str(checkout / "csrc" / "api")]
            + ([str(cccl)] if cccl.is_dir() else []),
            extra_ldflags=[*map(str, objects), "-lcudart"], verbose=False)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        return [f"module: {e}"]
    target.unlink(missing_ok=True)
    (work / f"{MODULE_NAME}.so").rename(target)
    print(f"module: {target}", flush=True)
    return []


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    checkout = args.flashmla.resolve()
    reason = missing(checkout)
    if reason:
        print(f"build_flashmla.py: {reason}", file=sys.stderr)
        return 1
    failures = []
    if args.stage in ("objects", "all"):
        failures += build_objects(checkout, args.jobs, args.nvcc, args.dry_run)
    if args.stage in ("module", "all") and not failures:
        failures += build_module(checkout, args.dry_run)
    for f in failures:
        print(f"build_flashmla.py: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
