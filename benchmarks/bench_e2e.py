"""End-to-end images/s of pruned DeiTs: ragvit vs the pipelines PyTorch users have.

``python benchmarks/bench_e2e.py [--suite paper policies graph compiled | all] [--quick]
[--budget-s S] [--out PREFIX]`` runs one or more suites in one process and writes one PREFIX.md
(a section per suite, each ending with its targets, met or missed) and one PREFIX.json (env +
every row, each tagged with its suite); set RAGVIT_GIT_SHA where the tree has no .git. Models
are random-init (pretrained=False: nothing is downloaded, and speed does not depend on the
weights), fp16, random images; the same inputs are checked and timed. Correctness first in
every suite (max |dlogit| vs the padded-masked reference replaying the pipeline's own
decisions, by ragvit.bench.pipelines.check's rule; top-1 agreement reported; "all results
match" is printed before any number), then images/s from ragvit.bench.timing.interleaved_ms: a
row's pipelines (each patched pipeline on its own copy of the model) timed call by call in
rotating order, CUDA events around each forward, median of >= 50 after >= 10 warm-ups each, so
host noise hits every pipeline of a row alike. Each row records the host-speed probe taken
right after its timing; rows timed off the run's starting speed are listed at the end.

Suites:
  paper     (default) ThresholdL2 keep 50% after block 4 (`l2_keep50_b4`, the paper's) and
            keep 30% at blocks 4/7/10; DeiT-S/B 224 and DeiT-B 384, batch 1/4/16/64/256.
  policies  DeiT-S/B 224, batch 1/16/256, each policy at its paper default and at keep ~50%
            after block 4 (EViT, ATS, ToMe, DynamicViT with random predictors, ThresholdL2:
            fixed keep 50% and ragged threshold 1.0); kept-token fractions.
  graph     DeiT-S/B 224, batch 1/4/16, ThresholdL2 keep 50% after block 4: ragvit_graph vs
            ragvit eager, timm unpruned eager and graph, paper_fa2 and fa2_packed.
  baselines DeiT-S/B 224, batch 1/16/256, ThresholdL2 keep 50% after block 4: ragvit eager and
            as a graph and compiled against the strongest alternatives for fixed counts
            (dense_gather eager and compiled, paper_fa2, fa2_packed_graph), with the compiled
            suite's targets too; not in `all` (its compiles take minutes).
  compiled  DeiT-S/B 224, batch 1/16/256, ThresholdL2 keep 50% after block 4: ragvit_compiled
            (torch.compile of the patched model; reduce-overhead at batch <= 16, default
            above) vs ragvit_graph and ragvit eager.
Pipelines (ragvit.bench.pipelines.make_pipeline builds them; same process, same inputs):
  timm_eager / timm_graph  the unpruned timm model, eager / replayed as one CUDA graph
  reference    ragvit.reference.vit_forward_reference: the same pruning on padded tensors,
               key-padding masks, SDPA (what users write without ragvit)
  paper_fa2    the paper's FA2-varlen baseline pipeline (ragvit.bench.pipelines.paper_forward;
               not its Triton method): timm's blocks, its packer with three host syncs (two
               .item(), a nonzero), then torch's modules and FA2 varlen on the packed rows
               (checked against the reference replaying its own decisions)
  dense_gather / dense_gather_compiled   fixed counts: timm's blocks on the gathered kept
               tokens, eager / under torch.compile
  fa2_packed_graph   fa2_packed replayed as one CUDA graph
  fa2_packed   ragvit's packed pipeline with torch's FA2 varlen as attention; for EViT/ATS
               plus the head-mean CLS attention row in torch ops (FA2 does not return it);
               n/a for ToMe (FA2 varlen takes no per-key bias for proportional attention)
  ragvit / ragvit_graph    ragvit.patch(model, policy), eager / as a CUDA graph
  ragvit_compiled          torch.compile(patched model, fullgraph=True), compiled before timing

The paper suite also checks ragvit.patch without a policy against timm's forward (lossless:
within twice timm's own error against fp32, plus a floor, or the run fails). Every suite
lists, per row, the images whose kept set differs from an independent fp32 selection and
max |dlogit| on the others (ragvit.reference.selection_agreement).

Run time on an H200 (60 calls per figure, the graph suite 3x that, plus checks and model
set-up): paper ~2 min alone (--quick ~1 min), policies ~2.5 min alone, graph ~1 min, all
three in one process ~3.5 min (model set-up shared); compiled is estimated at ~5 min, most of
it compilation (one graph per model and batch size, compiled again from Inductor's cache for
timing). --budget-s (default 540) caps the
process: each suite gets a share of what is left in proportion to those figures
(SUITE_MINUTES); rows past a suite's share are reported as skipped (budget), never
half-timed, and the results are still written. --tiny runs every suite on the CPU with
DeiT-Tiny at 64 px (a smoke test of this script; its numbers are not ragvit's performance).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time

import torch

import ragvit
from ragvit import reference, timm_patch
from ragvit.bench import pipelines, report, timing
from ragvit.bench.pipelines import GPU_ONLY, UNPRUNED, patched, timm_forward
from ragvit.pruning import ATS, EViT, ThresholdL2, ToMe

MODELS = {
    "DeiT-S 224": ("deit_small_patch16_224", 224),
    "DeiT-B 224": ("deit_base_patch16_224", 224),
    "DeiT-B 384": ("deit_base_patch16_384", 384),
    "DeiT-T 64": ("deit_tiny_patch16_224", 64),  # --tiny (CPU smoke test)
}
# H200 measurements; baselines and compiled: estimates dominated by torch.compile (two models,
# three batch sizes, one compile each)
SUITE_MINUTES = {"paper": 2.0, "policies": 2.7, "graph": 1.0, "baselines": 6.0, "compiled": 5.0}
SUITES = tuple(SUITE_MINUTES)
# Calls per pipeline per timing round, the last one timed (timing.interleaved_ms): the graph
# suite's replays are GPU-bound and short, so each is timed after two more of its own, with
# its model's weights back in L2 (DeiT-S's fit) as when a model is served alone; the eager
# suites are host-bound and take one call per round.
BURST = {"paper": 1, "policies": 1, "graph": 3, "baselines": 3, "compiled": 3}


class Context:
    """Device, dtype, timer settings and the time budget of one process."""

    def __init__(self, args):
        self.tiny = args.tiny
        self.device = "cpu" if args.tiny else "cuda"
        self.dtype = "fp32" if args.tiny else "fp16"
        self.torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[self.dtype]
        self.warmup, self.reps, self.seed = args.warmup, args.reps, args.seed
        self.end = time.monotonic() + args.budget_s if args.budget_s else None
        self.suite_end = self.end

    def pipelines(self, names):
        """names that run here: on the CPU (--tiny) neither the GPU-only pipelines nor the
        compiled baselines (inductor's CPU compile of a ViT takes minutes); ragvit_compiled
        does run, the compiled suite's smoke test of its own path."""
        baselines = tuple(n for n in pipelines.COMPILED if n != "ragvit_compiled")
        return tuple(n for n in names
                     if self.device == "cuda" or n not in GPU_ONLY + baselines)

    def start_suite(self, suite, remaining):
        """This suite's deadline: its estimate's share of the budget that is left."""
        if self.end is None:
            return
        left = max(0.0, self.end - time.monotonic())
        share = SUITE_MINUTES[suite] / sum(SUITE_MINUTES[s] for s in remaining)
        self.suite_end = time.monotonic() + left * share

    def out_of_time(self) -> bool:
        return self.suite_end is not None and time.monotonic() > self.suite_end

    def time_ms_interleaved(self, fns, burst=1) -> dict:
        """{name: timing.Stats} of the callables in fns, timed side by side."""
        return timing.interleaved_ms(fns, self.warmup, self.reps, self.device, burst)

    def images(self, batch, img_size):
        """The same random images for a (batch, size) in the check and the timing pass."""
        gen = torch.Generator(device="cpu").manual_seed(
            self.seed * 1_000_003 + batch * 1009 + img_size)
        return torch.randn(batch, 3, img_size, img_size, generator=gen).to(
            self.device, self.torch_dtype)

    def load(self, label):
        name, img_size = MODELS[label]
        return pipelines.load_model(name, img_size, self.dtype, self.device, self.seed), img_size


# ---- policies ----


def random_predictors(model, stages, seed):
    """DynamicViT prediction modules with seeded random weights (no trained ones are loaded)."""
    from ragvit.pruning import DynamicViTPredictor

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        modules = torch.nn.ModuleList(DynamicViTPredictor(model.embed_dim)
                                      for _ in range(stages))
    return modules.eval()


def policy_configs(model, seed) -> dict:
    """The policies suite: {key: (setting, policy)}; setting "paper" or "keep~50%".

    Paper settings are ragvit.pruning's documented defaults (EViT 0.7 at 3/6/9 fused; ATS
    K=108 at block 3; ToMe r=8 in every block; DynamicViT 0.7/0.49/0.343 at 3/6/9;
    ThresholdL2 keep 50% after block 4). keep~50%: one pruning point at block 4 leaving
    about half the patch tokens (ATS keeps at most n/2: duplicates collapse; ThresholdL2
    by threshold 1.0 x the mean norm, ragged).
    """
    from ragvit.pruning import DynamicViT

    half = model.patch_embed.num_patches // 2
    return {
        "l2_keep50_b4": ("paper", ThresholdL2(0.5, layers=(4,))),
        "l2_thr1_b4": ("keep~50%", ThresholdL2(threshold=1.0, layers=(4,))),
        "evit_keep70_b3_6_9": ("paper", EViT(0.7, layers=(3, 6, 9))),
        "evit_keep50_b4": ("keep~50%", EViT(0.5, layers=(4,))),
        "ats_k108_b3": ("paper", ATS(108, layers=(3,))),
        f"ats_k{half}_b4": ("keep~50%", ATS(half, layers=(4,))),
        "tome_r8_all": ("paper", ToMe(8)),
        f"tome_r{half}_b4": ("keep~50%", ToMe(half, layers=(4,))),
        "dynvit_70_49_34_b3_6_9": ("paper", DynamicViT(
            (0.7, 0.49, 0.343), layers=(3, 6, 9), predictor=random_predictors(model, 3, seed))),
        "dynvit_keep50_b4": ("keep~50%", DynamicViT(
            (0.5,), layers=(4,), predictor=random_predictors(model, 1, seed + 1))),
    }


PAPER_POLICIES = {
    "l2_keep50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
    "l2_keep30_b4_7_10": lambda: ThresholdL2(0.3, layers=(4, 7, 10)),
}


# ---- correctness ----


def kept_fractions(model, policy, decided) -> tuple[float, float]:
    """(final, per_block): tokens after the last pruning point / N, and the mean over
    blocks of tokens per block / N (mid-block pruning counts half a block on each side)."""
    N = model.patch_embed.num_patches + model.num_prefix_tokens
    counts = [N] + [float(timm_patch.kept_mask(d).sum(1).double().mean()) for d in decided]
    depth, total = len(model.blocks), 0.0
    for i in range(depth):
        after = counts[sum(1 for j in policy.layers if j <= i)]
        before = counts[sum(1 for j in policy.layers if j < i)]
        total += (before + after) / 2 if policy.prune_mid_block else after
    return counts[-1] / N, total / (depth * N)


def check_fa2(model, x, policy, tol) -> tuple[float | None, str | None]:
    """FA2 packed vs the reference replaying FA2's own decisions: (err, unavailable)."""
    why = pipelines.fa2_unsupported(policy)
    if why:
        return None, why
    try:
        attention = pipelines.fa2_attention_for(policy)
        return pipelines.own_decisions_err(model, x, policy, attention), None
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
        return None, f"{type(e).__name__}: {e}"


def check_row(model, x, policy, pipeline_names, ctx) -> dict:
    """pipelines.check on the pipelines it builds, FA2 against its own decisions, kept
    fractions. ok: every pipeline within pipelines.TOLERANCE[dtype] or check's fp32-relative
    rule (top-1 agreement reported: that bound allows a flip only on near-ties, top-2 margin
    within twice the error). The reference's own decisions are
    reported (decisions_agree), not required: a near-tie may flip in fp16."""
    tol = pipelines.TOLERANCE[ctx.dtype]
    own = tuple(p for p in pipeline_names if p not in ("reference", "fa2_packed"))
    try:
        c = pipelines.check(model, x, policy, own, ctx.dtype)
    except Exception as e:  # noqa: BLE001 - e.g. ToMe: the fp16 reference merged others
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "err": {},
                "err_ragvit_vs_reference": math.nan, "err_fa2_vs_reference": math.nan,
                "kept_fraction_last_stage": math.nan, "kept_per_block": math.nan,
                "top1_agree": math.nan, "unavailable": {}}
    err, unavailable = dict(c["err"]), dict(c["unavailable"])
    if "fa2_packed" in pipeline_names:
        err["fa2_packed"], why = check_fa2(model, x, policy, tol)
        if why:
            unavailable["fa2_packed"] = why
    with patched(model, policy):
        logits, decided = timm_patch.forward_with_decisions(model, x)
    final, per_block = kept_fractions(model, policy, decided)
    selection = reference.selection_agreement(model, x, policy, logits, decided)
    # FA2 packed runs torch's modules like the reference: plain tolerance. Our own
    # pipelines were judged by pipelines.check (tolerance, or its fp32-relative rule).
    ok = c["ok"] and (err.get("fa2_packed") is None or err["fa2_packed"] <= tol)
    return {
        "err": err,
        "unavailable": unavailable,
        "err_exact": c["err_exact"],
        "err_reference_exact": c["err_reference_exact"],
        "err_ragvit_vs_reference": err["ragvit"],
        "err_fa2_vs_reference": err.get("fa2_packed") if err.get("fa2_packed") is not None
        else math.nan,
        "decisions_agree": c["decisions_agree"],
        "top1_agree": c["top1_agree"],
        "kept_fraction_last_stage": final,
        "kept_per_block": per_block,
        "selection": selection,
        "tolerance": tol,
        "ok": ok,
    }


def check_lossless(model, x) -> dict:
    """ragvit.patch(model) without a policy against timm's own forward on the same weights
    and images: {"err", "err_timm", "bar", "ok"}. The bar comes from timm's own rounding
    error in x's dtype (err_timm: against timm on copies of the weights and images in fp32, or
    float64 for an fp32 run): two forwards each that far from the truth differ by at most
    twice that, plus pipelines.EXACT_FLOOR (flash-attention's rule)."""
    with patched(model, None):
        ours = model(x)
    theirs = timm_forward(model, x)
    truth_dtype = torch.float64 if x.dtype == torch.float32 else torch.float32
    truth = timm_forward(copy.deepcopy(model).to(truth_dtype), x.to(truth_dtype))
    err, err_timm = pipelines.max_err(ours, theirs), pipelines.max_err(theirs, truth)
    bar = 2 * err_timm + pipelines.EXACT_FLOOR[LOSSLESS_DTYPE[x.dtype]]
    return {"err": err, "err_timm": err_timm, "bar": bar, "ok": err <= bar}


LOSSLESS_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---- one suite: check everything, then time what passed ----


def run_suite(suite, ctx, models, batches, policies_for, pipeline_names, remaining, lossless=False):
    """rows of one suite; policies_for(model) -> {key: (setting, policy)}."""
    ctx.start_suite(suite, remaining)
    print(f"== suite {suite}: {', '.join(models)}; batch {', '.join(map(str, batches))}; "
          f"{', '.join(pipeline_names)}", flush=True)
    loaded = {label: ctx.load(label) for label in models}
    configs = {label: policies_for(loaded[label][0]) for label in models}
    rows = []
    for label, (model, img_size) in loaded.items():
        for batch in batches:
            x = ctx.images(batch, img_size)
            lossless_check = check_lossless(model, x) if lossless else None
            if lossless_check is not None and not lossless_check["ok"]:
                lossless_failed = (
                    f"lossless: ragvit.patch without a policy is {lossless_check['err']:.2e} "
                    f"from timm's forward, over the bar {lossless_check['bar']:.2e} (2 x timm's "
                    f"own error {lossless_check['err_timm']:.2e} + floor)")
                print(f"{suite} | {label} BS {batch}: FAILED {lossless_failed}", flush=True)
            for key, (setting, policy) in configs[label].items():
                row = {"suite": suite, "model": label, "policy": key, "setting": setting,
                       "batch": batch}
                rows.append(row)
                if ctx.out_of_time():
                    row["skipped"] = "budget"
                    continue
                row["check"] = check_row(model, x, policy, pipeline_names, ctx)
                if lossless_check is not None:
                    row["lossless_err"], row["lossless_bar"] = (lossless_check["err"],
                                                                lossless_check["bar"])
                    if not lossless_check["ok"]:
                        row["check"]["ok"] = False
                        row["check"].setdefault("error", lossless_failed)
                c = row["check"]
                print(f"{suite} | {label} {key} BS {batch}: ragvit "
                      f"{c['err_ragvit_vs_reference']:.2e}, FA2 {c['err_fa2_vs_reference']:.2e}, "
                      f"top-1 {c['top1_agree']:.3f}, "
                      f"kept {c['kept_fraction_last_stage']:.3f}, ok {c['ok']}"
                      + "".join(f"; {n} n/a: {w[:120]}" for n, w in c["unavailable"].items())
                      + (f"; ERROR {c['error'][:200]}" if "error" in c else ""), flush=True)
    bad = sum(1 for r in rows if "check" in r and not r["check"]["ok"])
    print(f"{suite}: all results match" if not bad
          else f"{suite}: {bad} rows FAILED correctness (not timed)", flush=True)
    for label, (model, img_size) in loaded.items():
        # One copy of the model per patched pipeline, so that all of a row's pipelines are
        # live at once and timed interleaved (patch() changes the model it is given).
        copies = {}
        for batch in batches:
            x = None
            shared = {}  # unpruned figures, once per (model, batch)
            for row in rows:
                if (row["model"], row["batch"]) != (label, batch) or "skipped" in row \
                        or not row["check"]["ok"]:
                    continue
                if ctx.out_of_time():
                    row["skipped"] = "budget"
                    continue
                x = x if x is not None else ctx.images(batch, img_size)
                policy = configs[label][row["policy"]][1]
                names = [n for n in pipeline_names
                         if (n in UNPRUNED and n not in shared) or n == "reference"
                         or (n not in UNPRUNED and row["check"]["err"].get(n) is not None)]
                with contextlib.ExitStack() as stack:
                    fns = {}
                    for name in names:
                        if name in UNPRUNED or name == "reference":
                            target = model  # never patched
                        else:
                            if name not in copies:
                                copies[name] = copy.deepcopy(model)
                            target = copies[name]
                        fns[name] = stack.enter_context(pipelines.make_pipeline(
                            name, target, None if name in UNPRUNED else policy, x))
                    stats = ctx.time_ms_interleaved(fns, BURST[suite])
                shared.update({n: stats[n] for n in UNPRUNED if n in stats})
                row.update(report.probe_against_start())
                row["timing"] = {}
                for name in pipeline_names:  # unavailable ones are listed in the check
                    st = shared.get(name) if name in UNPRUNED else stats.get(name)
                    if st is not None:
                        row["timing"][name] = {"ms": vars(st),
                                               "images_per_s": batch / (st.median / 1e3)}
                print(f"{suite} | {label} {row['policy']} BS {batch}: "
                      + ", ".join(f"{n} {t['images_per_s']:.0f}"
                                  for n, t in row["timing"].items()) + " img/s"
                      + ("" if row["host_steady"] is not False
                         else f" (host probe {row['host_probe_us']} µs: unsteady)"), flush=True)
            del x
        del copies
    del loaded
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    skipped = sum(1 for r in rows if "skipped" in r)
    if skipped:
        print(f"{suite}: {skipped} rows skipped (time budget)", flush=True)
    return rows, bad


# ---- rendering ----


def _ips(row, name):
    t = row.get("timing", {}).get(name)
    return t["images_per_s"] if t else None


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def _status(row) -> str | None:
    if "skipped" in row:
        return "skipped (time budget)"
    if not row["check"]["ok"]:
        return "FAILED" + (f": {row['check']['error'][:80]}" if "error" in row["check"] else "")
    return None


def _errs(c) -> str:
    """ragvit / FA2 max |dlogit| vs the reference; where ragvit passed by pipelines.check's
    fp32-relative rule, also its error and the reference's against the fp32 forward."""
    text = f"{_fmt(c.get('err_ragvit_vs_reference'))} / {_fmt(c.get('err_fa2_vs_reference'))}"
    exact = (c.get("err_exact") or {}).get("ragvit")
    if exact is not None:
        text += f" (vs fp32: {_fmt(exact)}, fp16 ref {_fmt(c['err_reference_exact']['ragvit'])})"
    return text


def _fmt(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


def _table_head(head: str) -> list[str]:
    """A Markdown table's header row and its separator."""
    return [head, "|" + "---|" * (head.count("|") - 1)]


def render_paper(rows) -> list[str]:
    names = ("timm_eager", "timm_graph", "reference", "fa2_packed", "ragvit")
    head = ("| model | policy | BS | kept | max dlogit ragvit / FA2 | img/s: " + " / ".join(names)
            + " | ragvit / FA2 packed | ragvit / timm eager | ragvit / timm graph | "
            "ragvit / reference |")
    lines = ["ThresholdL2 policies. kept = token fraction after the last pruning point.", "",
             *_table_head(head)]
    targets = {"fa2_13": [], "fa2_1": [], "b256": [], "check": []}
    for r in rows:
        c = r.get("check", {})
        start = (f"| {r['model']} | {r['policy']} | {r['batch']} | "
                 f"{_fmt(c.get('kept_fraction_last_stage'))} | {_errs(c)}")
        if _status(r):
            lines.append(start + f" {_status(r)} | | | | | |")
            continue
        ips = {n: _ips(r, n) for n in names}
        ours = ips["ragvit"]
        lines.append(start + " | " + " / ".join(f"{v:.0f}" if v else "–" for v in ips.values())
                     + f" | {_ratio(ours, ips['fa2_packed'])} | {_ratio(ours, ips['timm_eager'])}"
                     f" | {_ratio(ours, ips['timm_graph'])} | {_ratio(ours, ips['reference'])} |")
        what = f"{r['model']} {r['policy']} BS {r['batch']}"
        if ours and ips["fa2_packed"]:
            ratio = ours / ips["fa2_packed"]
            targets["fa2_13" if r["batch"] <= 16 else "fa2_1"].append(
                (ratio >= (1.3 if r["batch"] <= 16 else 1.0), what, ratio))
        if (r["model"] == "DeiT-B 224" and r["policy"] == "l2_keep50_b4" and r["batch"] == 256
                and ours and ips["timm_eager"]):
            targets["b256"].append((ours >= 1.4 * ips["timm_eager"], what,
                                    ours / ips["timm_eager"]))
        targets["check"].append((bool(c.get("ok")), what, c.get("top1_agree", math.nan)))
    lines += ["", "Targets:",
              _target_line("batch 1-16: ragvit >= 1.3x FA2 packed", targets["fa2_13"]),
              _target_line("batch 64, 256: ragvit >= FA2 packed", targets["fa2_1"]),
              _target_line("DeiT-B 224, keep 50% after block 4, batch 256: ragvit >= 1.4x timm "
                           "eager", targets["b256"]),
              _target_line("correct: max dlogit rule (value: top-1 agreement)",
                           targets["check"], unit="")]
    return lines


def render_policies(rows) -> list[str]:
    names = ("timm_eager", "reference", "fa2_packed", "ragvit")
    head = ("| model | policy | setting | BS | kept final / per block | max dlogit ragvit / FA2 "
            "| top-1 agree | img/s: timm / reference / FA2 packed / ragvit | ragvit / reference "
            "| ragvit / FA2 packed | ragvit / timm |")
    lines = ["kept final = tokens after the last pruning point / N; per block = mean tokens "
             "per block / N (the FLOP-relevant figure). FA2 packed for EViT/ATS includes the "
             "CLS attention row in torch ops; n/a for ToMe (no key bias in FA2 varlen). "
             "DynamicViT runs random (seeded) predictors.", "",
             *_table_head(head)]
    ref_target, fa2_target = [], []
    for r in rows:
        c = r.get("check", {})
        start = (f"| {r['model']} | {r['policy']} | {r['setting']} | {r['batch']} | "
                 f"{_fmt(c.get('kept_fraction_last_stage'))} / "
                 f"{_fmt(c.get('kept_per_block'))} | {_errs(c)}")
        if _status(r):
            lines.append(start + f" {_status(r)} | | | | | |")
            continue
        ips = {n: _ips(r, n) for n in names}
        ours = ips["ragvit"]
        lines.append(start + f" | {c['top1_agree']:.3f} | "
                     + " / ".join(f"{v:.0f}" if v else "n/a" for v in ips.values())
                     + f" | {_ratio(ours, ips['reference'])} | {_ratio(ours, ips['fa2_packed'])}"
                     f" | {_ratio(ours, ips['timm_eager'])} |")
        what = f"{r['model']} {r['policy']} BS {r['batch']}"
        if r["batch"] == 256 and ours and ips["reference"]:
            ref_target.append((ours / ips["reference"] >= 1.3, what, ours / ips["reference"]))
        if ours and ips["fa2_packed"]:
            fa2_target.append((ours >= ips["fa2_packed"], what, ours / ips["fa2_packed"]))
    lines += ["", "Targets:", _target_line("ragvit >= 1.3x reference at batch 256",
                                                     ref_target),
              _target_line("ragvit >= FA2 packed (every row where FA2 runs)", fa2_target)]
    return lines


def render_graph(rows) -> list[str]:
    names = ("timm_eager", "timm_graph", "paper_fa2", "fa2_packed", "ragvit", "ragvit_graph")
    head = ("| model | BS | kept | max dlogit ragvit / ragvit graph / paper | img/s: "
            + " / ".join(names) + " | graph / timm graph | graph / paper FA2 | "
            "graph / FA2 packed | graph / ragvit eager |")
    lines = ["ThresholdL2 keep 50% after block 4; graph = ragvit.bench.pipelines.make_pipeline"
             "('ragvit_graph'), the whole pruned forward replayed as one CUDA graph.", "",
             *_table_head(head)]
    targets = {"s1_2500": [], "s1_fa2": [], "s1_timm": [], "timm12": []}
    for r in rows:
        c = r.get("check", {})
        start = (f"| {r['model']} | {r['batch']} | {_fmt(c.get('kept_fraction_last_stage'))} | "
                 f"{_fmt(c.get('err_ragvit_vs_reference'))} / "
                 f"{_fmt(c.get('err', {}).get('ragvit_graph'))} / "
                 f"{_fmt(c.get('err', {}).get('paper_fa2'))}")
        if _status(r):
            lines.append(start + f" {_status(r)} | | | | | |")
            continue
        ips = {n: _ips(r, n) for n in names}
        g = ips["ragvit_graph"]
        lines.append(start + " | " + " / ".join(f"{v:.0f}" if v else "n/a" for v in ips.values())
                     + f" | {_ratio(g, ips['timm_graph'])} | {_ratio(g, ips['paper_fa2'])} | "
                     f"{_ratio(g, ips['fa2_packed'])} | {_ratio(g, ips['ragvit'])} |")
        what = f"{r['model']} BS {r['batch']}"
        if g and r["batch"] <= 16 and ips["timm_graph"]:
            targets["timm12"].append((g >= 1.2 * ips["timm_graph"], what, g / ips["timm_graph"]))
        if r["model"].startswith("DeiT-S") and r["batch"] == 1 and g:
            targets["s1_2500"].append((g >= 2500, what, g))
            if ips["paper_fa2"]:
                targets["s1_fa2"].append((g >= 10 * ips["paper_fa2"], what,
                                          g / ips["paper_fa2"]))
            if ips["timm_graph"]:
                targets["s1_timm"].append((g > ips["timm_graph"], what, g / ips["timm_graph"]))
    lines += ["", "Targets:",
              _target_line("DeiT-S batch 1: ragvit graph >= 2500 img/s", targets["s1_2500"],
                           unit=" img/s"),
              _target_line("DeiT-S batch 1: ragvit graph >= 10x the paper's pipeline (paper_fa2)",
                           targets["s1_fa2"]),
              _target_line("DeiT-S batch 1: ragvit graph > timm graph", targets["s1_timm"]),
              _target_line("every batch <= 16: ragvit graph >= 1.2x timm graph",
                           targets["timm12"])]
    return lines


def render_compiled(rows, on_cpu: bool = False) -> list[str]:
    names = ("ragvit", "ragvit_graph", "ragvit_compiled")
    head = ("| model | BS | compile mode | kept | max dlogit ragvit / compiled | img/s: "
            + " / ".join(names) + " | compiled / graph | compiled / ragvit eager |")
    lines = ["ThresholdL2 keep 50% after block 4; compiled = torch.compile(patched model, "
             "fullgraph=True) in ragvit.bench.pipelines.compile_mode (reduce-overhead up to "
             f"batch {pipelines.COMPILE_REDUCE_OVERHEAD_MAX_BATCH}, default above).", "",
             *_table_head(head)]
    for r in rows:
        c = r.get("check", {})
        mode = pipelines.compile_mode(r["batch"], "cpu" if on_cpu else "cuda")
        start = (f"| {r['model']} | {r['batch']} | {mode} | "
                 f"{_fmt(c.get('kept_fraction_last_stage'))} | "
                 f"{_fmt(c.get('err_ragvit_vs_reference'))} / "
                 f"{_fmt(c.get('err', {}).get('ragvit_compiled'))}")
        if _status(r):
            lines.append(start + f" {_status(r)} | | |")
            continue
        ips = {n: _ips(r, n) for n in names}
        cc = ips["ragvit_compiled"]
        lines.append(start + " | " + " / ".join(f"{v:.0f}" if v else "n/a" for v in ips.values())
                     + f" | {_ratio(cc, ips['ragvit_graph'])} | {_ratio(cc, ips['ragvit'])} |")
    return lines + ["", "Targets:", *compiled_targets(rows)]


def compiled_targets(rows) -> list[str]:
    """The compiled forward's target lines over rows that time ragvit, ragvit_graph and
    ragvit_compiled (the compiled and the baselines suites both do)."""
    targets = {"graph": [], "eager": []}
    for r in rows:
        if _status(r):
            continue
        ips = {n: _ips(r, n) for n in ("ragvit", "ragvit_graph", "ragvit_compiled")}
        cc, what = ips["ragvit_compiled"], f"{r['model']} BS {r['batch']}"
        if cc and r["batch"] <= 16 and ips["ragvit_graph"]:
            targets["graph"].append((cc >= 0.95 * ips["ragvit_graph"], what,
                                     cc / ips["ragvit_graph"]))
        if cc and r["batch"] >= 256 and ips["ragvit"]:
            targets["eager"].append((cc >= ips["ragvit"], what, cc / ips["ragvit"]))
    return [_target_line("batch 1-16: compiled (reduce-overhead) >= 0.95x ragvit graph",
                         targets["graph"]),
            _target_line("batch 256: compiled (default) >= ragvit eager", targets["eager"])]


def _target_line(what, results, unit="x") -> str:
    if not results:
        return f"- {what}: not measured"
    missed = [f"{w} ({v:.2f}{unit})" for ok, w, v in results if not ok]
    verdict = "met" if not missed else "MISSED for " + ", ".join(missed)
    return f"- {what}: {sum(ok for ok, _, _ in results)}/{len(results)} {verdict}"


def render_selection(rows) -> list[str]:
    """ragvit's own decisions against an independent selection, one line per checked row."""
    lines = ["Decisions against an independent selection (the reference deciding on its own "
             "activations in fp32, same images; ragvit.reference.selection_agreement): images "
             "whose kept set differs (near-tied scores), and max |dlogit| against that forward "
             "on the other images.", "",
             "| model | policy | BS | images differ | max dlogit where the same |",
             "|---|---|---|---|---|"]
    for r in rows:
        a = r.get("check", {}).get("selection")
        if a:
            lines.append(f"| {r['model']} | {r['policy']} | {r['batch']} | "
                         f"{a['images_differ']}/{a['images']} | "
                         + ("–" if math.isnan(a["max_dlogit_same"])
                            else f"{a['max_dlogit_same']:.1e}") + " |")
    return lines


BASELINES = ("dense_gather", "dense_gather_compiled", "paper_fa2", "fa2_packed_graph")
OURS = ("ragvit", "ragvit_graph", "ragvit_compiled")


def render_baselines(rows) -> list[str]:
    """ragvit's best form against the fastest correct alternative of the same row."""
    names = BASELINES + OURS
    head = ("| model | BS | img/s: " + " / ".join(names) + " | fastest alternative | "
            "ragvit's best | ragvit's best / fastest alternative |")
    lines = ["ThresholdL2 keep 50% after block 4, fixed counts: every pipeline a competent "
             "user could write for them. dense_gather: timm's own blocks on the gathered kept "
             "tokens (dense_gather_compiled: the same under torch.compile, reduce-overhead at "
             "batch <= 16, default above); paper_fa2: the paper's FA2-varlen baseline "
             "pipeline (three host syncs); fa2_packed_graph: ragvit's packed pipeline on FA2 "
             "varlen and torch's modules, replayed as a CUDA graph.", "",
             *_table_head(head)]
    targets = []
    for r in rows:
        start = f"| {r['model']} | {r['batch']} | "
        if _status(r):
            lines.append(start + f"{_status(r)} | | | |")
            continue
        ips = {n: _ips(r, n) for n in names}
        alt = max((n for n in BASELINES if ips[n]), key=lambda n: ips[n], default=None)
        best = max((n for n in OURS if ips[n]), key=lambda n: ips[n], default=None)
        lines.append(start + " / ".join(f"{v:.0f}" if v else "–" for v in ips.values())
                     + f" | {alt or '–'} | {best or '–'} | "
                     f"{_ratio(ips.get(best), ips.get(alt))} |")
        if alt and best and ips["dense_gather_compiled"]:
            need = 1.5 if r["batch"] <= 16 else 1.3
            ratio = ips[best] / ips["dense_gather_compiled"]
            targets.append((ratio >= need, f"{r['model']} BS {r['batch']} (>= {need}x)", ratio))
    lines += ["", "Targets:", _target_line(
        "ragvit's best >= 1.5x compiled dense_gather at batch 1-16, >= 1.3x at 256", targets),
        *compiled_targets(rows)]
    return lines


RENDER = {"paper": render_paper, "policies": render_policies, "graph": render_graph,
          "baselines": render_baselines, "compiled": render_compiled}


def render(rows, env) -> str:
    lines = [f"# End-to-end images/s on {env['device']}", "",
             f"driver {env['driver'] or '–'}, CUDA {env['cuda']}, torch {env['torch']}, "
             f"timm {env['timm']}, ragvit {env['ragvit']} @ {env['git_sha']}; "
             f"{env['dtype']}, random weights and images; median of {env['reps']} after "
             f"{env['warmup']} warm-ups ({env['timer']}). max dlogit: vs the padded-masked "
             "reference replaying the pipeline's own decisions, within 0.004 (fp16), or, where "
             "not, at least as close to the same forward in fp32 on the same decisions as "
             "that fp16 reference is (err <= 2 x the reference's + 0.001, every pruned "
             "pipeline; ragvit's figures shown); top-1 agreement is reported: that bound "
             "allows a flip only where the reference's top-2 margin is within twice the "
             "error (near-ties).", ""]
    for suite in env["suites"]:
        lines += [f"## Suite `{suite}`", ""]
        mine = [r for r in rows if r["suite"] == suite]
        lines += (render_compiled(mine, env["device"].startswith("CPU")) if suite == "compiled"
                  else RENDER[suite](mine)) + [""]
        lines += render_selection(mine) + [""]
    lines += render_unsteady(rows, env)
    return "\n".join(lines)


def render_unsteady(rows, env) -> list[str]:
    """The rows timed while the host ran off its speed at the run's start (each row's probe,
    taken right after its timing, against the start's, beyond report.HOST_DRIFT_LIMIT)."""
    off = [r for r in rows if r.get("host_steady") is False]
    if not off:
        return []
    return ([f"Rows timed off the host's starting speed (probe {env['host_probe_start_us']} "
             f"µs at the start, beyond {report.HOST_DRIFT_LIMIT}x): their absolute figures "
             "and ratios against other rows do not carry.", ""]
            + [f"- {r['suite']}: {r['model']} {r['policy']} BS {r['batch']}: probe "
               f"{r['host_probe_us']} µs" for r in off] + [""])


# ---- command line ----


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=(
        "estimated H200 minutes: " + ", ".join(f"{k} {v:g}" for k, v in SUITE_MINUTES.items())
        + " (paper --quick: 1)"))
    parser.add_argument("--suite", nargs="+", choices=SUITES + ("all",), default=["paper"],
                        help="suites to run, in order (all: paper policies graph compiled)")
    parser.add_argument("--quick", action="store_true",
                        help="paper suite: DeiT-S/B 224, batch 1 and 64, l2_keep50_b4 only")
    parser.add_argument("--models", nargs="+", choices=[m for m in MODELS if "T 64" not in m],
                        default=None, help="override every suite's models")
    parser.add_argument("--batches", nargs="+", type=int, default=None,
                        help="override every suite's batch sizes")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls per figure (>=10)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per figure (>=50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole process, shared among the suites by their "
                             "estimates; rows past a suite's share are skipped (0: no limit)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke test: DeiT-Tiny at 64 px, fp32, batch 1 and 2")
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    report.start_run()  # the host-speed probe at the run's start
    suites = ([s for s in SUITES if s != "baselines"] if "all" in args.suite
              else list(dict.fromkeys(args.suite)))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    args.reps = args.reps if args.reps is not None else (3 if args.tiny else 50)
    if not args.tiny and (args.warmup < 10 or args.reps < 50):
        parser.error("--warmup must be >= 10 and --reps >= 50")
    if args.budget_s < 0:
        parser.error("--budget-s must be >= 0")
    if any(b < 1 for b in args.batches or ()):
        parser.error("--batches must be >= 1")
    if not args.tiny and not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit (or --tiny on the CPU)")
    ctx = Context(args)
    if args.tiny:
        torch.set_num_threads(1)  # tiny models: intra-op threads only add barrier waits
    if ctx.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    rows, bad = [], 0
    with torch.inference_mode(), _quiet_dynamicvit():
        for i, suite in enumerate(suites):
            models, batches, policies, pipeline_names, lossless = suite_plan(suite, args, ctx)
            got, failed = run_suite(suite, ctx, models, batches, policies, pipeline_names,
                                    suites[i:], lossless)
            rows += got
            bad += failed
    return report.publish(
        rows, bad, render, args.out, ctx.device, suites=suites, dtype=ctx.dtype,
        warmup=args.warmup, reps=args.reps,
        timer=("CUDA events" if ctx.device == "cuda" else "perf_counter, CPU smoke run")
        + ", a row's pipelines interleaved call by call"
        + (f"; graph suite: each timed call the last of {BURST['graph']} in a row"
           if "graph" in suites else ""))


def suite_plan(suite, args, ctx):
    """(models, batches, policies_for, pipeline_names, lossless) of one suite."""
    if suite == "paper":
        models, batches = list(MODELS)[:3], [1, 4, 16, 64, 256]
        keys = list(PAPER_POLICIES)
        if args.quick:
            models, batches, keys = models[:2], [1, 64], keys[:1]
        policies = lambda model: {k: ("paper", PAPER_POLICIES[k]()) for k in keys}  # noqa: E731
        pipeline_names = ("timm_eager", "timm_graph", "reference", "fa2_packed", "ragvit")
        lossless = True
    elif suite == "policies":
        models, batches = list(MODELS)[:2], [1, 16, 256]
        policies = lambda model: policy_configs(model, args.seed)  # noqa: E731
        pipeline_names = ("timm_eager", "reference", "fa2_packed", "ragvit")
        lossless = False
    elif suite == "baselines":
        models, batches = list(MODELS)[:2], [1, 16, 256]
        policies = lambda model: {"l2_keep50_b4": ("paper", ThresholdL2(0.5, layers=(4,)))}  # noqa: E731
        pipeline_names = BASELINES + OURS
        lossless = False
    elif suite == "graph":
        models, batches = list(MODELS)[:2], [1, 4, 16]
        policies = lambda model: {"l2_keep50_b4": ("paper", ThresholdL2(0.5, layers=(4,)))}  # noqa: E731
        pipeline_names = ("timm_eager", "timm_graph", "paper_fa2", "fa2_packed", "ragvit",
                     "ragvit_graph")
        lossless = False
    else:
        models, batches = list(MODELS)[:2], [1, 16, 256]
        policies = lambda model: {"l2_keep50_b4": ("paper", ThresholdL2(0.5, layers=(4,)))}  # noqa: E731
        pipeline_names = ("ragvit", "ragvit_graph", "ragvit_compiled")
        lossless = False
    if args.tiny:
        models, batches = ["DeiT-T 64"], [1, 2]
    models = args.models if args.models and not args.tiny else models
    batches = args.batches or batches
    return models, batches, policies, ctx.pipelines(pipeline_names), lossless


@contextlib.contextmanager
def _quiet_dynamicvit():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicViT: prediction modules are randomly")
        yield


if __name__ == "__main__":
    raise SystemExit(main())
