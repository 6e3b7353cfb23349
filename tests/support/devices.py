"""Device parameters and the GPU marks.

Every op test lists its "cuda" parameters whatever the machine: without torch CUDA and a
CUDA build of ragvit they are skipped, not left out, so a CPU run collects the same nodes
as a GPU run. Importable without a built ragvit (then nothing runs on CUDA).
"""

from __future__ import annotations

import pytest
import torch


def _ragvit_cuda_available() -> bool:
    try:
        import ragvit  # absent from an unbuilt checkout: then nothing runs on CUDA
    except ImportError:
        return False
    return bool(ragvit.cuda_available())


CUDA_OK = torch.cuda.is_available() and _ragvit_cuda_available()

requires_cuda = pytest.mark.skipif(
    not CUDA_OK, reason="needs torch CUDA and a CUDA build of ragvit with a visible GPU"
)


def gpu_marks() -> list:
    """Marks for a CUDA-only test or parameter: the `gpu` marker plus the skip."""
    return [pytest.mark.gpu, requires_cuda]


def devices() -> list:
    """Parameters for a `device` argument: "cpu", and "cuda" (skipped without a GPU)."""
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=gpu_marks()),
    ]


def device_param(device: str, *values, id: str, sanitizer: bool = False):
    """pytest.param(device, *values) with id "<device>-<id>", gpu_marks() on "cuda", and
    the sanitizer mark on the CUDA cases small enough for compute-sanitizer."""
    marks = gpu_marks() if device == "cuda" else []
    if sanitizer and device == "cuda":
        marks.append(pytest.mark.sanitizer)
    return pytest.param(device, *values, marks=marks, id=f"{device}-{id}")
