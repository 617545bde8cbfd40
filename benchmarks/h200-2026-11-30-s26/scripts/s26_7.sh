#!/bin/bash
# Session 26, call 7: the balanced seesaw's work list in pairs (this tree) against in tiles (dev/t_tiles):
# GPU tests of the balanced split, A/B in one process, then the bench.
export MLAGEN_CACHE_DIR=/tmp/c PYTHONUNBUFFERED=1 PYTHONPATH=.
J=("64,8,9,4096=mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a" "128,32,4,4096=mma_ht32_qt2_bn64_w8_st2_spb_tma_ss_sm90a"
   "64,1,9,131072=mma_ht64_qt1_bn64_w8_st2_spb_tma_ss_sm90a" "128,1,9,65536=mma_ht64_qt1_bn64_w8_st2_spb_p16_tma_ss_sm90a"
   "16,64,4,4096=mma_ht16_qt4_bn64_w8_st2_spb_p16_tma_ss_sm90a")
(python3 benchmarks/h200-2026-11-30-s26/scripts/pre_tree.py dev/t_tiles "${J[@]}" > $OUT/pre_tiles.txt 2>&1; python3 benchmarks/h200-2026-11-30-s26/scripts/pre_tree.py . "${J[@]}" > $OUT/pre_pairs.txt 2>&1) &
HYPOTHESIS_PROFILE=quick timeout 230 python3 -m pytest -q -m gpu tests/test_gpu_verify.py \
  -k "balanced_split_layouts or wgmma_schedules or dispatched_matches or split_merge_across" > $OUT/gpu_tests_balanced.log 2>&1
tail -n 3 $OUT/gpu_tests_balanced.log
wait
ROWS=("64,8,9,4096" "64,32,9,4096" "128,32,4,4096" "64,1,9,131072" "128,1,9,65536" "16,64,4,4096")
ARGS=(); for r in "${ROWS[@]}"; do ARGS+=("$r=tiles/dispatch|pairs/dispatch"); done
timeout 150 python3 benchmarks/ab_trees.py 2 tiles=dev/t_tiles,pairs=. "${ARGS[@]}" 2>&1 | grep -v Warn | tee $OUT/ab_pairs.txt
timeout 100 python3 cli.py bench --grid seed --grid serving --out $OUT/bench > $OUT/bench.log 2>&1
grep "worst\|ceilings" $OUT/bench/bench.md
