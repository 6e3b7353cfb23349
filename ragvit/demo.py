"""The main job: a DeiT-S pruned by ragvit, verified against the reference, then timed.

``python -m ragvit.demo`` builds a random-init DeiT-S (pretrained=False: nothing is
downloaded), patches it with the default pruning policy (ThresholdL2, keep 50% of the
patch tokens after block 4), checks the packed pipeline against the padded-masked
reference (max |dlogit|, top-1 agreement), and prints the speed table for the device
there is: on a GPU fp16 at batch 1/16/64 for every pipeline of ``ragvit.bench``; on the
CPU a small fp32 run at batch 1 and 2. ``python -m ragvit.demo --attention [--batch B]``
runs the op-level example instead: ``ragvit.attention`` on DeiT-S geometry after 50%
pruning against a float64 per-sequence reference, with the host time per call
(ragvit.bench.timing.host_us). That example needs only NumPy: its reference is NumPy
float64 (ragvit.reference needs torch) and the timer imports no torch.
``--device cpu|cuda`` picks the device for either (default: the best there is). What the
machine lacks for a run (a CUDA GPU or driver, ragvit's CUDA kernels, torch and timm for
the model demo) is an argparse usage error, exit 2, with one line naming it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ragvit
from ragvit.bench import timing


def reference(q, k, v, cu_seqlens, scale):
    """float64 attention one sequence at a time (no padding, no masks)."""
    out = np.zeros(q.shape, dtype=np.float64)
    for s in range(len(cu_seqlens) - 1):
        a, b = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        qs, ks, vs = (t[a:b].astype(np.float64).transpose(1, 0, 2) for t in (q, k, v))
        logits = scale * qs @ ks.transpose(0, 2, 1)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out[a:b] = ((p / p.sum(-1, keepdims=True)) @ vs).transpose(1, 0, 2)
    return out


def make_runner(q, k, v, cu, lengths, device="auto"):
    """(device name, run() -> out, fetch(out) -> float32 NumPy) on `device` ("auto": the
    best there is; "cuda" was checked by main)."""
    try:
        import torch
    except ImportError:
        torch = None
    if device == "cuda" or (device == "auto" and torch is not None
                            and torch.cuda.is_available() and ragvit.cuda_available()):
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(t)).cuda() for t in (q, k, v))
        tcu, out = torch.from_numpy(cu).cuda(), torch.empty_like(tq)
        max_seqlen = int(lengths.max())

        def fetch_cuda(o):
            torch.cuda.synchronize()
            return o.float().cpu().numpy()

        return (torch.cuda.get_device_name(),
                lambda: ragvit.attention(tq, tk, tv, tcu, max_seqlen, out=out), fetch_cuda)
    out = np.empty_like(q)
    return ("cpu (NumPy)", lambda: ragvit.attention(q, k, v, cu, out=out),
            lambda o: o.astype(np.float32))


def attention_demo(batch: int, seed: int, device: str = "auto") -> int:
    """The op-level example: ragged attention vs a float64 reference, host µs per call."""
    rng = np.random.default_rng(seed)
    heads, head_dim = 6, 64  # DeiT-S
    lengths = np.clip(rng.normal(99, 20, batch).round(), 1, 197).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    qkv = rng.standard_normal((total, 3, heads, head_dim)).astype(np.float16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    scale = head_dim**-0.5

    device, run, fetch = make_runner(q, k, v, cu, lengths, device)
    result = fetch(run())
    ref = reference(q, k, v, cu, scale)
    err = float(np.abs(result - ref).max())
    calls = 20 if device == "cpu (NumPy)" else 2000
    us = timing.host_us(run, calls, warmup=0).median  # run() above was the warm-up
    fetch(run())
    print(f"ragvit {ragvit.__version__} on {device}")
    print(f"batch {batch}, {total} tokens (lengths {lengths.min()}..{lengths.max()}), "
          f"H={heads}, D={head_dim}, float16")
    print(f"max |ragvit - float64 reference| = {err:.2e}  ({'ok' if err < 2e-3 else 'TOO LARGE'})")
    print(f"host time per call: {us:.2f} µs (median of {calls})")
    return 0 if err < 2e-3 else 1


def model_demo(seed: int, device: str) -> int:
    """Patch a DeiT-S with the default policy, verify against the reference, time it."""
    import torch

    from . import bench

    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available()
                               and ragvit.cuda_available())
    config = bench.BenchConfig(model="deit_s", keep=0.5, layers=(4,), seed=seed,
                               device="cuda" if gpu else "cpu")
    if not gpu:  # ~0.1 s per image on one slow core: keep it small
        config.batches, config.warmup, config.reps = (1, 2), 1, 3
        # One thread: on a shared 2-core box, two torch threads run 10x slower than one
        # whenever anything else is busy (barrier spinning); a steady figure matters more.
        config.threads = 1
    where = torch.cuda.get_device_name() if gpu else "the CPU (1 torch thread)"
    print(f"ragvit {ragvit.__version__}: DeiT-S 224 (random init), ThresholdL2 keep 50% after "
          f"block 4, on {where}")
    t0 = time.perf_counter()
    result = bench.run(config, progress=False,
                       log=lambda line: print("  " + line, flush=True))
    checks = [r["check"] for r in result["rows"]]
    images = sum(r["batch"] for r in result["rows"])
    worst = max(c["err_ragvit_vs_reference"] for c in checks)
    top1 = sum(c["top1_agree"] * r["batch"] for c, r in zip(checks, result["rows"],
                                                              strict=True)) / images
    tol = checks[0]["tolerance"]
    print(f"ragvit vs the padded-masked reference: max |dlogit| {worst:.2e} (tolerance "
          f"{tol:g}), top-1 agreement {top1:.0%} over {images} images, decisions agree: "
          f"{all(c['decisions_agree'] for c in checks)}")
    print()
    print(bench.render_table(result))
    if not gpu:
        print("CPU figures show that the pipelines run and agree; ragvit's kernels are for the "
              "GPU (README: measured H200 figures; scripts/gpu_check.sh on a GPU machine).")
    print(f"done in {time.perf_counter() - t0:.1f} s. More: python -m ragvit.bench --help")
    return 1 if result["failed"] else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ragvit.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--attention", action="store_true",
                        help="run the op-level ragged-attention example instead")
    parser.add_argument("--batch", type=int, default=32,
                        help="images (sequences) for --attention")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    if not args.attention:
        try:
            import timm  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            parser.error(f"the model demo needs torch and timm: pip install 'ragvit[bench]' "
                         f"(or run the NumPy-only `python -m ragvit.demo --attention`): {e}")
    if args.device == "cuda" and (problem := cuda_problem()):
        parser.error(f"--device cuda: {problem}")
    if args.attention:
        return attention_demo(args.batch, args.seed, args.device)
    return model_demo(args.seed, args.device)


def cuda_problem() -> str | None:
    """Why --device cuda cannot run here (one line), or None when it can."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "the CUDA path needs torch: pip install 'ragvit[bench]'"
    from .bench.sweep import cuda_problem as bench_cuda_problem

    return bench_cuda_problem()


if __name__ == "__main__":
    raise SystemExit(main())
