#!/bin/bash
# Session 28, call 5: the transposed tile's merge reads 10 16-bit partial rows a batch (one L2
# round trip a row for up to 10 splits) against 6, A/B in one process.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 240 python3 benchmarks/ab_trees.py 5 main=dev/t_main,b10=dev/t_b10 \
  '8,16,9,16384=main/dispatch|b10/dispatch|main/dispatch|b10/dispatch' \
  '8,16,9,8192=main/dispatch|b10/dispatch' \
  '16,32,2,8192=main/dispatch|b10/dispatch' 2>&1 | grep -v Warn | tee $OUT/ab_batch10.txt
