"""Build ragvit._C: nvcc compiles csrc/kernels/*.cu to objects (when nvcc is found), then
one setuptools Extension links them with the C core. RAGVIT_CUDA_ARCHS="80;90" picks
the SASS targets (PTX of the newest is embedded too); RAGVIT_WERROR=1 adds -Werror;
RAGVIT_NO_CUDA=1 builds the CPU-only module even where nvcc exists."""
import glob, os, shutil, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
WARN = ["-Wall", "-Wextra"] + (["-Werror"] if os.environ.get("RAGVIT_WERROR") == "1" else [])


def find_cuda():
    """CUDA root holding bin/nvcc: CUDA_HOME, CUDA_PATH, nvcc on PATH, the nvidia-cuda-nvcc wheel."""
    if os.environ.get("RAGVIT_NO_CUDA") == "1":
        return None
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None)
    roots += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*"))
    roots.append("/usr/local/cuda")
    is_root = lambda r: all(os.path.exists(os.path.join(r, f)) for f in ("bin/nvcc", "include/cuda_runtime.h"))  # noqa: E731
    return next((r for r in roots if r and is_root(r)), None)


def find_cublaslt(cuda):
    """(include dir, library path) of cuBLASLt: the CUDA root, then nvidia wheels on sys.path."""
    roots = [os.environ.get("RAGVIT_CUBLAS_HOME"), cuda]
    for p in sys.path + [os.path.join(sys.prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")]:
        roots += sorted(glob.glob(os.path.join(p, "nvidia", "cu*"))) + [os.path.join(p, "nvidia", "cublas")]
    for r in filter(None, roots):
        libs = sorted(glob.glob(os.path.join(r, "lib*", "libcublasLt.so*")) + glob.glob(os.path.join(r, "lib", "x64", "libcublasLt.so*")))
        if os.path.exists(os.path.join(r, "include", "cublasLt.h")):
            return os.path.join(r, "include"), (libs[-1] if libs else None)
    return None, None


class BuildExt(build_ext):
    def build_extensions(self):
        cuda, ext = find_cuda(), self.extensions[0]
        if cuda is None:
            print("ragvit: nvcc not found (CUDA_HOME, CUDA_PATH, PATH): building a CPU-only module")
        else:
            # sm_80 SASS also runs on 8.6/8.9; Hopper ("90" or "90a") gets sm_90a SASS (its
            # wgmma attention path, RAGVIT_HAS_SM90A) and newer GPUs the last arch's PTX
            archs = os.environ.get("RAGVIT_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
            archs = [a.strip().rstrip("a") for a in archs if a.strip()]
            gencode = [f"-gencode=arch=compute_{a}{'a' if a == '90' else ''},"
                       f"code=sm_{a}{'a' if a == '90' else ''}" for a in archs]
            gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
            if "90" in archs:
                gencode.append("-DRAGVIT_HAS_SM90A")
            os.makedirs(self.build_temp, exist_ok=True)
            sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cu")))
            objects = [os.path.join(self.build_temp, os.path.basename(s) + ".o") for s in sources]
            flags = ["-std=c++17", "-O3", "-DRAGVIT_WITH_CUDA", "-Xcompiler", "-fPIC," + ",".join(WARN),
                     "-I" + os.path.join(ROOT, "csrc"), "--expt-relaxed-constexpr", "--threads", "0", *gencode]
            blas_include, blas_lib = find_cublaslt(cuda)
            if blas_include is None:
                print("ragvit: cublasLt.h not found (CUDA root, nvidia-cublas wheel): linear runs on the CPU only")
            else:
                flags += ["-DRAGVIT_HAVE_CUBLASLT", "-I" + blas_include]
                flags += [f'-DRAGVIT_CUBLASLT_PATH="{blas_lib}"'] if blas_lib else []
            nvcc = [os.path.join(cuda, "bin", "nvcc"), *flags]
            with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
                jobs = [pool.submit(subprocess.check_call, nvcc + ["-c", s, "-o", o])
                        for s, o in zip(sources, objects)]
                [j.result() for j in jobs]
            ext.extra_objects += objects
            ext.define_macros.append(("RAGVIT_WITH_CUDA", "1"))
            libdirs = [os.path.join(cuda, d) for d in ("lib64", "lib", "lib/x64") if os.path.isdir(os.path.join(cuda, d))]
            ext.library_dirs += libdirs
            ext.libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
        super().build_extensions()


setup(
    ext_modules=[Extension(
        "ragvit._C",
        sources=sorted(glob.glob("csrc/*.c")),
        include_dirs=[os.path.join(ROOT, "csrc"), numpy.get_include()],
        # kernels and headers too: a changed .cu must relink the module, not only a .c
        depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/kernels/*")),
        extra_compile_args=["-std=c11", "-O3", *WARN],
    )],
    cmdclass={"build_ext": BuildExt},
)
