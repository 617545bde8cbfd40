#!/bin/bash
# Session 26, call 3: more merge blocks on the batched rows (MERGE_TARGET_BLOCKS above 128), then the GPU suite.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 240 python3 benchmarks/h200-2026-11-30-s26/scripts/ab_merge_target.py 3 128,256,512,1024 64,8,9,4096 64,32,9,4096 128,32,4,4096 64,64,2,8192 64,128,1,4096 16,64,4,4096 2>&1 | grep -v Warn | tee $OUT/ab_merge_target_batched.txt
HYPOTHESIS_PROFILE=quick timeout 330 python3 -m pytest -q -m gpu tests/ > $OUT/gpu_tests.log 2>&1
tail -n 3 $OUT/gpu_tests.log
