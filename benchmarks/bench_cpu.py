"""Pruned DeiT on the CPU: ragvit.patch against the padded reference and the unpruned model.

``python benchmarks/bench_cpu.py [--model deit_s] [--batches 1 2 4 16] [--reps N]
[--threads N] [--repeat N] [--out PREFIX]`` checks, then times, on the CPU in fp32 with
ThresholdL2 keep 50% after block 4 (the paper's setting; --keep and --layers change it):

  timm_eager     the unpruned timm model (its own forward)
  reference      ragvit.reference.vit_forward_reference: the same pruning on padded tensors,
                 key-padding masks and SDPA (ragvit.bench.pipelines' "reference")
  ragvit         ragvit.patch(model, policy): on CPU rows, attention through torch's SDPA and
                 the row ops through torch's functions (residual in the GEMM, GELU in place)
  ragvit_c_attn  the same patched forward on ragvit.attention's C backend and torch's modules
                 (what ragvit.patch ran on the CPU without the torch path)

Every pipeline's max |dlogit| against the reference replaying its decisions is printed, then
"all results match", then the timings: ragvit.bench.timing.interleaved_ms(device="cpu"), the
four pipelines called in rotating order in one process (each patched one on its own copy of
the model), median of --reps calls after --warmup each, so load from other processes lands on
every pipeline of a row alike and the ratios carry. --repeat times every row again that many
times (each round its own row) to show how stable the ratios are. Models are random-init
(pretrained=False); speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform

import torch

import ragvit
from ragvit.bench import pipelines, report, timing
from ragvit.bench.sweep import check_then_time

PIPELINES = ("timm_eager", "reference", "ragvit", "ragvit_c_attn")
TOLERANCE = pipelines.TOLERANCE["fp32"]


def c_attention(*args, **kwargs):
    """ragvit.attention (the C backend on CPU tensors) behind a wrapper: a patched model
    given any attention other than ragvit.attention itself calls it on every device (and,
    through pipelines.patched, runs torch's modules: row_ops=False)."""
    return ragvit.attention(*args, **kwargs)


@contextlib.contextmanager
def pipeline(name, model, policy, x):
    """A no-argument callable running pipeline `name` on x (patching inside the block)."""
    if name == "ragvit_c_attn":
        with pipelines.patched(model, policy, attention=c_attention):
            yield lambda: model(x)
    else:
        with pipelines.make_pipeline(name, model, policy, x) as fn:
            yield fn


def check_case(model, policy, batch, img_size, seed):
    """Max |dlogit| of every pipeline against the reference replaying its decisions."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    x = torch.randn(batch, 3, img_size, img_size, generator=gen)
    result = pipelines.check(model, x, policy, ("timm_eager", "reference", "ragvit"), "fp32")
    err = dict(result["err"])
    err["ragvit_c_attn"] = pipelines.own_decisions_err(model, x, policy, c_attention)
    ok = result["ok"] and err["ragvit_c_attn"] <= TOLERANCE
    print(f"BS {batch}: max |dlogit| vs reference: "
          + ", ".join(f"{n} {e:.2e}" for n, e in err.items())
          + f"; kept {result['kept_fraction']:.3f}", flush=True)
    return {"batch": batch, "x": x, "err": err, "ok": ok, "timing": []}


def time_case(models, policy, row, args):
    """Appends one {pipeline: ms median} per round of --repeat to row["timing"]."""
    with contextlib.ExitStack() as stack:
        fns = {name: stack.enter_context(pipeline(name, models[name], policy, row["x"]))
               for name in PIPELINES}
        for _ in range(args.repeat):
            stats = timing.interleaved_ms(fns, args.warmup, args.reps, device="cpu")
            row["timing"].append({name: s.median for name, s in stats.items()})
            print(render_round(row["batch"], row["timing"][-1]), flush=True)


def render_round(batch, ms):
    ref, timm_ms, ours, c_ms = (ms[n] for n in ("reference", "timm_eager", "ragvit",
                                                "ragvit_c_attn"))
    return (f"| {batch} | {timm_ms:.1f} | {ref:.1f} | {c_ms:.1f} | {ours:.1f} "
            f"| {ref / ours:.2f} | {timm_ms / ours:.2f} | {ref / c_ms:.2f} |")


HEADER = ("| batch | timm unpruned ms | padded reference ms | ragvit, C attention + modules ms "
          "| ragvit ms | ragvit / reference | ragvit / timm | C attention / reference |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")


def cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(rows, env):
    lines = [f"{env['cpu_model']}, {os.cpu_count()} cores; torch {env['torch']}, "
             f"{env['threads']} torch thread(s); tree {env['git_sha']}; load average "
             f"{env['load_start']:.2f} at the start, {env['load_end']:.2f} at the end",
             "", HEADER]
    for row in rows:
        lines += [render_round(row["batch"], ms) for ms in row["timing"]]
    lines.append("\nspeedups: time of the baseline / time of ragvit (> 1: ragvit faster)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deit_s", help="timm name or alias (deit_s, deit_t, ...)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16])
    p.add_argument("--keep", type=float, default=0.5)
    p.add_argument("--layers", type=int, nargs="+", default=[4])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2, help="timing rounds per batch size")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or min(args.reps, args.repeat, args.threads, args.img_size) < 1:
        p.error("--batches, --reps, --repeat, --threads and --img-size must be >= 1")
    report.start_run()
    load_start = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    name = pipelines.MODELS.get(args.model, args.model)
    model = pipelines.load_model(name, args.img_size, "fp32", "cpu", args.seed)
    models = {n: model if n in ("timm_eager", "reference") else copy.deepcopy(model)
              for n in PIPELINES}
    policy = pipelines.make_policy(args.keep, None, args.layers)
    with torch.inference_mode():
        rows, bad = check_then_time(
            args.batches, lambda b: check_case(model, policy, b, args.img_size, args.seed),
            lambda b, row: time_case(models, policy, row, args), lambda row: row["ok"])
    for row in rows:
        del row["x"]
    print()
    return report.publish(rows, bad, render, args.out, "cpu", cpu_model=cpu_model(),
                          load_start=load_start, load_end=os.getloadavg()[0], model=name,
                          keep=args.keep, layers=args.layers, reps=args.reps,
                          repeat=args.repeat)


if __name__ == "__main__":
    raise SystemExit(main())
