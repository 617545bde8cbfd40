"""The schedule registry (`mlagen.plan.schedules`) is the one place that says what a schedule is,
and the family registry (`mlagen.plan.families`) what a family is: no other module under mlagen/
decides anything by a schedule's or a family's name, and each entry agrees with its templates,
the tuner's space and the fuzzer's draws."""

import ast
from pathlib import Path

import pytest

from mlagen.dsl.arch import ARCHS
from mlagen.dsl.errors import SpecError
from mlagen.dsl.spec import COMBINES, FAMILIES, LOADS, PARTIALS, SCHEDULES, TAGS, Problem, Variant, naive
from mlagen.plan import families, schedules
from mlagen.plan.families import FLASH, MMA, NAIVE, family_of
from mlagen.plan.schedules import (
    FP8_LDG,
    FP8_MMA,
    FP8_WS,
    LOCKSTEP,
    P_EXCHANGE,
    SEESAW,
    TRANSPOSED,
    schedule_of,
    stack_budget,
)
from mlagen.plan.space import split_variants, structures, twin_variants
from mlagen.plan.validate import is_valid, validate
from mlagen.tools.fuzz import FuzzSpace, draw, draw_variant

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlagen"
REGISTRY = Path(schedules.__file__).resolve()
NAMES = frozenset(schedules.SCHEDULES)
FAMILY_REGISTRY = Path(families.__file__).resolve()
FAMILY_NAMES = frozenset(families.FAMILIES)
# The DSL's identity predicates (`Variant.seesaw` ...), kept for tests and benchmarks outside the
# package; no module under mlagen/ reads them (test_no_module_reads_the_dsl_schedule_predicates).
PREDICATES = frozenset({"Variant.seesaw", "Variant.transposed", "Variant.p_exchange"})
# Where the DSL decides by a family's name, its vocabulary: the naive family's names (`Variant.untiled`,
# which only the DSL reads: test_no_module_reads_the_dsl_family_predicate) and their parsing.
FAMILY_PREDICATES = frozenset({"Variant.untiled", "parse_variant"})


def _named(node: ast.AST, names: frozenset[str]) -> bool:
    """Whether `node` is one of `names` as a literal, or a collection of literals holding one."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_named(e, names) for e in node.elts)
    return False


class _Finder(ast.NodeVisitor):
    """Collects the decisions a module makes on registered names (a schedule's or a family's):
    comparisons (==, !=, in, is) with a name, dicts keyed by names and match cases on them, with
    the qualified name they sit in."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.scope: list[str] = []
        self.found: list[tuple[int, str, str]] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def _add(self, node: ast.expr | ast.pattern, what: str) -> None:
        self.found.append((node.lineno, ".".join(self.scope), what))

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(_named(e, self.names) for e in (node.left, *node.comparators)):
            self._add(node, ast.unparse(node))
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        if any(k is not None and _named(k, self.names) for k in node.keys):
            self._add(node, "a dict keyed by registered names")
        self.generic_visit(node)

    def visit_MatchValue(self, node: ast.MatchValue) -> None:
        if _named(node.value, self.names):
            self._add(node, f"case {ast.unparse(node.value)}")
        self.generic_visit(node)


def _decisions(source: str, names: frozenset[str] = NAMES) -> list[tuple[int, str, str]]:
    finder = _Finder(names)
    finder.visit(ast.parse(source))
    return finder.found


def _modules(registry: Path = REGISTRY) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.resolve() != registry]


def test_the_finder_sees_each_form_of_a_decision_by_name():
    source = '''
def f(v, s):
    a = v.schedule == "seesaw"
    b = "transposed" != s
    c = v.schedule in ("p_exchange", "transposed")
    d = {"lockstep": 1}
    match s:
        case "seesaw":
            pass
    e = v.family == "mma" or v.loads in ("tma",) or s.name == schedule.twin_of
'''
    found = _decisions(source)
    assert [line for line, _, _ in found] == [3, 4, 5, 6, 8] and {scope for _, scope, _ in found} == {"f"}
    assert [line for line, _, _ in _decisions(source, FAMILY_NAMES)] == [10]


def test_no_module_outside_the_registry_decides_by_a_schedule_name():
    """Every schedule decision is a field or method of the schedule's entry (`schedule_of`):
    comparing `Variant.schedule` with a name, or keying a dict by names, anywhere else under
    mlagen/ is a branch the next schedule would have to find."""
    found = []
    for path in _modules():
        for line, scope, what in _decisions(path.read_text()):
            if not (path.name == "spec.py" and scope in PREDICATES):
                found.append(f"{path.relative_to(ROOT)}:{line} ({scope or 'module'}): {what}")
    assert not found, "ask the schedule's registry entry instead:\n" + "\n".join(found)


def test_no_module_reads_the_dsl_schedule_predicates():
    """`Variant.seesaw`, `.transposed` and `.p_exchange` name one schedule each; code under
    mlagen/ asks the registry entry what the schedule does instead."""
    predicates = {name.split(".")[1] for name in PREDICATES}
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in predicates and isinstance(node.ctx, ast.Load)]
    assert not found, found


def test_the_dsl_names_exactly_the_registered_schedules():
    assert tuple(schedules.SCHEDULES) == SCHEDULES
    assert {value for field, value, _ in TAGS if field == "schedule"} == NAMES - {Variant().schedule}
    assert schedules.SCHEDULES[Variant().schedule] is LOCKSTEP
    assert tuple(schedules.SCHEDULES.values()) == (LOCKSTEP, SEESAW, TRANSPOSED, P_EXCHANGE, FP8_WS, FP8_MMA,
                                                  FP8_LDG)


@pytest.mark.parametrize("schedule", list(schedules.SCHEDULES.values()), ids=list(schedules.SCHEDULES))
def test_an_entry_is_consistent(schedule):
    """Its template exists; what it accepts is the DSL's; the schedule it twins and the families
    it serves exist; a variant it adopts passes its rules."""
    assert (ROOT / "templates" / schedule.template).is_file()
    assert set(schedule.families) <= set(FAMILIES) and "mma" in schedule.families
    assert schedule.archs is None or set(schedule.archs) <= set(ARCHS)
    assert set(schedule.loads) <= set(LOADS) and set(schedule.combines) <= set(COMBINES)
    assert set(schedule.partials) <= set(PARTIALS) and set(schedule.fp8_kv_loads) <= set(schedule.loads)
    assert schedule.twin_of is None or schedule.twin_of in NAMES
    assert schedule.split_unit == (2 if schedule.paired else 1)
    assert not schedule.tile_a_block or schedule.combines == ("cluster",)
    adopted = schedule.adopt(Variant(family="mma", arch=(schedule.archs or ("sm_90",))[0]))
    assert schedule_of(adopted) is schedule and schedule.check(adopted) is None


def test_the_rows_an_entry_lists_are_the_rows_its_layout_takes():
    for schedule in (TRANSPOSED, P_EXCHANGE):
        for rows in range(1, 130):
            heads = rows if rows <= 64 else rows // 9
            q_tile = 1 if rows <= 64 else 9
            if heads * q_tile != rows:
                continue
            v = schedule.adopt(Variant(family="mma", head_tile=heads, q_tile=q_tile, arch="sm_90a", kv_split=2))
            assert is_valid(Problem(heads=heads), v) == (rows in schedule.rows), (schedule.name, rows)


def test_mbarriers_stack_and_flags_follow_the_entry():
    lockstep = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a")
    variants = [lockstep, lockstep.with_(loads="tma"), SEESAW.twin(lockstep),
                P_EXCHANGE.adopt(lockstep.with_(kv_split=4)),
                TRANSPOSED.adopt(lockstep.with_(head_tile=8, q_tile=9)), TRANSPOSED.adopt(lockstep.with_(head_tile=32))]
    problem = Problem(heads=64)
    for v in variants:
        plan = validate(problem.with_(heads=v.head_tile), v)
        entry = schedule_of(v)
        assert plan.schedule is entry and 0 <= plan.load_mbarriers <= plan.mbarriers == entry.mbarriers(v)
        assert plan.seesaw == entry.seesaw_loop and plan.max_keys == entry.max_keys(v)
        assert stack_budget(v) == entry.stack(v) == (128 if entry is TRANSPOSED and v.head_tile * v.q_tile > 32 else 0)
    assert [validate(problem.with_(heads=v.head_tile), v).mbarriers for v in variants] == [0, 2, 6, 5, 0, 0]
    assert validate(problem, P_EXCHANGE.adopt(lockstep.with_(kv_split=4))).max_keys == 4 * 64


def test_the_twin_of_a_variant_is_the_same_tile_on_the_twinning_schedule():
    lockstep = Variant(family="mma", head_tile=64, q_tile=1, block_n=64, arch="sm_90a", partials="16bit")
    assert SEESAW.twin(lockstep) == lockstep.with_(schedule="seesaw", loads="tma")
    assert SEESAW.twin(SEESAW.twin(lockstep)) is None and TRANSPOSED.twin(lockstep) is None


@pytest.mark.parametrize("problem, seqlen_q", [(Problem(heads=64), 1), (Problem(heads=8), 9),
                                               (Problem(heads=16, page_size=16), 2)])
def test_the_tuner_space_draws_only_valid_variants_of_each_schedule(problem, seqlen_q):
    """Every variant of the tuner's space passes its schedule's rules and validates, and the
    space reaches the schedules that its problem and sm_90a allow."""
    found = []
    for family in FAMILIES:
        for v in structures(problem, seqlen_q, "sm_90a", family, limit=12):
            found += [v, *split_variants(problem, v, 256, skip=0)]
    found += twin_variants(problem, [v for v in found if v.family == "mma" and is_valid(problem, v)][:8])
    valid = [v for v in found if is_valid(problem, v)]
    assert valid and all(schedule_of(v).check(v) is None for v in valid if v.family == "mma")
    reached = {v.schedule for v in valid}
    assert {LOCKSTEP.name} <= reached
    if problem.heads == 64:
        assert reached >= {SEESAW.name, P_EXCHANGE.name}


def test_the_fuzzer_draws_every_schedule_and_only_valid_variants():
    space = FuzzSpace(kv_formats=("dtype", "e4m3", "ds_mla"), q_formats=("dtype", "e4m3"))
    drawn = [(s, draw_variant(s, "sm_90")) for s in (draw(seed, space) for seed in range(300))]
    assert all(v is not None and is_valid(s.problem, v) for s, v in drawn)
    assert {v.schedule for _, v in drawn if v is not None} == NAMES
    for shape, v in drawn:
        if v is not None and shape.problem.fp8_kv and v.family == "mma":
            assert v.loads in schedule_of(v).fp8_kv_loads


def test_no_module_outside_the_registry_decides_by_a_family_name():
    """Every family decision is a field of the family's entry (`family_of`): comparing
    `Variant.family` with a name, or keying a dict by names, anywhere else under mlagen/ is a
    branch the next family would have to find. The DSL's vocabulary (the naive family's names)
    is the exception (FAMILY_PREDICATES)."""
    found = []
    for path in _modules(FAMILY_REGISTRY):
        for line, scope, what in _decisions(path.read_text(), FAMILY_NAMES):
            if not (path.name == "spec.py" and scope in FAMILY_PREDICATES):
                found.append(f"{path.relative_to(ROOT)}:{line} ({scope or 'module'}): {what}")
    assert not found, "ask the family's registry entry instead:\n" + "\n".join(found)


def test_no_module_reads_the_dsl_family_predicate():
    """`Variant.untiled` names the naive family for the DSL's names; code above the DSL asks the
    entry (`KernelFamily.tiled`)."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in _modules(FAMILY_REGISTRY)
             if path.name != "spec.py" for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "untiled" and isinstance(node.ctx, ast.Load)]
    assert not found, found


def test_the_dsl_names_exactly_the_registered_families():
    assert tuple(families.FAMILIES) == FAMILIES
    assert tuple(families.FAMILIES.values()) == (NAIVE, FLASH, MMA)
    assert family_of(naive()) is NAIVE and naive().untiled and not NAIVE.tiled


@pytest.mark.parametrize("family", list(families.FAMILIES.values()), ids=list(families.FAMILIES))
def test_a_family_entry_is_consistent(family):
    """Its template exists, or its schedules' do; a family that takes the knobs runs every
    schedule and a family without runs the lockstep loop only; an untiled family takes no knob
    and its first structure of the tuner's space validates (an untiled family's variant,
    `naive`); over FP8 inputs, its family passes where it reads them (its tile may not fit)."""
    schedules_run = [s for s in schedules.SCHEDULES.values() if family.name in s.families]
    assert family.template is None or (ROOT / "templates" / family.template).is_file()
    assert family.template is not None or all((ROOT / "templates" / s.template).is_file() for s in schedules_run)
    assert schedules_run == (list(schedules.SCHEDULES.values()) if family.knobs else [LOCKSTEP])
    assert family.fuzz_weight >= 1 and (family.tiled or not family.knobs)
    assert family.fp8_kv != "staged" or any(s.fp8_kv_loads for s in schedules_run)
    problem = Problem(heads=8)
    tile = structures(problem, 8, "sm_90a", family.name, limit=1)[0]
    assert family.tiled or tile == naive("sm_90a")
    assert validate(problem, tile).family is family
    assert validate(problem, tile).template == family.template_for(tile)
    for kv_format, q_format in (("dtype", "e4m3"), ("e4m3", "dtype"), ("ds_mla", "dtype"), ("e4m3", "e4m3")):
        fp8 = problem.with_formats(kv_format, q_format)
        by_schedule = any(s.takes(tile) and s.reads_queries(q_format) and s.reads(kv_format) for s in schedules_run)
        reads = (family.fp8_q or q_format == "dtype" or by_schedule) and (bool(family.fp8_kv) or kv_format == "dtype")
        try:
            validate(fp8, tile)
            refused = None
        except SpecError as e:
            refused = e.field
        assert (refused != "variant.family") == reads, (kv_format, q_format, refused)
