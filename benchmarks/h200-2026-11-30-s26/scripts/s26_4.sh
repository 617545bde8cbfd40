#!/bin/bash
# Session 26, call 4: the two memory-bound target rows re-tuned under session 25's timing; the bench.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 360 python3 cli.py tune --row 8,16,9,16384 --row 16,64,4,4096 --write-default > $OUT/tune.log 2>&1
tail -n 12 $OUT/tune.log
cp mlagen/tables/h200.json $OUT/h200.json
timeout 150 python3 cli.py bench --grid seed --grid serving --out $OUT/bench > $OUT/bench.log 2>&1
grep -E "^\| (16|8) \|" $OUT/bench/bench.md; grep "worst\|ceilings" $OUT/bench/bench.md
