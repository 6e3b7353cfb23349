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
