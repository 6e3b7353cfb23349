"""Before the first pruning point: ragvit.attention or dense SDPA (patch's dense_until_pruning).

``python benchmarks/bench_dense_sdpa.py [--models deit_s deit_b] [--batches 1 16 64 256]
[--img-size 224] [--reps N] [--out PREFIX]`` patches two copies of a random-init model in fp16
on the GPU with ThresholdL2 keep 50% after block 4: one with ``dense_until_pruning=True``
(blocks 0-3 run timm's dense SDPA on (B, H, N, D) views of the qkv output), one with ``False``
(those blocks run ragvit.attention on the packed rows). It then times each as a replayed CUDA graph
(ragvit.cuda_graph, the way a latency-bound user runs it; GPU ms from CUDA events around each
replay) and eagerly (ms per forward, CUDA events; host-bound at small batches), the two
contenders of a row called in rotating order in one process (ragvit.bench.timing.interleaved_ms).
Both are checked first against an fp32 copy of the model replaying their decisions.
Ratio = dense / ragvit (> 1: ragvit's attention is faster there). patch()'s default
(dense_until_pruning=None: ragvit.attention in those blocks) follows from these rows.
"""

from __future__ import annotations

import argparse
import copy

import torch

import ragvit
from ragvit import reference
from ragvit.bench import pipelines, report, timing
from ragvit.bench.sweep import check_then_time

MODES = ("graph", "eager")


class Case:
    """One (model, batch): the two patched copies, their graphed forms and the input."""

    def __init__(self, name: str, batch: int, img_size: int, base):
        self.model, self.batch, self.img_size = name, batch, img_size
        self.x = torch.randn(batch, 3, img_size, img_size, device="cuda",
                             dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(
                                 batch))
        self.policy, self.patched = pipelines.make_policy(0.5), {}
        for dense in (True, False):
            model = copy.deepcopy(base)
            ragvit.patch(model, self.policy, dense_until_pruning=dense)
            self.patched[dense] = model
        self.graphed = {dense: ragvit.cuda_graph(m) for dense, m in self.patched.items()}


def check_case(case: Case) -> dict:
    """Each variant against an fp32 copy of the model replaying its decisions, within
    twice the fp16 padded reference's own error against that fp32 forward (same decisions)
    plus pipelines.EXACT_FLOOR: a bar measured on this input, not a fixed one."""
    row = {"model": case.model, "batch": case.batch, "tokens": case.batch * (
        (case.img_size // 16) ** 2 + 1)}
    model32 = copy.deepcopy(case.patched[True]).float()
    ragvit.unpatch(model32)
    ok = True
    with torch.inference_mode():
        for dense, model in case.patched.items():
            logits, decided = ragvit.forward_with_decisions(model, case.x)
            exact = reference.vit_forward_reference(model32, case.x.float(), case.policy,
                                                    decisions=decided)
            fp16_ref = reference.vit_forward_reference(model, case.x, case.policy,
                                                       decisions=decided)
            err, err_ref = pipelines.max_err(logits, exact), pipelines.max_err(fp16_ref, exact)
            row[f"err_exact_dense_{dense}"], row[f"err_reference_dense_{dense}"] = err, err_ref
            ok &= err <= 2 * err_ref + pipelines.EXACT_FLOOR["fp16"]
    row["ok"] = bool(ok)
    return row


def time_case(case: Case, row: dict, reps: int) -> None:
    with torch.inference_mode():
        for mode in MODES:
            fns = case.graphed if mode == "graph" else case.patched
            stats = timing.interleaved_ms({f"dense_{d}": (lambda f=f: f(case.x))
                                           for d, f in fns.items()}, reps=reps)
            row[f"{mode}_ms"] = {name: vars(s) for name, s in stats.items()}
            row[f"{mode}_ratio"] = (stats["dense_True"].median / stats["dense_False"].median)


def render(rows, env) -> str:
    lines = [
        f"# dense SDPA or ragvit.attention before the first pruning point, {env['device']}",
        "",
        f"driver {env['driver']}, torch {env['torch']}, timm {env['timm']}, ragvit "
        f"{env['ragvit']} @ {env['git_sha']}; fp16, random-init weights, ThresholdL2 keep 50% "
        "after block 4; host probe "
        f"{env['host_probe_start_us']} µs at the start, {env['host_probe_us']} µs at the end. "
        "ms per forward (CUDA events), median over interleaved calls; ratio = dense / ragvit "
        "(> 1: ragvit.attention in blocks 0-3 is faster).",
        "",
        "| model | batch | tokens | graph ms: dense / ragvit | graph ratio | "
        "eager ms: dense / ragvit | eager ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | {r['batch']} | {r['tokens']} | FAILED "
                         f"correctness: {r} | | | |")
            continue
        cells = []
        for mode in MODES:
            ms = r[f"{mode}_ms"]
            cells += [f"{ms['dense_True']['median']:.3f} / {ms['dense_False']['median']:.3f}",
                      f"{r[f'{mode}_ratio']:.2f}"]
        lines.append(f"| {r['model']} | {r['batch']} | {r['tokens']} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["deit_s", "deit_b"],
                        choices=sorted(pipelines.MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--reps", type=int, default=30, help="timed calls per contender")
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.reps < 1:
        parser.error(f"--batches and --reps must be >= 1, got {args.batches} and {args.reps}")
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    report.start_run()
    rows, bad = [], 0
    for name in args.models:
        base = pipelines.load_model(pipelines.MODELS[name], args.img_size, "fp16", "cuda")
        cases = [Case(name, b, args.img_size, base) for b in args.batches]
        got, failed = check_then_time(cases, check_case,
                                      lambda case, row: time_case(case, row, args.reps),
                                      lambda row: row["ok"])
        rows += got
        bad += failed
    return report.publish(rows, bad, render, args.out, "cuda")


if __name__ == "__main__":
    raise SystemExit(main())
