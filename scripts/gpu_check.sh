#!/usr/bin/env bash
# GPU checks for any CUDA machine: build, the test suite (GPU tests included), the smallest
# cases under compute-sanitizer, the attention kernels' self-test and the benchmarks. Each
# step logs to DIR/<step>.log under a time limit, so the summary table always prints last.
# Usage: scripts/gpu_check.sh [--out DIR] [--archs LIST] [--tag NAME] [STEP ...]
#   --out DIR     logs and results (default: $OUT, else ./gpu_logs)
#   --archs LIST  RAGVIT_CUDA_ARCHS for the build and the self-test (default: the compute
#                 capabilities of this machine's GPUs, scripts/cuda_archs.sh; "90" is sm_90a)
#   --tag NAME    suffix of the results files (default: the GPU's name, e.g. h200)
# Steps (default: build bench test sanitize selftest, run in this order whatever the order
# given):
#   build       pip install -e . for the archs
#   bench       benchmarks/bench_attention.py -> DIR/attention_<tag>.md/.json (quick: --quick)
#   test        pytest; TEST_ARGS="-m gpu" runs the CUDA cases only, TEST_PATHS picks files
#   sanitize    memcheck, and racecheck on ragvit's kernels, over the sanitizer-marked cases
#               (memcheck: memcheck alone)
#   selftest    builds dev/test_attention.cu (dev/README.md) for one arch and runs it (selfbench: --bench)
#   packbench   benchmarks/bench_pack.py -> DIR/pack_<tag>
#   interop     benchmarks/bench_interop.py -> DIR/interop_<tag>
#   e2e         benchmarks/bench_e2e.py --quick; e2e_all: every suite in one process
#               (DIR/e2e_<tag>); e2e_paper, e2e_policies, e2e_graph, e2e_baselines,
#               e2e_compiled: one suite each (DIR/e2e_<suite>_<tag>, about 2 / 2.5 / 1 / 6 / 5
#               min on an H200)
#   compile     benchmarks/bench_compile_call.py, DeiT-S and DeiT-B batch 1 and 16,
#               reduce-overhead -> DIR/compile_call_<tag>
#   profile     benchmarks/profile_e2e.py, DeiT-S batch 1 and DeiT-B batch 256, and the
#               strongest alternative (dense_gather_compiled) at DeiT-B batch 256
#   fused       builds dev/fused_block.cu (dev/README.md) for sm_90a, runs its checks and
#               timing (--bench), sets it beside ragvit's present path on timm blocks
#               (dev/fused_block_check.py), profiles its first launch with ncu (stalls by
#               source line), then memcheck and racecheck on its --quick cases
#   notebook    benchmarks/run_notebook.py on DIR and benchmarks/results plus its own sweep
#               (NB_SWEEP=0 skips it) -> DIR/notebook/
#   tar         packs everything into DIR/gpu_check_logs.tar.gz, leaving it and summary.txt
# Time limits: the *_TIMEOUT variables below. Where the tree has no .git, set RAGVIT_GIT_SHA
# so the results name their commit.
set -uo pipefail
out=${OUT:-$PWD/gpu_logs}
archs=${RAGVIT_CUDA_ARCHS:-}
tag=""
steps=()
while [ $# -ge 1 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --archs) archs=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        -h | --help) sed -n 2,36p "$0"; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
        *) steps+=("$1"); shift ;;
    esac
done
[ ${#steps[@]} -gt 0 ] || steps=(build bench test sanitize selftest)
mkdir -p "$out"
OUT=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
if [ -z "$archs" ]; then
    archs=$(scripts/cuda_archs.sh) || { echo "gpu_check.sh: no GPU found; pass --archs" >&2; exit 2; }
fi
if [ -z "$tag" ]; then
    tag=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z' 'a-z' \
        | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\{1,\}/_/g' -e 's/^_//' -e 's/_$//')
    tag=${tag:-gpu}
fi
export PYTHONUNBUFFERED=1 RAGVIT_CUDA_ARCHS=$archs
declare -A result
run() {  # run NAME CMD...: log to $OUT/NAME.log, record pass/FAIL and the last line
    local name=$1; shift
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then result[$name]="pass"; else result[$name]="FAIL($?)"; fi
    result[$name]+=" $((SECONDS - t0))s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-110)"
}
has() { [[ " ${steps[*]} " == *" $1 "* ]]; }
selftest_flags() {  # nvcc flags and sources for one arch of $archs (dev/README.md's commands)
    local arch=${archs%%;*}
    [[ ";$archs;" == *";90;"* ]] && arch=90
    if [ "$arch" = 90 ]; then  # sm_90a with the wgmma path
        echo "-DRAGVIT_HAS_SM90A -gencode=arch=compute_90a,code=sm_90a csrc/kernels/attention_wgmma.cu"
    else
        echo "-gencode=arch=compute_$arch,code=sm_$arch"
    fi
}

echo "gpu_check.sh: archs $archs, tag $tag, steps ${steps[*]}, logs in $OUT"
nvidia-smi --query-gpu=name,driver_version,compute_cap,clocks.sm,memory.used --format=csv \
    > "$OUT/gpu.txt" 2>&1
if has build; then
    run build python3 -m pip install --no-build-isolation --no-deps -v -e .
fi
if has bench; then
    run bench_attention timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_attention.py \
        --out "$OUT/attention_$tag"
fi
if has test; then
    # the whole suite takes about 6 min on an H200
    run test timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -rf --durations=10 ${TEST_ARGS:-} \
        ${TEST_PATHS:-tests}
    grep -E "^(FAILED|ERROR)" "$OUT/test.log" | cut -c1-200 | head -80
fi
if has sanitize || has memcheck; then
    run memcheck timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool memcheck \
        --error-exitcode 9 python3 -m pytest -q -m sanitizer tests
fi
if has sanitize; then
    # Only ragvit's kernels, by name prefix: torch's own SDPA kernels (the tests' baseline)
    # report hazards.
    for kernels in attention_ pack_ segment_mean topk_index; do
        run "racecheck_${kernels%_}" timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer \
            --tool racecheck --kernel-name "kns=$kernels" --error-exitcode 9 \
            python3 -m pytest -q -m sanitizer -k "not garbage" tests
    done
fi
if has selftest || has selfbench; then
    # $(selftest_flags) unquoted: one word per flag
    run selftest_build nvcc -std=c++17 -O3 --expt-relaxed-constexpr -DRAGVIT_WITH_CUDA \
        -Icsrc/include -Icsrc/kernels $(selftest_flags) dev/test_attention.cu \
        csrc/kernels/attention.cu csrc/kernels/attention_fma.cu csrc/kernels/attention_mma.cu \
        -o dev/test_attention.bin
fi
if has selftest; then
    run selftest timeout "${SELFTEST_TIMEOUT:-240}" ./dev/test_attention.bin
fi
if has selfbench; then
    run selfbench timeout 180 ./dev/test_attention.bin --bench
fi
if has packbench; then
    run bench_pack timeout 150 python3 benchmarks/bench_pack.py --out "$OUT/pack_$tag"
fi
if has interop; then
    run bench_interop timeout 120 python3 benchmarks/bench_interop.py --out "$OUT/interop_$tag"
fi
if has e2e; then
    run bench_e2e timeout "${E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --quick \
        --out "$OUT/e2e_quick_$tag"
fi
if has e2e_all; then
    run e2e_all timeout "${E2E_ALL_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --suite all \
        --budget-s $(( ${E2E_ALL_TIMEOUT:-560} - 50 )) --out "$OUT/e2e_$tag"
fi
for suite in paper policies graph baselines compiled; do
    if has "e2e_$suite"; then
        budget_var="E2E_${suite^^}_TIMEOUT"
        limit=${!budget_var:-$([ "$suite" = graph ] && echo 240 || echo 540)}
        run "e2e_$suite" timeout "$limit" python3 benchmarks/bench_e2e.py --suite "$suite" \
            --budget-s $((limit - 60)) --out "$OUT/e2e_${suite}_$tag"
    fi
done
if has notebook; then
    run notebook timeout "${NB_TIMEOUT:-240}" python3 benchmarks/run_notebook.py --text-only \
        --out "$OUT/notebook" --results "$OUT" benchmarks/results \
        $([ "${NB_SWEEP:-1}" = 1 ] && echo --sweep)
fi
if has profile; then
    run profile_s1 timeout 120 python3 benchmarks/profile_e2e.py --model deit_small_patch16_224 \
        --batch 1
    run profile_b256 timeout 120 python3 benchmarks/profile_e2e.py --model deit_base_patch16_224 \
        --batch 256
    run profile_b256_dense_gather timeout 180 python3 benchmarks/profile_e2e.py \
        --model deit_base_patch16_224 --batch 256 --pipeline dense_gather_compiled
fi
if has compile; then
    run compile_call timeout "${COMPILE_TIMEOUT:-300}" python3 benchmarks/bench_compile_call.py \
        --models deit_s deit_b --batch 1 16 --variants reduce-overhead \
        --out "$OUT/compile_call_$tag"
fi
if has fused; then
    # sm_90a: the prototype needs no Hopper instruction, but the machines this runs on are
    # Hopper; dev/README.md has the sm_80 command
    run fused_build nvcc -std=c++17 -O3 -lineinfo -Icsrc/include -Icsrc/kernels \
        -gencode=arch=compute_90a,code=sm_90a -Xptxas -v dev/fused_block.cu \
        -o dev/fused_block.bin
    run fused timeout 120 ./dev/fused_block.bin --bench
    run fused_lib_build nvcc -std=c++17 -O3 -Xcompiler -fPIC -shared -DFUSED_BLOCK_LIBRARY \
        -Icsrc/include -Icsrc/kernels -gencode=arch=compute_90a,code=sm_90a \
        dev/fused_block.cu -o dev/libfused_block.so
    run fused_check timeout 180 python3 dev/fused_block_check.py --lib dev/libfused_block.so
    # where the first launch (DeiT-S 1x99, full grid) stalls, by source line (-lineinfo above)
    run fused_ncu timeout 180 ncu --section SpeedOfLight --section WarpStateStats \
        --section SourceCounters --print-details all -k regex:fused_block_kernel -c 1 \
        ./dev/fused_block.bin
    for tool in memcheck racecheck; do
        run "fused_$tool" timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" \
            --error-exitcode 9 ./dev/fused_block.bin --quick
    done
fi
if has quick; then
    run bench_quick python3 benchmarks/bench_attention.py --quick
fi

summary() {
    echo "== $(head -2 "$OUT/gpu.txt" | tail -1) =="
    for k in "${!result[@]}"; do printf '%-16s %s\n' "$k" "${result[$k]}"; done | sort
}
grep -h -B1 -A5 "^Targets" "$OUT"/e2e_*.md 2>/dev/null
summary | tee "$OUT/summary.txt"
if has tar; then
    (cd "$OUT" && tar czf gpu_check_logs.tar.gz --exclude gpu_check_logs.tar.gz -- * && \
        rm -rf notebook && find . -maxdepth 1 -type f ! -name gpu_check_logs.tar.gz \
        ! -name summary.txt -delete)
    ls -la "$OUT"
fi
