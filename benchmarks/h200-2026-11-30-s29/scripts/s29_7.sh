#!/bin/bash
# Session 29, call 7: the seesaw's first K1 issued once Q is in (dev/t_ss), against main (v56).
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 420 python3 benchmarks/ab_trees.py 3 m=dev/t_v56,s=dev/t_ss '16,64,4,4096=m/dispatch|s/dispatch|s/dispatch|m/dispatch' '64,8,9,4096=m/dispatch|s/dispatch' '128,32,4,4096=m/dispatch|s/dispatch' '64,1,9,65536=m/dispatch|s/dispatch' '64,1,9,4096=m/dispatch|s/dispatch' 2>&1 | tee $OUT/ab_ss_first.txt
