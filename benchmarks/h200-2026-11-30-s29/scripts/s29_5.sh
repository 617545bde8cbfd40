#!/bin/bash
# Session 29, call 5: v56 on main — the GPU suite, memcheck on the transposed variants, the bench.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $OUT/gpu.txt 2>&1
HYPOTHESIS_PROFILE=quick timeout 330 python3 -m pytest -q -m gpu tests/ > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
MLAGEN_LINEINFO=1 timeout 100 compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py _tr_ > $OUT/memcheck_tr.log 2>&1
grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck_tr.log | tail -n 3
timeout 140 python3 cli.py bench --grid seed --grid serving --out $OUT/bench > $OUT/bench.log 2>&1
grep -E "^\| " $OUT/bench/bench.md | head -30; grep "worst\|ceilings" $OUT/bench/bench.md
