"""The templates read the plan only: every number and flag they use is a `KernelPlan` attribute
(or one of its problem's, arch's or tensor-core layout's), never the variant behind it, so what
a kernel depends on is declared, documented and derived once in Python."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from mlagen.codegen.render import template_dir
from mlagen.dsl.arch import Arch
from mlagen.dsl.spec import Problem
from mlagen.plan.mma_plan import MmaLayout
from mlagen.plan.schedules import SCHEDULES
from mlagen.plan.validate import KernelPlan

TEMPLATES = sorted(template_dir().glob("*.j2"))
# Jinja expressions and statements: where a template reads its context.
JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
# a read of the plan: one attribute of it, and that attribute's own where it has one
READ = re.compile(r"(?<![\w.])plan\.(\w+)(?:\.(\w+))?")
# names templates bind to a plan attribute with a Jinja `set`
BOUND = re.compile(r"\{%-?\s*set\s+(\w+)\s*=\s*plan\.(\w+)\s*-?%\}")
# The plan attributes that are objects, by the class whose attributes a template may read on.
NESTED = {"problem": Problem, "arch": Arch, "mma": MmaLayout}


def _declares(cls: type, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(cls)} or hasattr(cls, name)


def _reads(path: Path) -> list[tuple[str, str | None]]:
    """(attribute, its attribute or None) for each plan attribute `path` reads, through a name
    bound to one as well."""
    text = path.read_text()
    blocks = JINJA.findall(text)
    bound = {name: attr for name, attr in BOUND.findall(text)}
    found = [(m.group(1), m.group(2)) for b in blocks for m in READ.finditer(b)]
    for name, attr in bound.items():
        found += [(attr, m.group(1)) for b in blocks for m in re.finditer(rf"(?<![\w.]){name}\.(\w+)", b)]
    return found


def test_templates_found():
    assert {p.name for p in TEMPLATES} >= {"mma.cu.j2", "merge.cuh.j2", "launcher.h.j2"}


# What a template pulls in: {% include "x" %}, {% import "x" as y %}, {% from "x" import y %},
# and each name of a choice: {% include "x" if a else "y" %}.
PULLING = re.compile(r"\{%-?\s*(?:include|import|from)\s+(.*?)-?%\}", re.S)
NAME = re.compile(r"\"([^\"]+\.j2)\"")


def pulls(text: str) -> list[str]:
    """The templates `text` pulls in, in order."""
    return [name for statement in PULLING.findall(text) for name in NAME.findall(statement)]


def test_every_fragment_is_included_and_says_what_it_holds():
    """A kernel's or launcher's template (`*.cu.j2`, `*.h.j2`) is an entry that no template pulls
    in; every fragment (`*.cuh.j2`) is included or imported by another template, and opens with a
    Jinja comment that says what it holds."""
    pulled = {name: {p.name for p in TEMPLATES if name in pulls(p.read_text())}
              for name in (p.name for p in TEMPLATES)}
    for schedule in SCHEDULES.values():     # a schedule's own KV tiles: its template includes them by the entry's name
        if schedule.kv_template:
            pulled[schedule.kv_template].add(schedule.template)
    problems = []
    for path in TEMPLATES:
        users = pulled[path.name] - {path.name}
        if path.name.endswith((".cu.j2", ".h.j2")):
            if users:
                problems.append(f"{path.name}: an entry, pulled in by {sorted(users)}")
        elif not path.name.endswith(".cuh.j2"):
            problems.append(f"{path.name}: neither an entry (.cu.j2, .h.j2) nor a fragment (.cuh.j2)")
        else:
            if not users:
                problems.append(f"{path.name}: a fragment no template includes or imports")
            if not re.match(r"\{#-?\s*\S.*?#\}", path.read_text(), re.S):
                problems.append(f"{path.name}: does not open with a comment saying what it holds")
    assert not problems, "\n".join(problems)


def test_merge_fragment_includes_the_split_concerns_in_order():
    """merge.cuh.j2 is the split families' fragment: inside the kernel's namespace, it includes
    one file per concern, in the order they depend on each other."""
    text = (template_dir() / "merge.cuh.j2").read_text()
    assert pulls(text) == ["split_partials.cuh.j2", "split_counters.cuh.j2", "split_work_list.cuh.j2",
                           "split_pair_merge.cuh.j2", "split_merge_blocks.cuh.j2"]


# A Jinja statement, and the statements a kernel template may name its load kind (`tma`) in: its
# binding, a choice between files to include, and the guard of the TMA helpers' include.
STATEMENT = re.compile(r"\{%.*?%\}", re.S)
NAMES_LOADS = re.compile(r"\btma\b")
CHOOSES_FILES = re.compile(r"\{%-?\s*(?:set tma = plan\.tma\s*-?|include\s[^%]*)%\}"
                           r"|\{% if tma %\}(?=\{% include \"tma\.cuh\.j2\" %\})")


def load_branches(text: str) -> list[str]:
    """The statements of `text` that name the load kind other than to choose a file."""
    return [m.group(0) for m in STATEMENT.finditer(text)
            if NAMES_LOADS.search(m.group(0)) and not CHOOSES_FILES.match(text, m.start())]


@pytest.mark.parametrize("name", ["mma.cu.j2", "mma_transposed.cu.j2"])
def test_load_kind_picks_files_not_branches(name: str):
    """A kernel's KV loads (TMA boxes or cp.async rows) are one file of a pair with one interface:
    the entry template names `tma` only to choose which file it includes, never to branch inside
    the kernel's body."""
    text = (template_dir() / name).read_text()
    assert not load_branches(text), f"{name} branches on the load kind"
    assert any("_kv_tma" in n for n in pulls(text)), f"{name} includes no load file"
    assert load_branches(text.replace("{% include", "{% if tma %}x{% endif %}{% include", 1))


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_reads_no_variant(path: Path):
    text = path.read_text()
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            if re.search(r"plan\.variant", line)]
    hits += [f"{path.name}: {b}" for b in JINJA.findall(text) if re.search(r"\bvariant\b", b)]
    assert not hits, "templates read the plan, not its variant:\n" + "\n".join(hits)


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_reads_declared_plan_attributes(path: Path):
    missing = []
    for attr, sub in _reads(path):
        if not _declares(KernelPlan, attr):
            missing.append(f"plan.{attr}")
        elif sub is not None and attr in NESTED and not _declares(NESTED[attr], sub):
            missing.append(f"plan.{attr}.{sub}")
    assert not missing, f"{path.name} reads what KernelPlan does not declare: {sorted(set(missing))}"


def test_plan_properties_templates_read_are_documented():
    read = {attr for path in TEMPLATES for attr, _ in _reads(path)}
    undocumented = sorted(a for a in read if isinstance(getattr(KernelPlan, a, None), property)
                          and not (getattr(KernelPlan, a).__doc__ or "").strip())
    assert not undocumented, f"KernelPlan properties the templates read without a docstring: {undocumented}"
