"""mlagen's packages are layers, and imports go one way: a module imports only from its own layer
or lower ones, never a private name (`_x`) of another module, and no modules import each other
round a cycle. Imports are read from the source with `ast`, at the top of a module and inside
its functions and `if TYPE_CHECKING:` blocks alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlagen"

# Every module under mlagen, by its dotted name under mlagen ("" is mlagen/__init__.py), in its
# layer, lowest first. A new module has to be placed here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dsl", ("dsl", "dsl.arch", "dsl.errors", "dsl.kv_layout", "dsl.spec")),
    ("plan", ("plan", "plan.families", "plan.mma_plan", "plan.params", "plan.schedules", "plan.space", "plan.terms",
              "plan.tiles", "plan.validate")),
    ("codegen", ("codegen", "codegen.build", "codegen.compiler", "codegen.precompile", "codegen.render")),
    ("dispatch", ("dispatch", "dispatch.policy", "dispatch.presets", "dispatch.tables")),
    ("runtime", ("runtime", "runtime.context_parallel", "runtime.inputs", "runtime.kv_formats", "runtime.lasting",
                 "runtime.launch", "runtime.merge", "runtime.op", "runtime.ops", "runtime.reference", "runtime.sinks",
                 "runtime.sparse_reference",
                 "runtime.tensormap", "runtime.varlen", "runtime.workspace", "compat", "compat.flash_mla")),
    # the package's public API: what `import mlagen` gives (__all__, __version__)
    ("api", ("",)),
    # a model's attention through mlagen (transformers' DeepSeek-V3), above the runtime
    ("integrations", ("integrations", "integrations.backends", "integrations.deepseek_v3", "integrations.drafting",
                      "integrations.paged_cache", "integrations.speculative")),
    ("tools", ("tools", "tools.bench", "tools.cli", "tools.eager", "tools.emit", "tools.files", "tools.floor",
               "tools.fuzz", "tools.grids", "tools.launcher", "tools.live_peer", "tools.peers", "tools.report",
               "tools.sass", "tools.sparse_bench", "tools.stamp", "tools.tables", "tools.testing", "tools.timing",
               "tools.tune", "tools.workload")),
)


def modules_under(package: Path) -> dict[str, Path]:
    """Each module under `package` (a folder) by its dotted name under it; a package's name is
    that of its __init__.py ("" for the top one)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, modules: dict[str, Path], top: str = "mlagen") -> list[tuple[int, str, str]]:
    """(line, module, imported name or "") for each import in `path` (module `name`) of one of
    `modules`: `from .x import y` gives (x, y), or (x.y, "") when y is a module itself;
    `import top.x` gives (x, ""). Imports of other packages are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    found.append((node.lineno, alias.name.removeprefix(top).removeprefix("."), ""))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond the package")
                base = parts[:len(parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module == top or (node.module or "").startswith(top + "."):
                target = node.module.removeprefix(top).removeprefix(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.append((node.lineno, sub, "") if sub in modules else (node.lineno, target, alias.name))
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(modules: dict[str, Path], layers: tuple[tuple[str, tuple[str, ...]], ...],
               top: str = "mlagen") -> list[str]:
    """What breaks the rules among `modules`: an import of a higher layer, of a module that does
    not exist, of another module's private name, and each import cycle."""
    rank = {m: i for i, (_, members) in enumerate(layers) for m in members}
    layer = {m: layer_name for layer_name, members in layers for m in members}

    def dotted(m: str) -> str:
        return f"{top}.{m}" if m else top

    found = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    root = modules[""].parent.parent           # the folder that holds the package
    for name, path in modules.items():
        where = path.relative_to(root).as_posix()
        for line, target, imported in imports(name, path, modules, top):
            if target not in modules:
                found.append(f"{where}:{line}: imports {dotted(target)}, which is not a module of {top}")
                continue
            if target != name:
                graph[name].add(target)
            # (a module without a layer fails test_every_module_has_one_layer instead)
            if rank.get(target, -1) > rank.get(name, len(layers)):
                found.append(f"{where}:{line}: {layer[name]} imports {dotted(target)} of the higher layer "
                             f"{layer[target]}")
            if imported and is_private(imported) and target != name:
                found.append(f"{where}:{line}: imports the private {imported} of {dotted(target)}")
    for cycle, group in cycles(graph):
        more = f" (in one cycle group with {', '.join(dotted(m) for m in group if m not in cycle)})" \
            if len(group) > len(cycle) - 1 else ""
        found.append(f"import cycle: {' -> '.join(dotted(m) for m in cycle)}{more}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """(a cycle, closed: its first module again at the end; the group) for each strongly
    connected group of more than one module in `graph` (Tarjan's algorithm): every module of a
    group is on a cycle with every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:
        members = set(group)
        path, seen = [group[0]], {group[0]}
        while True:                         # walk inside the group until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in members)
            if nxt in seen:
                found.append((path[path.index(nxt):] + [nxt], group))
                break
            path.append(nxt)
            seen.add(nxt)
    return found


def test_every_module_has_one_layer():
    placed = [m for _, members in LAYERS for m in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    modules = set(modules_under(PACKAGE))
    assert not modules - set(placed), f"modules without a layer: add them to LAYERS: {sorted(modules - set(placed))}"
    assert not set(placed) - modules, f"LAYERS names modules that do not exist: {sorted(set(placed) - modules)}"


def test_each_layer_is_its_package():
    """A layer's modules are its package's (the runtime's also mlagen.compat's); the API layer is
    mlagen's own __init__.py."""
    for layer_name, members in LAYERS:
        if layer_name == "api":
            assert members == ("",)
            continue
        allowed = {layer_name, "compat"} if layer_name == "runtime" else {layer_name}
        assert {m.split(".")[0] for m in members} <= allowed, (layer_name, members)


def test_imports_go_one_way():
    found = violations(modules_under(PACKAGE), LAYERS)
    assert not found, "imports against the layers:\n" + "\n".join(found)


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A package `toy` of two layers, low (toy.low.a, .b, .d) and high (toy.high.c), that breaks
    every rule once."""
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from . import b\n",
        "low/b.py": "from .a import _helper  # private, and a cycle with a\n",
        "low/d.py": "def f():\n    from ..high import c  # upward, inside a function\n",
        "high/__init__.py": "",
        "high/c.py": "import toy.low.a\nfrom ..missing import x\n\nif False:\n    from toy.low.b import x\n",
    }
    for name, text in files.items():
        (tmp_path / "toy" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toy" / name).write_text(text)
    return tmp_path / "toy"


def test_the_check_finds_each_kind_of_violation(toy: Path):
    layers = (("low", ("", "low", "low.a", "low.b", "low.d")), ("high", ("high", "high.c")))
    found = violations(modules_under(toy), layers, top="toy")
    assert "toy/low/d.py:2: low imports toy.high.c of the higher layer high" in found, found
    assert "toy/low/b.py:1: imports the private _helper of toy.low.a" in found, found
    assert "import cycle: toy.low.a -> toy.low.b -> toy.low.a" in found, found
    assert "toy/high/c.py:2: imports toy.missing, which is not a module of toy" in found, found
    assert len(found) == 4, found
    assert imports("high.c", toy / "high" / "c.py", modules_under(toy), top="toy") == [
        (1, "low.a", ""), (2, "missing", "x"), (5, "low.b", "x")]
