"""Precompile 'H,B,S,prefix=variant|variant' pairs into the disk cache (parallel, no GPU)."""
import sys

from mlagen.grids import parse_row
from mlagen.precompile import precompile
from mlagen.spec import parse_variant
from mlagen.workload import problem_for

jobs = []
for arg in sys.argv[1:]:
    row_s, vs = arg.split("=")
    problem = problem_for(parse_row(row_s), 64, "causal", "bf16")
    jobs += [(problem, parse_variant(v)) for v in vs.split("|") if v != "dispatch"]
for k, err in precompile(jobs, workers=8).items():
    print(k[1].name, err or "ok", flush=True)
