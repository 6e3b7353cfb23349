"""What every ragvit benchmark shares besides the timer: the run's environment record,
the check-then-time loop, and writing PREFIX.md / PREFIX.json."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys


def environment(**extra) -> dict:
    """GPU, driver, CUDA, torch, ragvit version and git SHA of this run (plus `extra`)."""
    import torch

    import ragvit

    def cmd(c):
        try:
            return subprocess.check_output(c, shell=True, text=True,
                                           stderr=subprocess.DEVNULL).strip()
        except Exception:  # noqa: BLE001
            return "unknown"

    here = os.path.dirname(os.path.abspath(__file__))
    return {
        # CPU smoke runs (bench_e2e.py --tiny) name the processor instead.
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "driver": cmd("nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1"),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "ragvit": ragvit.__version__,
        # The GPU machine gets a copy of the tree without .git: pass RAGVIT_GIT_SHA there.
        "git_sha": os.environ.get("RAGVIT_GIT_SHA") or cmd(f"git -C {here} rev-parse --short HEAD"),
        "python": sys.version.split()[0],
        **extra,
    }


def check_then_time(cases, check, time, is_ok):
    """Checks every case first (prints "all results match" before any number), then
    times the cases that passed. Returns (rows, number of failed rows)."""
    rows = [check(case) for case in cases]
    bad = sum(1 for row in rows if not is_ok(row))
    print("all results match" if not bad else f"{bad} grid points FAILED correctness",
          flush=True)
    for case, row in zip(cases, rows, strict=True):
        if is_ok(row):
            time(case, row)
    return rows, bad


def publish(rows: list, bad: int, render, prefix: str | None, **extra) -> int:
    """Renders rows with this run's environment, prints the table, writes the results;
    returns the exit code (1 when any row failed correctness)."""
    env = environment(**extra)
    table = render(rows, env)
    print(table)
    write_results(prefix, table, env, rows)
    return 1 if bad else 0


def write_results(prefix: str | None, table: str, env: dict, rows: list) -> None:
    """Writes the Markdown table and the JSON record when a prefix was given."""
    if not prefix:
        return
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".md", "w") as f:
        f.write(table)
    with open(prefix + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1, default=_to_json)


def _to_json(value):
    """NumPy scalars and the like: numbers where they are numbers, text otherwise."""
    return float(value) if hasattr(value, "__float__") else str(value)
