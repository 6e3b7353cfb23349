"""Where the CUDA toolkit and cuBLASLt are, for setup.py and the build backend (backend.py).

One search, two users: setup.py compiles against what it finds; the backend, asked by pip
what an isolated build needs, adds the NVIDIA cuBLAS wheel (its headers) when CUDA is there
and cuBLASLt's header is not, so that `pip install .` builds CUDA `linear` wherever nvcc is.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

env, join = os.environ.get, os.path.join


def site_dirs() -> list[str]:
    """Where installed packages are: sys.path (an isolated build's environment included)
    and the interpreter's own site-packages."""
    python = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return [*sys.path, join(sys.prefix, "lib", python, "site-packages")]


def wheel_roots() -> list[str]:
    """CUDA roots the NVIDIA wheels install: nvidia/cu13 (CUDA 13 layout; nvcc, runtime and
    cuBLAS share it), then nvidia/cublas (CUDA 12 layout, cuBLAS alone)."""
    sites = site_dirs()
    return ([w for p in sites for w in sorted(glob.glob(join(p, "nvidia", "cu[0-9]*")))] +
            [join(p, "nvidia", "cublas") for p in sites])


def first_root(roots, *files) -> str | None:
    """The first root that holds every one of files, or None."""
    return next((r for r in roots if r and all(os.path.exists(join(r, f)) for f in files)),
                None)


def is_cuda_wanted() -> bool:
    return env("RAGVIT_NO_CUDA") != "1"


def is_cublaslt_wanted() -> bool:
    return env("RAGVIT_NO_CUBLASLT") != "1"


def cuda_root() -> str | None:
    """The CUDA toolkit to build with (nvcc and the runtime headers): CUDA_HOME, CUDA_PATH,
    the nvcc on PATH, an NVIDIA wheel, /usr/local/cuda; None without one."""
    nvcc = shutil.which("nvcc")
    home = nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    roots = [env("CUDA_HOME"), env("CUDA_PATH"), home, *wheel_roots(), "/usr/local/cuda"]
    return first_root(roots, "bin/nvcc", "include/cuda_runtime.h")


def cublas_root(cuda: str) -> str | None:
    """The root whose include/ holds cublasLt.h: RAGVIT_CUBLAS_HOME, the CUDA root, an
    NVIDIA wheel."""
    return first_root([env("RAGVIT_CUBLAS_HOME"), cuda, *wheel_roots()], "include/cublasLt.h")


def cuda_major(cuda: str) -> int | None:
    """The CUDA major version of a toolkit root (CUDA_VERSION in include/cuda.h)."""
    try:
        with open(join(cuda, "include", "cuda.h")) as f:
            found = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return int(found.group(1)) // 1000 if found else None


def cublas_wheel(major: int) -> str:
    """The NVIDIA wheel that ships cuBLASLt's header and library for a CUDA major version."""
    return (f"nvidia-cublas>={major},<{major + 1}" if major >= 13
            else f"nvidia-cublas-cu{major}")


def build_requires() -> list[str]:
    """What a build needs beyond pyproject.toml's list: the cuBLAS wheel matching the CUDA
    toolkit when building with CUDA and cuBLASLt's header is nowhere to be found."""
    if not (is_cuda_wanted() and is_cublaslt_wanted()):
        return []
    cuda = cuda_root()
    if cuda is None or cublas_root(cuda) is not None:
        return []
    major = cuda_major(cuda)
    return [cublas_wheel(major)] if major else []


def missing_cublaslt_message(cuda: str) -> str:
    """Why a CUDA build stops when cuBLASLt's header is missing, and the ways on."""
    major = cuda_major(cuda) or 13
    return (f"ragvit: cublasLt.h not found (RAGVIT_CUBLAS_HOME, {cuda}, NVIDIA wheels): "
            f"CUDA linear needs it. Install the wheel "
            f"(python3 -m pip install '{cublas_wheel(major)}'), point RAGVIT_CUBLAS_HOME at "
            f"a root with include/cublasLt.h, or build without CUDA linear "
            f"(RAGVIT_NO_CUBLASLT=1; ragvit.linear then runs on CPU arrays only).")
