#!/bin/bash
# Session 29, call 6: v56 against v55 again (order alternated), then a second bench of v56.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 300 python3 benchmarks/ab_trees.py 3 m=dev/t_main,v=dev/t_v56 '8,16,9,16384=m/dispatch|v/dispatch|v/dispatch|m/dispatch' '16,32,2,8192=m/dispatch|v/dispatch|v/dispatch|m/dispatch' '8,16,9,4096=m/dispatch|v/dispatch' 2>&1 | tee $OUT/ab_v56.txt
timeout 140 python3 cli.py bench --grid seed --grid serving --out $OUT/bench > $OUT/bench.log 2>&1
grep -E "^\| (8|16) " $OUT/bench/bench.md; grep "worst\|ceilings" $OUT/bench/bench.md
