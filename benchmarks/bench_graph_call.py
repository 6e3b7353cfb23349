"""What one `ragvit.cuda_graph(model)(x)` call costs the host, and the latency a caller sees.

``python benchmarks/bench_graph_call.py [--models deit_s deit_b] [--batch 1] [--calls N]
[--base-graph PATH] [--out PREFIX]`` patches a random-init model in fp16 on the GPU
(ThresholdL2 keep 50% after block 4), wraps it in ragvit.cuda_graph and measures, per model:

  host µs      the call itself (Python → replay queued, output copy queued), the device
               synchronized before each call so the queue never pushes back: median, p90
  parts        the same for the pieces a call is made of: the input copy into the static
               buffer, the graph's replay, the output copy
  sync µs      call + torch.cuda.synchronize(), what a caller waiting for one image sees
  b2b µs       back-to-back calls, per call (the GPU's pace once the host keeps ahead)

With --base-graph (another tree's ragvit/graph.py, loaded as a module of this ragvit) the
call's host µs of both wrappers are timed interleaved in one process (alternating blocks of
--block calls, the ratio being the median of per-block ratios), so the before/after ratio
carries across host-speed states.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

import ragvit
from ragvit.bench import pipelines, report


def percentile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def host_us(fn, calls: int) -> list[float]:
    """µs of fn() alone, each call after a synchronize (the queue empty)."""
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def sync_us(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def back_to_back_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / 1e3 / calls


def load_graph_module(path: str):
    """Another tree's graph.py as ragvit._graph_base (its relative imports resolve to this
    ragvit)."""
    spec = importlib.util.spec_from_file_location("ragvit._graph_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def interleaved_ratio(fns: dict, blocks: int, block: int) -> dict:
    """Per-block median host µs of each fn in alternating blocks; ratio of the first fn to
    the second, the median over blocks with its p10-p90."""
    names = list(fns)
    medians = {n: [] for n in names}
    for b in range(blocks):
        for name in (names if b % 2 == 0 else names[::-1]):
            medians[name].append(statistics.median(host_us(fns[name], block)))
    ratios = [a / b for a, b in zip(medians[names[0]], medians[names[1]], strict=True)]
    return {"us": {n: statistics.median(m) for n, m in medians.items()},
            "ratio": statistics.median(ratios), "p10": percentile(ratios, 0.1),
            "p90": percentile(ratios, 0.9)}


def measure(name: str, batch: int, args, base) -> dict:
    model = pipelines.load_model(pipelines.MODELS[name], 224, "fp16", "cuda")
    ragvit.patch(model, pipelines.make_policy(0.5))
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    graphed = ragvit.cuda_graph(model)
    row = {"model": name, "batch": batch}
    with torch.inference_mode():
        graphed(x)  # capture
        [entry] = [e for _, e in graphed._graphs.items()]
        out = entry.outputs[0]
        parts = {"call": lambda: graphed(x), "copy_in": lambda: entry.static_x.copy_(x),
                 "replay": entry.graph.replay, "copy_out": out.clone}
        for part, fn in parts.items():
            samples = host_us(fn, args.calls)
            row[f"host_{part}_us"] = {"median": statistics.median(samples),
                                      "p90": percentile(samples, 0.9)}
        samples = sync_us(lambda: graphed(x), args.calls)
        row["sync_us"] = {"median": statistics.median(samples), "p90": percentile(samples, 0.9)}
        row["b2b_us"] = back_to_back_us(lambda: graphed(x), args.calls)
        if base is not None:
            base_graphed = base.cuda_graph(model)
            base_graphed(x)
            row["ab"] = interleaved_ratio({"this": lambda: graphed(x),
                                           "base": lambda: base_graphed(x)},
                                          args.blocks, args.block)
    return row


def render(rows, env) -> str:
    lines = [
        f"# ragvit.cuda_graph call cost on {env['device']}",
        "",
        f"driver {env['driver']}, torch {env['torch']}, ragvit {env['ragvit']} @ "
        f"{env['git_sha']}; fp16, ThresholdL2 keep 50% after block 4; host probe "
        f"{env['host_probe_start_us']} µs at the start, {env['host_probe_us']} µs at the end. "
        "Host µs: the call alone after a synchronize (median / p90); sync µs: call + "
        "synchronize; b2b: back-to-back calls per call."
        + (f" A/B: against graph.py of {env['base_tree']}, interleaved blocks, ratio = "
           "this / base (median, p10–p90)." if env.get("base_tree") else ""),
        "",
        "| model | batch | host µs call | copy in | replay | copy out | sync µs | b2b µs | "
        "A/B host µs this / base | ratio (p10–p90) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    def cell(r, k):
        return f"{r[k]['median']:.1f} / {r[k]['p90']:.1f}"

    for r in rows:
        ab = r.get("ab")
        lines.append(
            f"| {r['model']} | {r['batch']} | {cell(r, 'host_call_us')} | "
            f"{cell(r, 'host_copy_in_us')} | {cell(r, 'host_replay_us')} | "
            f"{cell(r, 'host_copy_out_us')} | {cell(r, 'sync_us')} | "
            f"{r['b2b_us']:.1f} | "
            + (f"{ab['us']['this']:.1f} / {ab['us']['base']:.1f} | {ab['ratio']:.2f} "
               f"({ab['p10']:.2f}–{ab['p90']:.2f}) |" if ab else "– | – |"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deit_s", "deit_b"],
                        choices=sorted(pipelines.MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=2000, help="calls per figure")
    parser.add_argument("--blocks", type=int, default=100, help="A/B: alternating blocks")
    parser.add_argument("--block", type=int, default=50, help="A/B: calls per block")
    parser.add_argument("--base-graph", default=None,
                        help="another tree's ragvit/graph.py to time against")
    parser.add_argument("--base-tree", default=None, help="that tree's commit, for the record")
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    if min(args.batch, args.calls, args.blocks, args.block) < 1:
        parser.error("--batch, --calls, --blocks and --block must be >= 1")
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    report.start_run()
    base = load_graph_module(args.base_graph) if args.base_graph else None
    rows = [measure(name, args.batch, args, base) for name in args.models]
    return report.publish(rows, 0, render, args.out, "cuda", base_tree=args.base_tree)


if __name__ == "__main__":
    raise SystemExit(main())
