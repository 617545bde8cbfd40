"""The repository's promises: CI runs exactly the README's test command; the code, templates,
tests and docs describe the code as it is (no development history) and every file or name they
point to exists."""

from __future__ import annotations

import importlib
import inspect
import io
import pkgutil
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import mlagen

ROOT = Path(__file__).resolve().parent.parent

# What the history and reference checks read: the package, the templates, the tests, the CLI, the
# README, the docs and the examples. docs/api.md is left out: docs/make_api.py writes it from the
# docstrings, which are read here at their source.
SCANNED = ("mlagen", "templates", "tests", "docs", "examples", "cli.py", "README.md")
SKIPPED = {"docs/api.md"}
TEXT_SUFFIXES = {".py", ".j2", ".md", ".cu", ".cuh", ".h", ".sh", ".toml", ".txt"}


def _commands(text: str) -> list[str]:
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    main_job, test_command = _commands((ROOT / "README.md").read_text())
    assert "mlagen emit" in main_job and main_job.startswith("pip install torch==2.13.0")
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def _scanned_files() -> list[Path]:
    found = []
    for name in SCANNED:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for p in paths:
            rel = p.relative_to(ROOT).as_posix()
            if (p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Makefile")
                    and "__pycache__" not in p.parts and rel not in SKIPPED):
                found.append(p)
    return found


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


# Development history: version names (two digits, optionally a letter; one digit only as a
# possessive, since `deepseek-v3` names a model and `.v4` a PTX vector width), work sessions,
# the performance notes file and the dated benchmark folders. Each pattern is written so that
# its own text does not match it.
HISTORY = (
    re.compile(r"(?<![.\w])v\d{2}[a-z]?\b"),
    re.compile(r"(?<![.\w-])v\d[a-z]?'s\b"),
    re.compile(r"\b[Ss]essions? \d+"),
    re.compile(r"\bN[O]TES\b"),
    re.compile(r"\b[\w.]+-20\d\d-\d\d-\d\d"),
)


def test_no_development_history():
    """Comments, docstrings and docs say what the code does now and why (with the measured figure
    and its shape where one justifies a choice; docs/performance.md keeps the full record), not
    which version or session changed it, nor where a dated log of it lies."""
    hits = []
    for p in _scanned_files():
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if any(h.search(line) for h in HISTORY):
                hits.append(f"{_rel(p)}:{n}: {line.strip()}")
    assert not hits, "development history in the repository:\n" + "\n".join(hits)


def _prose(p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of what a file says rather than runs: a Python file's comments and
    strings (an f-string without its {fields}), a template without its Jinja statements and
    expressions (which name the template's own macros and values), any other file whole."""
    text = p.read_text()
    if p.suffix == ".j2":
        text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    if p.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        s = tok.string
        if tok.type == tokenize.STRING and "f" in s[: s.index(s[-1])].lower():
            s = re.sub(r"\{[^{}]*\}", "", s)
        yield from enumerate(s.splitlines(), tok.start[0])


def _names_then_attributes(names: list[str], prefix: str = "") -> re.Pattern[str]:
    """A word of `names` (after an optional `prefix`), then one or more `.attribute`s; not inside
    a path or a longer dotted name."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(r"(?<![\w/.~-])" + prefix + "(" + alternatives + r")((?:\.\w+)+)")


# Repository-relative paths: a top-level folder of the repository, then path characters (no
# placeholders such as <arch> or {preset}: the path is checked up to them).
TOP_FOLDERS = ("benchmarks", "docs", "templates", "mlagen", "tests", "examples", "generated", ".ci")
REPO_PATH = re.compile(r"(?<![\w/.~-])((?:" + "|".join(re.escape(t) for t in TOP_FOLDERS) + r")/[\w./*-]*)")
# Folders the tools create when they run, named as where their output goes: `mlagen bench`
# writes to benchmarks/latest by default.
OUTPUT_PATHS = {"benchmarks/latest"}
# A document named without a folder, in upper case as the top-level ones are (README.md): it
# must lie beside the file that names it or at the top. Lower-case names are as often files that
# the tools write (bench.md), so they are not checked.
BARE_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]*\.md)\b")
# A Markdown link to a relative target, resolved from the linking file's folder.
MD_LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)\s#]+)")
# A dotted name that starts with one of mlagen's modules or packages, by its path under mlagen
# (`dispatch.policy.num_splits`, `mlagen.plan.validate.SplitPlan.partial_rows`, `runtime.op`) or,
# without `mlagen.` before it, by a module's own name (`policy.num_splits`); with `mlagen.` itself;
# or with a class defined in one of its modules (`Variant.p_exchange`). One ending in a file
# extension names a file (`bench.png`, `merge.cuh.j2`), not an attribute.
def _module_paths() -> list[str]:
    """Every module and package under mlagen, as its dotted path under mlagen (`dsl`, `dsl.spec`)."""
    return sorted(m.name.removeprefix("mlagen.") for m in pkgutil.walk_packages(mlagen.__path__, "mlagen."))


MODULE_PATHS = _module_paths()
# The modules a name can stand for: its path, or a module's own name (the last part of its path;
# a name two modules share stands for both).
MODULE_NAMES: dict[str, list[str]] = {}
for _path in MODULE_PATHS:
    for _name in dict.fromkeys((_path, _path.rpartition(".")[2])):
        MODULE_NAMES.setdefault(_name, []).append(_path)
MODULE_NAME = _names_then_attributes(list(MODULE_NAMES))
FULL_MODULE_NAME = _names_then_attributes(MODULE_PATHS, prefix=r"mlagen\.")
PACKAGE_NAME = _names_then_attributes(["mlagen"])
FILE_EXTENSIONS = {"py", "j2", "cu", "cuh", "h", "md", "json", "log", "txt", "sh", "png", "svg", "csv", "html",
                   "toml", "so", "cubin", "ptx"}


def _classes() -> dict[str, list[type]]:
    """mlagen's classes by name, each from the module that defines it."""
    found: dict[str, list[type]] = {}
    for path in MODULE_PATHS:
        module = importlib.import_module(f"mlagen.{path}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                found.setdefault(name, []).append(value)
    return found


def _resolves(obj: object, names: list[str]) -> str | None:
    """The first of `names` that does not resolve as attributes from `obj` (a package's modules
    and a dataclass's fields included), or None where they all do."""
    for name in names:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif name in getattr(obj, "__dataclass_fields__", {}):
            return None        # a field without a default: its value is per instance
        elif hasattr(obj, "__path__"):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{name}")
            except ImportError:
                return name
        else:
            return name
    return None




def _path_exists(ref: str) -> bool:
    if ref in OUTPUT_PATHS or any(ref.startswith(o + "/") for o in OUTPUT_PATHS):
        return True
    return any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists()


def test_references_resolve():
    """Every repository path that the package, templates, tests, CLI, README, docs and examples
    name exists, every upper-case document they name and every relative Markdown link resolves,
    and every dotted name under one of mlagen's modules or classes is an attribute of it."""
    classes = _classes()
    class_name = _names_then_attributes(list(classes))
    dangling = []

    for p in _scanned_files():
        for n, line in _prose(p):
            where = f"{_rel(p)}:{n}"
            for m in REPO_PATH.finditer(line):
                ref = m.group(1).rstrip(".,:;")
                if not _path_exists(ref):
                    dangling.append(f"{where}: {ref} (no such path)")
            for m in BARE_DOC.finditer(line):
                if not (p.parent / m.group(1)).exists() and not (ROOT / m.group(1)).exists():
                    dangling.append(f"{where}: {m.group(1)} (not in the repository)")
            if p.suffix == ".md":
                for m in MD_LINK.finditer(line):
                    if not (p.parent / m.group(1)).exists():
                        dangling.append(f"{where}: {m.group(1)} (link target missing)")
            for pattern in (MODULE_NAME, FULL_MODULE_NAME):
                for m in pattern.finditer(line):
                    names = m.group(2).split(".")[1:]
                    if names[-1] in FILE_EXTENSIONS:
                        continue
                    missing = [_resolves(importlib.import_module(f"mlagen.{path}"), names)
                               for path in MODULE_NAMES[m.group(1)]]
                    if None not in missing:
                        dangling.append(f"{where}: {m.group(0)} (no {missing[0]!r})")
            for m in class_name.finditer(line):
                names = m.group(2).split(".")[1:]
                if all(_resolves(cls, names) is not None for cls in classes[m.group(1)]):
                    dangling.append(f"{where}: {m.group(0)} (no {names[0]!r} on the class)")
            for m in PACKAGE_NAME.finditer(line):
                names = m.group(2).split(".")[1:]
                if names[-1] in FILE_EXTENSIONS or names[0] in MODULE_PATHS:
                    continue             # a file, or a module's or package's name, checked above
                if _resolves(mlagen, names) is not None:
                    dangling.append(f"{where}: {m.group(0)} (not in mlagen)")
    assert not dangling, "references that do not resolve:\n" + "\n".join(dangling)


# A timing tied to a GPU: the GPU's name and, within the sentence, a figure in µs, %, x or TFLOP/s.
GPU_FIGURE = re.compile(r"\b(?:H100|H200)\b[^.;]{0,80}?\d+(?:\.\d+)?\s*(?:µs|%|x\b|TFLOP)")


def test_measured_figures_live_in_the_performance_record():
    """The package's docstrings and comments and the templates' comments quote no GPU's timings,
    which go stale as the kernels change: docs/performance.md keeps them, and the code names the
    section."""
    hits = [f"{_rel(p)}:{n}: {line.strip()}"
            for top in ("mlagen", "templates") for p in sorted((ROOT / top).rglob("*"))
            if p.suffix in (".py", ".j2") and "__pycache__" not in p.parts
            for n, line in _prose(p) if GPU_FIGURE.search(line)]
    assert not hits, "GPU timings outside docs/performance.md:\n" + "\n".join(hits)
