"""Build ragvit._C: nvcc (CUDA_HOME, CUDA_PATH, PATH or the nvidia-cuda-nvcc wheel; the search
is build_support/cuda_find.py's) compiles csrc/kernels/*.cu (the sm_90a-only files for sm_90a
alone), then one Extension links them with the C sources of csrc/core, csrc/cpu and
csrc/python; only PyInit__C is exported. Environment: RAGVIT_CUDA_ARCHS ("80;90": SASS
targets, "90" as sm_90a, PTX of the last), RAGVIT_WERROR=1, RAGVIT_NO_CUDA=1 (CPU only),
RAGVIT_CUBLAS_HOME (a root with include/cublasLt.h; else the CUDA root or an NVIDIA wheel; a
CUDA build without it stops with the ways on), RAGVIT_NO_CUBLASLT=1 (CUDA without linear),
RAGVIT_SANITIZE ("address,undefined": the C sources built with those
-fsanitize checks, -O1 -g, aborting on the first report; the kernels are not instrumented; the
runtime must be preloaded into Python: scripts/sanitize_cpu.sh)."""
import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT, env, join = os.path.dirname(os.path.abspath(__file__)), os.environ.get, os.path.join
sys.path.insert(0, join(ROOT, "build_support"))
import cuda_find  # noqa: E402 (build_support/, put on sys.path just above)

WARN = ["-Wall", "-Wextra"] + (["-Werror"] if env("RAGVIT_WERROR") == "1" else [])
SANITIZE = env("RAGVIT_SANITIZE", "").replace(" ", "")
# -O1 keeps the stacks of a report readable; UB aborts like an ASan error instead of printing
# and going on, so a test run cannot pass over one.
SANITIZE_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-O1", "-g",
                  "-fno-sanitize-recover=all"] if SANITIZE else []


ARCHS = [a.strip().rstrip("a") for a in
         env("RAGVIT_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()]
# kernel files of sm_90a instructions (wgmma, TMA): built for sm_90a alone, left out without 90
SM90A_ONLY = {"attention_wgmma.cu"}


def arch_flags(source):
    """-gencode flags of one kernel file: sm_90a for the SM90A_ONLY files; else every arch
    (sm_80 SASS also runs on 8.6/8.9; "90" or "90a" gets sm_90a SASS) and, for newer GPUs,
    the last arch's PTX."""
    if os.path.basename(source) in SM90A_ONLY:
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{a}{'a' * (a == '90')},code=sm_{a}{'a' * (a == '90')}"
            for a in ARCHS] + [f"-gencode=arch=compute_{ARCHS[-1]},code=compute_{ARCHS[-1]}"]


def build_commit():
    """The tree's short commit, for ragvit.build_info(): RAGVIT_GIT_SHA, else git; "unknown"
    outside a checkout (an sdist)."""
    sha = env("RAGVIT_GIT_SHA", "")
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                 capture_output=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            sha = ""
    return sha if sha.isalnum() else "unknown"


def c_string(text):
    """A C string literal of text (alphanumerics and ;), for a -D macro."""
    return '"' + text + '"'


def nvcc_command(cuda):
    """nvcc and the flags every kernel file shares: RAGVIT_HAS_SM90A when the SM90A_ONLY files
    are built (the attention dispatcher calls them only then) and cuBLASLt's flags; and whether
    cuBLASLt is built in. cuBLASLt is dlopen()ed at run time (linear.cu: the soname, through
    the module's RUNPATH too, then the library found here): its header is all the build
    needs."""
    cmd = [join(cuda, "bin", "nvcc"), "-std=c++17", "-O3", "-DRAGVIT_WITH_CUDA", "-Xcompiler",
           ",".join(["-fPIC", "-fvisibility=hidden", *WARN]), "-I" + join(ROOT, "csrc", "include"),
           "-I" + join(ROOT, "csrc"), "--expt-relaxed-constexpr",
           "--threads", "0"]
    cmd += ["-DRAGVIT_HAS_SM90A"] if "90" in ARCHS else []
    if not cuda_find.is_cublaslt_wanted():
        print("ragvit: RAGVIT_NO_CUBLASLT=1: linear runs on CPU arrays only")
        return cmd, False
    blas = cuda_find.cublas_root(cuda)
    if blas is None:
        sys.exit(cuda_find.missing_cublaslt_message(cuda))
    # an in-place or editable build also tries the library found here; a wheel does not
    # (backend.py): the path may not exist where the wheel is installed
    libs = [] if env("RAGVIT_BUILDING_WHEEL") == "1" else \
        sorted(glob.glob(join(blas, "lib*", "libcublasLt.so*")))
    cmd += ["-DRAGVIT_HAVE_CUBLASLT", "-I" + join(blas, "include")]
    return cmd + ([f'-DRAGVIT_CUBLASLT_PATH="{libs[-1]}"'] if libs else []), True


def wheel_rpaths(cuda):
    """Where dlopen("libcublasLt.so.N") also looks (the module's RUNPATH): the NVIDIA wheels'
    library folders (CUDA 13 layout, CUDA 12 layout) in the site-packages the module is
    installed into."""
    return [f"$ORIGIN/../nvidia/cu{cuda_find.cuda_major(cuda) or 13}/lib",
            "$ORIGIN/../nvidia/cublas/lib"]


class BuildExt(build_ext):
    def build_extensions(self):
        if SANITIZE and "clang" in os.path.basename(self.compiler.compiler_so[0]):
            # clang links its ASan runtime statically by default, which a module loaded into
            # an uninstrumented Python cannot use: link the shared one (the one preloaded)
            for ext in self.extensions:
                ext.extra_link_args.append("-shared-libsan")
        is_wanted = cuda_find.is_cuda_wanted()
        self.extensions[0].define_macros.append(("RAGVIT_BUILD_COMMIT", c_string(build_commit())))
        cuda = cuda_find.cuda_root() if is_wanted else None
        if cuda is None:
            why = ("RAGVIT_NO_CUDA=1" if not is_wanted
                   else "nvcc not found (CUDA_HOME, CUDA_PATH, PATH)")
            print(f"ragvit: {why}: building a CPU-only module")
            return super().build_extensions()
        (nvcc, has_cublaslt), ext = nvcc_command(cuda), self.extensions[0]
        sources = [s for s in sorted(glob.glob(join(ROOT, "csrc", "kernels", "*.cu")))
                   if "90" in ARCHS or os.path.basename(s) not in SM90A_ONLY]
        objects = [join(self.build_temp, os.path.basename(s) + ".o") for s in sources]
        os.makedirs(self.build_temp, exist_ok=True)
        with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # a failed nvcc raises
            run = lambda s, o: subprocess.check_call(  # noqa: E731
                nvcc + arch_flags(s) + ["-c", s, "-o", o])
            list(pool.map(run, sources, objects))
        ext.extra_objects += objects
        ext.depends += objects  # fresh kernel objects relink the module (a CPU-only .so goes)
        ext.define_macros += [("RAGVIT_WITH_CUDA", "1"),
                              ("RAGVIT_BUILD_CUDA_ARCHS", c_string(";".join(ARCHS))),
                              ("RAGVIT_BUILD_CUBLASLT", "1" if has_cublaslt else "0")]
        libdirs = [join(cuda, "lib64"), join(cuda, "lib")]
        ext.library_dirs += [d for d in libdirs if os.path.isdir(d)]
        ext.libraries += ["cudart_static", "rt", "pthread", "dl", "stdc++"]
        ext.runtime_library_dirs += wheel_rpaths(cuda) if has_cublaslt else []
        super().build_extensions()


# depends: the kernels and headers too, so that a changed .cu relinks the module
SOURCES = sorted(glob.glob("csrc/core/*.c") + glob.glob("csrc/cpu/*.c") +
                 glob.glob("csrc/python/*.c"))
setup(ext_modules=[Extension("ragvit._C", sources=SOURCES,
                             include_dirs=[join(ROOT, "csrc", "include"), join(ROOT, "csrc"),
                                           numpy.get_include()],
                             depends=sorted(glob.glob("csrc/*/*.h") + glob.glob("csrc/kernels/*")),
                             extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden",
                                                 *WARN, *SANITIZE_FLAGS],
                             extra_link_args=SANITIZE_FLAGS)],
      cmdclass={"build_ext": BuildExt})
