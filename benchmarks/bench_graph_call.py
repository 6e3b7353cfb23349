"""What one `ragvit.cuda_graph(model)(x)` call costs the host, and the latency a caller sees.

``python benchmarks/bench_graph_call.py [--models deit_s deit_b] [--batch 1] [--calls N]
[--base-graph PATH] [--out PREFIX]`` patches a random-init model in fp16 on the GPU
(ThresholdL2 keep 50% after block 4), wraps it in ragvit.cuda_graph twice, and measures, per
model, both ways a repeated-key call can replay: through `ragvit._C.graph_replay` (one C call:
copy in, graph launch, copy out; what cuda_graph does) and through torch (copy_, replay(),
clone(); the same wrapper with the C call switched off). Their outputs are checked bit for bit
against each other, and against eager, before anything is timed.

  host µs      the call itself (Python → replay queued, output copy queued), the device
               synchronized before each call so the queue never pushes back: median, p90
  C / torch    the two calls' host µs timed interleaved in one process (alternating blocks
               of --block calls), the ratio being the median of per-block ratios (p10-p90)
  parts        host µs of the pieces: torch's input copy into the static buffer, its
               replay(), its output clone, and _C.graph_replay called directly
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


def host_us(fn, calls: int, wait: bool = False) -> list[float]:
    """µs of fn() alone, each call after a synchronize (the queue empty); with wait, of fn()
    and a synchronize after it (what a caller waiting for the result sees)."""
    out = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        if wait:
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


def summary(samples) -> dict:
    return {"median": statistics.median(samples), "p90": percentile(samples, 0.9)}


def only_entry(graphed):
    [entry] = [e for _, e in graphed._graphs.items()]
    return entry


def check(name: str, model, graphed, through_torch, batch: int) -> None:
    """Fresh inputs: the C call's output equals torch's replay bit for bit, and eager's
    within fp16 noise (graph and eager run the same kernels; capacity mode aside)."""
    if not only_entry(graphed).exec_handle:
        raise SystemExit(f"{name}: the graph does not replay through _C.graph_replay")
    for _ in range(3):
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
        got, ref, eager = graphed(x), through_torch(x), model(x)
        torch.cuda.synchronize()
        if not torch.equal(got, ref):
            raise SystemExit(f"{name}: _C.graph_replay and torch's replay differ")
        err = float((got.float() - eager.float()).abs().max())
        if not err <= 4e-3:
            raise SystemExit(f"{name}: graph vs eager max |diff| {err:.3g} > 0.004")


def measure(name: str, batch: int, args, base) -> dict:
    model = pipelines.load_model(pipelines.MODELS[name], 224, "fp16", "cuda")
    ragvit.patch(model, pipelines.make_policy(0.5))
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.float16)
    graphed = ragvit.cuda_graph(model)
    through_torch = ragvit.cuda_graph(model)
    row = {"model": name, "batch": batch}
    with torch.inference_mode():
        graphed(x)  # capture and the first replay, which decides the C call
        through_torch(x)
        only_entry(through_torch).exec_handle = 0  # copy_, replay(), clone() from now on
        check(name, model, graphed, through_torch, batch)
        entry = only_entry(graphed)
        out = entry.outputs[0]
        parts = {"call": lambda: graphed(x), "call_torch": lambda: through_torch(x),
                 "copy_in": lambda: entry.static_x.copy_(x), "replay": entry.graph.replay,
                 "copy_out": out.clone,
                 "graph_replay": lambda: ragvit._C.graph_replay(
                     entry.exec_handle, x, entry.static_x, entry.replay_outputs)}
        for part, fn in parts.items():
            row[f"host_{part}_us"] = summary(host_us(fn, args.calls))
        row["c_vs_torch"] = interleaved_ratio({"c": lambda: graphed(x),
                                               "torch": lambda: through_torch(x)},
                                              args.blocks, args.block)
        row["sync_us"] = summary(host_us(lambda: graphed(x), args.calls, wait=True))
        row["sync_torch_us"] = summary(host_us(lambda: through_torch(x), args.calls, wait=True))
        row["b2b_us"] = back_to_back_us(lambda: graphed(x), args.calls)
        row["b2b_torch_us"] = back_to_back_us(lambda: through_torch(x), args.calls)
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
        "synchronize; b2b: back-to-back calls per call. C: the call replays through "
        "_C.graph_replay (what cuda_graph does); torch: through copy_, replay() and clone(). "
        "C / torch: both calls' host µs in interleaved blocks, ratio median (p10–p90). Parts: "
        "torch's copy_, replay() and clone(), and _C.graph_replay called alone."
        + (f" A/B: against graph.py of {env['base_tree']}, interleaved blocks, ratio = "
           "this / base (median, p10–p90)." if env.get("base_tree") else ""),
        "",
        "| model | batch | host µs C | host µs torch | C / torch interleaved | copy in | "
        "replay | copy out | graph_replay | sync µs C / torch | b2b µs C / torch | "
        "A/B host µs this / base | ratio (p10–p90) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def cell(r, k):
        return f"{r[k]['median']:.1f} / {r[k]['p90']:.1f}"

    for r in rows:
        ab, ct = r.get("ab"), r["c_vs_torch"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {cell(r, 'host_call_us')} | "
            f"{cell(r, 'host_call_torch_us')} | "
            f"{ct['us']['c']:.1f} / {ct['us']['torch']:.1f} = {ct['ratio']:.2f} "
            f"({ct['p10']:.2f}–{ct['p90']:.2f}) | "
            f"{cell(r, 'host_copy_in_us')} | {cell(r, 'host_replay_us')} | "
            f"{cell(r, 'host_copy_out_us')} | {cell(r, 'host_graph_replay_us')} | "
            f"{r['sync_us']['median']:.1f} / {r['sync_torch_us']['median']:.1f} | "
            f"{r['b2b_us']:.1f} / {r['b2b_torch_us']:.1f} | "
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
    print("all results match: _C.graph_replay equals torch's replay bit for bit, and eager "
          "within 0.004")
    return report.publish(rows, 0, render, args.out, "cuda", base_tree=args.base_tree)


if __name__ == "__main__":
    raise SystemExit(main())
