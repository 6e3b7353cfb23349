"""End-to-end benchmark of pruned timm ViTs: ragvit vs the pipelines PyTorch users have.

``python -m ragvit.bench [--config NAME] [--model deit_s] [--batches 1 16 64] ...`` runs one
named configuration (model, resolution, dtype, ThresholdL2 policy, batch sizes, pipelines),
checks every pipeline against the padded-masked reference first (max |dlogit|, top-1
agreement; "all results match" is printed before any number), then times it and prints a
table; ``--out PREFIX`` writes PREFIX.json and PREFIX.csv. Pipelines, same process, same
inputs:
  timm_eager   the unpruned timm model (its own forward)
  timm_graph   the same, replayed as one CUDA graph (GPU only)
  reference    ragvit.reference.vit_forward_reference: the same pruning on padded tensors
               with key-padding masks and SDPA (what users write without ragvit)
  paper_fa2    the paper's pipeline: its syncing packer (.item(), nonzero) and FA2 varlen
               attention on torch's modules (GPU only; ThresholdL2 keep, one pruning point)
  fa2_packed   ragvit's packed pipeline with torch's FA2 varlen as attention (GPU only)
  ragvit       ragvit.patch(model, policy), eager
  ragvit_graph the same through ragvit.cuda_graph: replayed as one CUDA graph per batch size
               (GPU only; data-dependent policies, e.g. --threshold, run in capacity mode)
GPU times come from CUDA events around each forward, CPU times from perf_counter; both are
medians with p20/p80. Models are random-init (pretrained=False; speed does not depend on
the weights, and nothing is downloaded). The functions are importable (see `run`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import glob
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = [
    "CONFIGS", "MODELS", "PIPELINES", "BenchConfig", "ConfigError", "check", "environment",
    "fa2_attention", "flat_rows", "graphed", "load_model", "load_result_folders", "load_results",
    "main", "make_pipeline", "make_policy", "max_err", "own_decisions_err", "paper_forward",
    "patched", "render_table", "run", "time_ms", "timm_forward", "write_results",
]

# Aliases for the timm names (any other timm VisionTransformer name works as well).
MODELS = {
    "deit_t": "deit_tiny_patch16_224",
    "deit_s": "deit_small_patch16_224",
    "deit_b": "deit_base_patch16_224",
    "deit_b384": "deit_base_patch16_384",
}
PIPELINES = ("timm_eager", "timm_graph", "reference", "paper_fa2", "fa2_packed", "ragvit",
             "ragvit_graph")
GPU_ONLY = ("timm_graph", "paper_fa2", "fa2_packed", "ragvit_graph")
UNPRUNED = ("timm_eager", "timm_graph")
DTYPES = ("fp32", "fp16", "bf16")
# max |dlogit| allowed against the reference (fp16: the patch issue's GPU criterion).
TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}
# The additive floor of check()'s fp32-relative rule (tests/conftest.py ERROR_FLOOR).
EXACT_FLOOR = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3}


@dataclass
class BenchConfig:
    """One benchmark run. Fields left None take a device-dependent default in `resolve`."""

    model: str = "deit_s"
    img_size: int | None = None
    dtype: str | None = None
    keep: float | None = 0.5
    threshold: float | None = None
    layers: tuple[int, ...] = (4,)
    batches: tuple[int, ...] | None = None
    pipelines: tuple[str, ...] | None = None
    device: str = "auto"
    warmup: int | None = None
    reps: int | None = None
    seed: int = 0
    threads: int | None = None

    def resolve(self) -> BenchConfig:
        """A copy with every None filled in for the device this process can use."""
        import torch

        from . import ops

        c = dataclasses.replace(self)
        if c.device == "auto":
            c.device = "cuda" if torch.cuda.is_available() and ops.cuda_available() else "cpu"
        gpu = c.device == "cuda"
        c.model = MODELS.get(c.model, c.model)
        if c.img_size is None:
            c.img_size = 384 if "_384" in c.model else 224
        c.dtype = c.dtype or ("fp16" if gpu else "fp32")
        c.batches = tuple(c.batches or ((1, 16, 64) if gpu else (1, 2)))
        c.pipelines = tuple(p for p in (c.pipelines or PIPELINES) if gpu or p not in GPU_ONLY)
        c.warmup = c.warmup if c.warmup is not None else (10 if gpu else 1)
        c.reps = c.reps if c.reps is not None else (50 if gpu else 5)
        return c

    @property
    def policy_name(self) -> str:
        mode = f"keep{self.keep:g}" if self.threshold is None else f"thr{self.threshold:g}"
        return f"l2_{mode}_b{'_'.join(map(str, self.layers))}"


# Named configurations (flags given next to --config override their fields).
CONFIGS = {
    "paper": BenchConfig(),  # DeiT-S 224, ThresholdL2 keep 50% after block 4
    "deit_b": BenchConfig(model="deit_b", batches=(1, 4, 16, 64, 256)),
    "deit_b384": BenchConfig(model="deit_b384", batches=(1, 16, 64)),
    "multistage": BenchConfig(keep=0.3, layers=(4, 7, 10)),
    "ragged": BenchConfig(keep=None, threshold=1.0),
    "tiny": BenchConfig(model="deit_t", img_size=64, dtype="fp32", device="cpu",
                        batches=(1, 2), warmup=1, reps=3, threads=1),
}


class ConfigError(ValueError):
    """A configuration that cannot run on its model (e.g. pruning layers past the depth)."""


# ---- pipelines ----


def make_policy(keep: float | None = 0.5, threshold: float | None = None,
                layers=(4,)):
    """ThresholdL2 with a fixed keep ratio (threshold None) or a per-image threshold."""
    from .pruning import ThresholdL2

    if threshold is not None:
        return ThresholdL2(threshold=threshold, layers=tuple(layers))
    return ThresholdL2(keep, layers=tuple(layers))


def load_model(name: str, img_size: int, dtype: str = "fp32", device: str = "cpu",
               seed: int = 0):
    """A random-init timm model (pretrained=False) in eval, cast to dtype on device."""
    import timm
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, img_size=img_size)
    return model.eval().to(device=device, dtype=_torch_dtype(dtype))


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def fa2_attention(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, out=None, cls_attn=None):
    """ragvit.attention's signature on torch's FA2 varlen kernel (no cls_attn)."""
    import torch

    if cls_attn is not None:
        raise ValueError("fa2_attention: FA2 varlen gives no cls_attn")
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale)[0]


def paper_forward(model, x, policy, attention=None, *, return_decisions: bool = False):
    """The paper's pruned pipeline, as its code runs it: timm's blocks on the padded batch up
    to the pruning point, then the paper's packer (counts, cumsum, ``.item()`` for the total
    and for max_seqlen, ``nonzero``, ``index_select``: two host syncs, data-dependent shapes,
    so no CUDA graph) and the remaining blocks on packed rows with torch's modules and FA2
    varlen attention. The baseline of issue 6's batch-1 target; its decisions equal
    ThresholdL2's (ties keep the earlier token).

    Args:
        model: a timm VisionTransformer with a class token, in eval.
        x: (B, 3, H, W) images.
        policy: ThresholdL2 with a fixed keep ratio and one pruning point.
        attention: ragvit.attention's signature (default fa2_attention; tests pass a CPU one).
        return_decisions: also return its decision, [keep] with keep the (B, N) bool mask of
            kept tokens (forward_with_decisions' format, for vit_forward_reference).

    Returns:
        (B, num_classes) logits, or (logits, [keep]) with return_decisions.

    Raises:
        ValueError: another policy, or more than one pruning point.
    """
    import torch

    from .pruning import ThresholdL2, kept_count

    if not isinstance(policy, ThresholdL2) or policy.keep is None or len(policy.layers) != 1:
        raise ValueError(f"paper_forward: the paper's pipeline prunes once with a fixed keep "
                         f"ratio (ThresholdL2(keep=r, layers=(i,))), got {policy!r}")
    attention = fa2_attention if attention is None else attention
    layer, P = policy.layers[0], int(model.num_prefix_tokens)
    h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    for blk in model.blocks[:layer]:
        h = blk(h)
    B, N, C = h.shape
    scores = torch.linalg.vector_norm(h[:, P:], dim=-1, dtype=torch.float32)
    # stable descending sort: equal scores keep the earlier token, as topk_selection does
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices
    top = top[:, :kept_count(policy.keep[0], N - P)] + P
    keep = torch.zeros(B, N, dtype=torch.bool, device=h.device)
    keep[:, :P] = True
    keep.scatter_(1, top, True)
    counts = keep.sum(1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    total = int(cu_seqlens[-1].item())  # host sync 1
    max_seqlen = int(counts.max().item())  # host sync 2
    rows = h.reshape(B * N, C).index_select(0, keep.reshape(-1).nonzero().squeeze(1))
    for blk in model.blocks[layer:]:
        attn = blk.attn
        qkv = attn.qkv(blk.norm1(rows)).view(total, 3, attn.num_heads, attn.head_dim)
        q, k, v = qkv.unbind(1)
        o = attention(q, k, v, cu_seqlens, max_seqlen, scale=attn.scale)
        o = attn.proj_drop(attn.proj(o.reshape(total, attn.attn_dim)))
        rows = rows + blk.drop_path1(blk.ls1(o))
        rows = rows + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(rows))))
    first = cu_seqlens[:-1].long()[:, None] + torch.arange(P, device=rows.device)
    logits = model.forward_head(model.norm(rows[first]))
    return (logits, [keep]) if return_decisions else logits


@contextlib.contextmanager
def patched(model, policy, attention=None):
    """ragvit.patch for the duration of a with block. With a replacement attention (the
    FA2 pipelines) the blocks keep torch's LayerNorm / Linear / GELU modules, as a user
    writing that pipeline would (fused_ops=False); ragvit itself runs with patch's default
    (its fused row ops on CUDA, torch's modules on the CPU)."""
    from . import timm_patch

    timm_patch.patch(model, policy, attention=attention,
                     fused_ops=None if attention is None else False)
    try:
        yield model
    finally:
        timm_patch.unpatch(model)


def timm_forward(model, x):
    """The unpatched timm forward, whatever instance attribute patch() set."""
    return type(model).forward(model, x)


def graphed(fn, x):
    """fn(static_x) captured as one CUDA graph; returns run(inp=x) that copies in, replays."""
    import torch

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)

    def run(inp=x):
        static_x.copy_(inp)
        graph.replay()
        return out

    run.graph = graph  # keep the graph alive as long as the callable
    return run


@contextlib.contextmanager
def make_pipeline(name: str, model, policy, x):
    """Yields a no-argument callable running pipeline `name` on x (patching inside the block)."""
    from . import reference

    if name == "timm_eager":
        yield lambda: timm_forward(model, x)
    elif name == "timm_graph":
        yield graphed(lambda inp: timm_forward(model, inp), x)
    elif name == "reference":
        yield lambda: reference.vit_forward_reference(model, x, policy)
    elif name == "fa2_packed":
        with patched(model, policy, attention=fa2_attention):
            yield lambda: model(x)
    elif name == "paper_fa2":
        yield lambda: paper_forward(model, x, policy)
    elif name == "ragvit":
        with patched(model, policy):
            yield lambda: model(x)
    elif name == "ragvit_graph":
        from .graph import cuda_graph

        with patched(model, policy):
            # clone_output=False: the static output, like timm_graph (`graphed`) returns.
            run = cuda_graph(model, clone_output=False)
            run(x)  # capture now, as `graphed` does, so no timed call includes it
            yield lambda: run(x)
    else:
        raise ValueError(f"unknown pipeline {name!r}; choose from {', '.join(PIPELINES)}")


def max_err(a, b) -> float:
    """max |a - b| over all elements, computed in float64 (a and b: tensors of one shape)."""
    return float((a.double() - b.double()).abs().max())


def _replay_err(model, x, policy, logits, decided) -> float:
    """max |dlogit| of a pipeline's logits against the reference replaying its decisions."""
    from . import reference

    return max_err(logits, reference.vit_forward_reference(model, x, policy, decisions=decided))


def own_decisions_err(model, x, policy, attention) -> float:
    """max |dlogit| of ragvit's packed pipeline with a replacement attention (an FA2
    pipeline) against the reference replaying that pipeline's own decisions."""
    from . import timm_patch

    with patched(model, policy, attention=attention):
        logits, decided = timm_patch.forward_with_decisions(model, x)
    return _replay_err(model, x, policy, logits, decided)


def check(model, x, policy, pipelines, dtype: str = "fp32") -> dict:
    """Every pipeline's max |dlogit| against the padded-masked reference, before timing.

    Pruned pipelines compare with the reference replaying their decisions (so numerical
    noise cannot flip a choice): ragvit's for ragvit and ragvit_graph, their own for
    paper_fa2 and fa2_packed (torch's modules may rank a near-tie the other way in
    fp16); unpruned ones with the unpruned reference.

    Returns:
        {"err": {pipeline: float or None}, "unavailable": {pipeline: reason},
         "err_exact": {pipeline: float} and "err_reference_exact" (fp16/bf16 only),
         "decisions_agree", "top1_agree" (ragvit vs reference), "kept_fraction", "ok"}.
        ok: every pipeline that ran (in fp16/bf16 the reference on its own decisions
        excepted: near-ties may flip them) is within TOLERANCE[dtype] of the reference, or, in
        fp16/bf16, a pruned pipeline that is not is at least as close to the truth as the
        reference itself by flash-attention's rule: against the same forward in fp32 (an
        fp32 copy of the model, same decisions), err_exact <= 2 * err_reference_exact +
        EXACT_FLOOR[dtype] (ragvit's fused row ops add the residual before rounding, so at large
        widths and batches it can sit just past TOLERANCE from the fp16 reference while
        being closer to fp32 than that reference is); ragvit ran; and ragvit's top-1
        equals the reference's wherever the reference has no near-tie. A baseline that
        cannot run here (e.g. FA2 in fp32) is listed in "unavailable", not failed.
    """
    import copy

    from . import reference, timm_patch

    with patched(model, policy):
        ours, decided = timm_patch.forward_with_decisions(model, x)
    replayed = reference.vit_forward_reference(model, x, policy, decisions=decided)
    ref, ref_decided = reference.vit_forward_reference(model, x, policy, return_decisions=True)
    dense = None
    err, unavailable, pruned_logits = {}, {}, {}
    for name in pipelines:
        try:
            # the baselines against the reference replaying their own decisions
            if name == "fa2_packed":
                err[name] = own_decisions_err(model, x, policy, fa2_attention)
                continue
            if name == "paper_fa2":
                logits, own = paper_forward(model, x, policy, return_decisions=True)
                err[name] = _replay_err(model, x, policy, logits, own)
                continue
            with make_pipeline(name, model, policy, x) as fn:
                logits = fn()
            if name in UNPRUNED:
                if dense is None:
                    dense = reference.vit_forward_reference(model, x, None)
                err[name] = max_err(logits, dense)
            elif name == "reference":
                err[name] = max_err(ref, replayed)
            else:
                err[name] = max_err(logits, replayed)
                pruned_logits[name] = logits.clone()  # a graph's static output gets reused
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            unavailable[name] = f"{type(e).__name__}: {e}"
            err[name] = None
    agree = ours.argmax(1) == replayed.argmax(1)
    tol = TOLERANCE[dtype]
    err_exact, err_reference_exact = {}, None
    if dtype != "fp32" and any(e is not None and e > tol for e in err.values()):
        model32 = copy.deepcopy(model).float()
        exact = reference.vit_forward_reference(model32, x.float(), policy, decisions=decided)
        del model32
        err_reference_exact = max_err(replayed, exact)
        err_exact = {name: max_err(lg, exact) for name, lg in pruned_logits.items()}

    def within(name, e):
        if e is None or e <= tol:
            return True
        return (name in err_exact
                and err_exact[name] <= 2 * err_reference_exact + EXACT_FLOOR[dtype])

    # A top-1 flip counts only where the reference's top-2 margin exceeds 2 * tolerance
    # (random-init models have near-ties that rounding may legitimately flip).
    top2 = replayed.double().topk(2, dim=1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * tol
    # "reference" is the reference on its own decisions against it replaying ragvit's: in
    # fp16/bf16 a near-tie in the scores may flip a decision (reported: decisions_agree).
    judged = {n: e for n, e in err.items() if dtype == "fp32" or n != "reference"}
    ok = (all(within(name, e) for name, e in judged.items())
          and err.get("ragvit", 0.0) is not None and bool((agree | near_tie).all()))
    return {
        "err": err,
        "unavailable": unavailable,
        "err_exact": err_exact,
        "err_reference_exact": err_reference_exact,
        "err_ragvit_vs_reference": max_err(ours, replayed),
        "decisions_agree": all(bool((a == b).all())
                               for a, b in zip(decided, ref_decided, strict=True)),
        "top1_agree": float(agree.float().mean()),
        "kept_fraction": float(timm_patch.kept_mask(decided[-1]).float().mean()),
        "tolerance": tol,
        "ok": ok,
    }


# ---- timing ----


def time_ms(fn, device: str, warmup: int, reps: int) -> dict:
    """ms per fn(): CUDA events around each call on GPU, perf_counter on CPU.

    Returns:
        {"median", "p20", "p80"} in milliseconds over `reps` calls after `warmup` calls.
    """
    import torch

    gpu = device == "cuda"
    for _ in range(warmup):
        fn()
    if gpu:
        torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        if gpu:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    if len(samples) == 1:
        samples *= 2
    q = statistics.quantiles(samples, n=10, method="inclusive")
    return {"median": statistics.median(samples), "p20": q[1], "p80": q[7]}


def _progress(total: int, enabled: bool):
    """A tqdm bar on stderr, or a stand-in with update/close when tqdm is missing."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc="ragvit.bench", file=sys.stderr, leave=False)
        except ImportError:
            pass

    class _Quiet:
        def update(self, n=1):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    return _Quiet()


def run(config: BenchConfig | None = None, *, progress: bool = True, log=print) -> dict:
    """Checks, then times, one configuration.

    Args:
        config: what to run (None: the paper's configuration on the best device).
        progress: show a tqdm bar over the sweep (silently off without tqdm).
        log: where progress lines go (print, or a no-op).

    Returns:
        {"config": resolved fields, "env": environment(), "rows": [one per batch size:
         {"batch", "check": check(...), "timing": {pipeline: {"ms": {...}, "images_per_s"}}}],
         "failed": number of batch sizes failing the check (those are not timed)}.
    """
    import torch

    c = (config or BenchConfig()).resolve()
    if c.threads:
        torch.set_num_threads(c.threads)
    if c.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    model = load_model(c.model, c.img_size, c.dtype, c.device, c.seed)
    try:
        policy = make_policy(c.keep, c.threshold, c.layers)
        policy.check(len(model.blocks))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    gen = torch.Generator(device="cpu").manual_seed(c.seed)
    inputs = {b: torch.randn(b, 3, c.img_size, c.img_size, generator=gen).to(
        c.device, _torch_dtype(c.dtype)) for b in c.batches}
    rows = []
    bar = _progress(len(c.batches) * (1 + len(c.pipelines)), progress)
    if log is print and hasattr(bar, "write"):
        log = bar.write  # tqdm.write: lines above the bar instead of through it
    try:
        with torch.inference_mode():
            for b in c.batches:
                bar.set_postfix_str(f"check BS {b}")
                row = {"batch": b, "check": check(model, inputs[b], policy, c.pipelines, c.dtype)}
                rows.append(row)
                bar.update()
                errs = ", ".join(f"{n} {e:.2e}" if e is not None else f"{n} n/a"
                                 for n, e in row["check"]["err"].items())
                log(f"BS {b}: max |dlogit| vs reference: {errs}; top-1 agreement "
                    f"{row['check']['top1_agree']:.3f}; kept {row['check']['kept_fraction']:.3f}")
                for name, why in row["check"]["unavailable"].items():
                    log(f"  {name} unavailable: {why[:200]}")
            failed = sum(not r["check"]["ok"] for r in rows)
            log("all results match" if not failed
                else f"{failed} batch sizes FAILED correctness (not timed)")
            for row in rows:
                row["timing"] = {}
                for name in c.pipelines:
                    bar.set_postfix_str(f"{name} BS {row['batch']}")
                    if row["check"]["ok"] and row["check"]["err"][name] is not None:
                        with make_pipeline(name, model, policy, inputs[row["batch"]]) as fn:
                            ms = time_ms(fn, c.device, c.warmup, c.reps)
                        row["timing"][name] = {
                            "ms": ms, "images_per_s": row["batch"] / (ms["median"] / 1e3)}
                    bar.update()
    finally:
        bar.close()
    cfg = dataclasses.asdict(c)
    cfg["policy"] = c.policy_name
    return {"config": cfg, "env": environment(c.device), "rows": rows, "failed": failed}


# ---- reporting ----


def environment(device: str = "cpu") -> dict:
    """Device, driver, CUDA, torch, timm, ragvit version and git SHA of this run."""
    import torch

    from . import __version__

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
    gpu = device == "cuda"
    here = os.path.dirname(os.path.abspath(__file__))
    cpu = platform.processor() or platform.machine()
    return {
        "device": torch.cuda.get_device_name() if gpu else f"CPU ({cpu}, {os.cpu_count()} cores)",
        "threads": torch.get_num_threads(),
        "driver": sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        if gpu else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "timm": timm_version,
        "ragvit": __version__,
        # The GPU machine gets a copy of the tree without .git: pass RAGVIT_GIT_SHA there.
        "git_sha": os.environ.get("RAGVIT_GIT_SHA")
        or sh(["git", "-C", here, "rev-parse", "--short", "HEAD"]),
        "python": sys.version.split()[0],
    }


def render_table(result: dict) -> str:
    """Markdown: one row per batch size, images/s per pipeline and ragvit's speedups."""
    c, env = result["config"], result["env"]
    names = list(c["pipelines"])
    head = ["BS", "kept", "max dlogit ragvit", "top-1 agree"] + [f"{n} img/s" for n in names]
    base = [n for n in ("timm_eager", "fa2_packed", "reference") if n in names and n != "ragvit"]
    head += [f"ragvit / {n}" for n in base if "ragvit" in names]
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
    out = []  # bench_e2e.py: fp16, rows of {model, policy, batch, check, timing}
    for r in data["rows"]:
        for name, t in r.get("timing", {}).items():
            out.append({
                "model": r["model"], "img_size": None, "dtype": "fp16", "policy": r["policy"],
                "device": data["env"].get("gpu"), "batch": r["batch"], "pipeline": name,
                "kept_fraction": r["check"]["kept_fraction_last_stage"],
                "max_dlogit": r["check"].get("err_ragvit_vs_reference") if name == "ragvit"
                else None,
                "ms_median": t["ms"]["median"], "ms_p20": t["ms"]["p20"],
                "ms_p80": t["ms"]["p80"], "images_per_s": t["images_per_s"],
            })
    return out


def load_result_folders(folders, log=print) -> list[dict]:
    """load_results of every *.json in `folders` (in order), each row tagged with "suite":
    "sweep" for `write_results` files, else its bench_e2e suite. A bench_e2e suite comes
    from the first file that has it, so a fresh run's folder listed before the committed
    results wins and no suite is counted twice. Within a folder, files holding fewer suites
    come first (then by name): a one-suite re-run (gpu_check's e2e_<suite>_h200) supersedes
    that suite of an every-suite run (e2e_h200). JSON that is neither is ignored. `log`
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
                rows += [dict(r, suite="sweep") for r in load_results(path)]
                log(f"loaded {path}")
                continue
            if not (head.get("rows") and any("timing" in r for r in head["rows"])):
                continue
            flat = load_results(path)  # one per (row, pipeline), in file order
            new = set(suites) - seen
            if not new:
                log(f"skipped {path} (its suites came from an earlier file)")
                continue
            rows += [dict(r, suite=s) for r, s in zip(flat, suites, strict=True) if s in new]
            seen |= new
            log(f"loaded {path} suites: {', '.join(sorted(new))}")
    return rows


def write_results(prefix: str, result: dict) -> list[str]:
    """Writes PREFIX.json (everything) and PREFIX.csv (flat_rows); returns the paths."""
    os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(result, f, indent=1, default=lambda v: float(v) if hasattr(v, "__float__")
                  else str(v))
    rows = flat_rows(result)
    with open(prefix + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return [prefix + ".json", prefix + ".csv"]


# ---- command line ----


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ragvit.bench",
        description="Check, then time, pruned timm ViT pipelines (ragvit vs timm, the "
                    "padded reference and FA2 varlen).",
        epilog="configs: " + "; ".join(
            f"{k}: {v.model} keep={v.keep} thr={v.threshold} layers={v.layers}"
            for k, v in CONFIGS.items()))
    p.add_argument("--config", choices=list(CONFIGS), default="paper",
                   help="named configuration; the flags below override its fields")
    p.add_argument("--model", help=f"timm name or alias ({', '.join(MODELS)})")
    p.add_argument("--img-size", type=_positive_int, help="resolution (default: the model's)")
    p.add_argument("--dtype", choices=DTYPES, help="default fp16 on GPU, fp32 on CPU")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--keep", type=_ratio, help="ThresholdL2 fixed keep ratio")
    mode.add_argument("--threshold", type=_positive_float,
                      help="ThresholdL2 per-image threshold (ragged counts)")
    p.add_argument("--layers", type=int, nargs="+", help="pruning points (block indices)")
    p.add_argument("--batches", type=_positive_int, nargs="+", help="batch sizes")
    p.add_argument("--pipelines", nargs="+", choices=PIPELINES,
                   help="default: all that the device runs")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--warmup", type=int, help="warm-up calls per figure")
    p.add_argument("--reps", type=_positive_int, help="timed calls per figure")
    p.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="write OUT.json and OUT.csv")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return p


def config_from_args(args, p: argparse.ArgumentParser) -> BenchConfig:
    """The named config with the given flags applied; bad combinations are usage errors."""
    c = dataclasses.replace(CONFIGS[args.config])
    for name in ("model", "img_size", "dtype", "device", "warmup", "reps", "threads", "seed"):
        if getattr(args, name) is not None:
            setattr(c, name, getattr(args, name))
    if args.keep is not None:
        c.keep, c.threshold = args.keep, None
    if args.threshold is not None:
        c.keep, c.threshold = None, args.threshold
    for name in ("layers", "batches", "pipelines"):
        if getattr(args, name):
            setattr(c, name, tuple(getattr(args, name)))
    if c.warmup is not None and c.warmup < 0:
        p.error("--warmup must be >= 0")
    try:
        import timm
        import torch
    except ImportError as e:
        p.error(f"needs torch and timm (pip install -r requirements-test.txt): {e}")
    name = MODELS.get(c.model, c.model)
    if not timm.is_model(name):
        p.error(f"--model: unknown timm model or alias {c.model!r} "
                f"(aliases: {', '.join(MODELS)})")
    if c.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible to torch")
    if c.device == "cuda":
        from . import ops

        if not ops.cuda_available():
            p.error("--device cuda: this ragvit build has no CUDA kernels")
    if c.pipelines and (c.device == "cpu" or not torch.cuda.is_available()):
        gpu_only = [n for n in c.pipelines if n in GPU_ONLY]
        if gpu_only:
            p.error(f"--pipelines {' '.join(gpu_only)}: GPU only")
    return c


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    config = config_from_args(args, p)
    try:
        result = run(config, progress=not args.no_progress)
    except ConfigError as e:
        p.error(str(e))
    print(render_table(result))
    if args.out:
        for path in write_results(args.out, result):
            print(f"wrote {path}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
