#!/usr/bin/env bash
# One GPU session for the real batcher (issue 5), under 200 s of script time in all:
#   bench (skipped with BATCHSIM_GPU_BENCH=0): DynamicBatcher (CUDA graphs on and off) vs
#          the offline end-to-end peak (eager, and with a CUDA graph) and the naive
#          batcher, for each zoo model x max_batch_size {32, 128, 8}
#          -> $OUT/bench_gpu_<device>.json (rewritten after every configuration)
#          and a table at the end; it starts no configuration that would end after BUDGET_S
#          (default 165) seconds, and the whole script is killed HARD_S (default 195) seconds
#          after it started;
#   profiles (only with BATCHSIM_GPU_PROFILES=1, about 2 more minutes, outside HARD_S):
#          end-to-end profiles of the zoo at float32 and bfloat16 and the compute-only s(b)
#          next to the H200 reference;
#   placement (only with BATCHSIM_GPU_PLACEMENT=1, about 100 s more, outside HARD_S):
#          saturated throughput with the batcher's threads on all CPUs, 1, 2 or 4, and
#          with a shorter switch interval -> $OUT/placement_gpu_<device>.json;
#   pinning (only with BATCHSIM_GPU_PINNING=1, about a minute per model, outside HARD_S):
#          the encoder and the CNN at bfloat16, batcher after batcher at two
#          configurations, its threads where the OS puts them or pinned one per CPU
#          (bench_thread_pinning.py: do the rows' own speeds come from where the threads
#          land?) -> $OUT/thread_pinning_<model>.{json,log};
#   one worker (only with BATCHSIM_GPU_ONE_WORKER=1, about a minute per model, outside
#          HARD_S): the same, one worker each, through the pipeline of threads or a
#          thread per worker (bench_one_worker.py: what do the pipeline's hand-overs
#          cost a batch when there is nothing to overlap?) -> $OUT/one_worker_<model>.{json,log};
#   fidelity (only with BATCHSIM_GPU_FIDELITY=1, about 5 minutes more on an H200: the
#          encoder 3.5, the CNN 1.5; outside HARD_S): the simulator calibrated on the
#          encoder and the CNN at bfloat16 against the real batcher, quick grid, Poisson
#          (two seeds) and bursts, and a second calibration after the grid, with the
#          process on CPUs BATCHSIM_GPU_CPUS (default: the third to eighth of its CPUs,
#          2-7 on most machines, where it has 8 or more, as the pinning and one-worker
#          parts; empty: wherever the OS puts its threads), each kept awake by a spinner
#          at the lowest priority (bench_fidelity.py --cpu; bench/results/README.md: on
#          an H200 it took the calibration's size-by-idle pattern away and halved the
#          spread of the rows' speeds) -> $OUT/fidelity_<model>_bfloat16.json, and both
#          calibrations with their runs and the grid's real runs ->
#          fidelity_<model>_runs.pkl.gz (to refit and re-simulate them elsewhere;
#          bench_fidelity.py; the fast engine simulates, so SimPy need not be there; beside
#          the archive when packed: 3-9 MB each), and
#          their batches against the calibration's prediction, by size, trigger, idle time
#          and requests received -> $OUT/batch_residuals_<model>_bfloat16.{json,log}
#          (bench_batch_residuals.py), and the rate at which the simulator serves each
#          row's backlogs against the real batcher -> $OUT/backlog_<model>_bfloat16.{json,log}
#          (bench_backlog.py). BATCHSIM_GPU_PAIR=1 then runs the CNN again the same way
#          with its threads where the OS puts them (<model> cnn_os_placed; about 1.5
#          minutes more): the other half of a pair on one machine. BATCHSIM_GPU_PIN_THREADS=1
#          pins the event loop to the first of those CPUs and each batcher's threads one
#          per CPU on the others (bench_fidelity.py --pin-threads). BATCHSIM_GPU_MODELS
#          (default "encoder cnn") names the models to run; BATCHSIM_GPU_DURATION_S sets
#          each row's seconds of traffic (default the quick grid's 0.5; a quick row's
#          handful of bursts did not repeat its own p50 within 8.5-15.8% on an H200, so
#          1.5 asks whether longer rows do; about 3x the time). BATCHSIM_GPU_PIPELINE=0
#          serves the calibration and every row with a thread per worker instead of the
#          pipeline of threads (bench_fidelity.py --no-pipeline). Where nvidia-smi is,
#          the GPU's clocks are logged every 50 ms during each run -> gpu_clocks_<model>.csv,
#          and set beside its batches -> gpu_clocks_<model>_bfloat16.{json,log}
#          (bench_gpu_clocks.py: did the rows that ran slow run at lower clocks?).
# Each part is its own process under its own time limit, and every JSON is written as soon as
# its numbers exist, so a failure or a timeout keeps everything measured before it. A CUDA
# graph capture that fails falls back to the eager model and is reported in the JSON and log.
# Needs $PYTHON (default python3) with torch and numpy; no install: run from anywhere.
# Exits 1 if any part failed (the others still ran).
#   OUT=/some/dir bash bench/gpu_session.sh                      # on a GPU machine
#   PYTHON=.venv/bin/python BATCHSIM_GPU_DRY=1 OUT=/tmp/x bash bench/gpu_session.sh
#                                                                # CPU dry run, seconds
# BATCHSIM_GPU_PACK=1: the parts write under a temporary folder, packed into
# $OUT/all.tar.gz (as parts/...) after each part, for a lent machine that hands back only a
# few of the files under $OUT, and at most 16 MB each; the fidelity part's pickles stay
# beside the archive. So $OUT holds only those, even when the command is cut off midway.
set -u
start=$SECONDS
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/results}
PACKED=$OUT
mkdir -p "$PACKED"
if [ "${BATCHSIM_GPU_PACK:-0}" = 1 ]; then
    PARTS_ROOT=$(mktemp -d)
    trap 'rm -rf "$PARTS_ROOT"' EXIT
    OUT=$PARTS_ROOT/parts
fi
pack() {  # the new archive replaces the old one whole: a cut-off tar leaves the last
    if [ "${BATCHSIM_GPU_PACK:-0}" = 1 ]; then
        tar -czf "$PACKED/.all.tar.gz.new" -C "$PARTS_ROOT" parts &&
            mv "$PACKED/.all.tar.gz.new" "$PACKED/all.tar.gz"
    fi
}
# The third to eighth of this process's CPUs, where it has 8 or more (the first two left to
# the machine's own work); numbered as the OS numbers them, which need not start at 0.
SIX_CPUS=$("$PYTHON" -c 'import os; c = sorted(os.sched_getaffinity(0))
print(",".join(map(str, c[2:8])) if len(c) >= 8 else "")')
FAILED=0
ended() {  # a part's name and exit code: said in the log, and in the script's own exit code
    echo "$1 exit $2 after $((SECONDS - start)) s"
    if [ "$2" != 0 ]; then FAILED=1; fi
}
BUDGET_S=${BUDGET_S:-165}
HARD_S=${HARD_S:-195}
DRY=()
if [ -n "${BATCHSIM_GPU_DRY:-}" ]; then DRY=(--dry-run); fi
mkdir -p "$OUT"

timeout 20 "$PYTHON" - <<'PY'
import os, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available(), "cpus", os.cpu_count())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
PY
command -v nvidia-smi >/dev/null && timeout 10 nvidia-smi \
    --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv

# What is left of HARD_S, less 5 s for the kill, bounds the bench; its budget fits inside.
left=$((HARD_S - (SECONDS - start) - 5))
budget=$(( BUDGET_S < left - 20 ? BUDGET_S : left - 20 ))
if [ "$budget" -lt 1 ]; then budget=1; fi
if [ "${BATCHSIM_GPU_BENCH:-1}" = 1 ]; then
    echo "== bench: DynamicBatcher vs the offline peak and the naive batcher (budget" \
         "${budget} s, killed after ${left} s) =="
    timeout -k 5 "$left" "$PYTHON" bench/bench_gpu.py bench --out-dir "$OUT" \
        --budget-s "$budget" "${DRY[@]}" 2>&1 | tee "$OUT/bench.log"
    ended "bench" "${PIPESTATUS[0]}"
    pack
fi

if [ "${BATCHSIM_GPU_PLACEMENT:-0}" = 1 ]; then
    echo "== placement: the batcher's threads on all CPUs, 1, 2 or 4 =="
    timeout -k 5 150 "$PYTHON" bench/bench_gpu_placement.py --out-dir "$OUT" "${DRY[@]}" \
        2>&1 | tee "$OUT/placement.log"
    ended "placement" "${PIPESTATUS[0]}"
    pack
fi

if [ "${BATCHSIM_GPU_PROFILES:-0}" = 1 ]; then
    echo "== profiles and the reference check =="
    timeout -k 5 130 "$PYTHON" bench/bench_gpu.py profiles --out-dir "$OUT" "${DRY[@]}" \
        2>&1 | tee "$OUT/profiles.log"
    ended "profiles" "${PIPESTATUS[0]}"
    pack
fi

benches=()
if [ "${BATCHSIM_GPU_PINNING:-0}" = 1 ]; then benches+=(thread_pinning); fi
if [ "${BATCHSIM_GPU_ONE_WORKER:-0}" = 1 ]; then benches+=(one_worker); fi
for bench in "${benches[@]}"; do
    echo "== $bench: batcher after batcher =="
    if [ -n "${BATCHSIM_GPU_DRY:-}" ]; then
        runs=(mlp) ARGS=(--quick)
    else
        runs=(encoder cnn) ARGS=(--device cuda --dtype bfloat16)
        if [ "$bench" = thread_pinning ]; then ARGS+=(--size default); fi
        if [ -n "$SIX_CPUS" ]; then ARGS+=(--cpu "$SIX_CPUS"); fi
    fi
    for model in "${runs[@]}"; do
        timeout -k 5 150 "$PYTHON" "bench/bench_${bench}.py" --model "$model" "${ARGS[@]}" \
            --out "$OUT/${bench}_${model}.json" 2>&1 | tee "$OUT/${bench}_${model}.log"
        ended "$bench $model" "${PIPESTATUS[0]}"
        pack
    done
done

if [ "${BATCHSIM_GPU_FIDELITY:-0}" = 1 ]; then
    echo "== fidelity: the calibrated simulator against the real batcher =="
    PIN=()
    if [ -n "${BATCHSIM_GPU_DRY:-}" ]; then
        # the CPU takes the path CUDA takes by default: s(b) timed through the batcher
        dtype=float32 FID=(--device cpu --size tiny --duration-s 0.05 --profile batcher)
    else
        dtype=bfloat16 FID=(--device cuda --size default)
        if [ "${BATCHSIM_GPU_PIPELINE:-1}" = 0 ]; then FID+=(--no-pipeline); fi
        cpus=${BATCHSIM_GPU_CPUS-$SIX_CPUS}
        if [ -n "$cpus" ]; then PIN=(--cpu "$cpus"); fi
        if [ -n "$cpus" ] && [ "${BATCHSIM_GPU_PIN_THREADS:-0}" = 1 ]; then
            PIN+=(--pin-threads)
        fi
    fi
    read -ra runs <<< "${BATCHSIM_GPU_MODELS:-encoder cnn}"
    if [ -n "${BATCHSIM_GPU_DURATION_S:-}" ]; then
        FID+=(--duration-s "$BATCHSIM_GPU_DURATION_S")
    fi
    if [ "${BATCHSIM_GPU_PAIR:-0}" = 1 ]; then runs+=(cnn_os_placed); fi
    for name in "${runs[@]}"; do
        model=${name%%_*} args=("${FID[@]}" "${PIN[@]}")
        if [ "$name" = cnn_os_placed ]; then args=("${FID[@]}"); fi
        pickle="$PACKED/fidelity_${name}_runs.pkl.gz" clocks="$OUT/gpu_clocks_${name}.csv"
        sampler=""
        if [ -z "${BATCHSIM_GPU_DRY:-}" ] && command -v nvidia-smi >/dev/null; then
            "$PYTHON" bench/bench_gpu_clocks.py sample "$clocks" & sampler=$!
        fi
        timeout -k 5 300 "$PYTHON" bench/bench_fidelity.py --model "$model" --quick \
            --dtype "$dtype" --workloads poisson,poisson-seed2,bursty --recalibrate "${args[@]}" \
            --out "$OUT/fidelity_${name}_${dtype}.json" \
            --save-runs "$pickle" 2>&1 | tee "$OUT/fidelity_${name}.log"
        ended "fidelity $name" "${PIPESTATUS[0]}"
        if [ -n "$sampler" ]; then
            kill "$sampler"; wait "$sampler" 2>/dev/null
            timeout -k 5 60 "$PYTHON" bench/bench_gpu_clocks.py "$pickle" "$clocks" \
                --out "$OUT/gpu_clocks_${name}_${dtype}.json" \
                > "$OUT/gpu_clocks_${name}_${dtype}.log" 2>&1
            ended "gpu clocks $name" "$?"
        fi
        timeout -k 5 60 "$PYTHON" bench/bench_batch_residuals.py \
            "$pickle" --out "$OUT/batch_residuals_${name}_${dtype}.json" \
            > "$OUT/batch_residuals_${name}_${dtype}.log" 2>&1
        ended "batch residuals $name" "$?"
        timeout -k 5 60 "$PYTHON" bench/bench_backlog.py \
            "$pickle" --out "$OUT/backlog_${name}_${dtype}.json" \
            > "$OUT/backlog_${name}_${dtype}.log" 2>&1
        ended "backlog $name" "$?"
        pack
    done
fi
ls -l "$OUT"
exit "$FAILED"  # 1 if any part failed (each part still ran, and kept what it made)
