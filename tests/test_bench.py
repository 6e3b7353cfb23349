"""ragvit.bench (timer, pipelines, report, CLI), the scripts in benchmarks/ and the notebook.

The CLI runs in a subprocess as a user would run it (--help, a tiny DeiT-Tiny 64 px sweep
that must print "all results match", the table and write JSON/CSV; malformed arguments
must give argparse's usage error, exit 2, not a traceback). The benchmark scripts run their
CPU smoke modes (bench_e2e.py --tiny) and argument checks. The notebook executes top to
bottom headless with RAGVIT_NB_TINY=1, so it cannot rot, prints no absolute path, saves
its figures into a scratch folder (never benchmarks/results) and names each one's data. The
timer's scheduling (rotation, interleaving, bursts) is checked with counting callables on
the CPU; ragvit_compiled is compiled on the CPU twice (the sweep, in-process, and
bench_e2e.py's compiled suite). Budget: about five minutes on two slow cores, most of it in
the subprocesses that import torch, the notebook, bench_e2e.py and the two compilations.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from support.devices import CUDA_OK, requires_cuda
from support.inputs import seed_note

pytest.importorskip("timm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "benchmarks", "ragvit_benchmarks.ipynb")


def run_cli(*args, timeout=120, **env):
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ragvit.bench", *args], cwd=ROOT,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: python -m ragvit.bench" in r.stdout
    for flag in ("--config", "--model", "--keep", "--threshold", "--pipelines", "--out"):
        assert flag in r.stdout


def test_tiny_cpu_sweep(tmp_path):
    prefix = str(tmp_path / "tiny")
    r = run_cli("--config", "tiny", "--batches", "1", "2", "--reps", "2", "--out", prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    # stderr is a pipe, not a terminal: progress comes as plain lines, no bar redraws
    assert "\r" not in r.stderr and "\r" not in r.stdout
    assert "ragvit.bench [1/10] check BS 1" in r.stderr.splitlines(), r.stderr
    assert "ragvit.bench [10/10] ragvit BS 2" in r.stderr.splitlines(), r.stderr
    out = r.stdout
    assert "all results match" in out
    assert out.index("max |dlogit|") < out.index("all results match") < out.index("img/s")
    assert "| BS | kept |" in out and "ragvit img/s" in out
    with open(prefix + ".json") as f:
        result = json.load(f)
    assert result["failed"] == 0
    assert result["config"]["model"] == "deit_tiny_patch16_224"
    assert [row["batch"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["check"]["ok"] and row["check"]["err"]["ragvit"] <= 1e-4
        # the CPU's default pipelines
        assert set(row["timing"]) == {"timm_eager", "reference", "dense_gather", "ragvit"}
        assert all(t["images_per_s"] > 0 for t in row["timing"].values())
    with open(prefix + ".csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and {r["pipeline"] for r in rows} == {"timm_eager", "reference",
                                                                   "dense_gather", "ragvit"}


def child_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_importing_bench_imports_no_torch_and_sets_no_environment():
    """ragvit.bench and its timer import without torch or timm and leave os.environ as it
    was, so NumPy-only code (ragvit.demo's attention example) can use the timer."""
    code = ("import os, sys; before = dict(os.environ); import ragvit.bench, ragvit.bench.timing; "
            "assert dict(os.environ) == before, set(os.environ) ^ set(before); "
            "assert 'torch' not in sys.modules and 'timm' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_demo_attention_runs_without_torch():
    """`python -m ragvit.demo --attention` with torch unimportable: NumPy arrays, the NumPy
    float64 reference and ragvit.bench.timing.host_us."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            "sys.argv = ['ragvit.demo', '--attention', '--batch', '2']; "
            "runpy.run_module('ragvit.demo', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cpu (NumPy)" in r.stdout and "(ok)" in r.stdout
    assert "host time per call" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--batches", "0"], "--batches"),
    (["--keep", "1.5"], "--keep"),
    (["--keep", "0.5", "--threshold", "1.0"], "not allowed with"),
    (["--pipelines", "bogus"], "--pipelines"),
    (["--config", "nope"], "--config"),
    (["--reps", "x"], "--reps"),
    (["--model", "not_a_model"], "unknown timm model"),
    (["--device", "cpu", "--pipelines", "timm_graph"], "GPU only"),
    (["--model", "resnet18"], "resnet18 is not a ViT/DeiT; ragvit.bench runs timm "
     "VisionTransformer and VisionTransformerDistilled models: the aliases deit_t, deit_s"),
    (["--model", "vit_base_patch16_siglip_224"], "a model without a class token is not "
     "supported"),
], ids=lambda v: v if isinstance(v, str) else "_".join(v))
def test_malformed_arguments_are_usage_errors(args, message, capsys):
    from ragvit.bench import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err


def test_device_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    import torch

    from ragvit.bench import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "error: --device cuda: torch finds no CUDA GPU" in capsys.readouterr().err


def test_run_refuses_a_non_vit_model_before_loading_it():
    from ragvit import bench

    with pytest.raises(bench.ConfigError, match="resnet18 is not a ViT/DeiT"):
        bench.run(bench.BenchConfig(model="resnet18", device="cpu"), progress=False)


def test_without_torch_names_the_bench_extra():
    """A wheel has no requirements-test.txt: the message names ragvit's [bench] extra."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['ragvit.bench']; "
            "runpy.run_module('ragvit.bench', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "needs torch and timm: pip install 'ragvit[bench]'" in r.stderr
    assert "requirements-test.txt" not in r.stderr


class _Stream:
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


def test_progress_is_plain_lines_when_not_a_terminal():
    from ragvit.bench import sweep

    stream = _Stream(tty=False)
    bar = sweep._progress(2, True, file=stream)
    for step in ("check BS 1", "ragvit BS 1"):
        bar.set_postfix_str(step)
        bar.update()
    bar.close()
    text = "".join(stream.text)
    assert "\r" not in text
    assert text == "ragvit.bench [1/2] check BS 1\nragvit.bench [2/2] ragvit BS 1\n"
    quiet = _Stream(tty=False)
    bar = sweep._progress(2, False, file=quiet)
    bar.set_postfix_str("check BS 1")
    assert quiet.text == []


def test_progress_is_a_bar_on_a_terminal():
    tqdm = pytest.importorskip("tqdm")
    from ragvit.bench import sweep

    bar = sweep._progress(2, True, file=_Stream(tty=True))
    assert isinstance(bar, tqdm.tqdm)
    bar.close()


def test_malformed_arguments_subprocess():
    """The user-visible form: exit 2, usage on stderr, no traceback."""
    r = run_cli("--config", "tiny", "--layers", "99")  # past DeiT-Tiny's 12 blocks
    assert r.returncode == 2, r.stdout + r.stderr
    assert "usage:" in r.stderr and "layers" in r.stderr
    assert "Traceback" not in r.stderr


def test_load_results_reads_bench_e2e_json(tmp_path):
    from ragvit.bench import report

    path = tmp_path / "e2e.json"
    timing = {"ms": {"median": 2.0, "p20": 1.9, "p80": 2.1}, "images_per_s": 500.0}
    path.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "rows": [{
        "model": "DeiT-S 224", "policy": "l2_keep50_b4", "batch": 1,
        "check": {"kept_fraction_last_stage": 0.5, "err_ragvit_vs_reference": 1e-3},
        "timing": {"timm_eager": timing, "ragvit": timing}}]}))
    rows = report.load_results(str(path))
    assert [r["pipeline"] for r in rows] == ["timm_eager", "ragvit"]
    assert rows[1]["device"] == "NVIDIA H200" and rows[1]["max_dlogit"] == 1e-3
    assert rows[1]["dtype"] == "fp16"  # the older record: "gpu", no dtype
    path.write_text(json.dumps({"env": {"device": "NVIDIA H100", "dtype": "bf16"}, "rows": [{
        "model": "DeiT-S 224", "policy": "l2_keep50_b4", "batch": 1,
        "check": {"kept_fraction_last_stage": 0.5}, "timing": {"ragvit": timing}}]}))
    rows = report.load_results(str(path))
    assert rows[0]["device"] == "NVIDIA H100" and rows[0]["dtype"] == "bf16"


def test_load_result_folders_takes_each_suite_once(tmp_path):
    """report.load_result_folders: a bench_e2e suite comes from the first file that
    has it (a fresh folder listed first wins over the committed results; within a folder a
    one-suite re-run wins over an every-suite run), sweeps always load, other JSON is
    ignored; every file is logged as loaded or skipped."""
    from ragvit.bench import report

    timing = {"ms": {"median": 2.0, "p20": 1.9, "p80": 2.1}, "images_per_s": 500.0}

    def e2e(suites, ips):
        t = dict(timing, images_per_s=ips)
        return {"env": {"gpu": "NVIDIA H200"}, "rows": [{
            "model": "DeiT-S 224", "policy": "l2_keep50_b4", "batch": 1, "suite": s,
            "check": {"kept_fraction_last_stage": 0.5, "err_ragvit_vs_reference": 1e-3},
            "timing": {"timm_eager": t, "ragvit": t}} for s in suites]}

    fresh, committed = tmp_path / "fresh", tmp_path / "committed"
    fresh.mkdir()
    committed.mkdir()
    (fresh / "e2e_paper_h200.json").write_text(json.dumps(e2e(["paper"], 900.0)))
    (committed / "e2e_h200.json").write_text(json.dumps(e2e(["paper", "graph", "policies"],
                                                             500.0)))
    (committed / "e2e_zz_h200.json").write_text(json.dumps(e2e(["graph"], 100.0)))
    (committed / "attention_h200.json").write_text(json.dumps({"env": {}, "rows": [{}]}))
    lines = []
    rows = report.load_result_folders([fresh, committed], log=lines.append)
    got = sorted((r["suite"], r["pipeline"], r["images_per_s"]) for r in rows)
    assert got == [("graph", "ragvit", 100.0), ("graph", "timm_eager", 100.0),
                   ("paper", "ragvit", 900.0), ("paper", "timm_eager", 900.0),
                   ("policies", "ragvit", 500.0), ("policies", "timm_eager", 500.0)]
    assert {(r["suite"], r["source"]) for r in rows} == {
        ("graph", "e2e_zz_h200.json"), ("paper", "e2e_paper_h200.json"),
        ("policies", "e2e_h200.json")}
    assert lines == [f"loaded {fresh / 'e2e_paper_h200.json'} suites: paper",
                     f"loaded {committed / 'e2e_zz_h200.json'} suites: graph",
                     f"loaded {committed / 'e2e_h200.json'} suites: policies"]
    lines.clear()
    rows = report.load_result_folders([committed, fresh], log=lines.append)
    assert lines == [f"loaded {committed / 'e2e_zz_h200.json'} suites: graph",
                     f"loaded {committed / 'e2e_h200.json'} suites: paper, policies",
                     f"skipped {fresh / 'e2e_paper_h200.json'} (its suites came from an "
                     "earlier file)"]


def test_notebook_executes_in_tiny_mode(monkeypatch):
    try:
        import ipykernel  # noqa: F401
        import matplotlib  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as e:
        pytest.skip(f"notebook test needs nbclient, nbformat, ipykernel and matplotlib "
                    f"(pip install -r requirements-test.txt): {e}")
    monkeypatch.setenv("RAGVIT_NB_TINY", "1")
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
    assert "tiny mode" in text and "ran 2 configurations" in text
    assert images >= 3  # throughput/speedup, attention µs, kept fraction vs speedup
    assert_no_absolute_paths(text)
    # tiny mode saves its figures into a scratch folder, each naming its data's source
    assert "saved build/notebook/e2e_throughput.png | data: this run, CPU" in text
    assert ("saved build/notebook/attention_us.png | data: stored "
            "benchmarks/results/attention_h200.json, NVIDIA H200 (not this run)") in text
    assert "saved build/notebook/kept_vs_speedup.png | data: this run, CPU" in text


def assert_no_absolute_paths(text):
    """No path of this machine in a notebook's outputs (the repository, $HOME, a venv)."""
    for root in {ROOT, os.path.expanduser("~"), sys.prefix, os.path.realpath(ROOT)}:
        assert root not in text, f"{root} in the notebook's outputs"
    assert not re.search(r"(^|[\s'\"(])/(root|home|opt|usr|tmp|work)/", text), text


# ---- the scripts in benchmarks/ (CPU smoke runs and argument checks) ----

BENCH = os.path.join(ROOT, "benchmarks")


def load_script(name):
    """benchmarks/<name>.py as a module, in this process (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(script, *args, timeout=180, **extra_env):
    env = dict(os.environ, **extra_env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_e2e_help():
    r = run_script("bench_e2e.py", "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--suite", "--budget-s", "--tiny", "--out", "policies", "graph"):
        assert flag in r.stdout


@pytest.mark.parametrize("flag", ["--batches", "--reps"])
def test_bench_dense_sdpa_refuses_counts_below_one(flag):
    """Usage error (exit 2) naming the flags, before any CUDA check."""
    r = run_script("bench_dense_sdpa.py", flag, "0")
    assert r.returncode == 2, r.stderr
    assert "--batches and --reps must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("flag", ["--block", "--ratio-calls", "--calls", "--reps", "--rounds"])
def test_bench_attention_refuses_counts_below_one(flag):
    """A zero count is argparse's usage error (exit 2) naming the flags, before any CUDA
    check, so it runs on the CPU."""
    r = run_script("bench_attention.py", flag, "0")
    assert r.returncode == 2, r.stderr
    assert "--reps, --rounds, --block, --calls and --ratio-calls must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_pack.py", "bench_interop.py",
                                    "bench_host_ab.py", "bench_dense_sdpa.py", "profile_e2e.py",
                                    "run_notebook.py", "bench_compile_call.py"])
def test_benchmark_scripts_help(script):
    """Every entry script imports (ragvit.bench, no path tricks) and prints its usage."""
    r = run_script(script, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:")


@pytest.mark.parametrize("args,message", [
    (["--variants", "reduce-overhead+fast"], "unknown variant 'reduce-overhead+fast': MODE or "
                                            "MODE+freezing"),
    (["--variants", "quick"], "unknown variant 'quick': Unrecognized mode=quick"),
    (["--calls", "0"], "--calls, --reps and --batch must be >= 1"),
])
def test_bench_compile_call_usage_errors(args, message):
    """bench_compile_call.py refuses a variant that is not MODE[+freezing] and counts below 1,
    before it looks for a GPU."""
    r = run_script("bench_compile_call.py", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_bench_host_ab_against_its_own_build(tmp_path):
    """The A/B host timer loads a second copy of the extension beside ragvit._C; timed
    against itself, every call's ratio is a number near 1 and the record names both trees."""
    import ragvit

    r = run_script("bench_host_ab.py", "--base", ragvit._C.__file__, "--base-tree", "same",
                   "--calls", "100", "--out", str(tmp_path / "ab"))
    assert r.returncode == 0, r.stderr
    assert "all results match" in r.stdout
    record = json.loads((tmp_path / "ab.json").read_text())
    assert record["env"]["base"] == "same"
    assert {row["call"] for row in record["rows"]} >= {"attention_out", "attention_alloc",
                                                       "layer_norm_out"}
    for row in record["rows"]:
        assert 0.2 < row["ratio"] < 5, row


def test_bench_host_ab_refuses_a_file_that_is_no_module(tmp_path):
    bogus = tmp_path / "_C.txt"
    bogus.write_text("not a module")
    r = run_script("bench_host_ab.py", "--base", str(bogus), "--calls", "10")
    assert r.returncode != 0
    assert "not an extension module" in r.stderr + r.stdout


@pytest.mark.parametrize("row", ["DeiT-X:deit224_keep50:4", "DeiT-S:nokeep:4", "DeiT-S:all0:4",
                                 "DeiT-S:deit224_keep50:0", "DeiT-S:deit224_keep50"])
def test_bench_attention_refuses_bad_rows(row, capsys):
    """--rows entries are checked before any CUDA check: a bad one is a usage error."""
    bench_attention = load_script("bench_attention")
    with pytest.raises(SystemExit) as exc:
        bench_attention.main(["--rows", row])
    assert exc.value.code == 2
    assert f"bad row {row!r}: want MODEL:DIST:S" in capsys.readouterr().err


def test_bench_e2e_tiny_all_suites(tmp_path):
    """Every suite checks then times on the CPU and lands in one .md (a section each) and
    one .json that ragvit.bench.report.load_results reads."""
    from ragvit.bench import report

    prefix = str(tmp_path / "e2e")
    r = run_script("bench_e2e.py", "--tiny", "--suite", "all", "--batches", "2", "--reps", "2",
                   "--warmup", "0", "--out", prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    for suite in ("paper", "policies", "graph", "compiled"):
        assert f"{suite}: all results match" in r.stdout
        first_timing = next(i for i, line in enumerate(r.stdout.splitlines())
                            if line.startswith(f"{suite} | ") and "img/s" in line)
        assert r.stdout.splitlines().index(f"{suite}: all results match") < first_timing
    with open(prefix + ".md") as f:
        md = f.read()
    assert md.count("## Suite") == 4 and md.count("\nTargets:\n") == 4
    with open(prefix + ".json") as f:
        data = json.load(f)
    assert ["paper", "policies", "graph", "compiled"] == data["env"]["suites"]
    by_suite = {}
    for row in data["rows"]:
        by_suite.setdefault(row["suite"], []).append(row)
        assert row["check"]["ok"] and row["check"]["err_ragvit_vs_reference"] <= 1e-4
        assert {"ragvit", "timm_eager" if row["suite"] != "compiled" else "ragvit_compiled"} \
            <= set(row["timing"])
    assert len(by_suite["policies"]) == 10 and len(by_suite["graph"]) == 1
    (compiled,) = by_suite["compiled"]  # torch.compile of the patched model, on the CPU too
    assert compiled["check"]["err"]["ragvit_compiled"] <= 1e-4
    kinds = {row["policy"].split("_")[0] for row in by_suite["policies"]}
    assert kinds == {"l2", "evit", "ats", "tome", "dynvit"}
    assert data["env"]["device"].startswith("CPU") and data["env"]["dtype"] == "fp32"
    assert len(report.load_results(prefix + ".json")) == sum(len(r["timing"])
                                                             for r in data["rows"])
    # fp32 on the CPU: ragvit decides as the independent fp32 selection does on every image
    assert md.count("| model | policy | BS | images differ | max dlogit where the same |") == 4
    for row in data["rows"]:
        sel = row["check"]["selection"]
        assert sel["images"] == 2 and sel["images_differ"] == 0, row
        assert sel["max_dlogit_same"] <= 1e-4
    assert all(r["lossless_err"] <= r["lossless_bar"] for r in by_suite["paper"])


def test_bench_e2e_tiny_baselines_suite(tmp_path):
    """The baselines suite (not in all) checks dense_gather against the reference on its own
    decisions and times it beside ragvit on the CPU; its table names the fastest
    alternative and ragvit's best per row."""
    prefix = str(tmp_path / "e2e")
    r = run_script("bench_e2e.py", "--tiny", "--suite", "baselines", "--batches", "2", "--reps",
                   "2", "--warmup", "0", "--out", prefix)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "baselines: all results match" in r.stdout
    with open(prefix + ".json") as f:
        data = json.load(f)
    assert data["env"]["suites"] == ["baselines"]
    [row] = data["rows"]
    assert row["check"]["ok"] and row["check"]["err"]["dense_gather"] <= 1e-4
    assert row["host_probe_us"] > 0 and row["host_steady"] in (True, False)
    # the CPU runs no graphs and compiles ragvit alone (the compiled baselines take minutes)
    assert set(row["timing"]) == {"dense_gather", "ragvit", "ragvit_compiled"}
    with open(prefix + ".md") as f:
        md = f.read()
    assert "| fastest alternative | ragvit's best |" in md
    assert "| DeiT-T 64 | 2 | " in md and "| dense_gather | ragvit" in md
    # the compiled suite's targets, from the same rows: no graph on the CPU, no batch 256
    assert "- batch 1-16: compiled (reduce-overhead) >= 0.95x ragvit graph: not measured" in md
    assert "- batch 256: compiled (default) >= ragvit eager: not measured" in md


def test_compiled_targets_judge_each_row():
    """bench_e2e.compiled_targets: compiled >= 0.95x the graph at batch <= 16 and >= eager at
    batch >= 256, one verdict per timed row; failed and skipped rows are left out."""
    bench_e2e = load_script("bench_e2e")

    def row(batch, eager, graph, compiled, **extra):
        timing = {n: {"images_per_s": v} for n, v in
                  (("ragvit", eager), ("ragvit_graph", graph), ("ragvit_compiled", compiled))
                  if v is not None}
        return {"model": "M", "batch": batch, "check": {"ok": True}, "timing": timing, **extra}

    rows = [row(1, 300, 1000, 950), row(16, 3000, 10000, 9400), row(256, 5000, None, 5000),
            row(256, 5000, None, 4999), row(1, 1, 1, 0.1, skipped="budget"),
            {"model": "M", "batch": 4, "check": {"ok": False}, "timing": {}}]
    graph, eager = bench_e2e.compiled_targets(rows)
    assert graph == ("- batch 1-16: compiled (reduce-overhead) >= 0.95x ragvit graph: 1/2 "
                     "MISSED for M BS 16 (0.94x)")
    assert eager == ("- batch 256: compiled (default) >= ragvit eager: 1/2 MISSED for "
                     "M BS 256 (1.00x)")
    assert bench_e2e.compiled_targets(rows[:1] + rows[2:3]) == [
        "- batch 1-16: compiled (reduce-overhead) >= 0.95x ragvit graph: 1/1 met",
        "- batch 256: compiled (default) >= ragvit eager: 1/1 met"]


def test_bench_e2e_lossless_bar_fails_the_run(monkeypatch, capsys):
    """bench_e2e.check_lossless: within twice timm's own error against float64 plus the
    floor on the CPU; a run whose lossless check misses its bar fails every row of that
    model and batch, says why, and exits 1."""
    import timm
    import torch

    bench_e2e = load_script("bench_e2e")
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    with torch.no_grad():
        got = bench_e2e.check_lossless(model, torch.randn(2, 3, 64, 64))
    assert got["ok"] and got["err"] <= got["bar"] == 2 * got["err_timm"] + 1e-5
    missed = {"err": 0.5, "err_timm": 1e-6, "bar": 1.2e-5, "ok": False}
    monkeypatch.setattr(bench_e2e, "check_lossless", lambda model, x: missed)
    assert bench_e2e.main(["--tiny", "--suite", "paper", "--batches", "1"]) == 1
    out = capsys.readouterr().out
    assert ("paper | DeiT-T 64 BS 1: FAILED lossless: ragvit.patch without a policy is "
            "5.00e-01 from timm's forward, over the bar 1.20e-05") in out
    assert "paper: 2 rows FAILED correctness (not timed)" in out


def test_bench_e2e_budget_skips_rows(tmp_path, capsys):
    """In-process (no second torch import): a spent budget skips rows, still writes."""
    bench_e2e = load_script("bench_e2e")
    prefix = str(tmp_path / "e2e")
    assert bench_e2e.main(["--tiny", "--suite", "graph", "--batches", "1", "--budget-s",
                           "1e-3", "--out", prefix]) == 0
    assert "rows skipped (time budget)" in capsys.readouterr().out
    with open(prefix + ".md") as f:
        assert "skipped (time budget)" in f.read()


def test_fa2_cls_attn_matches_ragvit(monkeypatch, gen):
    """The FA2 baseline for EViT/ATS (pipelines.fa2_attention_cls) computes the CLS attention
    row in torch; with ragvit.attention standing in for FA2 (CPU), both rows agree."""
    import torch

    import ragvit
    from ragvit.bench import pipelines

    monkeypatch.setattr(pipelines, "fa2_attention", lambda q, k, v, cu, m=None, *, scale=None:
                        ragvit.attention(q, k, v, cu, m, scale=scale))
    lengths = [5, 1, 17, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    qkv = torch.randn(int(cu[-1]), 3, 6, 64, generator=gen)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    ours, theirs = torch.empty(len(q)), torch.empty(len(q))
    out = pipelines.fa2_attention_cls(q, k, v, cu, 17, scale=0.125, cls_attn=theirs)
    expected = ragvit.attention(q, k, v, cu, 17, scale=0.125, cls_attn=ours)
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="no per-key bias"):
        pipelines.fa2_attention_cls(q, k, v, cu, 17, bias=torch.zeros(len(q)))


def test_run_notebook_inprocess_saves_pngs(tmp_path):
    """Without nbclient/ipykernel the in-process engine executes the notebook, keeps figure
    outputs in the .ipynb and writes the PNGs where told; no output names an absolute path
    (the PNG folder is outside the repository here)."""
    r = run_script("run_notebook.py", "--tiny", "--engine", "inprocess", "--out",
                   str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    with open(tmp_path / "ragvit_benchmarks.ipynb") as f:
        nb = json.load(f)
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c["outputs"])
    images = sum("image/png" in o.get("data", {}) for c in nb["cells"]
                 if c["cell_type"] == "code" for o in c["outputs"])
    assert "tiny mode" in text and "ran 2 configurations" in text and images >= 3
    assert_no_absolute_paths(text)
    assert str(tmp_path) not in text and f"saved …/{tmp_path.name}/e2e_throughput.png" in text
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert {"e2e_throughput.png", "kept_vs_speedup.png"} <= pngs


def test_run_notebook_text_only_drops_the_inline_images(tmp_path):
    """--text-only saves the executed notebook without inline images (the PNG files keep
    them), its text outputs intact: the copy the repository keeps stays small."""
    r = run_script("run_notebook.py", "--engine", "inprocess", "--text-only",
                   "--out", str(tmp_path), RAGVIT_NB_TINY="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("tiny mode (RAGVIT_NB_TINY=1)"), r.stdout
    with open(tmp_path / "ragvit_benchmarks.ipynb") as f:
        nb = json.load(f)
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert not any(k.startswith("image/") for o in outputs for k in o.get("data", {}))
    assert "ran 2 configurations" in "".join("".join(o.get("text", "")) for o in outputs)
    assert {"e2e_throughput.png", "kept_vs_speedup.png"} <= {p.name for p in
                                                             tmp_path.glob("*.png")}


@pytest.mark.parametrize("args", [["--tiny"], []], ids=["tiny", "auto"])
def test_run_notebook_tiny_never_writes_into_results(args):
    """Tiny mode's CPU smoke figures never replace the measured ones in benchmarks/results
    (without a flag a machine without a GPU renders in tiny mode)."""
    if not args and CUDA_OK:
        pytest.skip("without a flag a GPU machine renders in full mode")
    r = run_script("run_notebook.py", *args, "--out", os.path.join("benchmarks", "results"),
                   timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "tiny mode writes no figures into benchmarks/results" in r.stderr
    assert "Traceback" not in r.stderr


def test_host_us_and_time_ms_on_the_cpu():
    """timing.host_us syncs after the warm-up, every `sync_every` (200) timed calls and at
    the end, never inside a timed call; time_ms on the CPU with one rep gives that sample as
    its spread."""
    from ragvit.bench import timing

    calls, syncs = [], []
    stats = timing.host_us(lambda: calls.append(1), calls=400, warmup=3,
                           sync=lambda: syncs.append(len(calls)))
    assert len(calls) == 403 and syncs == [3, 203, 403, 403]
    assert 0 < stats.p10 <= stats.median <= stats.p90
    calls.clear()
    syncs.clear()
    timing.host_us(lambda: calls.append(1), calls=3, warmup=0,
                   sync=lambda: syncs.append(len(calls)), sync_every=1)
    assert syncs == [0, 1, 2, 3, 3]  # profile_e2e: every forward from an empty queue
    one = timing.time_ms(lambda: sum(range(1000)), "cpu", warmup=0, reps=1)
    assert one.median == one.p20 == one.p80 > 0
    assert timing.cuda_sync() is None  # no GPU here: nothing to wait for


def test_stats_percentiles_stay_ordered_on_tied_samples():
    """Tied samples (host timers tick in whole ns) interpolate to an ulp past their value in
    statistics.quantiles; the percentiles stay ordered around the median."""
    from ragvit.bench import timing

    stats = timing._stats([0.12] * 7 + [0.13] * 3)
    assert stats.p10 <= stats.p20 <= stats.median == 0.12 <= stats.p80 <= stats.p90 <= 0.13


def test_interleaved_host_timer_pairs_rounds(monkeypatch):
    """timing.host_us_interleaved: every fn is timed in each round and the ratio is per
    round: on a simulated clock where every call of round r costs (1 + r) µs for fast and
    2 or 3 times that (even / odd rounds) for slow, the drift cancels and the rounds' ratios
    are 2 and 3 (median 2.5), where a ratio of the pooled medians would be 13 / 5.5."""
    from ragvit.bench import timing

    calls = {"fast": 0, "slow": 0}
    now = [0]

    def tick(name, factors):
        def fn():
            calls[name] += 1
            r = max(0, calls[name] - 5 - 1) // 23  # the round of this call (after 5 warm-ups)
            now[0] += factors[r % 2] * (1 + r) * 1000
        return fn

    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: now[0])
    stats, ratios = timing.host_us_interleaved(
        {"fast": tick("fast", (1, 1)), "slow": tick("slow", (2, 3))}, {"slow": ("slow", "fast")},
        calls=200, block=20, warmup=5, sync=lambda: None)
    assert calls == {"fast": 5 + 10 * 23, "slow": 5 + 10 * 23}  # warm-up + rounds × (3 + block)
    assert stats["fast"].median == 5.5 and stats["slow"].median == 13.0  # rounds' medians
    assert (ratios["slow"].p10, ratios["slow"].median, ratios["slow"].p90) == (2.0, 2.5, 3.0)


def test_interleaved_ms_times_every_fn_each_round():
    """timing.interleaved_ms (bench_e2e's timer): warm-up per fn, then one call of
    every fn per round in rotating order, so each fn gets `reps` samples."""
    from ragvit.bench import timing

    order = []

    def make(name, work):
        def fn():
            order.append(name)
            sum(range(work))
        return fn

    stats = timing.interleaved_ms({"a": make("a", 10), "b": make("b", 20000)}, warmup=2,
                                  reps=6, device="cpu")
    assert order[:4] == ["a", "a", "b", "b"]  # warm-up
    rounds = [order[4 + 2 * r: 6 + 2 * r] for r in range(6)]
    assert all(sorted(r) == ["a", "b"] for r in rounds)
    assert rounds[0] != rounds[1], "the order must rotate between rounds"
    assert stats["b"].median > stats["a"].median > 0


def test_interleaved_ms_burst_times_the_last_of_each_run():
    """interleaved_ms(burst=3): each round calls every fn three times in a row and times
    only the third (the steady state); burst < 1 is refused."""
    from ragvit.bench import timing

    order = []

    def make(name):
        def fn():
            order.append(name)
            # the third call of a run is slow: only it is timed, so only it shows
            run = len(order) - 5  # calls after the two warm-ups each, from 0
            work = 200000 if run >= 0 and run % 3 == 2 else 10
            sum(range(work))
        return fn

    stats = timing.interleaved_ms({"a": make("a"), "b": make("b")}, warmup=2, reps=4,
                                  device="cpu", burst=3)
    rounds = [order[4 + 6 * r: 10 + 6 * r] for r in range(4)]
    assert all(r[:3] == [r[0]] * 3 and r[3:] == [r[3]] * 3 and r[0] != r[3] for r in rounds)
    assert len(order) == 4 + 4 * 2 * 3
    fast = min(timing.interleaved_ms({"x": lambda: None}, warmup=1, reps=4,
                                     device="cpu")["x"].median, 1e-3)
    assert stats["a"].median > 100 * fast and stats["b"].median > 100 * fast
    with pytest.raises(ValueError, match="burst must be >= 1, got 0"):
        timing.interleaved_ms({"a": make("a")}, device="cpu", burst=0)


def test_rotated_blocks_rotate_the_order_and_pool_every_round():
    """timing.rotated_blocks (bench_attention's GPU comparison): one block per
    timer per round, the order rotating by one each round, each timer's rounds x reps
    samples pooled; rounds or reps < 1 is refused."""
    from ragvit.bench import timing

    order = []

    def make(name, value):
        def timer(reps):
            order.append((name, reps))
            return [value + len(order)] * reps
        return timer

    stats = timing.rotated_blocks({"a": make("a", 0.0), "b": make("b", 100.0),
                                   "c": make("c", 200.0)}, rounds=3, reps=4)
    assert [n for n, _ in order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(reps == 4 for _, reps in order)
    # a's blocks were calls 1, 6, 8: samples 1 x4, 6 x4, 8 x4 -> median 6
    assert stats["a"].median == 6 and stats["a"].p10 == 1 and stats["a"].p90 == 8
    assert stats["b"].median == 100 + 4 and stats["c"].median == 200 + 5  # calls 2, 4, 9; 3, 5, 7
    for rounds, reps in ((0, 4), (3, 0)):
        with pytest.raises(ValueError, match="rounds and reps must be >= 1"):
            timing.rotated_blocks({"a": make("a", 0.0)}, rounds=rounds, reps=reps)


@pytest.mark.gpu
@requires_cuda
def test_gpu_us_graphs_times_each_capturable_fn():
    """timing.gpu_us_graphs on the GPU: a fn that sleeps 200x more cycles on the device
    measures what the same sleep takes back to back in eager mode (CUDA events around 20
    queued calls: the GPU never waits for the host there), give or take a tenth of it and
    the short fn's figure (which bounds the per-call launch cost inside a replay); a fn that
    cannot be captured is left out, not raised, and leaves torch's CUDA generator usable."""
    import torch

    from ragvit.bench import timing

    def not_capturable():
        torch.cuda.synchronize()  # illegal while capturing

    def long_sleep():
        torch.cuda._sleep(200000)

    stats = timing.gpu_us_graphs(
        {"short": lambda: torch.cuda._sleep(1000), "long": long_sleep,
         "bad": not_capturable}, rounds=2, reps=5, calls_per_graph=2, warmup_s=0.01)
    assert set(stats) == {"short", "long"}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    long_sleep()
    start.record()
    for _ in range(20):
        long_sleep()
    end.record()
    end.synchronize()
    eager_us = start.elapsed_time(end) * 1e3 / 20
    long_us, short_us = stats["long"].median, stats["short"].median
    assert 0 < short_us < long_us
    assert abs(long_us - eager_us) <= 0.1 * eager_us + short_us, (long_us, eager_us, short_us)
    assert torch.randn(8, device="cuda").isfinite().all()  # not left in capture mode


def test_fa2_attention_for_each_policy():
    """The FA2 pipelines' attention: with the CLS attention row for EViT and ATS, plain for
    ThresholdL2 and no policy; ToMe (per-key bias) is reported as unsupported."""
    from ragvit.bench import pipelines
    from ragvit.pruning import ATS, EViT, ThresholdL2, ToMe

    assert pipelines.fa2_attention_for(None) is pipelines.fa2_attention
    assert pipelines.fa2_attention_for(ThresholdL2(0.5)) is pipelines.fa2_attention
    assert pipelines.fa2_attention_for(EViT(0.7, layers=(3,))) is pipelines.fa2_attention_cls
    assert pipelines.fa2_attention_for(ATS(108, layers=(3,))) is pipelines.fa2_attention_cls
    assert "per-key bias" in pipelines.fa2_unsupported(ToMe(8))
    assert pipelines.fa2_unsupported(EViT(0.7, layers=(3,))) is None


def test_environment_record(monkeypatch):
    """report.environment: one record for every results file (device, driver, CUDA, torch,
    timm, ragvit and its git SHA, Python, the host-speed probe), RAGVIT_GIT_SHA first, extra
    fields appended."""
    from ragvit.bench import report

    monkeypatch.setenv("RAGVIT_GIT_SHA", "abc1234")
    report.start_run()
    env = report.environment("cpu", suites=["paper"])
    assert list(env) == ["device", "threads", "driver", "cuda", "torch", "timm", "ragvit",
                         "git_sha", "python", "host_probe_start_us", "host_probe_us",
                         "host_drift", "host_steady", "suites"]
    assert env["device"].startswith("CPU (") and env["driver"] is None
    assert env["host_probe_start_us"] > 0 and env["host_probe_us"] > 0
    assert env["host_drift"] >= 1.0 and isinstance(env["host_steady"], bool)
    assert env["git_sha"] == "abc1234" and env["suites"] == ["paper"]


@pytest.mark.parametrize("start,end,steady", [(1200.0, 1250.0, True), (1250.0, 1200.0, True),
                                              (1200.0, 1900.0, False), (1900.0, 1200.0, False)])
def test_unsteady_host_is_marked(monkeypatch, tmp_path, capsys, start, end, steady):
    """A run whose probe moved by more than HOST_DRIFT_LIMIT either way is marked in its
    record, first in its Markdown and on stderr; a steady run carries no warning."""
    from ragvit.bench import report

    monkeypatch.setattr(report, "_run_start_probe_us", start)
    monkeypatch.setattr(report, "host_probe_us", lambda reps=21: end)
    prefix = str(tmp_path / "run")
    assert report.publish([{"x": 1}], 0, lambda rows, env: "| x |\n", prefix, "cpu") == 0
    env = json.loads((tmp_path / "run.json").read_text())["env"]
    assert env["host_drift"] == round(max(start, end) / min(start, end), 3)
    assert env["host_steady"] is steady
    md, err = (tmp_path / "run.md").read_text(), capsys.readouterr().err
    assert md.startswith("**UNSTEADY HOST") is (not steady)
    assert ("UNSTEADY HOST" in err) is (not steady)
    assert md.endswith("| x |\n")


@pytest.mark.parametrize("now,steady", [(1250.0, True), (1900.0, False), (900.0, False)])
def test_probe_against_start_dates_a_row(monkeypatch, now, steady):
    from ragvit.bench import report

    monkeypatch.setattr(report, "_run_start_probe_us", 1200.0)
    monkeypatch.setattr(report, "host_probe_us", lambda reps=21: now)
    assert report.probe_against_start() == {"host_probe_us": now, "host_steady": steady}
    monkeypatch.setattr(report, "_run_start_probe_us", None)
    assert report.probe_against_start()["host_steady"] is None


def test_e2e_lists_rows_timed_off_the_starting_speed():
    e2e = load_script("bench_e2e")
    env = {"host_probe_start_us": 1200.0}
    rows = [{"suite": "paper", "model": "DeiT-S 224", "policy": "l2_keep50_b4", "batch": b,
             "host_probe_us": p, "host_steady": s}
            for b, p, s in [(1, 1210.0, True), (16, 2400.0, False), (256, 1190.0, None)]]
    lines = e2e.render_unsteady(rows, env)
    assert lines[0].startswith("Rows timed off the host's starting speed (probe 1200.0 µs")
    assert [line for line in lines if line.startswith("- ")] == [
        "- paper: DeiT-S 224 l2_keep50_b4 BS 16: probe 2400.0 µs"]
    assert e2e.render_unsteady(rows[:1], env) == []


def test_unprobed_run_is_neither_steady_nor_unsteady(monkeypatch):
    from ragvit.bench import report

    monkeypatch.setattr(report, "_run_start_probe_us", None)
    env = report.environment("cpu")
    assert env["host_drift"] is None and env["host_steady"] is None
    assert report.unsteady_note(env) is None


def test_max_err_is_float64_max_abs_difference(gen):
    """pipelines.max_err: max |a - b| in float64 (fp16 inputs are not subtracted in fp16;
    one NaN makes it NaN, as a failed check must)."""
    import torch

    from ragvit.bench import pipelines

    a = torch.randn(3, 5, generator=gen)
    b = a.clone()
    b[1, 2] += 0.25
    assert pipelines.max_err(a, b) == pytest.approx(0.25, abs=1e-6)
    assert pipelines.max_err(a.half(), a.half()) == 0.0
    big = torch.tensor([60000.0], dtype=torch.float16)
    assert pipelines.max_err(big, -big) == 120000.0  # overflows fp16, not float64
    b[0, 0] = float("nan")
    assert torch.isnan(torch.tensor(pipelines.max_err(a, b)))


def test_compiled_pipeline_on_the_cpu_when_named(one_cpu_thread, capsys):
    """ragvit_compiled (torch.compile of the patched model) is left out of the CPU default
    (compiling takes tens of seconds there) and runs when named: checked against the
    reference, timed, and set against ragvit eager in the table. In-process."""
    import dataclasses

    from ragvit.bench import pipelines, report, sweep

    assert "ragvit_compiled" not in sweep.BenchConfig(device="cpu").resolve().pipelines
    assert pipelines.compile_mode(16, "cuda") == "reduce-overhead"
    assert pipelines.compile_mode(17, "cuda") == pipelines.compile_mode(1, "cpu") == "default"
    config = dataclasses.replace(sweep.CONFIGS["tiny"], batches=(2,), threads=None, reps=2,
                                 warmup=0, pipelines=("ragvit", "ragvit_compiled"))
    result = sweep.run(config, progress=False, log=lambda *a: None)
    assert result["failed"] == 0
    (row,) = result["rows"]
    assert row["check"]["ok"] and row["check"]["err"]["ragvit_compiled"] <= 1e-4
    assert set(row["timing"]) == {"ragvit", "ragvit_compiled"}
    table = report.render_table(result)
    assert "| ragvit_compiled img/s | compiled / ragvit |" in table, table


def test_bench_patched_row_ops():
    """pipelines.patched: ragvit keeps patch's default row_ops (None: the row ops on
    CUDA, timm's modules on the CPU); a replacement attention (the FA2 pipelines) gets
    row_ops=False, the modules a user writing that pipeline would run."""
    import timm

    from ragvit import timm_patch
    from ragvit.bench import pipelines

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    with pipelines.patched(model, None):
        assert vars(model)[timm_patch._STATE_ATTR].row_ops is None
    with pipelines.patched(model, None, attention=lambda *a, **k: None):
        assert vars(model)[timm_patch._STATE_ATTR].row_ops is False
    assert not timm_patch.is_patched(model)


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_paper_forward_matches_reference(name, gen, seed):
    """pipelines.paper_forward (the paper's pipeline) with ragvit.attention standing in for
    FA2 (CPU): logits equal the padded-masked reference's, and its returned decisions equal
    the reference's ThresholdL2 decisions."""
    import timm
    import torch

    import ragvit
    from ragvit import reference
    from ragvit.bench import pipelines
    from ragvit.pruning import ThresholdL2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, img_size=64).eval()
    x = torch.randn(3, 3, 64, 64, generator=gen)
    policy = ThresholdL2(0.5, layers=(4,))
    with torch.no_grad():
        got = pipelines.paper_forward(model, x, policy, attention=ragvit.attention)
        expected, decided = reference.vit_forward_reference(model, x, policy,
                                                            return_decisions=True)
        again, own = pipelines.paper_forward(model, x, policy, attention=ragvit.attention,
                                         return_decisions=True)
    assert got.shape == (3, model.num_classes)
    assert float((got - expected).abs().max()) <= 1e-4
    assert torch.equal(again, got)
    P = model.num_prefix_tokens  # CLS (and the distillation token)
    assert len(own) == 1 and own[0].shape == (3, P + 16) and own[0].dtype == torch.bool
    assert torch.equal(own[0], decided[0])
    assert own[0].sum(1).tolist() == [P + 8] * 3  # the prefix + ceil(0.5 * 16) patches


def test_paper_forward_refuses_other_policies(gen):
    import timm
    import torch

    from ragvit.bench import pipelines
    from ragvit.pruning import EViT, ThresholdL2

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(1, 3, 64, 64, generator=gen)
    for policy in (ThresholdL2(threshold=1.0), ThresholdL2(0.5, layers=(2, 5)),
                   EViT(0.7, layers=(3,))):
        with pytest.raises(ValueError, match="the paper's pipeline prunes once with a fixed "
                                             "keep ratio"):
            pipelines.paper_forward(model, x, policy)


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
@pytest.mark.parametrize("layers,keep", [((4,), 0.5), ((2, 5, 8), 0.3)], ids=["one", "three"])
def test_dense_gather_matches_reference_and_ragvit(name, layers, keep, gen, seed):
    """pipelines.dense_gather_forward (timm's blocks on the gathered kept tokens): logits
    equal the padded-masked reference replaying its decisions, and its decisions equal
    ragvit's and the reference's own at every pruning point (fp32, CPU)."""
    import timm
    import torch

    import ragvit
    from ragvit import reference
    from ragvit.bench import pipelines
    from ragvit.pruning import ThresholdL2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, img_size=64).eval()
    x = torch.randn(3, 3, 64, 64, generator=gen)
    policy = ThresholdL2(keep, layers=layers)
    with torch.inference_mode():
        got, decided = pipelines.dense_gather_forward(model, x, policy, return_decisions=True)
        replayed = reference.vit_forward_reference(model, x, policy, decisions=decided)
        _, own = reference.vit_forward_reference(model, x, policy, return_decisions=True)
        with pipelines.patched(model, policy):
            _, ours = ragvit.forward_with_decisions(model, x)
        plain = pipelines.dense_gather_forward(model, x, policy)
        with_kept, kept = pipelines.dense_gather_forward(model, x, policy, return_kept=True)
    assert pipelines.max_err(got, replayed) <= 1e-4, seed_note(seed)
    assert torch.equal(plain, got) and torch.equal(with_kept, got)
    # the kept positions (what the compiled pipeline returns for its check) are the decisions
    assert [k.shape[1] for k in kept] == [int(d[0].sum()) for d in decided]
    from_kept = pipelines.kept_decisions(kept, decided[0].shape[1])
    assert all(torch.equal(a, b) for a, b in zip(from_kept, decided, strict=True))
    assert len(decided) == len(layers)
    for mine, theirs, ragvits in zip(decided, own, ours, strict=True):
        assert mine.dtype == torch.bool and mine.shape == theirs.shape
        assert torch.equal(mine, theirs) and torch.equal(mine, ragvits), seed_note(seed)


def test_dense_gather_refuses_data_dependent_policies(gen):
    """Only fixed keep counts make a dense batch; check() lists the pipeline as
    unavailable for the others instead of failing."""
    import timm
    import torch

    from ragvit.bench import pipelines
    from ragvit.pruning import EViT, ThresholdL2

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    cases = [(ThresholdL2(threshold=1.0), "not ThresholdL2 with a threshold"),
             (EViT(0.7, layers=(3,)), "not EViT")]
    for policy, words in cases:
        assert words in pipelines.dense_gather_unsupported(policy)
        with pytest.raises(ValueError, match="dense_gather_forward: dense_gather runs fixed keep "
                                             "counts"):
            pipelines.dense_gather_forward(model, x, policy)
        with torch.inference_mode():
            result = pipelines.check(model, x, policy, ("dense_gather", "ragvit"))
        assert result["err"]["dense_gather"] is None and result["ok"]
        assert "fixed keep counts" in result["unavailable"]["dense_gather"]


def test_compile_mode_and_default_pipelines():
    """reduce-overhead (CUDA graphs) up to batch 16, default above; on the CPU the sweep's
    default pipelines leave the compiled ones out (named, they run)."""
    from ragvit.bench import pipelines, sweep

    assert [pipelines.compile_mode(b, "cuda") for b in (1, 16, 17, 256)] == [
        "reduce-overhead", "reduce-overhead", "default", "default"]
    assert pipelines.compile_mode(1, "cpu") == "default"
    assert set(pipelines.COMPILED) <= set(pipelines.PIPELINES)
    config = sweep.BenchConfig(device="cpu").resolve()
    assert not set(config.pipelines) & set(pipelines.COMPILED)
    assert "dense_gather" in config.pipelines
    named = sweep.BenchConfig(device="cpu", pipelines=("dense_gather_compiled",)).resolve()
    assert named.pipelines == ("dense_gather_compiled",)


@pytest.mark.parametrize("policy_name", ["l2_keep50_b4", "tome_r2_b3", "none"])
def test_selection_agreement_counts_images_that_differ(policy_name, gen):
    """reference.selection_agreement: ragvit's fp32 decisions on the CPU are the independent
    selection's (no image differs, logits within fp32 tolerance); an image whose kept set is
    edited counts as differing and its logits (shifted) are left out of max_dlogit_same; a
    decision list of the wrong length is refused."""
    import timm
    import torch

    from ragvit import reference, timm_patch
    from ragvit.pruning import ThresholdL2, ToMe
    from ragvit.timm_patch import patch, unpatch

    policy = {"l2_keep50_b4": ThresholdL2(0.5, layers=(4,)), "tome_r2_b3": ToMe(2, layers=(3,)),
              "none": None}[policy_name]
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(3, 3, 64, 64, generator=gen)
    with torch.no_grad():
        patch(model, policy)
        logits, decided = timm_patch.forward_with_decisions(model, x)
        unpatch(model)
        same = reference.selection_agreement(model, x, policy, logits, decided)
    assert same["images"] == 3 and same["images_differ"] == 0 and same["fraction_differ"] == 0
    assert 0 <= same["max_dlogit_same"] <= 1e-4
    if policy is None:
        return
    edited = [d.clone() for d in decided]
    kept = timm_patch.kept_mask(edited[0])[1].clone()
    if edited[0].dtype == torch.bool:  # swap a kept patch token for a dropped one
        edited[0][1, int(kept[1:].nonzero()[0]) + 1] = False
        edited[0][1, int(kept.logical_not().nonzero()[0])] = True
    else:  # merge a kept patch token into another kept one
        src, dst = (kept[1:].nonzero()[:2, 0] + 1).tolist()
        edited[0][1, src] = dst
    shifted = logits.clone()
    shifted[1] += 1.0
    with torch.no_grad():
        one = reference.selection_agreement(model, x, policy, shifted, edited)
        with pytest.raises(ValueError, match="one entry per pruning point"):
            reference.selection_agreement(model, x, policy, logits, [])
    assert one["images_differ"] == 1 and one["fraction_differ"] == pytest.approx(1 / 3)
    assert one["max_dlogit_same"] <= same["max_dlogit_same"]  # the shifted image left out


def test_check_reports_not_fails_reference_decision_flips_in_half(monkeypatch, gen):
    """pipelines.check: the reference on its own decisions differing from it replaying ragvit's
    (an fp16 near-tie flipping a choice; simulated by shifting its logits) fails the row in
    fp32 and is only reported in fp16/bf16."""
    import timm
    import torch

    from ragvit import reference
    from ragvit.bench import pipelines
    from ragvit.pruning import ThresholdL2

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    real = reference.vit_forward_reference

    def flipped(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("return_decisions"):
            return out[0] + 1.0, out[1]
        return out

    monkeypatch.setattr(reference, "vit_forward_reference", flipped)
    policy = ThresholdL2(0.5, layers=(4,))
    with torch.no_grad():
        strict = pipelines.check(model, x, policy, ("reference", "ragvit"), "fp32")
        half = pipelines.check(model, x, policy, ("reference", "ragvit"), "fp16")
    assert strict["err"]["reference"] >= 0.99 and not strict["ok"]
    assert half["err"]["reference"] >= 0.99 and half["ok"]


def test_check_judges_baselines_on_their_own_decisions(monkeypatch, gen):
    """pipelines.check compares paper_fa2 and fa2_packed with the reference replaying their own
    decisions (ragvit.attention standing in for FA2 on the CPU): both run and are within
    fp32 tolerance."""
    import timm
    import torch

    import ragvit
    from ragvit.bench import pipelines
    from ragvit.pruning import ThresholdL2

    monkeypatch.setattr(pipelines, "fa2_attention", lambda q, k, v, cu, m=None, *, scale=None,
                        out=None, cls_attn=None: ragvit.attention(q, k, v, cu, m, scale=scale))
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    policy = ThresholdL2(0.5, layers=(4,))
    with torch.no_grad():
        c = pipelines.check(model, x, policy, ("paper_fa2", "fa2_packed", "ragvit"), "fp32")
    assert c["ok"] and not c["unavailable"], c
    assert c["err"]["paper_fa2"] <= 1e-4 and c["err"]["fa2_packed"] <= 1e-4


def test_check_judges_every_pruned_pipeline_against_fp32_on_its_own_decisions(monkeypatch, gen):
    """pipelines.check's fp32-relative rule covers the baselines too: with the fp16 bar below 0
    every pruned pipeline falls to it and passes (its error against the fp32 forward on its
    own decisions within 2x the reference's own + EXACT_FLOOR), each with its own figures;
    dense_gather's logits shifted by 10x EXACT_FLOOR fail the row."""
    import timm
    import torch

    from ragvit.bench import pipelines
    from ragvit.pruning import ThresholdL2

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=gen)
    policy = ThresholdL2(0.5, layers=(4,))
    monkeypatch.setitem(pipelines.TOLERANCE, "fp16", -1.0)
    with torch.no_grad():
        c = pipelines.check(model, x, policy, ("dense_gather", "ragvit"), "fp16")
    assert c["ok"], c
    assert set(c["err_exact"]) == set(c["err_reference_exact"]) == {"dense_gather", "ragvit"}
    for name in ("dense_gather", "ragvit"):
        assert c["err_exact"][name] <= 2 * c["err_reference_exact"][name] + 1e-3

    real = pipelines.dense_gather_forward
    shift = 10 * pipelines.EXACT_FLOOR["fp16"]

    def shifted(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] + shift, *out[1:]) if isinstance(out, tuple) else out + shift

    monkeypatch.setattr(pipelines, "dense_gather_forward", shifted)
    with torch.no_grad():
        bad = pipelines.check(model, x, policy, ("dense_gather", "ragvit"), "fp16")
    assert not bad["ok"]
    assert bad["err_exact"]["dense_gather"] >= shift - 1e-4
    assert bad["err_exact"]["ragvit"] == pytest.approx(c["err_exact"]["ragvit"])


def test_bench_cpu_smoke(tmp_path):
    """bench_cpu.py on DeiT-T at 64 px: every pipeline checked ("all results match" before
    any timing row), one row per batch and round, the table and JSON written."""
    out = str(tmp_path / "cpu")
    r = run_script("bench_cpu.py", "--model", "deit_t", "--img-size", "64", "--batches", "1",
                   "2", "--reps", "2", "--repeat", "2", "--warmup", "0", "--out", out)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    first_row = next(i for i, line in enumerate(lines) if line.startswith("| 1 |"))
    assert "all results match" in lines[:first_row]
    table = open(out + ".md").read()
    assert sum(line.startswith(("| 1 |", "| 2 |")) for line in table.splitlines()) == 4
    rows = json.load(open(out + ".json"))["rows"]
    assert [len(row["timing"]) for row in rows] == [2, 2]
    assert set(rows[0]["timing"][0]) == {"timm_eager", "reference", "ragvit", "ragvit_c_attn"}
