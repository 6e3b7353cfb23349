#!/usr/bin/env bash
# Prints RAGVIT_CUDA_ARCHS for the GPUs this machine sees: their compute capabilities without
# the dot, unique, ";"-separated ("90" on an H100 or H200, "80;89" with an A100 and an L4).
# setup.py builds sm_90a code for "90" (it holds the wgmma attention kernel) and sm_XX for
# the others. Asks nvidia-smi (compute_cap), else torch; exits 1 when neither finds a GPU.
# Usage: RAGVIT_CUDA_ARCHS=$(scripts/cuda_archs.sh) python3 -m pip install -e .
set -uo pipefail
caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || caps=""
if [ -z "$caps" ]; then
    caps=$("${PYTHON:-python3}" -c "import torch
for i in range(torch.cuda.device_count()):
    print('%d.%d' % torch.cuda.get_device_capability(i))" 2>/dev/null) || caps=""
fi
archs=$(printf '%s\n' $caps | tr -d . | grep -E '^[0-9]+$' | sort -un | paste -sd ';' -)
[ -n "$archs" ] || { echo "cuda_archs.sh: no GPU found (nvidia-smi, torch)" >&2; exit 1; }
echo "$archs"
