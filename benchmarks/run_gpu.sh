#!/usr/bin/env bash
# Runs mlagen's GPU tests, compute-sanitizer, tuning, the benchmark, ragged batches, host cost
# and fuzzing on this machine's GPU, as named steps, and writes each step's output to a results
# folder. It may be started from any folder: it runs in the repository root.
#
#   bash benchmarks/run_gpu.sh                 # tests verify sanitize bench: about 30 min on an H200
#   bash benchmarks/run_gpu.sh STEP...         # the named steps, in order
#
#   step       what it runs                                           time on the H200    timeout
#   tests      pytest -m gpu tests/, all but test_gpu_verify.py,      4 min cold, H100   540 s
#              on 12 pytest-xdist workers sharing the GPU
#   verify     pytest -m gpu tests/test_gpu_verify.py, 12 workers     under 3 min, H100   540 s
#   memcheck   compute-sanitizer memcheck on benchmarks/sanitize.py  2.5 min             300 s
#   synccheck  synccheck on the transposed tile and the fp8_ws and    under 1 min         150 s
#              fp8_mma and fp8_ldg schedules' tiles
#              (--only _tr_,feature+fp8_ws,feature+fp8_mma,fp8_ldg)
#   racecheck1 racecheck, all but the transposed tile (--skip _tr_),  3.5 min, cold       360 s
#              on the three small cases, every family (--cases 0-2)
#   racecheck2 the same on the balanced splits' and the P exchange's  4-5 min             480 s
#              cases (--cases 3-8)
#   racecheck3 the same on the engine features (--only feature+,     under 2 min         420 s
#              --skip _tr_): batch-invariant splits, FP8, context-parallel
#              shards, ragged rows, gathered keys
#   racecheck  racecheck1 racecheck2 racecheck3
#   sanitize   memcheck synccheck racecheck1 racecheck2 racecheck3
#   tune       mlagen tune, seed and serving grids, into the shipped   under 5 min         420 s
#              table mlagen/dispatch/tables/<gpu>.json (--write-default)
#   tune8      mlagen tune --kv e4m3, --kv ds_mla, then --kv e4m3     ~5 min, estimated  540 s
#              --q e4m3, serving grid (the FP8 inputs' entries of that table)
#   bench      mlagen bench, seed, serving and trees grids; the      under 2 min warm    585 s
#              dispatcher's pick under tree masks too, batch-invariant mode's and on FP8 inputs
#   ragged     benchmarks/ragged.py on three batch shapes, then       1-4 min             450 s
#              ragged_drafts.py with trees and causal
#   peers      benchmarks/build_flashmla.py: FlashMLA's sm90 decode   1 min, objects built  540 s
#              kernels from third_party/FlashMLA, for bench's (and bench --sparse's)
#              live FlashMLA column (objects compile where stale; the module links here);
#              then tests/test_live_peer.py's GPU tests on the build
#   sparse     benchmarks/flashmla_sparse_tests.py (FlashMLA's own    ~2 min, estimated  540 s
#              sparse test file, from third_party/FlashMLA; skipped
#              without it), then mlagen bench --sparse
#   host       benchmarks/host_cost.py                                10 s warm           120 s
#   fuzz       mlagen fuzz for 4 minutes                              4.5 min             330 s
#   facts      only gpu.txt (every run writes it first)
#
# "Cold" is an empty compile cache: every kernel compiles first (the sanitizer steps compile
# theirs again, with line info). Compiled kernels go to $MLAGEN_CACHE_DIR, /tmp/mlagen-cache
# unless it is set. Run `tune` (and `tune8`) before `bench`, since bench times the dispatcher's
# picks from the table tune writes; users tuning for their own GPU run `mlagen tune` instead,
# which leaves the shipped table alone.
#
# Each step writes into benchmarks/results/<gpu>/ (<gpu>: the GPU's name as a short slug,
# "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3), or into RESULTS=dir,
# replacing the files of the same name there:
#   every run  gpu.txt (GPU name, driver, clocks, date, torch, CuPy and NVRTC versions)
#   tests      gpu_tests.log            verify     gpu_verify.log
#   memcheck, synccheck, racecheck1-3   sanitize_<step>.log
#   tune       tune.log                 tune8      tune8.log
#   bench      bench.json, bench.md, bench.png
#   ragged     ragged.log               host       host_cost.log        fuzz    fuzz.log
#   sparse     flashmla_sparse_tests.txt and .log, sparse.json, sparse.md     peers   flashmla_build.log
#
# COPY_TO=dir also copies the files of each step to dir/<gpu>/ as soon as the step ends (and the
# tuned table to dir/tables/), so a run that is stopped part-way leaves the finished steps there.
#
# The timeout is a safety limit, well above the step's usual time: a step that runs past it is
# stopped and counts as failed. Later steps still run, and the script exits non-zero when any
# step failed or timed out.
set -uo pipefail

STEPS="tests verify memcheck synccheck racecheck1 racecheck2 racecheck3 racecheck sanitize tune tune8 peers bench ragged sparse host fuzz facts"
DEFAULT_STEPS="tests verify sanitize bench"
# The GPU tests' pytest-xdist workers: one process takes over 9 minutes for the tests step, since most
# of its time is NVRTC compiles and host work that workers overlap; the kernels share the GPU.
TEST_WORKERS=${TEST_WORKERS:-12}
# Each step's timeout in seconds (ragged: all its runs together), a safety limit against a hung step.
declare -A LIMIT=([tests]=540 [verify]=540 [memcheck]=300 [synccheck]=150 [racecheck1]=360 [racecheck2]=480 [racecheck3]=420 [tune]=420 [tune8]=540
                  [peers]=540 [bench]=585 [ragged]=450 [sparse]=540 [host]=120 [fuzz]=330 [facts]=0)

usage() {
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

# The GPU's name as a folder name: "NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100-80gb-hbm3.
gpu_slug() {
  local name=${1#NVIDIA }
  name=$(printf '%s' "$name" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-')
  name=${name#-}
  printf '%s\n' "${name%-}"
}

# Checks every step name before anything runs; prints the steps, `sanitize` expanded.
expand_steps() {
  local step out=()
  for step in "$@"; do
    case " $STEPS " in
      *" $step "*) ;;
      *) echo "run_gpu.sh: unknown step '$step' (steps: $STEPS)" >&2; return 2 ;;
    esac
    case $step in
      sanitize) out+=(memcheck synccheck racecheck1 racecheck2 racecheck3) ;;
      racecheck) out+=(racecheck1 racecheck2 racecheck3) ;;
      *) out+=("$step") ;;
    esac
  done
  echo "${out[@]}"
}

main() {
  if [[ $# -gt 0 && ( $1 == -h || $1 == --help ) ]]; then
    usage
    return 0
  fi
  if [[ $# -eq 0 ]]; then
    set -- $DEFAULT_STEPS
    echo "run_gpu.sh: no steps named, so $DEFAULT_STEPS (about 30 min on an H200; --help lists the steps)" >&2
  fi
  local steps
  steps=$(expand_steps "$@") || return 2
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "run_gpu.sh: no GPU here (nvidia-smi not found); run it on a machine with an NVIDIA GPU and its driver" >&2
    return 1
  fi
  local root name driver slug
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  cd "$root" || return 1
  IFS=, read -r name driver < <(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)
  name=$(echo "$name" | xargs) driver=$(echo "$driver" | xargs)
  if [[ -z $name ]]; then
    echo "run_gpu.sh: nvidia-smi names no GPU" >&2
    return 1
  fi
  slug=$(gpu_slug "$name")
  local results=${RESULTS:-benchmarks/results/$slug}
  mkdir -p "$results"
  export PYTHONPATH=$root PYTHONUNBUFFERED=1 MLAGEN_CACHE_DIR=${MLAGEN_CACHE_DIR:-/tmp/mlagen-cache}

  local written=(gpu.txt) failed=() tables=() step start rc
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "name: $name"
    echo "driver: $driver"
    echo "clocks: $(nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader | head -n 1) (sm, memory)"
    python3 -c "import torch, cupy; from cupy.cuda import nvrtc; print('torch:', torch.__version__); \
print('cupy:', cupy.__version__); print('nvrtc: %d.%d' % nvrtc.getVersion())" 2>&1
  } >"$results/gpu.txt"
  cat "$results/gpu.txt"
  copy_done() {   # COPY_TO=dir: the files the steps so far wrote, to dir/<gpu>/ (tables to dir/tables/)
    [[ -n ${COPY_TO:-} ]] || return 0
    mkdir -p "$COPY_TO/$slug"
    local f
    for f in "${written[@]}"; do
      [[ -f $results/$f ]] && cp "$results/$f" "$COPY_TO/$slug/"
    done
    if [[ ${#tables[@]} -gt 0 ]]; then
      mkdir -p "$COPY_TO/tables" && cp "${tables[@]}" "$COPY_TO/tables/"
    fi
  }

  for step in $steps; do
    start=$SECONDS
    echo "== $step (results in $results)"
    case $step in
      tests)
        timeout ${LIMIT[tests]} python3 -m pytest -q -m gpu -n "$TEST_WORKERS" tests/ --ignore=tests/test_gpu_verify.py 2>&1 |
          tee "$results/gpu_tests.log"
        rc=${PIPESTATUS[0]}; written+=(gpu_tests.log) ;;
      verify)   # the kernels against the fp64 reference, family by family
        timeout ${LIMIT[verify]} python3 -m pytest -q -m gpu -n "$TEST_WORKERS" tests/test_gpu_verify.py 2>&1 |
          tee "$results/gpu_verify.log"
        rc=${PIPESTATUS[0]}; written+=(gpu_verify.log) ;;
      memcheck | synccheck | racecheck1 | racecheck2 | racecheck3)
        # -lineinfo: each report names its source lines. racecheck does not pair bar.arrive with
        # bar.sync: the transposed tile (_tr_), whose warpgroups hand over through them, gets
        # synccheck instead (and tests/test_gpu_verify.py's bitwise-repeatability test). The
        # fp8_ws, fp8_mma and fp8_ldg tiles, whose producer keeps barriers of its own, get both.
        local pick=()
        [[ $step == synccheck ]] && pick=(--only _tr_,feature+fp8_ws,feature+fp8_mma,fp8_ldg)
        [[ $step == racecheck1 ]] && pick=(--skip _tr_ --cases 0-2)
        [[ $step == racecheck2 ]] && pick=(--skip _tr_ --cases 3-8)
        [[ $step == racecheck3 ]] && pick=(--only feature+ --skip _tr_)
        MLAGEN_LINEINFO=1 timeout "${LIMIT[$step]}" compute-sanitizer --tool "${step%[123]}" --print-limit 20 \
          --error-exitcode 1 \
          python3 benchmarks/sanitize.py "${pick[@]}" 2>&1 | tee "$results/sanitize_$step.log"
        rc=${PIPESTATUS[0]}; written+=("sanitize_$step.log") ;;
      tune)
        timeout ${LIMIT[tune]} python3 cli.py tune --grid seed --grid serving --write-default 2>&1 | tee "$results/tune.log"
        rc=${PIPESTATUS[0]}; written+=(tune.log); tables=(mlagen/dispatch/tables/*.json) ;;
      tune8)    # each FP8 cache format in turn, then e4m3 queries over e4m3, a third of the step's time each
        rc=0; : > "$results/tune8.log"
        for formats in "--kv e4m3" "--kv ds_mla" "--kv e4m3 --q e4m3"; do
          timeout $(( ${LIMIT[tune8]} / 3 )) python3 cli.py tune --grid serving $formats --write-default 2>&1 |
            tee -a "$results/tune8.log"
          [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
        done
        written+=(tune8.log); tables=(mlagen/dispatch/tables/*.json) ;;
      bench)
        timeout ${LIMIT[bench]} python3 cli.py bench --grid seed --grid serving --grid trees --mask causal,tree,tree-per-request \
          --batch-invariant --fp8 e4m3,ds_mla --out "$results"
        rc=$?; written+=(bench.json bench.md bench.png) ;;
      ragged)   # batches of mixed lengths (the bench's rows are uniform): dispatch vs adaptive vs balanced;
                # then mixed draft counts against even ones, with trees and causal
        {
          for shape in "64 32 9 256 16384" "64 64 2 256 16384" "8 16 9 256 16384"; do
            # shellcheck disable=SC2086
            timeout $((LIMIT[ragged] / 4)) python3 benchmarks/ragged.py $shape 2>&1 || echo "ragged.py $shape: rc $?" >&2
          done
          for mask in tree causal; do
            timeout $((LIMIT[ragged] / 8)) python3 benchmarks/ragged_drafts.py --mask $mask 2>&1 ||
              echo "ragged_drafts.py --mask $mask: rc $?" >&2
          done
        } 2>&1 | tee "$results/ragged.log"
        rc=0; grep -q "^ragged.*py .*: rc " "$results/ragged.log" && rc=1
        written+=(ragged.log) ;;
      peers)    # FlashMLA built from its checkout, so that bench and bench --sparse time it live; then
                # the GPU tests that call the build (they skip without it, so the tests step, which runs
                # first, skips them on a fresh machine)
        timeout ${LIMIT[peers]} python3 benchmarks/build_flashmla.py 2>&1 | tee "$results/flashmla_build.log"
        rc=${PIPESTATUS[0]}
        if [[ $rc -eq 0 ]]; then
          timeout 120 python3 -m pytest -q -rs -m gpu tests/test_live_peer.py 2>&1 | tee -a "$results/flashmla_build.log"
          rc=${PIPESTATUS[0]}
        fi
        written+=(flashmla_build.log) ;;
      sparse)   # FlashMLA's sparse test file where its checkout is, then the sparse grid's timings
        rc=0
        if [[ -d third_party/FlashMLA ]]; then
          timeout $((LIMIT[sparse] / 2)) python3 benchmarks/flashmla_sparse_tests.py \
            --out "$results/flashmla_sparse_tests.txt" > "$results/flashmla_sparse_tests.log" 2>&1 || rc=1
          written+=(flashmla_sparse_tests.txt flashmla_sparse_tests.log)
        else
          echo "sparse: no third_party/FlashMLA checkout, so FlashMLA's sparse test file is skipped" >&2
        fi
        timeout $((LIMIT[sparse] / 2)) python3 cli.py bench --sparse --format markdown --out "$results" 2>&1 || rc=1
        written+=(sparse.json sparse.md) ;;
      host)
        timeout ${LIMIT[host]} python3 benchmarks/host_cost.py 2>&1 | tee "$results/host_cost.log"
        rc=${PIPESTATUS[0]}; written+=(host_cost.log) ;;
      fuzz)     # random shapes through the dispatcher's pick for 4 minutes
        timeout ${LIMIT[fuzz]} python3 cli.py fuzz --minutes 4 2>&1 | tee "$results/fuzz.log"
        rc=${PIPESTATUS[0]}; written+=(fuzz.log) ;;
      facts)
        rc=0 ;;
    esac
    echo "== $step: rc $rc, $((SECONDS - start)) s"
    [[ $rc -ne 0 ]] && failed+=("$step")
    copy_done   # after every step: a run stopped part-way has copied the steps it finished
  done
  if [[ ${#failed[@]} -gt 0 ]]; then
    echo "run_gpu.sh: failed: ${failed[*]}" >&2
    return 1
  fi
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
  exit $?
fi
