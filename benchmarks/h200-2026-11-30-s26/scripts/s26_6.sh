#!/bin/bash
# Session 26, call 6: per-block traces of the balanced seesaw rows (which ranges end last).
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
for row in "64 8 9 4096" "64 32 9 4096"; do
  f=$(echo $row | tr ' ' '_')
  timeout 90 python3 benchmarks/trace_blocks.py $row --warm --gt > $OUT/trace_blocks_$f.txt 2>&1
  tail -n 3 $OUT/trace_blocks_$f.txt
done
python3 - <<'PY'
from mlagen import dispatch
print("ranges", dispatch.balanced_parts.__doc__[:80])
PY
