#!/usr/bin/env bash
# Two gpu_check.sh runs side by side on a two-GPU machine: lane 0 (GPU 0, first half of the
# cores) for timings, lane 1 (GPU 1, second half) for tests and compute-sanitizer, so one
# device call does both without the tests disturbing the benchmarks' GPU.
# Usage: scripts/gpu_two_lanes.sh "<lane 0 steps>" "<lane 1 steps>"
#   e.g. scripts/gpu_two_lanes.sh "bench packbench e2e_paper tar" "test sanitize tar"
# The module is built once first, unless ragvit/_C.cpython-3XX-*.so for this Python already
# imports (a build carried from elsewhere). Logs: $OUT/lane0, $OUT/lane1 (each ends with
# gpu_check.sh's summary; pass `tar` to keep the returned file count small).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if python3 -c "import ragvit, sys; sys.exit(not ragvit.cuda_is_compiled())" 2>/dev/null; then
    echo "ragvit: using the module already built here"
else
    RAGVIT_CUDA_ARCHS=${RAGVIT_CUDA_ARCHS:-90} python3 -m pip install --no-build-isolation \
        --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
half=$(( $(nproc) / 2 ))
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/lane1 taskset -c "$half-$(( 2 * half - 1 ))" \
    bash scripts/gpu_check.sh $2 > "$OUT/lane1.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/lane0 taskset -c "0-$(( half - 1 ))" \
    bash scripts/gpu_check.sh $1 > "$OUT/lane0.txt" 2>&1
wait
tail -n 25 "$OUT/lane0.txt" "$OUT/lane1.txt"
