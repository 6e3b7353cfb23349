#!/usr/bin/env bash
# Two gpu_check.sh runs side by side on a machine with two GPUs: lane 0 (GPU 0, the first
# half of the cores) for timings, lane 1 (GPU 1, the second half) for tests and
# compute-sanitizer, so the tests do not disturb the GPU the benchmarks time.
# Usage: scripts/gpu_two_lanes.sh [--out DIR] [--archs LIST] "<lane 0 steps>" "<lane 1 steps>"
#   e.g. scripts/gpu_two_lanes.sh "bench packbench e2e_paper" "test sanitize selftest"
# The module is built once first (gpu_check.sh build; --archs as there) unless ragvit already
# imports with its CUDA kernels. Logs: DIR/lane0 and DIR/lane1, each ending with its summary.
set -uo pipefail
out=${OUT:-$PWD/gpu_logs}
archs=()
while [ $# -ge 1 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --archs) archs=(--archs "$2"); shift 2 ;;
        *) break ;;
    esac
done
[ $# -eq 2 ] || { sed -n 2,8p "$0"; exit 2; }
mkdir -p "$out"
OUT=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
built() { python3 -c "import ragvit, sys; sys.exit(not ragvit.cuda_is_compiled())" 2>/dev/null; }
if built; then
    echo "ragvit: using the module already built here"
else
    bash scripts/gpu_check.sh --out "$OUT/build" "${archs[@]}" build > "$OUT/build.txt" 2>&1
    built || { tail -30 "$OUT/build/build.log" "$OUT/build.txt"; exit 1; }
fi
half=$(( $(nproc) / 2 ))
# $2 and $1 unquoted: one word per step
CUDA_VISIBLE_DEVICES=1 taskset -c "$half-$(( 2 * half - 1 ))" \
    bash scripts/gpu_check.sh --out "$OUT/lane1" "${archs[@]}" $2 > "$OUT/lane1.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=0 taskset -c "0-$(( half - 1 ))" \
    bash scripts/gpu_check.sh --out "$OUT/lane0" "${archs[@]}" $1 > "$OUT/lane0.txt" 2>&1
wait
tail -n 25 "$OUT/lane0.txt" "$OUT/lane1.txt"
