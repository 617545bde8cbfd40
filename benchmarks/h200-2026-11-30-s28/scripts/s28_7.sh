#!/bin/bash
# Session 28, call 7: the balanced split's segment cost (SEGMENT_TILES 2 = one pair, against 3 =
# two pairs) now that v55 made the transposed tile's segment end cheaper; A/B in one process.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 280 python3 benchmarks/ab_constant.py 4 SEGMENT_TILES=3,2,3,2 8,16,9,16384 8,16,9,8192 64,8,9,4096 16,64,4,4096 2>&1 | grep -v Warn | tee $OUT/ab_segment_tiles.txt
