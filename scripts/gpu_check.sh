#!/usr/bin/env bash
# GPU check for the device machine: build, GPU test suite, compute-sanitizer, benchmarks.
# Usage: scripts/gpu_check.sh [build] [bench] [test] [sanitize | memcheck] [mma] [mmabench] [packbench] [e2e]
#        [e2e_all] [e2e_paper] [e2e_policies] [e2e_graph] [notebook] [profile] [quick] [tar]
# (default: build bench test sanitize mma, in that order; each step has a time limit so the
# summary always prints). Pass RAGVIT_GIT_SHA: the GPU machine's copy of the tree has no .git.
# Logs go to $OUT (or ./gpu_logs); a short summary table is printed last.
# e2e: bench_e2e.py --quick; e2e_all: every suite in one process ($OUT/e2e_h200.md/.json,
# about 3.5 min); e2e_paper / e2e_policies / e2e_graph: one suite each (about 2 /
# 2.5 / 1 min on the H200, capped by --budget-s below the step's timeout), writing
# $OUT/e2e_<suite>_h200.md/.json. profile: benchmarks/profile_e2e.py, DeiT-S batch 1 and
# DeiT-B batch 256. notebook: benchmarks/run_notebook.py executes
# ragvit_benchmarks.ipynb on the results in $OUT and benchmarks/results plus its own H200
# sweep (about 2 min, NB_SWEEP=0 skips it; limit NB_TIMEOUT, default 240 s), writing $OUT/notebook/ (the executed
# notebook and its PNGs). tar (last): packs every log and $OUT/notebook/ into
# $OUT/gpu_check_logs.tar.gz and leaves only it and summary.txt (the device returns at most
# 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAGVIT_CUDA_ARCHS=${RAGVIT_CUDA_ARCHS:-90}
steps=${*:-build bench test sanitize mma}
declare -A result
run() {  # run NAME CMD...: log to $OUT/NAME.log, record pass/FAIL and the last line
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then result[$name]="pass"; else result[$name]="FAIL($?)"; fi
    result[$name]+=" $((SECONDS - t0))s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-110)"
}
has() { [[ " $steps " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
if has build; then
    run build python3 -m pip install --no-build-isolation --no-deps -v -e .
fi
if has bench; then
    run bench_attention timeout 200 python3 benchmarks/bench_attention.py --out "$OUT/attention_h200"
fi
if has test; then
    # TEST_ARGS="-m gpu": only the CUDA cases (the CPU ones run in CI; about 6 min on the H200
    # at 0341d69, so a device call can hold little else); TEST_PATHS: files
    run test timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -rf --durations=10 ${TEST_ARGS:-} \
        ${TEST_PATHS:-tests}
    grep -E "^(FAILED|ERROR)" "$OUT/test.log" | cut -c1-200 | head -80
fi
if has sanitize || has memcheck; then
    run memcheck timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 -m pytest -q -m sanitizer tests
fi
if has sanitize; then
    # Only ragvit's kernels: torch's own SDPA kernels (the tests' baseline) report hazards.
    for kernels in ragged_attention pack_tokens segment_mean topk_index; do
        run "racecheck_$kernels" timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer \
            --tool racecheck --kernel-name "kns=$kernels" --error-exitcode 9 \
            python3 -m pytest -q -m sanitizer -k "not garbage" tests
    done
fi
# mma / mmabench: the standalone self-test of the tensor-core kernel, and its GPU µs per
# launch plan (DeiT shapes). dev/test_attention_mma.bin is built here unless it was carried
# in already built (it is git-ignored, so it only exists when built from this tree).
if { has mma || has mmabench; } && [ ! -x dev/test_attention_mma.bin ]; then
    run mma_build nvcc -std=c++17 -O3 -DRAGVIT_WITH_CUDA -DRAGVIT_HAS_SM90A -Icsrc -Icsrc/kernels \
        -gencode=arch=compute_90a,code=sm_90a dev/test_attention_mma.cu -o dev/test_attention_mma.bin \
        -lpthread
fi
if has mma; then
    run mma_selftest timeout "${MMA_TIMEOUT:-240}" ./dev/test_attention_mma.bin
fi
if has mmabench; then
    run mma_bench timeout 180 ./dev/test_attention_mma.bin --bench
fi
if has packbench; then
    run bench_pack timeout 150 python3 benchmarks/bench_pack.py --out "$OUT/pack_h200"
fi
if has e2e; then
    run bench_e2e timeout "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --quick \
        --out "$OUT/e2e_quick_h200"
fi
if has e2e_all; then
    # every suite in one process: benchmarks/results/e2e_h200.md/.json (issues 5, 6 and 7)
    run e2e_all timeout "${E2E_ALL_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --suite all \
        --budget-s $(( ${E2E_ALL_TIMEOUT:-560} - 50 )) --out "$OUT/e2e_h200"
fi
for suite in paper policies graph; do
    if has "e2e_$suite"; then
        budget_var="E2E_${suite^^}_TIMEOUT"
        limit=${!budget_var:-$([ "$suite" = graph ] && echo 240 || echo 540)}
        run "e2e_$suite" timeout "$limit" python3 benchmarks/bench_e2e.py --suite "$suite" \
            --budget-s $((limit - 60)) --out "$OUT/e2e_${suite}_h200"
    fi
done
if has notebook; then
    run notebook timeout "${NB_TIMEOUT:-240}" python3 benchmarks/run_notebook.py \
        --out "$OUT/notebook" --results "$OUT" benchmarks/results \
        $([ "${NB_SWEEP:-1}" = 1 ] && echo --sweep)
fi
if has profile; then
    # per-kernel profiles of one patched forward (keep 50% after block 4): batch 1 and 256
    run profile_s1 timeout 120 python3 benchmarks/profile_e2e.py --model deit_small_patch16_224 --batch 1
    run profile_b256 timeout 120 python3 benchmarks/profile_e2e.py --model deit_base_patch16_224 \
        --batch 256
fi
if has quick; then
    run bench_quick python3 benchmarks/bench_attention.py --quick
fi

summary() {
    echo "== $(head -2 "$OUT/gpu.txt" | tail -1) =="
    for k in "${!result[@]}"; do printf '%-16s %s\n' "$k" "${result[$k]}"; done | sort
}
grep -h -B1 -A5 "^Targets" "$OUT"/e2e_*_h200.md 2>/dev/null
summary | tee "$OUT/summary.txt"
if has tar; then
    # everything, the notebook folder included (the device returns at most 8 files)
    (cd "$OUT" && tar czf gpu_check_logs.tar.gz --exclude gpu_check_logs.tar.gz -- * && \
        rm -rf notebook && find . -maxdepth 1 -type f ! -name gpu_check_logs.tar.gz \
        ! -name summary.txt -delete)
    ls -la "$OUT" "$OUT/notebook" 2>/dev/null
fi
