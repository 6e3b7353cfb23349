"""What one compiled forward of a patched model costs, per set of Inductor options, beside
`ragvit.cuda_graph`.

``python benchmarks/bench_compile_call.py [--models deit_s] [--batch 1]
[--variants reduce-overhead reduce-overhead+freezing] [--calls N] [--reps N] [--out PREFIX]``
patches a random-init model in fp16 on the GPU (ThresholdL2 keep 50% after block 4), wraps it
in ragvit.cuda_graph and compiles it with `torch.compile(fullgraph=True, dynamic=False)` once
per variant: a torch.compile mode's own options (`torch._inductor.list_mode_options`), plus
Inductor freezing where the name ends in "+freezing". Every form's logits are checked against
eager's before anything is timed (within 0.004: same kernels, fp16 rounding). Per form:

  host µs      the call alone (Python -> queued), the device synchronized before each call
  sync µs      the call and a synchronize: what a caller waiting for one image sees
  b2b ms       CUDA events around one call after two more of its own (the e2e suites' burst),
               all forms timed side by side in rotating order (timing.interleaved_ms); the
               ratio column is form / ragvit.cuda_graph in images/s
  launches     CUDA runtime calls of one call (torch.profiler): graph launches, and kernel
               launches outside a graph; a form whose CUDA graph is used launches no kernel
               of the forward itself

One process per run; each run records the host-speed probe at its start and end
(ragvit.bench.report), and the md says when they differ by more than the stated factor.
Every variant must compile a graph of its own (Dynamo's counters), or the run stops.
"""

from __future__ import annotations

import argparse
import json

import torch

import ragvit
from ragvit.bench import pipelines, report, timing

BURST = 3  # as the e2e suites' graph, baselines and compiled suites


def host_us(fn, calls: int, wait: bool = False) -> dict:
    """Median and p90 host µs of fn() from an empty queue (timing.host_us, synchronized after
    every call, untimed); with wait, of fn() and a synchronize (timed)."""
    def call_and_wait():
        fn()
        torch.cuda.synchronize()

    stats = timing.host_us(call_and_wait if wait else fn, calls, warmup=0, sync_every=1)
    return {"median": stats.median, "p90": stats.p90}


def launches(fn) -> dict:
    """CUDA runtime and driver launch calls made by one fn() (torch.profiler's CPU-side
    events): graph launches, and kernel launches (any cuda*/cu* LaunchKernel variant)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    return {"graph": sum("GraphLaunch" in n for n in names),
            "kernel": sum("LaunchKernel" in n for n in names)}


def measure(name: str, batch: int, args) -> dict:
    model = pipelines.load_model(pipelines.MODELS[name], 224, "fp16", "cuda")
    ragvit.patch(model, pipelines.make_policy(0.5))
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    torch._dynamo.reset()
    forms = {"ragvit_graph": ragvit.cuda_graph(model, clone_output=False)}
    for variant in args.variants:
        forms[variant] = torch.compile(model, fullgraph=True, dynamic=False,
                                       options=pipelines.compile_options(variant))
    fns = {form: (lambda f=f: f(x)) for form, f in forms.items()}
    row = {"model": name, "batch": batch, "forms": {}}
    graphs = torch._dynamo.utils.counters["stats"]
    with torch.inference_mode():
        eager = model(x).float()
        for form, fn in fns.items():
            before = graphs["unique_graphs"]
            for _ in range(3):  # compile; reduce-overhead records its graph on the second call
                fn()
            if form != "ragvit_graph" and graphs["unique_graphs"] == before:
                # every patched model shares its forward's code: a variant must compile its
                # own graph, not reuse another's cache entry
                raise SystemExit(f"{name} {form}: compiled no graph of its own")
            err = float((fn().float() - eager).abs().max())
            if not err <= 4e-3:
                raise SystemExit(f"{name} {form}: max |dlogit| vs eager {err:.3g} > 0.004")
            row["forms"][form] = {"err_vs_eager": err}
        for form, fn in fns.items():
            r = row["forms"][form]
            r["host_us"] = host_us(fn, args.calls)
            r["sync_us"] = host_us(fn, args.calls, wait=True)
            r["launches"] = launches(fn)
        stats = timing.interleaved_ms(fns, warmup=10, reps=args.reps, burst=BURST)
    for form in fns:
        ms = stats[form].median
        row["forms"][form].update(b2b_ms=ms, images_per_s=batch * 1e3 / ms)
    return row


def render(rows: list, env: dict) -> str:
    lines = ["# Host cost of a compiled forward, per set of Inductor options", "",
             f"{env['device']}, driver {env['driver']}, torch {env['torch']}, tree "
             f"{env['git_sha']}, host probe {env['host_probe_start_us']:.0f} / "
             f"{env['host_probe_us']:.0f} µs (start / end). fp16, ThresholdL2 keep 50% after "
             "block 4, random weights and images; compiled: torch.compile(patched model, "
             "fullgraph=True, dynamic=False, options=the mode's own + freezing where named).",
             ""]
    lines += ["| model | BS | form | host µs (p90) | sync µs (p90) | b2b ms | / graph | "
              "graph / kernel launches a call | max dlogit vs eager |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        graph_ips = row["forms"]["ragvit_graph"]["images_per_s"]
        for form, r in row["forms"].items():
            lines.append(
                f"| {row['model']} | {row['batch']} | {form} | "
                f"{r['host_us']['median']:.1f} ({r['host_us']['p90']:.1f}) | "
                f"{r['sync_us']['median']:.1f} ({r['sync_us']['p90']:.1f}) | "
                f"{r['b2b_ms']:.3f} | {r['images_per_s'] / graph_ips:.2f} | "
                f"{r['launches']['graph']} / {r['launches']['kernel']} | "
                f"{r['err_vs_eager']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["deit_s"], choices=list(pipelines.MODELS))
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--variants", nargs="+",
                   default=["reduce-overhead", "reduce-overhead+freezing"],
                   help="torch.compile modes, each optionally with +freezing")
    p.add_argument("--calls", type=int, default=200, help="calls per host-time figure")
    p.add_argument("--reps", type=int, default=100, help="timed rounds of the b2b figures")
    p.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    if min(args.calls, args.reps, *args.batch) < 1:
        p.error("--calls, --reps and --batch must be >= 1")
    for variant in args.variants:
        try:
            pipelines.compile_options(variant)
        except ValueError as exc:
            p.error(str(exc))
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    report.start_run()
    rows = []
    for name in args.models:
        for batch in args.batch:
            rows.append(measure(name, batch, args))
            # each row as it comes: a run stopped by a time limit still leaves what it measured
            print(json.dumps(rows[-1]), flush=True)
    env = report.environment("cuda")
    text = render(rows, env)
    print(text)
    if args.out:
        report.write_report(args.out, text, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
