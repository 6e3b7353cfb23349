"""The build and the Makefile as a new user meets them: what `make demo` installs, what a
CPU-only build says about why it is CPU-only, and what ragvit.build_info() reports. Runs on
the CPU (about 40 s: one CPU-only build into a scratch folder)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("pytest", "ruff", "clang-format", "nbclient", "nbformat", "ipykernel", "matplotlib",
         "tqdm")


def _requirements(name: str) -> list[str]:
    with open(os.path.join(ROOT, name)) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def test_demo_requirements_hold_only_what_the_demo_uses():
    demo = _requirements("requirements-demo.txt")
    names = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0].lower() for r in demo}
    assert {"torch", "timm", "numpy"} <= names
    assert not names & set(TOOLS), names & set(TOOLS)
    assert "-r requirements-demo.txt" in _requirements("requirements-test.txt")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_demo_requirements_only():
    r = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "requirements-demo.txt" in r.stdout
    assert "requirements-test.txt" not in r.stdout


def test_cpu_only_build_names_the_switch_and_reports_what_it_holds(tmp_path):
    """With RAGVIT_NO_CUDA=1 the build says so, not that nvcc is missing, and the module it
    builds reports no CUDA and the commit it was given (RAGVIT_GIT_SHA)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGVIT_")}
    env.update(RAGVIT_NO_CUDA="1", RAGVIT_GIT_SHA="abc1234")
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                        str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "ragvit: RAGVIT_NO_CUDA=1: building a CPU-only module" in r.stdout
    assert "nvcc not found" not in r.stdout + r.stderr
    [path] = (tmp_path / "lib" / "ragvit").glob("_C*")
    spec = importlib.util.spec_from_file_location("ragvit_scratch._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build_info() == {"commit": "abc1234", "cuda": False, "cuda_archs": [],
                                   "cublaslt": False}


def test_build_info_describes_this_build():
    import ragvit

    info = ragvit.build_info()
    assert set(info) == {"version", "commit", "cuda", "cuda_archs", "cublaslt", "cpu_only",
                         "cuda_devices"}
    assert info["version"] == ragvit.__version__
    assert info["commit"] == "unknown" or info["commit"].isalnum()
    assert info["cuda"] == ragvit.cuda_is_compiled() == (not info["cpu_only"])
    assert info["cuda_devices"] == (ragvit.cuda_device_count() if info["cuda"] else 0)
    assert all(isinstance(a, str) and a.isdigit() for a in info["cuda_archs"])
    assert bool(info["cuda_archs"]) == info["cuda"]
    assert not info["cublaslt"] or info["cuda"]


# ---- the CUDA search and the isolated build's requirements (build_support/) ----

def _cuda_find(monkeypatch, env: dict[str, str]):
    """build_support/cuda_find.py with only env's RAGVIT_/CUDA_ variables, no nvcc on PATH
    and no NVIDIA wheels (this interpreter's would otherwise be found)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "build_support"))
    import cuda_find

    for name in list(os.environ):
        if name.startswith(("RAGVIT_", "CUDA_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cuda_find.shutil, "which", lambda name: None)
    monkeypatch.setattr(cuda_find, "wheel_roots", lambda: [])
    return cuda_find


def _toolkit(root, version: int, cublaslt: bool):
    """A CUDA root as the search sees it: bin/nvcc, the runtime and driver headers, and
    cublasLt.h when asked."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("")
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    if cublaslt:
        (root / "include" / "cublasLt.h").write_text("")
    return str(root)


@pytest.mark.parametrize("version,wheel", [(13000, "nvidia-cublas>=13,<14"),
                                           (12080, "nvidia-cublas-cu12")])
def test_isolated_build_requires_the_cublas_wheel_matching_cuda(tmp_path, monkeypatch,
                                                                version, wheel):
    """nvcc without cuBLASLt's header: the build needs the cuBLAS wheel of that CUDA major."""
    cuda = _toolkit(tmp_path / "cuda", version, cublaslt=False)
    cuda_find = _cuda_find(monkeypatch, {"CUDA_HOME": cuda})
    assert cuda_find.cuda_root() == cuda
    assert cuda_find.cublas_root(cuda) is None
    assert cuda_find.build_requires() == [wheel]


@pytest.mark.parametrize("env", [{"RAGVIT_NO_CUDA": "1"}, {"RAGVIT_NO_CUBLASLT": "1"}],
                         ids=["no_cuda", "no_cublaslt"])
def test_isolated_build_requires_nothing_more_when_switched_off(tmp_path, monkeypatch, env):
    cuda = _toolkit(tmp_path / "cuda", 13000, cublaslt=False)
    assert _cuda_find(monkeypatch, {"CUDA_HOME": cuda, **env}).build_requires() == []


def test_isolated_build_requires_nothing_more_with_cublaslt_or_without_cuda(tmp_path,
                                                                            monkeypatch):
    with_header = _toolkit(tmp_path / "full", 13000, cublaslt=True)
    cuda_find = _cuda_find(monkeypatch, {"CUDA_HOME": with_header})
    assert cuda_find.cublas_root(with_header) == with_header
    assert cuda_find.build_requires() == []
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setattr(cuda_find, "first_root", lambda roots, *files: None)
    assert cuda_find.cuda_root() is None
    assert cuda_find.build_requires() == []


def test_cublas_home_names_where_the_header_is(tmp_path, monkeypatch):
    cuda = _toolkit(tmp_path / "cuda", 13000, cublaslt=False)
    blas = _toolkit(tmp_path / "blas", 13000, cublaslt=True)
    cuda_find = _cuda_find(monkeypatch, {"CUDA_HOME": cuda, "RAGVIT_CUBLAS_HOME": blas})
    assert cuda_find.cublas_root(cuda) == blas
    assert cuda_find.build_requires() == []


def test_missing_cublaslt_message_names_every_way_on(tmp_path, monkeypatch):
    cuda = _toolkit(tmp_path / "cuda", 13000, cublaslt=False)
    message = _cuda_find(monkeypatch, {}).missing_cublaslt_message(cuda)
    for words in ("cublasLt.h not found", cuda, "pip install 'nvidia-cublas>=13,<14'",
                  "RAGVIT_CUBLAS_HOME", "RAGVIT_NO_CUBLASLT=1"):
        assert words in message, (words, message)


def test_backend_adds_the_requirement_to_setuptools_own(monkeypatch):
    """pyproject.toml's backend is setuptools' with cuda_find.build_requires() appended to
    the wheel and editable requirements, and a wheel built without the build's own
    libcublasLt path (RAGVIT_BUILDING_WHEEL)."""
    cuda_find = _cuda_find(monkeypatch, {})
    monkeypatch.setattr(cuda_find, "build_requires", lambda: ["nvidia-cublas>=13,<14"])
    import backend
    from setuptools import build_meta

    monkeypatch.setattr(build_meta, "get_requires_for_build_wheel", lambda settings: ["a"])
    monkeypatch.setattr(build_meta, "get_requires_for_build_editable", lambda settings: ["b"])
    assert backend.get_requires_for_build_wheel() == ["a", "nvidia-cublas>=13,<14"]
    assert backend.get_requires_for_build_editable() == ["b", "nvidia-cublas>=13,<14"]
    monkeypatch.delenv("RAGVIT_BUILDING_WHEEL", raising=False)
    monkeypatch.setattr(build_meta, "build_wheel", lambda *args: (
        args, os.environ.get("RAGVIT_BUILDING_WHEEL")))
    assert backend.build_wheel("dist") == (("dist", None, None), "1")
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert 'build-backend = "backend"' in text and 'backend-path = ["build_support"]' in text


def test_unknown_attribute_is_an_attribute_error():
    """The lazy names (patch, cuda_graph, ...) resolve; any other name is an AttributeError,
    so hasattr and getattr with a default behave."""
    import ragvit

    with pytest.raises(AttributeError, match="module 'ragvit' has no attribute 'pach'"):
        ragvit.pach  # noqa: B018 - the attribute access is the test
    assert not hasattr(ragvit, "pach") and getattr(ragvit, "pach", None) is None
    assert callable(ragvit.patch) and callable(ragvit.cuda_graph)
