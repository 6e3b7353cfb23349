"""A/B of ragvit.attention builds on single rows of benchmarks/bench_attention.py.

Each call times ragvit (out= given) and padded SDPA without a mask on the same data, as
bench_attention.py does (CUDA-graph replay of 20 calls, L2 flushed per replay), in the
order ragvit, SDPA, ragvit, and prints one line a row: both ragvit figures, SDPA's and the
ratio of the faster ragvit figure to SDPA's. SDPA is the anchor that makes runs of
different builds comparable: run this once per build (scripts/build_variant.sh), each
build's package first on PYTHONPATH, alternating builds over rounds, e.g.
    for r in 1 2; do for v in base new; do
        (cd / && PYTHONPATH=$ROOT/ab/$v python3 $ROOT/scripts/ab_attention_rows.py --tag $v)
    done; done
Rows: MODEL:DIST:S, with DIST a bench_attention distribution or allN (every length N).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

DEFAULT_ROWS = (
    "DeiT-B:deit384_full:32",
    "DeiT-B:deit224_keep100:256",
    "DeiT-S:deit224_keep50:256",
    "DeiT-S:deit384_full:32",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="ragvit", help="label of this build in the output")
    parser.add_argument("--reps", type=int, default=50, help="graph replays per figure")
    parser.add_argument("rows", nargs="*", default=DEFAULT_ROWS, help="MODEL:DIST:S")
    args = parser.parse_args(argv)
    import torch

    try:
        import ragvit
    except ImportError as err:
        parser.error(f"ragvit is not importable ({err}): put a build first on PYTHONPATH")
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    import bench_attention as ba

    from ragvit.bench import timing

    flusher = timing.L2Flusher()
    for row in args.rows:
        try:
            model, dist, num_seqs = row.split(":")
            num_seqs = int(num_seqs)
            fixed = int(dist[3:]) if dist.startswith("all") else 0
            if model not in ba.MODELS or num_seqs < 1 or (dist.startswith("all") and fixed < 1):
                raise ValueError
            lengths = (
                np.full(num_seqs, fixed, dtype=np.int32)
                if fixed
                else ba.lengths_for(dist, num_seqs, 0)  # an unknown distribution raises
            )
        except (ValueError, IndexError):
            parser.error(
                f"bad row {row!r}: want MODEL:DIST:S, MODEL one of {list(ba.MODELS)}, DIST a "
                "bench_attention distribution or allN"
            )
        case = ba.Case(model, dist, num_seqs, lengths=lengths)
        ours = [timing.gpu_us_graph(case.ragvit_out, flusher=flusher, reps=args.reps).median]
        sdpa = timing.gpu_us_graph(case.sdpa, flusher=flusher, reps=args.reps).median
        ours.append(timing.gpu_us_graph(case.ragvit_out, flusher=flusher, reps=args.reps).median)
        print(
            f"{args.tag:8s} {model} {dist:16s} S={num_seqs:3d} ragvit {ours[0]:7.1f} "
            f"{ours[1]:7.1f} sdpa {sdpa:7.1f} ratio {min(ours) / sdpa:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
