"""Every kernel's source opens its namespace once, defines its constants once, in the traits
block ahead of every fragment, carries no arithmetic that a plan value makes degenerate, and
runs its segments as named device functions rather than long lambdas: checked on the rendered
source of every preset variant and of one kernel of each schedule no preset ships."""

from __future__ import annotations

import re

import pytest

from mlagen.codegen.render import render, template_dir
from mlagen.dispatch.presets import PRESETS
from mlagen.dsl.arch import CI_ARCHS
from mlagen.dsl.spec import Problem, parse_variant
from mlagen.plan.validate import validate

# One kernel of each schedule or key source that no preset ships: the producer tiles over FP8
# caches (fp8_ws, fp8_mma, fp8_ldg), the P exchange, and gathered keys.
OTHER_JOBS = [
    ("fp8_ws", Problem(heads=64, kv_format="e4m3", lse=True), "mma_ht64_qt1_bn64_w8_st2_spa_tma_ws_sm90a"),
    ("fp8_mma", Problem(heads=64, kv_format="e4m3", q_format="e4m3", lse=True),
     "mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_f8_sm90a"),
    ("fp8_ldg", Problem(heads=64, kv_format="ds_mla", lse=True), "mma_ht64_qt1_bn64_w8_st2_spb_lg_sm90a"),
    ("fp8_ldg-gathered", Problem(heads=128, kv_format="ds_mla", lse=True, keys="gathered", mask="none"),
     "mma_ht64_qt1_bn64_w8_st2_spa_lg_sm90a"),
    ("p_exchange", Problem(heads=64, lse=True), "mma_ht64_qt1_bn64_w8_st1_sp5_cl_px_sm90a"),
    ("gathered", Problem(heads=64, kv_format="ds_mla", lse=True, keys="gathered", mask="none"),
     "mma_ht64_qt1_bn64_w8_st1_spa_sm90a"),
]
JOBS = sorted({(preset.name, v.name): (preset.name, preset.problem, v) for preset in PRESETS.values()
               for arch in CI_ARCHS for v in preset.variants(arch)}.values(),
              key=lambda job: (job[0], job[2].name)) + [(label, p, parse_variant(n)) for label, p, n in OTHER_JOBS]
# A namespace-scope constant: `constexpr <type> NAME =` at the start of a line.
CONSTANT = re.compile(r"^constexpr\s+(?:int|bool|float|unsigned)\s+(\w+)\s*=", re.M)
# Arithmetic by a unit: what rendering a plan value of 1 into a formula leaves.
DEGENERATE = re.compile(r"/ 1\b|\* 1\b|% 1\b|\+ 1 - 1\b|\(1\) \*")
# Constants that fragments once redefined for themselves, now the traits block's HT, QT, ROWS,
# WARPS and HEAD_TILES.
RETIRED = ("MERGE_WARPS", "GROUP_ROWS", "SLOT_HEAD_TILES", "SLOT_Q_TILE")


def _code(source: str) -> str:
    """`source` without its comments."""
    return re.sub(r"//[^\n]*", "", source)


def _traits(source: str, namespace: str) -> str:
    """The traits block: from the namespace's opening to the first device function."""
    start = source.index(f"namespace {namespace} {{")
    return source[start:source.index("__device__", start)]


@pytest.fixture(params=JOBS, ids=lambda job: f"{job[0]}-{job[2].name}")
def kernel(request):
    _, problem, variant = request.param
    plan = validate(problem, variant)
    return plan, render(plan)


def test_one_namespace_opened_once(kernel):
    plan, source = kernel
    opened = re.findall(r"^namespace\s+(\w+)\s*\{", source, re.M)
    assert opened == [plan.name], f"namespaces opened: {opened}"
    assert "mlagen_mlagen_" not in source


def test_no_degenerate_arithmetic(kernel):
    _, source = kernel
    hits = [line.strip() for line in _code(source).splitlines() if DEGENERATE.search(line)]
    assert not hits, "arithmetic by a unit:\n" + "\n".join(hits)


def test_constants_are_defined_once_in_the_traits_block_first(kernel):
    plan, source = kernel
    traits = CONSTANT.findall(_traits(source, plan.name))
    assert {"H", "DL", "WARPS", "THREADS", "HT", "QT", "ROWS", "HEAD_TILES"} <= set(traits)
    defined = CONSTANT.findall(source)
    twice = sorted({name for name in defined if defined.count(name) > 1})
    assert not twice, f"constants defined more than once: {twice}"
    assert not [name for name in RETIRED if re.search(rf"\b{name}\b", source)]


# The kernel template's own constants, which the traits block emits after the shared ones.
KERNEL_CONSTANTS = re.compile(r"\{% macro kernel_constants\(\) -?%\}(.*?)\{%-? endmacro %\}", re.S)
# A constant whose value a Jinja expression renders: one read from the plan.
FROM_PLAN = re.compile(r"^constexpr\s[^;]*\{\{", re.M)


def test_fragments_neither_open_namespaces_nor_define_plan_constants():
    """Only common.cuh.j2 opens the kernel's namespace (and includes the traits block first in
    it); no other template defines a constant that traits.cuh.j2 defines, a fragment defines no
    constant from the plan, and a kernel's template defines those of its constants that come
    from the plan in kernel_constants, the macro the traits block emits."""
    traits = set(CONSTANT.findall((template_dir() / "traits.cuh.j2").read_text()))
    problems = []
    for path in sorted(template_dir().glob("*.j2")):
        if path.name in ("traits.cuh.j2", "launcher.h.j2"):
            continue
        text = path.read_text()
        if path.name != "common.cuh.j2" and re.search(r"^namespace\s", text, re.M):
            problems.append(f"{path.name} opens a namespace")
        again = traits & set(CONSTANT.findall(text))
        if again:
            problems.append(f"{path.name} redefines {sorted(again)}")
        if path.name.endswith(".cuh.j2") and FROM_PLAN.search(text):
            problems.append(f"{path.name} defines a constant from the plan: {FROM_PLAN.search(text).group(0)}")
        if path.name.endswith(".cu.j2"):
            outside = FROM_PLAN.findall(KERNEL_CONSTANTS.sub("", text))
            if not KERNEL_CONSTANTS.search(text) or outside:
                problems.append(f"{path.name}: plan constants outside kernel_constants: {outside}")
    assert not problems, "\n".join(problems)


# A lambda whose body opens on its line: `[&](...) {`, `[](...) -> T {`.
LAMBDA = re.compile(r"^(\s*)\S.*\[[&=]?\]\s*\([^)]*\)[^;{]*\{\s*(?://.*)?$")
LONGEST_LAMBDA = 40   # lines: a helper's size, not a phase of the kernel


def _lambda_lengths(source: str) -> list[tuple[int, str]]:
    """(lines, opening line) of each lambda in `source`: up to the closing brace at its indent."""
    lines = source.splitlines()
    found = []
    for i, line in enumerate(lines):
        if m := LAMBDA.match(line):
            end = next(j for j in range(i + 1, len(lines)) if re.match(rf"{m.group(1)}\}}", lines[j]))
            found.append((end - i, line.strip()))
    return found


def test_segments_are_named_device_functions(kernel):
    """The mma kernels' segment (one row group's share of the work) is a device function of
    its own over a context struct, and no lambda anywhere runs past LONGEST_LAMBDA lines."""
    plan, source = kernel
    if plan.template in ("mma.cu.j2", "mma_transposed.cu.j2"):
        assert re.search(r"^__device__ __forceinline__ void segment\(const VerifyParams& p, const Block\w+& blk,",
                         source, re.M)
        assert not re.search(r"auto segment = ", source)
    long = [(n, line) for n, line in _lambda_lengths(source) if n > LONGEST_LAMBDA]
    assert not long, f"lambdas over {LONGEST_LAMBDA} lines: {long}"
