#!/usr/bin/env bash
# One GPU session for the real batcher (issue 5), about 6 minutes in all:
#   1. profiles: the three zoo models end to end at float32 and bfloat16 -> profile JSONs,
#      and their compute-only s(b) printed next to the H200 reference;
#   2. bench: DynamicBatcher vs the offline peak and the naive batcher -> bench_gpu_*.json.
# Each part is its own process under its own time limit, and every JSON is written as soon
# as its numbers exist, so a failure or a timeout in one part keeps everything else.
# Needs python with torch and numpy (pandas optional); no install: run from anywhere.
#   OUT=/some/dir bash bench/gpu_session.sh          # on a GPU machine
#   BATCHSIM_GPU_DRY=1 OUT=/tmp/x bash bench/gpu_session.sh   # CPU dry run, seconds
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/results}
DRY=()
if [ -n "${BATCHSIM_GPU_DRY:-}" ]; then DRY=(--dry-run); fi
mkdir -p "$OUT"
start=$SECONDS

"$PYTHON" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0))
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv

echo "== part 1: profiles and the reference check =="
timeout -k 5 130 "$PYTHON" bench/bench_gpu.py profiles --out-dir "$OUT" "${DRY[@]}" \
    2>&1 | tee "$OUT/profiles.log"
echo "profiles part exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"

left=$((330 - (SECONDS - start)))
echo "== part 2: batcher benchmark ($left s left) =="
timeout -k 5 "$left" "$PYTHON" bench/bench_gpu.py bench --out-dir "$OUT" \
    --budget-s $((left - 25)) "${DRY[@]}" 2>&1 | tee "$OUT/bench.log"
echo "bench part exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
ls -l "$OUT"
