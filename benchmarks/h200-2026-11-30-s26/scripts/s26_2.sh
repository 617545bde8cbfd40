#!/bin/bash
# Session 26, call 2: merge blocks per launch (MERGE_TARGET_BLOCKS) swept in one process; traces; the GPU suite.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 330 python3 benchmarks/h200-2026-11-30-s26/scripts/ab_merge_target.py 3 128,64,40,27,18,9 64,1,9,1024 64,1,9,4096 64,1,33,1024 64,1,9,16384 64,1,33,4096 64,1,9,65536 64,8,9,4096 2>&1 | grep -v Warn | tee $OUT/ab_merge_target.txt
for t in 128 27; do for row in "64 1 9 4096" "64 1 9 1024"; do
  echo "== target $t $row warm gt"; timeout 60 python3 benchmarks/h200-2026-11-30-s26/scripts/trace_target.py $t $row 2>&1 | grep -v Warn | tail -n 4
done; done > $OUT/trace_target.txt 2>&1
cat $OUT/trace_target.txt
