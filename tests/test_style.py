"""The repository's style checks (STYLE.md), as the pre-commit hooks run them.

ruff's lint rules (pyproject.toml) over the Python and the notebook, and clang-format with
the repository's .clang-format over the C and CUDA C of csrc/ and dev/. The tools come
pinned from requirements-test.txt, so every machine formats the same way; each check is
also run once on a deliberate violation, so a check that stopped checking would fail.
Every text file also speaks of the project alone: no account of how the work went (step or
ticket numbers, which machine ran what) and no machine's absolute paths.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_SUFFIXES = {".c", ".h", ".cu", ".cuh"}
C_SOURCES = sorted(
    p for folder in ("csrc", "dev") for p in (ROOT / folder).rglob("*") if p.suffix in C_SUFFIXES
)


# Phrases that narrate the work instead of describing the project, and absolute paths of the
# machines it was built on (results name their tree and GPU instead).
# (The brackets keep this file from matching its own patterns.)
NARRATION = re.compile(r"s[t]op [0-9]+|device[ ](?:log|call|machine)|issue[ ][0-9]+", re.I)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|op[t])/\w")
BINARY_SUFFIXES = {".png", ".so", ".o", ".bin", ".whl"}


def tracked_text_files() -> list[Path]:
    """The files git tracks (every file under the root outside build output without git)."""
    listed = run(["git", "ls-files", "-z"])
    if listed.returncode == 0 and listed.stdout:
        paths = [ROOT / p for p in listed.stdout.split("\0") if p]
    else:
        skip = {".git", "build", "__pycache__", ".pytest_cache", ".ruff_cache"}
        paths = [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.parts)]
    return [p for p in paths if p.suffix not in BINARY_SUFFIXES and p.is_file()]


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


@pytest.mark.parametrize("pattern", [NARRATION, MACHINE_PATH], ids=["narration", "machine_path"])
def test_files_speak_of_the_project(pattern):
    found = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in pattern.finditer(text)]
    assert not found, "\n".join(found[:40])


def test_narration_check_reports_a_violation():
    assert NARRATION.search("measured in St" + "op 12")
    assert NARRATION.search("seen on the device " + "machine")
    assert MACHINE_PATH.search('"/' + 'opt/torch/.venv/lib/python3.12/site-packages"')
    assert not MACHINE_PATH.search("csrc/include/ragvit.h and /usr/local/cuda")
