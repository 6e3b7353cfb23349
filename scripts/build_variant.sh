#!/usr/bin/env bash
# Builds a variant of ragvit for an A/B timing on the device (scripts/gpu_ab.sh): the
# package of REV (default: the working tree) with its _C module compiled with extra nvcc
# flags, into DIR/ragvit (DIR under the git-ignored ab/, carried to the device whole).
# Usage: scripts/build_variant.sh DIR [REV] [-- NVCC_FLAG ...]
#   e.g. scripts/build_variant.sh ab/base HEAD~1; scripts/build_variant.sh ab/new
# PYTHON (default python3) must be the device's Python (3.12 there); RAGVIT_CUDA_ARCHS
# (default 90) and RAGVIT_CUBLAS_HOME pass through to setup.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n 2,8p "$0"; exit 2; }
dir=$1; shift
rev=""
if [ $# -ge 1 ] && [ "$1" != "--" ]; then rev=$1; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
flags="$*"
root=$PWD
src=$root
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; [ -n "$rev" ] && git -C "$root" worktree remove --force "$tmp/tree" 2>/dev/null || true' EXIT
if [ -n "$rev" ]; then
    git worktree add -q --detach "$tmp/tree" "$rev"
    src=$tmp/tree
fi
rm -rf "$dir/ragvit" && mkdir -p "$dir"
(cd "$src" && NVCC_PREPEND_FLAGS="$flags" RAGVIT_CUDA_ARCHS=${RAGVIT_CUDA_ARCHS:-90} \
    RAGVIT_WERROR=1 "${PYTHON:-python3}" setup.py -q build_ext -b "$tmp/lib" -t "$tmp/obj" >/dev/null)
cp -r "$src/ragvit" "$dir/ragvit"
find "$dir/ragvit" -name "_C*.so" -delete
cp "$tmp"/lib/ragvit/_C*.so "$dir/ragvit/"
echo "$dir/ragvit: ${rev:-working tree}${flags:+, nvcc $flags}; $(ls "$dir"/ragvit/_C*.so)"
