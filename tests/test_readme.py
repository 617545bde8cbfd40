"""The README is the user's first page: its performance table is the latest H200 bench, pasted
as `mlagen bench` wrote it, and it stays short."""

from pathlib import Path

from mlagen.tools.report import from_json, summary_markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "h200"


def test_readme_table_is_the_latest_h200_bench():
    table = summary_markdown(from_json((RESULTS / "bench.json").read_text()))
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index(table[0])
    assert readme[start:start + len(table)] == table, (
        "README's performance table differs from benchmarks/results/h200/bench.json: paste the summary "
        "table of benchmarks/results/h200/bench.md")
    assert "\n".join(table) in (RESULTS / "bench.md").read_text()


def test_results_name_the_gpu_driver_and_date():
    meta = from_json((RESULTS / "bench.json").read_text()).meta
    assert meta["gpu"].startswith("NVIDIA H200") and meta["driver"] and meta["date_utc"]
    gpu = (RESULTS / "gpu.txt").read_text()
    assert "H200" in gpu and meta["driver"] in gpu


def test_readme_stays_a_short_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail to docs/"
