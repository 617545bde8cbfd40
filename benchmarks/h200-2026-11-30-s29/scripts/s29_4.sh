#!/bin/bash
# Session 29, call 4: tile B's first load issued after Q (b1) or after A's scores (b2), against main.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 560 python3 benchmarks/ab_trees.py 4 m=dev/t_main,b1=dev/t_b1,b2=dev/t_b2 '8,16,9,16384=m/dispatch|b1/dispatch|b2/dispatch' '8,16,9,8192=m/dispatch|b1/dispatch|b2/dispatch' '16,32,2,8192=m/dispatch|b1/dispatch|b2/dispatch' 2>&1 | tee $OUT/ab_first_b.txt
