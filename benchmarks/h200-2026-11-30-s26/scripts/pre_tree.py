"""Precompile 'H,B,S,prefix=variant|...' from the templates of TREE (first argument) into the disk cache."""
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from ab_trees import use_templates  # noqa: E402

from mlagen.grids import parse_row  # noqa: E402
from mlagen.precompile import precompile  # noqa: E402
from mlagen.spec import parse_variant  # noqa: E402
from mlagen.workload import problem_for  # noqa: E402

use_templates(Path(sys.argv[1]))
jobs = []
for arg in sys.argv[2:]:
    row_s, vs = arg.split("=")
    problem = problem_for(parse_row(row_s), 64, "causal", "bf16")
    jobs += [(problem, parse_variant(v)) for v in vs.split("|")]
for k, err in precompile(jobs, workers=8).items():
    print(k[1].name, err or "ok", flush=True)
