#!/bin/bash
# Session 28, call 4: 8/16/9/16k traced on v55 (warm, globaltimer): where the segment's end goes now.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 120 python3 benchmarks/trace_blocks.py 8 16 9 16384 --warm --gt > $OUT/trace_8_16_9_16384_warm.txt 2>&1
grep -v "Warn\|nanquantile\|return _nan" $OUT/trace_8_16_9_16384_warm.txt | tail -n 4
timeout 120 python3 benchmarks/trace_blocks.py 8 16 9 8192 --warm --gt > $OUT/trace_8_16_9_8192_warm.txt 2>&1
grep -v "Warn\|nanquantile\|return _nan" $OUT/trace_8_16_9_8192_warm.txt | tail -n 4
