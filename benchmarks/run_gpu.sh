#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: GPU facts, GPU tests, compute-sanitizer,
# tuning, benchmark, host cost. Logs go to $OUT (the device tool's folder) or ./out.
#   bash benchmarks/run_gpu.sh [tests] [sanitize] [tune] [bench] [ragged] [host] [fuzz]
# (default: tests sanitize bench). `tune` rewrites the shipped table (mlagen/tables/) and copies
# it to $OUT, so run it before `bench`. On the H200, racecheck alone takes ~5 min (memcheck less):
# give `sanitize` a device call of its own.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MLAGEN_CACHE_DIR=${MLAGEN_CACHE_DIR:-/tmp/mlagen-cache}
steps=${*:-tests sanitize bench}

{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import torch, cupy; from cupy.cuda import nvrtc; print('torch', torch.__version__, 'cupy', cupy.__version__, 'nvrtc', nvrtc.getVersion())"; } 2>&1 | tee "$OUT/gpu.txt"

for step in $steps; do
  case $step in
    tests)
      timeout 420 python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" ;;
    sanitize)
      # -lineinfo: each report names its source lines. racecheck does not pair bar.arrive with
      # bar.sync: the transposed tile (_tr_), whose warpgroups hand over through them, gets
      # synccheck instead (and tests/test_gpu_verify.py's bitwise-repeatability test).
      for check in "memcheck " "racecheck -_tr_" "synccheck _tr_"; do
        set -- $check
        MLAGEN_LINEINFO=1 timeout 480 compute-sanitizer --tool $1 --print-limit 20 python3 benchmarks/sanitize.py ${2:-} 2>&1 \
          | tail -n 40 | tee "$OUT/sanitize_$1.log"
      done ;;
    tune)
      timeout 300 python3 cli.py tune --grid seed --grid serving --write-default 2>&1 | tail -n 40 | tee "$OUT/tune.log"
      cp mlagen/tables/*.json "$OUT/" ;;
    bench)
      timeout 400 python3 cli.py bench --grid seed --grid serving --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" ;;
    ragged)   # batches of mixed lengths (the bench's rows are uniform): dispatch vs adaptive vs balanced
      for shape in "64 32 9 256 16384" "64 64 2 256 16384" "8 16 9 256 16384"; do
        timeout 120 python3 benchmarks/ragged.py $shape 2>&1
      done | tee "$OUT/ragged.log" ;;
    host)
      timeout 120 python3 benchmarks/host_cost.py 2>&1 | tee "$OUT/host.log" ;;
    fuzz)     # random shapes through the dispatcher's pick for 4 minutes
      timeout 330 python3 cli.py fuzz --minutes 4 --cases 100000 2>&1 | tee "$OUT/fuzz.log" ;;
    *)
      echo "unknown step $step (tests, sanitize, tune, bench, ragged, host, fuzz)"; exit 2 ;;
  esac
done
