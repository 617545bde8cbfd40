#!/bin/bash
# Session 26, call 1: session 25's unrun test first, the GPU suite, then unsplit variants on the short rows.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $OUT/gpu.txt 2>&1
V="mma_ht64_qt1_bn64_w8_st2_sp1_tma_sm90a|mma_ht64_qt1_bn64_w8_st2_sp1_sm90a|mma_ht16_qt4_bn64_w8_st2_sp1_tma_sm90a|mma_ht32_qt2_bn64_w8_st2_sp1_tma_sm90a|mma_ht64_qt1_bn64_w8_st1_sp1_tma_sm90a|mma_ht64_qt1_bn64_w8_st2_sp1_tma_ss_sm90a"
(python3 benchmarks/h200-2026-11-30-s26/scripts/pre.py "64,1,33,256=$V" "64,1,9,256=$V" > $OUT/pre.txt 2>&1) &
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_bench.py -k "measure_meets_every_cache" > $OUT/gpu_test_measure.log 2>&1
tail -n 3 $OUT/gpu_test_measure.log
wait
C=$(echo "dispatch|$V" | sed 's/|/|main\//g; s/^/main\//')
timeout 150 python3 benchmarks/ab_trees.py 3 main=. "64,1,33,256=$C" "64,1,9,256=$C" 2>&1 | tee $OUT/ab_unsplit.txt
for v in mma_ht64_qt1_bn64_w8_st2_sp1_tma_sm90a mma_ht16_qt4_bn64_w8_st2_sp1_tma_sm90a; do
  echo "== $v 64/1/33/256 warm gt"; timeout 60 python3 benchmarks/trace_blocks.py 64 1 33 256 $v --warm --gt 2>&1 | grep -v Warn | tail -n 4
done > $OUT/trace_unsplit.txt 2>&1
cat $OUT/trace_unsplit.txt
HYPOTHESIS_PROFILE=quick timeout 280 python3 -m pytest -q -m gpu tests/ > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
