"""`python -m ragvit.demo` as a new user meets it: a machine without what a flag asks for
gets argparse's usage error (exit 2) with one line naming the problem, never a traceback.

The CUDA refusals are forced on any machine (torch.cuda.is_available patched to False), so
a GPU CI run checks them too; the subprocess form runs where there is no GPU (a CPU CI run).
The demo's successful runs are covered by tests/test_bench.py (the NumPy-only attention
example) and by `make demo`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ragvit import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m ragvit.demo" in err
    return err.splitlines()[-1]


@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--attention", "--device", "cuda"]],
                         ids=["model", "attention"])
def test_device_cuda_without_a_gpu_is_a_usage_error(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = usage_error(capsys, argv)
    assert line.startswith("python -m ragvit.demo: error: --device cuda: torch finds no CUDA "
                           "GPU (no NVIDIA driver or no visible device)"), line


def test_device_cuda_without_cuda_kernels_is_a_usage_error(monkeypatch, capsys):
    from ragvit import ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "cuda_is_compiled", lambda: False)
    line = usage_error(capsys, ["--device", "cuda"])
    assert "--device cuda: this ragvit build has no CUDA kernels" in line, line


def test_model_demo_without_torch_names_the_bench_extra():
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['ragvit.demo']; "
            "runpy.run_module('ragvit.demo', run_name='__main__')")
    r = run_python(code)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "pip install 'ragvit[bench]'" in r.stderr and "--attention" in r.stderr
    assert "requirements-test.txt" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_device_cuda_subprocess_on_a_cpu_machine():
    """The user-visible form: exit 2, usage and one error line on stderr, no traceback."""
    r = run_python("from ragvit.demo import main; raise SystemExit(main(['--device', 'cuda']))")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.splitlines()[-1].startswith(
        "python -m ragvit.demo: error: --device cuda: ")


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
