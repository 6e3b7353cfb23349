"""The repository's style checks (STYLE.md), as the pre-commit hooks run them.

ruff's lint rules (pyproject.toml) over the Python and the notebook, and clang-format with
the repository's .clang-format over the C and CUDA C of csrc/ and dev/. The tools come
pinned from requirements-test.txt, so every machine formats the same way; each check is
also run once on a deliberate violation, so a check that stopped checking would fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_SUFFIXES = {".c", ".h", ".cu", ".cuh"}
C_SOURCES = sorted(
    p for folder in ("csrc", "dev") for p in (ROOT / folder).rglob("*") if p.suffix in C_SUFFIXES
)


def clang_format() -> str:
    module = pytest.importorskip("clang_format", reason="pip install -r requirements-test.txt")
    return module.get_executable("clang-format")


def run(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, input=stdin, capture_output=True, text=True)


def test_python_passes_ruff():
    pytest.importorskip("ruff", reason="pip install -r requirements-test.txt")
    result = run([sys.executable, "-m", "ruff", "check", "--no-cache", "."])
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_reports_a_violation():
    pytest.importorskip("ruff", reason="pip install -r requirements-test.txt")
    result = run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--stdin-filename", "x.py", "-"],
        stdin="import os\n",
    )
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout + result.stderr


def test_c_sources_are_clang_formatted():
    assert len(C_SOURCES) >= 20, "csrc/ and dev/ should hold the C and CUDA C sources"
    result = run([clang_format(), "--style=file", "--dry-run", "--Werror", *map(str, C_SOURCES)])
    assert result.returncode == 0, (
        "run `clang-format -i --style=file` on these (or `pre-commit run --all-files`):\n"
        + result.stderr[:4000]
    )


def test_clang_format_reports_a_violation():
    result = run(
        [clang_format(), "--style=file", "--dry-run", "--Werror", "--assume-filename=csrc/x.c"],
        stdin="int  f(void){return 0;}\n",
    )
    assert result.returncode != 0 and "clang-format-violations" in result.stderr, result.stderr
