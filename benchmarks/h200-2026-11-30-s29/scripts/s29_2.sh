#!/bin/bash
# Session 29, call 2: the refill issue probed; PDL in graphs on the memory-bound rows A/B'd.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 200 python3 dev/probe_issue.py 8 16 9 16384 mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a 2>&1 | tee $OUT/probe_issue.txt
timeout 380 python3 benchmarks/ab_constant.py 3 dispatch.PDL_TILES_PER_SM=24,40 8,16,9,16384 16,64,4,4096 8,16,9,8192 2>&1 | tee $OUT/ab_pdl.txt
