#!/bin/bash
# Session 28, call 2: the transposed epilogue's column sums once (inv) against main, A/B in one
# process; merge blocks 8 vs 9 a 72-row group on the inv tree; the transposed GPU tests.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $OUT/gpu.txt 2>&1
HYPOTHESIS_PROFILE=quick timeout 150 python3 -m pytest -q -x tests/test_gpu_verify.py -k "transposed or split_merge" > $OUT/gpu_tests_tr.log 2>&1
tail -n 2 $OUT/gpu_tests_tr.log
timeout 260 python3 benchmarks/ab_trees.py 5 main=dev/t_main,inv=dev/t_inv \
  '8,16,9,16384=main/dispatch|inv/dispatch|main/dispatch|inv/dispatch' \
  '8,16,9,8192=main/dispatch|inv/dispatch' \
  '16,32,2,8192=main/dispatch|inv/dispatch' 2>&1 | grep -v Warn | tee $OUT/ab_inv.txt
timeout 150 python3 benchmarks/ab_constant.py 5 MERGE_TARGET_BLOCKS=128,144,128,144 8,16,9,16384 8,16,9,8192 2>&1 | grep -v Warn | tee $OUT/ab_merge_target.txt
