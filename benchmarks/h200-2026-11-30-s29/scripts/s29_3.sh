#!/bin/bash
# Session 29, call 3: the transposed TMA refill issued by four warps (dev/t_iss) against main.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 150 python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from ab_trees import use_templates
use_templates(Path('dev/t_iss'))
import trace_seesaw
trace_seesaw.main(8, 16, 9, 16384, 'mma_ht8_qt9_bn64_w8_st2_spb_p16_tma_tr_sm90a')" > $OUT/trace_iss.txt 2>&1
head -26 $OUT/trace_iss.txt
timeout 400 python3 benchmarks/ab_trees.py 4 m=dev/t_main,i=dev/t_iss '8,16,9,16384=m/dispatch|i/dispatch' '8,16,9,8192=m/dispatch|i/dispatch' 2>&1 | tee $OUT/ab_iss.txt
