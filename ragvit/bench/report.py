"""What ragvit's benchmarks write: the run's environment record, tables, JSON/CSV/Markdown.

Every results file carries environment(): the device (GPU name, or the CPU), driver, CUDA,
torch, timm, Python, the ragvit version and git SHA, so figures compare across commits and
machines, and a host-speed probe at the run's start and end: a run whose host changed speed by
more than HOST_DRIFT_LIMIT between the two is marked unsteady in its record and its Markdown,
and publish() says so on stderr (its figures are not for committing or comparing). `python -m
ragvit.bench` writes PREFIX.json (config, env, rows) and PREFIX.csv (flat_rows); the scripts in
benchmarks/ write PREFIX.md (their table) and PREFIX.json (env, rows) through `publish`.
load_results / load_result_folders read both kinds back (the notebook's input), including the
older record that names the device "gpu".
"""

from __future__ import annotations

import csv
import glob
import json
import os
import platform
import subprocess
import sys

__all__ = [
    "HOST_DRIFT_LIMIT", "environment", "flat_rows", "host_drift", "host_probe_us",
    "load_result_folders", "load_results", "probe_against_start", "publish", "render_table",
    "start_run",
    "unsteady_note", "write_report", "write_results",
]


def host_probe_us(reps: int = 21) -> float:
    """The host-speed probe every record carries: median µs of a fixed pure-Python workload
    (a 20000-step integer loop). The benchmark host's CPU speed varies between runs, and
    host-bound figures follow it: compare a run's probe with the others' before trusting
    its absolute figures (ratios timed in one process are unaffected)."""
    import statistics
    import time

    def work():
        total = 0
        for i in range(20000):
            total += i ^ (i >> 3)
        return total

    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        work()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return round(statistics.median(samples), 1)


_run_start_probe_us: float | None = None

# The most a run's host may change speed between its start and end probes (the larger over
# the smaller) and still count as steady. The GPU machine's host moves between a fast and a
# slow state ~1.6x apart; within one state the probe varies by a few percent.
HOST_DRIFT_LIMIT = 1.25


def host_drift(env: dict) -> float | None:
    """How much the host's speed changed during a run: the larger of its start and end
    probes over the smaller (1.0: steady); None when the start was not probed."""
    start, end = env.get("host_probe_start_us"), env.get("host_probe_us")
    if not start or not end:
        return None
    return round(max(start, end) / min(start, end), 3)



def start_run() -> float:
    """Takes the host-speed probe at the start of a benchmark run (every entry point calls
    it first); environment() records it next to its own probe, taken at the end."""
    global _run_start_probe_us
    _run_start_probe_us = host_probe_us()
    return _run_start_probe_us


def environment(device: str | None = None, **extra) -> dict:
    """The record of this run: device, torch threads, driver, CUDA, torch, timm, ragvit
    version and git SHA, Python, the host-speed probe at the run's start (start_run; None
    when it was not called) and now (host_probe_start_us, host_probe_us), their ratio
    (host_drift) and whether it is within HOST_DRIFT_LIMIT (host_steady; None unprobed),
    plus `extra` (a script's own settings).

    Args:
        device: "cuda" or "cpu", where the run's work ran; None: "cuda" when torch sees a
            GPU. On the CPU the device names the processor and the driver is None.

    The git SHA comes from RAGVIT_GIT_SHA when set (a copy of the tree without .git),
    else from git; "unknown" when neither answers.
    """
    import torch

    from .. import __version__

    def sh(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            return "unknown"

    try:
        import timm

        timm_version = timm.__version__
    except ImportError:
        timm_version = "missing"
    gpu = torch.cuda.is_available() if device is None else device == "cuda"
    here = os.path.dirname(os.path.abspath(__file__))
    cpu = platform.processor() or platform.machine()
    env = {
        "device": torch.cuda.get_device_name() if gpu else f"CPU ({cpu}, {os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "timm": timm_version,
        "ragvit": __version__,
        "git_sha": os.environ.get("RAGVIT_GIT_SHA")
        or sh(["git", "-C", here, "rev-parse", "--short", "HEAD"]),
        "python": sys.version.split()[0],
        "host_probe_start_us": _run_start_probe_us,
        "host_probe_us": host_probe_us(),
    }
    drift = host_drift(env)
    env["host_drift"] = drift
    env["host_steady"] = None if drift is None else drift <= HOST_DRIFT_LIMIT
    return {**env, **extra}


def probe_against_start(reps: int = 5) -> dict:
    """The host-speed probe now (a few ms), against the run's start (start_run), for a row of
    figures timed just before: {"host_probe_us", "host_steady"}; host_steady is None when the
    start was not probed, else whether the two are within HOST_DRIFT_LIMIT. A run can start
    and end fast with a slow stretch between: this dates each row."""
    now = host_probe_us(reps)
    start = _run_start_probe_us
    steady = None if not start else max(start, now) / min(start, now) <= HOST_DRIFT_LIMIT
    return {"host_probe_us": now, "host_steady": steady}


def unsteady_note(env: dict) -> str | None:
    """The warning a run whose host changed speed carries (None for a steady run)."""
    if env.get("host_steady") is not False:
        return None
    return (f"UNSTEADY HOST: the host-speed probe moved {env['host_probe_start_us']} -> "
            f"{env['host_probe_us']} µs during this run ({env['host_drift']}x, limit "
            f"{HOST_DRIFT_LIMIT}x): its figures are not for committing or comparing.")


def render_table(result: dict) -> str:
    """Markdown: one row per batch size, images/s per pipeline and ragvit's speedups (and
    ragvit_compiled's over ragvit_graph and ragvit eager when it ran)."""
    c, env = result["config"], result["env"]
    names = list(c["pipelines"])
    head = ["BS", "kept", "max dlogit ragvit", "top-1 agree"] + [f"{n} img/s" for n in names]
    base = [n for n in ("timm_eager", "fa2_packed", "reference") if n in names and n != "ragvit"]
    head += [f"ragvit / {n}" for n in base if "ragvit" in names]
    # torch.compile of the patched model against ragvit's own eager and CUDA-graph runs
    versus = [n for n in ("ragvit_graph", "ragvit") if n in names and "ragvit_compiled" in names]
    head += [f"compiled / {n}" for n in versus]
    lines = [f"{c['model']} {c['img_size']}px {c['dtype']}, {c['policy']}, on {env['device']} "
             f"(torch {env['torch']}, ragvit {env['ragvit']} @ {env['git_sha']}); median of "
             f"{c['reps']} after {c['warmup']} warm-ups",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        ch, t = r["check"], r.get("timing", {})
        ips = {n: t[n]["images_per_s"] for n in names if n in t}
        cells = [str(r["batch"]), f"{ch['kept_fraction']:.2f}",
                 f"{ch['err_ragvit_vs_reference']:.1e}" + ("" if ch["ok"] else " FAILED"),
                 f"{ch['top1_agree']:.2f}"]
        cells += [f"{ips[n]:.1f}" if n in ips else "–" for n in names]
        if "ragvit" in names:
            cells += [f"{ips['ragvit'] / ips[n]:.2f}" if "ragvit" in ips and n in ips else "–"
                      for n in base]
        cells += [f"{ips['ragvit_compiled'] / ips[n]:.2f}" if "ragvit_compiled" in ips
                  and n in ips else "–" for n in versus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flat_rows(result: dict) -> list[dict]:
    """One dict per (batch, pipeline): the CSV rows and the notebook's data frame."""
    c = result["config"]
    out = []
    for r in result["rows"]:
        for name in c["pipelines"]:
            t = r.get("timing", {}).get(name)
            out.append({
                "model": c["model"], "img_size": c["img_size"], "dtype": c["dtype"],
                "policy": c["policy"], "device": result["env"]["device"], "batch": r["batch"],
                "pipeline": name, "kept_fraction": r["check"]["kept_fraction"],
                "max_dlogit": r["check"]["err"].get(name),
                "ms_median": t["ms"]["median"] if t else None,
                "ms_p20": t["ms"]["p20"] if t else None,
                "ms_p80": t["ms"]["p80"] if t else None,
                "images_per_s": t["images_per_s"] if t else None,
            })
    return out


def load_results(path: str) -> list[dict]:
    """flat_rows of a results JSON: written by `write_results`, or by benchmarks/bench_e2e.py."""
    with open(path) as f:
        data = json.load(f)
    if "config" in data:
        return flat_rows(data)
    # benchmarks/bench_e2e.py: rows of {model, policy, batch, check, timing}; an env with
    # "gpu" for "device" and no "dtype" is the older form of the record (fp16 runs only)
    env = data["env"]
    device, dtype = env.get("device", env.get("gpu")), env.get("dtype", "fp16")
    out = []
    for r in data["rows"]:
        for name, t in r.get("timing", {}).items():
            out.append({
                "model": r["model"], "img_size": None, "dtype": dtype, "policy": r["policy"],
                "device": device, "batch": r["batch"], "pipeline": name,
                "kept_fraction": r["check"]["kept_fraction_last_stage"],
                "max_dlogit": r["check"].get("err_ragvit_vs_reference") if name == "ragvit"
                else None,
                "ms_median": t["ms"]["median"], "ms_p20": t["ms"]["p20"],
                "ms_p80": t["ms"]["p80"], "images_per_s": t["images_per_s"],
            })
    return out


def load_result_folders(folders, log=print) -> list[dict]:
    """load_results of every *.json in `folders` (in order), each row tagged with "suite":
    "sweep" for `write_results` files, else its bench_e2e suite, and "source": the file's
    name (what a plot names as its data's origin, next to the row's device). A bench_e2e suite comes
    from the first file that has it, so a fresh run's folder listed before the committed
    results wins and no suite is counted twice. Within a folder, files holding fewer suites
    come first (then by name): a one-suite re-run (gpu_check.sh's e2e_<suite>_<gpu>)
    supersedes that suite of an every-suite run (e2e_<gpu>). JSON that is neither is ignored. `log`
    gets one line per file: loaded (with the suites taken) or skipped."""
    rows, seen = [], set()
    for folder in folders:
        files = []  # (path, head, the suite of each (row, pipeline) in file order)
        for path in sorted(glob.glob(os.path.join(str(folder), "*.json"))):
            with open(path) as f:
                head = json.load(f)
            files.append((path, head, [r.get("suite", "paper") for r in head.get("rows") or []
                                       for _ in r.get("timing", {})]))
        files.sort(key=lambda file: len(set(file[2])))  # stable: by name within a count
        for path, head, suites in files:
            if "config" in head:
                rows += [dict(r, suite="sweep", source=os.path.basename(path))
                         for r in load_results(path)]
                log(f"loaded {path}")
                continue
            if not (head.get("rows") and any("timing" in r for r in head["rows"])):
                continue
            flat = load_results(path)  # one per (row, pipeline), in file order
            new = set(suites) - seen
            if not new:
                log(f"skipped {path} (its suites came from an earlier file)")
                continue
            rows += [dict(r, suite=s, source=os.path.basename(path))
                     for r, s in zip(flat, suites, strict=True) if s in new]
            seen |= new
            log(f"loaded {path} suites: {', '.join(sorted(new))}")
    return rows


def write_results(prefix: str, result: dict) -> list[str]:
    """Writes PREFIX.json (everything) and PREFIX.csv (flat_rows); returns the paths."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(result, f, indent=1, default=_to_json)
    rows = flat_rows(result)
    with open(prefix + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return [prefix + ".json", prefix + ".csv"]


def publish(rows: list, bad: int, render, prefix: str | None, device: str | None = None,
            **extra) -> int:
    """Renders rows with this run's environment (device and extra as environment() takes
    them), prints the table, writes PREFIX.md and PREFIX.json when a prefix is given;
    returns the exit code (1 when any row failed correctness). An unsteady host's run is
    written with its warning first and the warning is printed to stderr."""
    env = environment(device, **extra)
    table = render(rows, env)
    print(table)
    note = unsteady_note(env)
    if note:
        print(note, file=sys.stderr)
    if prefix:
        write_report(prefix, table, env, rows)
    return 1 if bad else 0


def write_report(prefix: str, table: str, env: dict, rows: list) -> list[str]:
    """Writes the Markdown table to PREFIX.md (after unsteady_note's warning, for a run
    whose host changed speed) and {"env", "rows"} to PREFIX.json."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    note = unsteady_note(env)
    with open(prefix + ".md", "w") as f:
        f.write(f"**{note}**\n\n{table}" if note else table)
    with open(prefix + ".json", "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1, default=_to_json)
    return [prefix + ".md", prefix + ".json"]


def _to_json(value):
    """NumPy scalars and the like: numbers where they are numbers, text otherwise."""
    return float(value) if hasattr(value, "__float__") else str(value)
