#!/usr/bin/env bash
# The test suite under AddressSanitizer and UndefinedBehaviorSanitizer: builds the CPU-only
# ragvit._C with RAGVIT_SANITIZE=address,undefined (setup.py) in a scratch copy of the working
# tree (tracked and untracked files git does not ignore), so the in-place build is left alone,
# and runs pytest there with the sanitizer runtime preloaded into Python (an instrumented
# module cannot load into an uninstrumented interpreter otherwise). Fails on a failed test or on
# any sanitizer report, from pytest or from a subprocess it started (each process writes its
# reports to DIR/reports.<pid>; the log is also searched for them).
# Usage: scripts/sanitize_cpu.sh [PYTEST_ARG ...]
#   no arguments: the whole suite but tests/test_style.py (style checks run no C code)
#   e.g. scripts/sanitize_cpu.sh tests/test_interop.py -k numpy
# Environment: PYTHON (default python3, with requirements-test.txt installed); SANITIZE_DIR
# (default build/sanitize, git-ignored): the copy, the log DIR/pytest.log and the reports.
# LeakSanitizer is off: CPython and torch leave memory allocated at exit by design. The tests
# see RAGVIT_SANITIZE and skip the checks ASan itself defeats (RSS growth: its quarantine
# keeps freed blocks resident).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
dir=${SANITIZE_DIR:-$root/build/sanitize}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
tree=$dir/tree
[ $# -ge 1 ] || set -- tests --ignore=tests/test_style.py

rm -rf "$tree" "$dir"/reports.* "$dir/pytest.log"
cc=${CC:-$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("CC") or "cc")')}
if ! echo 'int main(void) { return 0; }' |
    $cc -fsanitize=address,undefined -x c - -o "$dir/probe" 2>"$dir/probe.log"; then
    cat "$dir/probe.log" >&2
    echo "sanitize: $cc cannot link -fsanitize=address,undefined (install libasan, libubsan)" >&2
    exit 1
fi
mkdir -p "$tree"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard |
        tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$tree" -xf -
    # a bench report names its commit; the copy has no .git
    RAGVIT_GIT_SHA=${RAGVIT_GIT_SHA:-$(git rev-parse --short HEAD)}
    export RAGVIT_GIT_SHA
else
    tar --exclude=./build --exclude=./.git -cf - . | tar -C "$tree" -xf -
fi
find "$tree" -name "_C*.so" -delete

export RAGVIT_SANITIZE=address,undefined
echo "sanitize: building the CPU-only module with -fsanitize=$RAGVIT_SANITIZE in $tree"
(cd "$tree" && RAGVIT_NO_CUDA=1 RAGVIT_WERROR=1 "$python" setup.py -q build_ext --inplace \
    >"$dir/build.log" 2>&1) || { cat "$dir/build.log"; exit 1; }
module=$(ls "$tree"/ragvit/_C*.so)

# The runtimes the module was linked against (gcc: libasan and libubsan; clang: one
# libclang_rt.asan), ASan's first: it must come before every other library.
libs=$(ldd "$module" | awk '$1 ~ /^lib(asan|ubsan|clang_rt\.)/ {print $3}')
runtimes=$(grep asan <<<"$libs" || true; grep -v asan <<<"$libs" || true)
runtimes=$(echo $runtimes)
if [ -z "$runtimes" ] || [[ " $runtimes " == *" not "* ]]; then
    echo "sanitize: the sanitizer runtimes of $module are not all found:" >&2
    ldd "$module" >&2
    exit 1
fi
echo "sanitize: preloading $runtimes"

# halt_on_error / -fno-sanitize-recover: the first report ends the process, so a report
# cannot scroll past inside a passing run. protect_shadow_gap=0: on a GPU machine torch's
# CUDA initialisation fails ("out of memory") without it, the driver maps inside ASan's
# shadow gap.
asan="detect_leaks=0:halt_on_error=1:protect_shadow_gap=0:log_path=$dir/reports"
ubsan="print_stacktrace=1:halt_on_error=1:log_path=$dir/reports"
start=$SECONDS
set +e
(cd "$tree" && LD_PRELOAD="$runtimes${LD_PRELOAD:+ $LD_PRELOAD}" \
    ASAN_OPTIONS="$asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
    UBSAN_OPTIONS="$ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}" \
    "$python" -m pytest -q -p no:cacheprovider "$@" 2>&1) | tee "$dir/pytest.log"
status=${PIPESTATUS[0]}
set -e
reports=$(ls "$dir"/reports.* 2>/dev/null || true)
for r in $reports; do
    echo "==== $r"
    cat "$r"
done
if [ -n "$reports" ] ||
    grep -qE "ERROR: (Address|Leak)Sanitizer|runtime error:" "$dir/pytest.log"; then
    echo "sanitize: FAIL: sanitizer report(s) above (log: $dir/pytest.log)" >&2
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "sanitize: FAIL: pytest exited with $status (log: $dir/pytest.log)" >&2
    exit "$status"
fi
echo "sanitize: OK, no sanitizer report, $((SECONDS - start)) s"
