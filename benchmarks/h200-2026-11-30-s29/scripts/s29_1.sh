#!/bin/bash
# Session 29, call 1: the transposed pair traced on main (v55): TMA (the table's pick) and cp.async.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
for v in mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a mma_ht8_qt9_bn64_w8_st2_spb_p16_tr_sm90a; do
  timeout 200 python3 benchmarks/trace_seesaw.py 8 16 9 16384 $v > $OUT/trace_$v.txt 2>&1
  head -40 $OUT/trace_$v.txt
done
