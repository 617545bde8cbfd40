"""FlashMLA's own sparse-decoding tests on mlagen: FlashMLA's tests/test_flash_mla_sparse_decoding.py
(its case list, data, reference and tolerances) with its `flash_mla` module replaced by
mlagen.compat.flash_mla, on this machine's GPU.

    git clone https://github.com/deepseek-ai/FlashMLA third_party/FlashMLA
    PYTHONPATH=. python3 benchmarks/flashmla_sparse_tests.py [--flashmla DIR] [--group G]... [--cases A:B]
                                                             [--out FILE]

The checkout needs no build: only FlashMLA's Python test files run (the test file, tests/lib.py,
tests/ref.py, tests/quant.py, tests/kernelkit/). The one compiled module among their imports is
`flash_mla` (the test file and lib.py import it); this script puts mlagen.compat.flash_mla in
sys.modules under that name before it loads them, so their calls of get_mla_metadata and
flash_mla_with_kvcache reach mlagen. They also import rich, numpy and triton (kernelkit's timing
helpers), which must be installed.

FlashMLA's file is a main() over the list its gen_testcase() returns, not a pytest module. This
script runs that list through the file's own test_flash_mla(), in the list's order, with the
seeds its main() gives (a case's seed is its place in the list) and its main()'s torch settings
(bf16 default dtype, new tensors on cuda:0, TF32 matmuls). The list holds three groups, in this
order:

  correctness   d_qk 576 and 512, with and without the extra cache and topk_length, sinks on
  corner        all indices invalid, empty requests, no attention sink
  performance   the production shapes (V3.2, MODEL1) and the peak ones: their correctness
                check runs, their timing does not (FlashMLA times its own kernels, found by
                name in a profile)

A case mlagen cannot run is skipped with the reason: d_qk 512 (FlashMLA's MODEL1 FP8 layout).
A case passes when the file's checks of out and lse (kernelkit's
check_is_allclose with its tolerances) pass, and fails when they do not or when the call raises
(the error is the reason). FlashMLA's output for each case is kept, and printed for the failed ones.

--group runs only the named groups; --cases A:B only the list's cases A..B-1 (positions, as the
progress lines print them), to split a long run. Prints, and writes to --out FILE as well:
passed / failed / skipped per group, each skip reason with its count, each failure with its
case and reason. Exits 1 when a case failed, 0 otherwise; without the checkout or a CUDA GPU it
exits with one line saying which.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.util
import io
import subprocess
import sys
import traceback
from pathlib import Path
from types import ModuleType

from bench_cli import ROOT, parser, require_gpu

DEFAULT_CHECKOUT = ROOT / "third_party" / "FlashMLA"
TEST_FILE = Path("tests") / "test_flash_mla_sparse_decoding.py"
GROUPS = ("correctness", "corner", "performance")
D512 = "FlashMLA's d_qk 512 FP8 layout is not built in mlagen"
UNTIMED = ("timing not run: FlashMLA times its own kernels (flash_fwd_splitkv_mla_fp8_sparse_kernel) by name in a "
           "profile; each case's correctness check ran")
OUTPUT_LINES = 30     # FlashMLA's output kept for a failed case: its last lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser(__file__, __doc__)
    p.add_argument("--flashmla", type=Path, default=DEFAULT_CHECKOUT, metavar="DIR",
                   help=f"the FlashMLA checkout (default {DEFAULT_CHECKOUT.relative_to(ROOT)})")
    p.add_argument("--group", action="append", choices=GROUPS, help="run only this group (repeatable)")
    p.add_argument("--cases", type=case_range, metavar="A:B", help="run only the list's cases A..B-1")
    p.add_argument("--out", type=Path, metavar="FILE", help="also write the counts to FILE")
    return p.parse_args(argv)


def case_range(text: str) -> range:
    """An argparse type: "A:B" (either end may be left out) as range(A, B)."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return range(int(start) if start else 0, int(stop) if stop else sys.maxsize)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B, two positions in the list") from None


def find_test_file(checkout: Path) -> Path:
    """FlashMLA's sparse-decoding test file in `checkout`; exits with one line where it is missing."""
    path = checkout / TEST_FILE
    if not path.is_file():
        raise SystemExit(f"{Path(__file__).name}: no FlashMLA checkout at {checkout} ({TEST_FILE} missing); get one "
                         f"with `git clone https://github.com/deepseek-ai/FlashMLA {checkout}`, or pass --flashmla DIR")
    return path


def install_shim() -> ModuleType:
    """Put mlagen.compat.flash_mla in sys.modules as `flash_mla` (replacing FlashMLA's own, if it
    was imported) and return it: FlashMLA's tests then call mlagen's get_mla_metadata and
    flash_mla_with_kvcache."""
    from mlagen.compat import flash_mla

    sys.modules["flash_mla"] = flash_mla
    return flash_mla


def load_tests(path: Path) -> ModuleType:
    """FlashMLA's test file at `path` as a module, its folder first on sys.path (for lib, ref,
    quant and kernelkit) and the shim installed; exits with one line naming a missing package."""
    install_shim()
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:
        raise SystemExit(f"{Path(__file__).name}: FlashMLA's tests import {e.name!r}, which is not installed "
                         f"here ({e})") from None
    return module


def use_flashmla_torch_settings() -> None:
    """The torch settings FlashMLA's main() makes before it runs its cases, but for its CPU thread
    count, which no result depends on."""
    import torch

    device = torch.device("cuda:0")
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(device)
    torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")


def case_groups(cases: list) -> list[str]:
    """Each case's group. gen_testcase lists its correctness cases, then its corner cases (the
    first of which has all indices invalid), then its performance cases (num_runs > 0)."""
    groups, group = [], "correctness"
    for case in cases:
        if case.num_runs > 0:
            group = "performance"
        elif group == "correctness" and (case.is_all_indices_invalid or case.have_zero_seqlen_k):
            group = "corner"
        groups.append(group)
    return groups


def skip_reason(case) -> str | None:
    """Why mlagen cannot run `case` (a RawTestParamForDecode): the layout it needs that mlagen
    lacks; None where it can run (the extra cache included)."""
    return D512 if case.d_qk != 576 else None


@dataclasses.dataclass
class Failure:
    """A failed case: its place in the list, group, parameters, reason and FlashMLA's output."""

    index: int
    group: str
    case: object
    reason: str
    output: str


@dataclasses.dataclass
class Tally:
    """What a run found: per group a Counter of passed / failed / skipped, the skips per (group,
    reason), the failures, and how many performance cases ran untimed."""

    counts: dict[str, collections.Counter] = dataclasses.field(
        default_factory=lambda: {g: collections.Counter() for g in GROUPS})
    skips: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[Failure] = dataclasses.field(default_factory=list)
    untimed: int = 0


def run_case(module: ModuleType, case, seed: int) -> tuple[bool, str, str]:
    """(passed, reason, FlashMLA's output) of one case through the file's test_flash_mla, with
    `seed` and its timing off."""
    param = dataclasses.replace(case, seed=seed, num_runs=0).to_test_param()
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            passed = bool(module.test_flash_mla(param).is_correct)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}", output.getvalue() + traceback.format_exc()
    return passed, "" if passed else "out or lse off FlashMLA's tolerances", output.getvalue()


def run_cases(module: ModuleType, groups: tuple[str, ...] = GROUPS, cases: range | None = None) -> Tally:
    """Runs the file's case list (the `groups`, the positions in `cases`), printing a line per
    case run, and returns the tally."""
    listed = module.gen_testcase()
    tally = Tally()
    for index, (case, group) in enumerate(zip(listed, case_groups(listed), strict=True)):
        if group not in groups or (cases is not None and index not in cases):
            continue
        reason = skip_reason(case)
        if reason is not None:
            tally.counts[group]["skipped"] += 1
            tally.skips[group, reason] += 1
            continue
        passed, why, output = run_case(module, case, index)
        tally.counts[group]["passed" if passed else "failed"] += 1
        if group == "performance":
            tally.untimed += 1
        if not passed:
            tally.failures.append(Failure(index, group, case, why, output))
        print(f"[{index}/{len(listed)}] {group} {'passed' if passed else 'FAILED: ' + why}: {case}", flush=True)
    return tally


def checkout_commit(checkout: Path) -> str:
    """The checkout's commit, or "commit unknown" where it is not a clone of its own (an exported
    tree has no .git, and git would name the commit of a repository around it)."""
    if not (checkout / ".git").exists():
        return "commit unknown"
    try:
        done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "commit unknown"
    return f"commit {done.stdout.strip()}"


def report(tally: Tally, title: str) -> str:
    """The counts as text: a table per group, the skip reasons, the untimed note, the failures."""
    lines = [title, f"{'group':<13}{'passed':>8}{'failed':>8}{'skipped':>9}"]
    total: collections.Counter = collections.Counter()
    for group in GROUPS:
        counts = tally.counts[group]
        total.update(counts)
        lines.append(f"{group:<13}{counts['passed']:>8}{counts['failed']:>8}{counts['skipped']:>9}")
    lines.append(f"{'all':<13}{total['passed']:>8}{total['failed']:>8}{total['skipped']:>9}")
    if tally.skips:
        lines.append("skipped:")
        lines += [f"  {group:<13}{n:>6}  {reason}" for (group, reason), n in tally.skips.items()]
    if tally.untimed:
        lines.append(f"performance: {tally.untimed} cases, {UNTIMED}")
    if tally.failures:
        lines.append("failed:")
        for f in tally.failures:
            lines.append(f"  [{f.index}] {f.group}: {f.case}")
            lines.append(f"      {f.reason}")
            lines += [f"      | {line}" for line in f.output.splitlines()[-OUTPUT_LINES:]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    path = find_test_file(args.flashmla)
    require_gpu(__file__)
    module = load_tests(path)
    use_flashmla_torch_settings()
    import torch

    tally = run_cases(module, tuple(args.group or GROUPS), args.cases)
    text = report(tally, f"FlashMLA's {TEST_FILE} ({checkout_commit(args.flashmla)}) on mlagen.compat.flash_mla, "
                         f"{torch.cuda.get_device_name()}")
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
