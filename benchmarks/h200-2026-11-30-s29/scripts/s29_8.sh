#!/bin/bash
# Session 29, call 8: synccheck on v56's transposed variants (its warpgroups hand over by named barriers).
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
MLAGEN_LINEINFO=1 timeout 300 compute-sanitizer --tool synccheck python3 benchmarks/sanitize.py _tr_ > $OUT/synccheck_tr.log 2>&1
grep -E "ERROR SUMMARY|passed|failed" $OUT/synccheck_tr.log | tail -n 3
