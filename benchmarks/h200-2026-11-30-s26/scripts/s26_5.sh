#!/bin/bash
# Session 26, call 5: when Q lands against the first KV tile (stamp 12 against stamp 2), warm and cold.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
for row in "64 1 9 1024" "64 1 9 4096" "64 1 33 1024" "64 1 9 16384" "64 8 9 4096"; do
  echo "== $row warm gt"; timeout 60 python3 benchmarks/trace_blocks.py $row --warm --gt 2>&1 | grep -v "Warn\|nanquantile" | tail -n 3
  echo "== $row cold gt"; timeout 60 python3 benchmarks/trace_blocks.py $row --gt 2>&1 | grep -v "Warn\|nanquantile" | tail -n 3
done > $OUT/trace_q.txt 2>&1
cat $OUT/trace_q.txt
