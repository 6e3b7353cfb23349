#!/usr/bin/env bash
# build_fused_ln_gemm.sh — builds ab/fused_ln_gemm.bin from dev/fused_ln_gemm.cu (sm_90a + sm_80).
# cuBLASLt: the toolkit's / system's (cublasLt.h found by nvcc, -lcublasLt links) first, else the
# nvidia-cu13 pip wheel's (CUBLAS_WHEEL=<dir with include/ and lib/>, default: found through
# python3). For the wheel only cublas*.h are symlinked into a private include dir, so the
# toolkit's own CUDA runtime headers stay first, and the library gets an rpath.
# Usage (repository root or anywhere): dev/build_fused_ln_gemm.sh [extra nvcc flags]
#   VERBOSE=1 adds -Xptxas -v (registers, spills per kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC=${NVCC:-nvcc}
mkdir -p ab
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80
       -Xcompiler -Wall,-Wextra -Xptxas --warn-on-spills)
[[ "${VERBOSE:-0}" == 1 ]] && flags+=(-Xptxas -v)

# 1. system: a tiny program that includes cublasLt.h and links -lcublasLt
printf '#include <cublasLt.h>\nint main() { return cublasLtGetVersion() == 0; }\n' \
    > "$tmp/probe.cu"
if "$NVCC" -std=c++17 "$tmp/probe.cu" -o "$tmp/probe" -lcublasLt >/dev/null 2>&1; then
    echo "build_fused_ln_gemm: system cuBLASLt"
    blas=(-lcublasLt)
else
    # 2. the pip wheel
    wheel=${CUBLAS_WHEEL:-$(python3 -c 'import glob, os, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
cands = [d for p in dirs for d in sorted(glob.glob(os.path.join(p, "nvidia", "cu*")))
         + [os.path.join(p, "nvidia", "cublas")]]
hits = [d for d in cands if os.path.exists(os.path.join(d, "include", "cublasLt.h"))]
print(hits[0] if hits else "")' 2>/dev/null || true)}
    lib=$(ls "$wheel"/lib/libcublasLt.so* 2>/dev/null | sort | tail -n 1 || true)
    if [[ -z "$wheel" || -z "$lib" ]]; then
        echo "build_fused_ln_gemm: no cuBLASLt (system toolkit, nvidia-cu13/cublas wheel)" >&2
        exit 1
    fi
    echo "build_fused_ln_gemm: cuBLASLt from $wheel"
    mkdir -p "$tmp/include"
    ln -s "$wheel"/include/cublas*.h "$tmp/include/"
    blas=(-I"$tmp/include" -L"$(dirname "$lib")" -l:"$(basename "$lib")"
          -Xlinker -rpath,"$(dirname "$lib")")
fi
set -x
"$NVCC" "${flags[@]}" "$@" dev/fused_ln_gemm.cu -o ab/fused_ln_gemm.bin "${blas[@]}"
