#!/bin/bash
# Session 28, call 6: the transposed epilogue's phases on v55 (8/16/9/16k, warm, globaltimer).
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 120 python3 dev/trace_epi.py 8 16 9 16384 > $OUT/trace_epi_8_16_9_16384.txt 2>&1
grep -v "Warn\|nanquantile\|return _nan" $OUT/trace_epi_8_16_9_16384.txt | tail -n 3
