#!/usr/bin/env bash
# Builds a variant of ragvit for an A/B timing (scripts/gpu_ab.sh, or bench_attention.py
# --rows): the package of REV (default: the working tree) with its _C module compiled with
# extra nvcc flags, into DIR/ragvit, a self-contained copy to put first on PYTHONPATH.
# Usage: scripts/build_variant.sh DIR [REV] [-- NVCC_FLAG ...]
#   e.g. scripts/build_variant.sh ab/base HEAD~1; scripts/build_variant.sh ab/new
# (ab/ is git-ignored.) PYTHON (default python3) is the Python that will import the build;
# RAGVIT_CUDA_ARCHS (default: this machine's GPUs, scripts/cuda_archs.sh, else setup.py's
# default) and RAGVIT_CUBLAS_HOME pass through to setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,9p "$0"; exit 2; }
dir=$1; shift
rev=""
if [ $# -ge 1 ] && [ "$1" != "--" ]; then rev=$1; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
flags="$*"
if [ -z "${RAGVIT_CUDA_ARCHS:-}" ] && archs=$(scripts/cuda_archs.sh 2>/dev/null); then
    export RAGVIT_CUDA_ARCHS=$archs
fi
root=$PWD
src=$root
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; [ -n "$rev" ] && git -C "$root" worktree remove --force "$tmp/tree" 2>/dev/null || true' EXIT
if [ -n "$rev" ]; then
    git worktree add -q --detach "$tmp/tree" "$rev"
    src=$tmp/tree
fi
rm -rf "$dir/ragvit" && mkdir -p "$dir"
(cd "$src" && NVCC_PREPEND_FLAGS="$flags" RAGVIT_WERROR=1 \
    "${PYTHON:-python3}" setup.py -q build_ext -b "$tmp/lib" -t "$tmp/obj" >/dev/null)
cp -r "$src/ragvit" "$dir/ragvit"
find "$dir/ragvit" -name "_C*.so" -delete
cp "$tmp"/lib/ragvit/_C*.so "$dir/ragvit/"
echo "$dir/ragvit: ${rev:-working tree}${flags:+, nvcc $flags}, archs ${RAGVIT_CUDA_ARCHS:-default}; $(ls "$dir"/ragvit/_C*.so)"
