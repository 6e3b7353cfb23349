"""Where a patched forward's GPU time goes: the CUDA kernels of one forward, grouped by name.

``python benchmarks/profile_e2e.py [--model deit_small_patch16_224] [--batch 1] [--keep 0.5]
[--row-ops auto|on|off] [--pipeline ragvit]`` runs ThresholdL2 keep `keep` after block 4 (the
paper's setting; --keep 1 for no policy) in fp16 under torch.profiler after warm-ups, and
prints one row per kernel name: calls per forward, total and mean µs, share of the forward's
kernel time; then the kernel count and sum, and the host time of one forward
(ragvit.bench.timing.host_us: median of 20, each forward starting from an empty queue).
--pipeline profiles another pipeline of ragvit.bench.pipelines on the same model and policy
instead of the patched model (e.g. dense_gather_compiled, the strongest alternative for fixed
counts; compiled pipelines compile first, as the benchmarks do); --row-ops is ragvit's alone.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict

from ragvit.bench import pipelines, timing


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--keep", type=float, default=0.5)
    p.add_argument("--row-ops", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--reps", type=int, default=5, help="profiled forwards (figures are per one)")
    p.add_argument("--pipeline", default="ragvit", choices=pipelines.PIPELINES,
                   help="the pipeline to profile (ragvit: ragvit.patch with --row-ops)")
    args = p.parse_args(argv)

    import timm
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ragvit.pruning import ThresholdL2

    model = timm.create_model(args.model, pretrained=False).eval().cuda().half()
    size = model.patch_embed.img_size[0]
    x = torch.randn(args.batch, 3, size, size, device="cuda", dtype=torch.float16)
    policy = None if args.keep >= 1 else ThresholdL2(args.keep, layers=(4,))
    with torch.inference_mode(), forward(args, model, policy, x) as run:
        host = timing.host_us(run, calls=20, warmup=10, sync_every=1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                run()
            torch.cuda.synchronize()
    per_name = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_name[ev.name][0] += 1
            per_name[ev.name][1] += ev.device_time
    total = sum(v[1] for v in per_name.values()) / args.reps
    count = sum(v[0] for v in per_name.values()) / args.reps
    print(f"{args.model} batch {args.batch} keep {args.keep} "
          + (f"row_ops={args.row_ops}" if args.pipeline == "ragvit" else args.pipeline))
    print(f"{'calls':>6} {'total us':>9} {'mean us':>8} {'share':>6}  kernel")
    for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{n / args.reps:6.1f} {us / args.reps:9.1f} {us / n:8.2f} "
              f"{us / args.reps / total:6.1%}  {name[:110]}")
    print(f"kernels per forward {count:.0f}, kernel time {total:.1f} us, host time per "
          f"forward {host.median:.0f} us (median of 20)")


@contextlib.contextmanager
def forward(args, model, policy, x):
    """A no-argument callable running one forward of args.pipeline on x."""
    import ragvit

    if args.pipeline != "ragvit":
        with pipelines.make_pipeline(args.pipeline, model, policy, x) as run:
            yield run
        return
    row_ops = {"auto": None, "on": True, "off": False}[args.row_ops]
    ragvit.patch(model, policy, row_ops=row_ops)
    try:
        yield lambda: model(x)
    finally:
        ragvit.unpatch(model)


if __name__ == "__main__":
    main()
