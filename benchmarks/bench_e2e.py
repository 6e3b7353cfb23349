"""End-to-end images/s of pruned DeiTs: ragvit vs the pipelines PyTorch users have.

Models DeiT-S/B 224 and DeiT-B 384 (random init: the machine is offline; speed does not
depend on the weights), fp16, batch 1/4/16/64/256, random images. Policies: ThresholdL2
keep 50% after block 4 (the paper's setting, `l2_keep50_b4`) and keep 30% per stage at
blocks 4/7/10 (`l2_keep30_b4_7_10`). Pipelines, same process, same inputs:
  timm_eager   the unpruned timm model (its own forward, SDPA attention)
  timm_graph   the same, the whole forward replayed as one CUDA graph (input copied in)
  reference    ragvit.reference.vit_forward_reference: the same pruning on padded tensors,
               key-padding masks, SDPA (what users write without ragvit)
  fa2_packed   ragvit's packed pipeline with torch.ops.aten._flash_attention_forward
               (FA2 varlen) as the attention op
  ragvit       ragvit.patch(model, policy)
The pipelines themselves are built by ragvit.bench (also `python -m ragvit.bench`, which
runs one configuration anywhere, CPU included); this script is the H200 sweep of the issue.
Correctness first (max |dlogit| vs the reference replaying ragvit's decisions, decision
agreement, top-1 agreement), then images/s from benchmarks/timing.events_ms (median of
>= 50 after >= 10 warm-ups).
``python benchmarks/bench_e2e.py [--quick] [--out PREFIX]`` writes PREFIX.md/.json;
set RAGVIT_GIT_SHA on machines without .git.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
import timing  # noqa: E402

import ragvit  # noqa: E402
from ragvit import bench, reference  # noqa: E402
from ragvit.bench import fa2_attention, graphed, patched, timm_forward  # noqa: E402
from ragvit.pruning import ThresholdL2  # noqa: E402

MODELS = {
    "DeiT-S 224": ("deit_small_patch16_224", 224),
    "DeiT-B 224": ("deit_base_patch16_224", 224),
    "DeiT-B 384": ("deit_base_patch16_384", 384),
}
POLICIES = {
    "l2_keep50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
    "l2_keep30_b4_7_10": lambda: ThresholdL2(0.3, layers=(4, 7, 10)),
}
BATCHES = (1, 4, 16, 64, 256)
PIPELINES = ("timm_eager", "timm_graph", "reference", "fa2_packed", "ragvit")


def check(model, x, policy) -> dict:
    """Correctness of the packed pipelines against the padded-masked reference."""
    c = bench.check(model, x, policy, ("reference", "fa2_packed", "ragvit"), "fp16")
    err = c["err"]
    return {
        "err_ragvit_vs_reference": err["ragvit"],
        "err_fa2_vs_reference": err["fa2_packed"] if err["fa2_packed"] is not None else math.nan,
        "err_reference_own_vs_replayed_decisions": err["reference"],
        "decisions_agree": c["decisions_agree"],
        "top1_agree": c["top1_agree"],
        "kept_fraction_last_stage": c["kept_fraction"],
        "ok": c["ok"],  # ragvit.bench.TOLERANCE["fp16"] (0.004), top-1 equal but for near-ties
    }


def check_lossless(model, x) -> float:
    with patched(model, None):
        ours = model(x)
    return float((ours.double() - timm_forward(model, x).double()).abs().max())


def time_row(model, x, policy, timm_figures, args) -> dict:
    batch = x.shape[0]
    ms = dict(timm_figures)
    ms["reference"] = timing.events_ms(lambda: reference.vit_forward_reference(model, x, policy),
                                       args.warmup, args.reps)
    with patched(model, policy, attention=fa2_attention):
        ms["fa2_packed"] = timing.events_ms(lambda: model(x), args.warmup, args.reps)
    with patched(model, policy):
        ms["ragvit"] = timing.events_ms(lambda: model(x), args.warmup, args.reps)
    return {name: {"ms": vars(s), "images_per_s": batch / (s.median / 1e3)}
            for name, s in ms.items()}


def time_timm(model, x, args) -> dict:
    figures = {"timm_eager": timing.events_ms(lambda: timm_forward(model, x), args.warmup,
                                              args.reps)}
    run = graphed(lambda inp: timm_forward(model, inp), x)
    figures["timm_graph"] = timing.events_ms(run, args.warmup, args.reps)
    del run
    return figures


def render(rows, env) -> str:
    head = ("| model | policy | BS | kept | max dlogit ragvit / FA2 | img/s: "
            + " / ".join(PIPELINES)
            + " | ragvit / FA2 packed | ragvit / timm eager | ragvit / timm graph | "
            "ragvit / reference |")
    lines = [f"# End-to-end images/s on {env['gpu']}", "",
             f"driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
             f"timm {env['timm']}, ragvit {env['ragvit']} @ {env['git_sha']}; fp16, random "
             "weights and images; CUDA events, median of >= 50 after >= 10 warm-ups. "
             "dlogit vs the padded-masked reference replaying ragvit's decisions; kept = "
             "token fraction after the last pruning point.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c, t = r["check"], r.get("timing")
        errs = f"{c['err_ragvit_vs_reference']:.4f} / {c['err_fa2_vs_reference']:.4f}"
        if not c["ok"] or t is None:
            lines.append(f"| {r['model']} | {r['policy']} | {r['batch']} | "
                         f"{c['kept_fraction_last_stage']:.2f} | {errs} FAILED | | | | | |")
            continue
        ips = {n: t[n]["images_per_s"] for n in PIPELINES}
        ours = ips["ragvit"]
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['batch']} | "
            f"{c['kept_fraction_last_stage']:.2f} | {errs} | "
            + " / ".join(f"{ips[n]:.0f}" for n in PIPELINES)
            + f" | {ours / ips['fa2_packed']:.2f} | {ours / ips['timm_eager']:.2f} | "
            f"{ours / ips['timm_graph']:.2f} | {ours / ips['reference']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="DeiT-S/B 224, batch 1 and 64, the paper's policy only")
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=None)
    parser.add_argument("--batches", nargs="*", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=10, help="warm-up calls per figure (>=10)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per figure (>=50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    if args.warmup < 10 or args.reps < 50:
        parser.error("--warmup must be >= 10 and --reps >= 50")
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    import timm

    models = args.models or list(MODELS)
    batches = args.batches or list(BATCHES)
    policies = list(POLICIES)
    if args.quick:
        models, batches, policies = ["DeiT-S 224", "DeiT-B 224"], [1, 64], ["l2_keep50_b4"]
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    rows = []
    with torch.inference_mode():
        for label in models:
            name, img_size = MODELS[label]
            model = timm.create_model(name, pretrained=False).eval().to("cuda", torch.float16)
            for batch in batches:
                x = torch.randn(batch, 3, img_size, img_size, generator=gen).to(
                    "cuda", torch.float16)
                lossless = check_lossless(model, x)
                for pname in policies:
                    policy = POLICIES[pname]()
                    row = {"model": label, "policy": pname, "batch": batch,
                           "check": check(model, x, policy), "lossless_err": lossless}
                    rows.append(row)
                    print(f"{label} {pname} BS {batch}: {row['check']}, lossless {lossless:.4f}",
                          flush=True)
            del model
            torch.cuda.empty_cache()
        bad = [r for r in rows if not r["check"]["ok"]]
        print("all results match" if not bad else f"{len(bad)} rows FAILED correctness",
              flush=True)
        for label in models:
            name, img_size = MODELS[label]
            model = timm.create_model(name, pretrained=False).eval().to("cuda", torch.float16)
            for batch in batches:
                x = torch.randn(batch, 3, img_size, img_size, device="cuda",
                                dtype=torch.float16)
                timm_figures = time_timm(model, x, args)
                for r in rows:
                    if (r["model"], r["batch"]) == (label, batch) and r["check"]["ok"]:
                        r["timing"] = time_row(model, x, POLICIES[r["policy"]](),
                                               timm_figures, args)
                        ips = r["timing"]["ragvit"]["images_per_s"]
                        print(f"{label} {r['policy']} BS {batch}: ragvit {ips:.0f} img/s",
                              flush=True)
            del model
            torch.cuda.empty_cache()
    return report.publish(rows, bad, render, args.out, timm=timm.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
