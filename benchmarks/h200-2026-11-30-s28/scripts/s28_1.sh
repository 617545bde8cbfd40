#!/bin/bash
# Session 28, call 1: the split flags (streaming merge) — the split/merge GPU tests, then an A/B of
# main / flags / flags+inv template trees in one process.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } > $OUT/gpu.txt 2>&1
HYPOTHESIS_PROFILE=quick timeout 200 python3 -m pytest -q -x tests/test_gpu_verify.py -k "split or merge or balanced or back_to_back or transposed" > $OUT/gpu_tests_merge.log 2>&1
tail -n 3 $OUT/gpu_tests_merge.log
timeout 330 python3 benchmarks/ab_trees.py 3 main=dev/t_main,flags=dev/t_flags,inv=dev/t_inv \
  '8,16,9,16384=main/dispatch|flags/dispatch|inv/dispatch' \
  '8,16,9,8192=main/dispatch|flags/dispatch|inv/dispatch' \
  '64,1,9,1024=main/dispatch|flags/dispatch' \
  '64,1,9,4096=main/dispatch|flags/dispatch' \
  '64,1,33,1024=main/dispatch|flags/dispatch' \
  '16,64,4,4096=main/dispatch|flags/dispatch' \
  '64,8,9,4096=main/dispatch|flags/dispatch' 2>&1 | grep -v Warn | tee $OUT/ab_flags.txt
