"""docs/api.md must match what docs/make_api.py renders from the code now; the guide's
commands and names must exist; the figures the docs quote from the code, the shipped table and
the latest H200 results must match them."""

import doctest
import json
import re
from pathlib import Path

import pytest
from scripts import load_script

import mlagen
from mlagen import Problem, SpecError, validate
from mlagen.dispatch import policy
from mlagen.dispatch.presets import DEFAULT_EMIT_ARCHS, DEFAULT_PRESET, get_preset
from mlagen.dsl.arch import get_arch
from mlagen.dsl.spec import parse_variant
from mlagen.plan import mma_plan
from mlagen.plan import validate as validate_module
from mlagen.tools import bench as bench_module
from mlagen.tools import grids
from mlagen.tools.floor import floor_bytes, floor_flops
from mlagen.tools.testing import E4M3_QUERY_TOLERANCE
from mlagen.tools.tune import TuneConfig

ROOT = Path(__file__).resolve().parent.parent


def _make_api():
    return load_script("docs/make_api.py")


def test_api_reference_is_up_to_date():
    committed = (ROOT / "docs" / "api.md").read_text()
    assert committed == _make_api().render(), "docs/api.md is stale: run python docs/make_api.py"


def test_guide_names_real_functions():
    guide = (ROOT / "docs" / "guide.md").read_text()
    for name in re.findall(r"\bmlagen\.(\w+)\(", guide):
        assert hasattr(mlagen, name), f"guide.md calls mlagen.{name}, which mlagen does not export"
    assert "from mlagen.compat.flash_mla import" in guide


def test_guide_dispatcher_example_runs():
    """The guide's dispatcher session, run as a doctest against the shipped table."""
    guide = (ROOT / "docs" / "guide.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", guide, re.S) if "choose_variant" in b)
    test = doctest.DocTestParser().get_doctest(block, {}, "guide.md dispatcher", "guide.md", 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 8


# ---- figures the docs quote from the code, the shipped table and the latest H200 results

RESULTS = ROOT / "benchmarks" / "results" / "h200"


def _doc(name: str) -> str:
    return (ROOT / name).read_text()


def _bench():
    return json.loads((RESULTS / "bench.json").read_text())


def _code_value(name: str):
    """The value a doc's "`name` (value)" stands for: a constant of one of mlagen's modules, a
    DispatchPolicy field's default, or one of the few names below."""
    special = {
        "kKvMapBytes": lambda: mma_plan.TENSOR_MAP_BYTES,
        "--retimes": lambda: TuneConfig.retimes,
    }
    if name in special:
        return special[name]()
    owner, _, attr = name.rpartition(".")
    owner = owner.rpartition(".")[2]
    if owner == "DispatchPolicy":
        return getattr(policy.H200, attr)
    module = {"validate": validate_module, "mma_plan": mma_plan, "policy": policy}[owner]
    return getattr(module, attr)


# "`name` (value)", "`name` (shipped: value)", across a line break too
QUOTED = re.compile(r"`([\w.-]+)`\s+\((?:shipped: )?(\d+(?:\.\d+)?)\)")


def test_quoted_constants_match_the_code():
    """Every "`constant` (value)" in the README and the docs holds the constant's value in the code."""
    seen = set()
    for doc in ("README.md", "docs/guide.md", "docs/design.md", "docs/performance.md"):
        for name, value in QUOTED.findall(_doc(doc)):
            seen.add(name)
            assert float(value) == _code_value(name), f"{doc}: `{name}` ({value}), the code has {_code_value(name)}"
    assert {"validate.SEGMENT_TILES", "validate.MERGE_TARGET_BLOCKS", "DispatchPolicy.seesaw_tiles_per_sm",
            "DispatchPolicy.pdl_tiles_per_sm", "mma_plan.STAGE_PAD", "kKvMapBytes"} <= seen, seen


def _figures():
    """(document, text it must hold, whether the code agrees): figures in prose."""
    arch = {a: get_arch(a).smem_per_block // 1024 for a in ("sm_80", "sm_89", "sm_90", "sm_120")}
    grid_rows = len(set(grids.SEED) | set(grids.SERVING))
    table = json.loads((ROOT / "mlagen" / "dispatch" / "tables" / "h200.json").read_text())["entries"]
    picks = [e["variant"] for e in table.values()]
    kimi = get_preset(DEFAULT_PRESET)
    tile64 = validate(kimi.problem, parse_variant("mma_ht64_qt1_bn64_w8_st2_spa_sm90")).smem_bytes
    tile72 = validate(Problem(heads=8), parse_variant("mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a")).smem_bytes
    return [
        ("README.md", "(Kimi K2: 64 heads,\nbf16, page size 64, causal masks) for sm_90 and sm_120",
         DEFAULT_PRESET == "kimi-k2" and kimi.problem.heads == 64 and kimi.problem.page_size == 64
         and kimi.problem.dtype == "bf16" and kimi.problem.mask == "causal"
         and DEFAULT_EMIT_ARCHS == ("sm_90", "sm_120")),
        ("README.md", "torch 2.4 or later", '"torch>=2.4"' in _doc("pyproject.toml")),
        ("docs/guide.md", "227 KB on\n    sm_90, 163 KB on sm_80, 99 KB on sm_89 and sm_120",
         (arch["sm_90"], arch["sm_80"], arch["sm_89"], arch["sm_120"]) == (227, 163, 99, 99)),
        ("docs/guide.md", "into ranges of at most 2048 keys (at most 8 of them",
         (1 << policy.INVARIANT_SPLIT_KEYS_LOG2, policy.INVARIANT_SPLITS) == (2048, 8)),
        ("docs/guide.md", "at most 24 KV tiles of work", policy.H200.pdl_tiles_per_sm == 24),
        ("docs/guide.md", "a cost of 24 rows per block", policy.H200.row_cost_of_a_block == 24),
        ("docs/guide.md", "holds at most 8 KV tiles of 64 keys", policy.H200.exchange_max_tiles == 8),
        ("docs/guide.md", "(the 17 shapes of the peers table", len(grids.SERVING) == 17),
        ("docs/guide.md", "seed + serving grids (19 shapes)", grid_rows == 19),
        ("docs/guide.md", "In an H200 tune of the 19 grid rows", grid_rows == 19),
        ("docs/guide.md", "more than 5% slower than that best", abs(bench_module.DISPATCH_SLACK - 1.05) < 1e-9),
        ("docs/guide.md", "each output row stays within 0.25\nrelative (its largest element within 0.75 x the "
         "row's RMS) and each lse within 0.3",
         (E4M3_QUERY_TOLERANCE.row_rel, E4M3_QUERY_TOLERANCE.row_max, E4M3_QUERY_TOLERANCE.lse_abs)
         == (0.25, 0.75, 0.3)),
        ("docs/design.md", f"{tile64:,} bytes for the 64-row, 64-key, two-stage tile", tile64 == 232192),
        ("docs/design.md", f"72 rows take all {tile72:,} bytes", tile72 == get_arch("sm_90").smem_per_block),
        ("docs/design.md", "Six mbarriers (`mma_plan.SEESAW_BARRIERS`)", mma_plan.SEESAW_BARRIERS == 6),
        ("docs/design.md", "any multiple of 8 from 16 to 72 (`mma_plan.TRANSPOSED_ROWS`)",
         list(mma_plan.TRANSPOSED_ROWS) == list(range(16, 73, 8))),
        ("docs/design.md", f"the shipped table runs it on {sum('_ss_' in v for v in picks)} of its {len(picks)}",
         True),
        ("docs/design.md", f"the shipped table runs it on {sum('_tma' in v for v in picks)} of its {len(picks)}",
         True),
    ]


@pytest.mark.parametrize("doc, text, agrees", _figures(), ids=lambda x: x if isinstance(x, str) else None)
def test_prose_figures_match_the_code(doc, text, agrees):
    """A figure the docs take from the code (a constant, a count of presets, rows or table entries,
    shared-memory bytes) is still in the doc, with the code's value."""
    assert re.sub(r"\s+", " ", text) in re.sub(r"\s+", " ", _doc(doc)), f"{doc} no longer says: {text!r}"
    assert agrees, f"{doc}: {text!r} disagrees with the code"


def test_check_example_matches_the_preset():
    """The guide's `mlagen check` example: the kimi-k2 preset's sm_90 variants and their shared
    memory as the plans derive them (registers are left out: they change with NVRTC)."""
    guide = _doc("docs/guide.md")
    block = next(b for b in re.findall(r"```text\n(.*?)```", guide, re.S) if "┃ preset" in b)
    rows = [[c.strip() for c in line.strip("│").split("│")] for line in block.splitlines() if line.startswith("│")]
    preset = get_preset("kimi-k2")
    variants = preset.variants("sm_90")
    assert [r[1] for r in rows] == [v.name for v in variants]
    assert [int(r[4]) for r in rows] == [validate(preset.problem, v).smem_bytes for v in variants]
    assert all(r[3] == "…" for r in rows)
    assert f"{len(variants)} variants compiled for sm_90" in block


def test_spec_error_example_is_the_message():
    guide = _doc("docs/guide.md")
    block = next(b for b in re.findall(r"```text\n(.*?)```", guide, re.S) if "SpecError" in b)
    call, shown = block.split("\n", 1)
    with pytest.raises(SpecError) as raised:
        eval(call.removeprefix(">>> "), {"mlagen": mlagen})
    assert re.sub(r"\s+", " ", shown.strip()) == f"SpecError: {raised.value}"


def test_performance_results_are_the_latest_bench():
    """docs/performance.md's results table: each row's memory and matrix floors (at the run's
    measured rates), time, × floor and FlashMLA figure, from benchmarks/results/h200/bench.json."""
    bench = _bench()
    copy, matmul = bench["meta"]["copy_tbps"] * 1e12, bench["meta"]["matmul_tflops"] * 1e12
    perf = _doc("docs/performance.md")
    lines = perf[perf.index("| row | memory floor µs |"):].splitlines()[2:]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[:len(bench["rows"])]]
    assert f"copy {bench['meta']['copy_tbps']:.2f} TB/s, bf16 matmul\n{bench['meta']['matmul_tflops']:.0f} TFLOP/s" \
        in perf
    for cells, row in zip(table, bench["rows"], strict=True):
        h, b, s, p = row["heads"], row["batch"], row["seqlen_q"], row["prefix"]
        mem = floor_bytes(h, b, s, p + s) / copy * 1e6
        math = floor_flops(h, b, s, p + s) / matmul * 1e6
        us = row["cells"]["dispatch"]["us"]
        flashmla = "—" if row["flashmla_us"] is None else f"{row['flashmla_us']:.1f}"
        assert cells[:6] == [f"{h}/{b}/{s}/{p}", f"{mem:.1f}", f"{math:.1f}", f"{us:.1f}",
                             f"{us / max(mem, math):.2f}", flashmla], cells


def _ratio_range(column: str) -> tuple[float, float]:
    ratios = [r["cells"][column]["us"] / r["cells"]["dispatch"]["us"] for r in _bench()["rows"]]
    return min(ratios), max(ratios)


def test_fp8_ranges_are_the_latest_bench():
    """The FP8 caches' time over bf16, as the README, the guide and performance.md quote it."""
    e4m3, ds_mla = _ratio_range("fp8:e4m3"), _ratio_range("fp8:ds_mla")
    tile_e4m3, tile_ds = _ratio_range("fp8:e4m3:tile")[1], _ratio_range("fp8:ds_mla:tile")[1]
    both = (min(e4m3[0], ds_mla[0]), max(e4m3[1], ds_mla[1]))
    assert f"(correct; {both[0]:.1f}-{both[1]:.1f}x the bf16 time" in _doc("README.md")
    guide = re.sub(r"\s+", " ", _doc("docs/guide.md"))
    assert (f"take {e4m3[0]:.1f}-{e4m3[1]:.1f}x the bf16 time for e4m3 and {ds_mla[0]:.1f}-{ds_mla[1]:.1f}x for "
            "ds_mla") in guide
    perf = re.sub(r"\s+", " ", _doc("docs/performance.md"))
    assert (f"e4m3 {e4m3[0]:.2f}-{e4m3[1]:.2f}x and ds_mla {ds_mla[0]:.2f}-{ds_mla[1]:.2f}x the bf16 dispatch "
            f"time (the `:tile` columns up to {tile_e4m3:.2f}x and {tile_ds:.2f}x)") in perf


def test_ragged_batch_ratios_are_the_latest_run():
    """design.md's balanced-over-adaptive ratios on ragged batches, for the shapes that
    run_gpu.sh's ragged step measures (benchmarks/results/h200/ragged.log)."""
    log = (RESULTS / "ragged.log").read_text()
    design = re.sub(r"\s+", " ", _doc("docs/design.md"))
    for head, body in re.findall(r"^(H=\d+ B=\d+ S=\d+): \d+ keys in all.*?\n(.*?)(?=^H=|\Z)", log, re.M | re.S):
        times = dict(re.findall(r"^(?:dispatch: )?(\S+_sp[ab]_\S+)\s+([\d.]+) µs", body, re.M))
        adaptive = next(float(t) for v, t in times.items() if "_spa_" in v)
        balanced = next(float(t) for v, t in times.items() if "_spb_" in v)
        assert re.search(rf"{balanced / adaptive:.2f}x (the adaptive split's time )?at {head}\b", design), head


def test_noise_and_cache_size_agree():
    readme = re.sub(r"\s+", " ", _doc("README.md"))
    perf = re.sub(r"\s+", " ", _doc("docs/performance.md"))
    assert "about 0.5 µs on the short rows and up to 7% on the batched ones" in readme
    assert "~0.5 µs on short rows and by up to 7% on batched rows" in perf
    assert "about 30 MB after the tests" in readme


# GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to hyphens, a
# repeated anchor numbered from -1.
def _anchors(text: str) -> set[str]:
    found: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = found.get(slug, 0)
        found[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_heading_links_resolve():
    docs = {name: _doc(name) for name in ("README.md", "docs/guide.md", "docs/design.md", "docs/performance.md",
                                          "benchmarks/README.md")}
    for name, text in docs.items():
        folder = (ROOT / name).parent
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            doc = (folder / target).resolve().relative_to(ROOT).as_posix() if target else name
            if doc in docs:
                assert anchor in _anchors(docs[doc]), f"{name}: link to {target}#{anchor} names no heading"


def test_family_and_tree_figures_are_the_latest_bench():
    """The families' distance from the floor on one long request, and a tree's cost over causal."""
    rows = [r for r in _bench()["rows"] if r["batch"] == 1 and r["prefix"] >= 65536]
    x = {f: [r["cells"][f]["us"] / r["floor_us"] for r in rows] for f in ("naive", "flash", "mma")}
    design = re.sub(r"\s+", " ", _doc("docs/design.md"))
    assert f"| {5 * round(min(x['naive']) / 5)}-{5 * round(max(x['naive']) / 5)}x the floor |" in design
    assert f"scalar FMA | {min(x['flash']):.0f}-{max(x['flash']):.0f}x |" in design
    assert f"the tensor cores | {min(x['mma']):.1f}-{max(x['mma']):.1f}x |" in design
    one = next(r for r in rows if (r["heads"], r["seqlen_q"], r["prefix"]) == (64, 9, 65536))
    naive, flash, mma = (one["cells"][f]["us"] / one["floor_us"] for f in ("naive", "flash", "mma"))
    guide = re.sub(r"\s+", " ", _doc("docs/guide.md"))
    assert (f"naive runs at about {10 * round(naive / 10)}× the floor, flash at {flash:.0f}× and mma at "
            f"{mma:.1f}×") in guide
    trees = _ratio_range("dispatch:tree") + _ratio_range("dispatch:tree-per-request")
    assert f"a random tree costs {min(trees):.2f}-{max(trees):.2f}x the causal time" in guide
