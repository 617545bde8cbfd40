#!/bin/bash
# Session 26, call 8: more rounds of the pairs-vs-tiles A/B; the per-range trace of 64/8/9/4096 with pairs.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
ROWS=("64,8,9,4096" "16,64,4,4096" "64,32,9,4096")
ARGS=(); for r in "${ROWS[@]}"; do ARGS+=("$r=tiles/dispatch|pairs/dispatch"); done
timeout 200 python3 benchmarks/ab_trees.py 4 tiles=dev/t_tiles,pairs=. "${ARGS[@]}" 2>&1 | grep -v Warn | tee $OUT/ab_pairs_more.txt
timeout 60 python3 benchmarks/trace_blocks.py 64 8 9 4096 --warm --gt > $OUT/trace_blocks_64_8_9_4096_pairs.txt 2>&1
tail -n 2 $OUT/trace_blocks_64_8_9_4096_pairs.txt
