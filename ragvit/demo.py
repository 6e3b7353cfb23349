"""The main job, for now: ragged attention on DeiT-S geometry after 50% token pruning.

Runs ``ragvit.attention`` on the best device available (CUDA through torch when both
are present, else NumPy on the CPU), prints the error against a float64 per-sequence
reference and the host time per call. ``python -m ragvit.demo [--batch B]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ragvit


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


def host_us_per_call(fn, calls):
    """Median host time of one call over `calls` back-to-back calls, in µs."""
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return float(np.median(samples)) / 1e3


def make_runner(q, k, v, cu, lengths):
    """(device name, run() -> out, fetch(out) -> float32 NumPy) on the best device."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available() and ragvit.cuda_available():
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="images (sequences)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be >= 1")

    rng = np.random.default_rng(args.seed)
    heads, head_dim = 6, 64  # DeiT-S
    lengths = np.clip(rng.normal(99, 20, args.batch).round(), 1, 197).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    qkv = rng.standard_normal((total, 3, heads, head_dim)).astype(np.float16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    scale = head_dim**-0.5

    device, run, fetch = make_runner(q, k, v, cu, lengths)
    result = fetch(run())
    ref = reference(q, k, v, cu, scale)
    err = float(np.abs(result - ref).max())
    calls = 20 if device == "cpu (NumPy)" else 2000
    us = host_us_per_call(run, calls)
    fetch(run())
    print(f"ragvit {ragvit.__version__} on {device}")
    print(f"batch {args.batch}, {total} tokens (lengths {lengths.min()}..{lengths.max()}), "
          f"H={heads}, D={head_dim}, float16")
    print(f"max |ragvit - float64 reference| = {err:.2e}  ({'ok' if err < 2e-3 else 'TOO LARGE'})")
    print(f"host time per call: {us:.2f} µs (median of {calls})")
    return 0 if err < 2e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
