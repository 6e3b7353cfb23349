"""Data-parallel pruned-ViT inference: one ragvit replica per rank, launched by torchrun.

``torchrun --nproc-per-node N benchmarks/bench_distributed.py [--model deit_b] [--batch 256]
[--batches-per-rank 4] [--passes 5] [--graph] [--one-gpu-ips X] [--out PREFIX]`` (add
``--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` on every machine for several;
run alone, without torchrun, it is a one-rank job). Each rank builds the same random-init
model (seeded), patches it (ThresholdL2 keep 50% after block 4 by default) on its own device
(cuda:LOCAL_RANK, or the CPU), and serves its shard of a fixed, seeded set of
WORLD_SIZE x --batches-per-rank batches (batch i to rank i mod WORLD_SIZE):

1. Check: every rank's logits on its first batch against ragvit.reference's padded forward
   replaying its decisions (ragvit.bench.pipelines.check), and every rank's logits on batch
   0 (the same images everywhere) against rank 0's. Rank 0 prints each rank's max |dlogit|
   and "all results match" before any figure; a failed check exits 1 on every rank.
2. One GPU: rank 0 times its shard alone while the other ranks wait at a barrier (skipped
   when --one-gpu-ips gives that figure, e.g. from a one-rank job on the same machine).
3. All ranks: --passes timed passes over their shards, each pass between barriers, synchronized
   at its end. A rank's images/s is its shard's images over its median pass time; the
   aggregate is all ranks' images over the slowest rank's time in each pass (median over
   passes); scaling efficiency = aggregate / (WORLD_SIZE x one GPU's images/s).

The ranks exchange only their reports (Python objects through torch.distributed: gloo on the
CPU, NCCL on GPUs unless --backend says otherwise); no tensor crosses devices during the
timed passes. --out PREFIX writes PREFIX.md and PREFIX.json (environment(), one row per
rank) on rank 0. On the CPU (--device cpu, or no GPU) the same path runs with gloo: that is
what tests/test_distributed.py starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ragvit
from ragvit.bench import pipelines, report
from ragvit.bench.sweep import cuda_problem


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deit_b", help="timm name or alias (deit_t, deit_s, ...)")
    p.add_argument("--img-size", type=int, default=None, help="default: the model's")
    p.add_argument("--dtype", choices=pipelines.DTYPES, help="default fp16 on GPU, fp32 on CPU")
    p.add_argument("--batch", type=int, default=256, help="images per batch")
    p.add_argument("--batches-per-rank", type=int, default=4)
    p.add_argument("--keep", type=float, default=0.5, help="ThresholdL2 keep ratio")
    p.add_argument("--layers", type=int, nargs="+", default=[4], help="pruning points")
    p.add_argument("--graph", action="store_true", help="replay through ragvit.cuda_graph")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes over the first batch")
    p.add_argument("--passes", type=int, default=5, help="timed passes over the shard")
    p.add_argument("--one-gpu-ips", type=float, default=None,
                   help="one device's images/s to scale against (default: measured on rank "
                        "0 alone first)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", help="torch.distributed backend (default nccl on GPUs, gloo "
                                     "on the CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write OUT.md and OUT.json (rank 0)")
    args = p.parse_args(argv)
    if min(args.batch, args.batches_per_rank, args.passes, args.threads) < 1 or args.warmup < 0:
        p.error("--batch, --batches-per-rank, --passes and --threads must be >= 1, "
                "--warmup >= 0")
    if args.device == "cuda" and (problem := cuda_problem()):
        p.error(f"--device cuda: {problem}")
    if args.device == "auto":
        args.device = "cuda" if cuda_problem() is None else "cpu"
    if args.dtype is None:
        args.dtype = "fp16" if args.device == "cuda" else "fp32"
    args.model = pipelines.MODELS.get(args.model, args.model)
    if problem := pipelines.model_problem(args.model, args.img_size):
        p.error(f"--model: {problem}")
    return args


def init(args) -> tuple[int, int, torch.device]:
    """Joins the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
    environment; a one-rank job of its own without them); returns (rank, world, device)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"rank {os.environ['RANK']}: LOCAL_RANK {local_rank} but only "
                             f"{torch.cuda.device_count()} GPU(s) here (--nproc-per-node)")
        # Before any CUDA work: this process then never touches another GPU.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def batch_images(args, index: int, device) -> torch.Tensor:
    """Batch `index` of the fixed set: the same images on every rank and in every job."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    x = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=gen)
    return x.to(device=device, dtype=pipelines.torch_dtype(args.dtype))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device) -> None:
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def check(args, model, policy, shard, first) -> dict:
    """This rank's max |dlogit| against the reference on its first batch (the model is
    patched inside pipelines.check), before the replica is patched for serving."""
    result = pipelines.check(model, shard[0], policy, ("ragvit",), args.dtype)
    return {"err_reference": result["err"]["ragvit"], "ok": result["ok"],
            "tolerance": result["tolerance"], "kept": result["kept_fraction"]}


def time_passes(forward, shard, passes: int, device, together: bool) -> list[float]:
    """Seconds per pass over the shard (synchronized at its end); every pass starts at a
    barrier when `together`."""
    times = []
    for _ in range(passes):
        if together:
            barrier(device)
        sync(device)
        t0 = time.perf_counter()
        for x in shard:
            forward(x)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def render(rows, summary, env) -> str:
    lines = [f"{env['device']}; torch {env['torch']}; tree {env['git_sha']}; "
             f"{summary['world_size']} rank(s) on {summary['nodes']} node(s); "
             f"{summary['model']} {summary['dtype']} batch {summary['batch']}, "
             f"ThresholdL2 keep {summary['keep']} at {summary['layers']}"
             f"{', CUDA graph' if summary['graph'] else ''}; "
             f"{summary['batches_per_rank']} batches per rank, median of "
             f"{summary['passes']} passes", "",
             "| rank | host | device | images/s | max dlogit vs reference | max dlogit vs rank 0 "
             "| kept |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['host']} | {r['device']} | {r['images_per_s']:.1f} "
                     f"| {r['err_reference']:.2e} | {r['err_rank0']:.2e} | {r['kept']:.3f} |")
    one = summary["one_gpu_images_per_s"]
    lines += ["", f"aggregate images/s: {summary['aggregate_images_per_s']:.1f}; one "
              f"{'GPU' if summary['device_type'] == 'cuda' else 'device'}: {one:.1f} "
              f"({summary['one_gpu_source']}); speedup {summary['speedup']:.2f}x on "
              f"{summary['world_size']}; scaling efficiency {summary['efficiency']:.3f}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    report.start_run()
    rank, world, device = init(args)
    try:
        return run(args, rank, world, device)
    finally:
        dist.destroy_process_group()


def run(args, rank, world, device) -> int:
    args.img_size = args.img_size or _default_size(args.model)
    model = pipelines.load_model(args.model, args.img_size, args.dtype, str(device), args.seed)
    policy = pipelines.make_policy(args.keep, None, args.layers)
    shard = [batch_images(args, i, device)
             for i in range(rank, world * args.batches_per_rank, world)]
    first = batch_images(args, 0, device)
    with torch.inference_mode():
        info = check(args, model, policy, shard, first)
        ragvit.patch(model, policy)
        forward = model
        if args.graph and device.type == "cuda":
            forward = ragvit.cuda_graph(model)
            info["graph_vs_eager"] = pipelines.max_err(forward(shard[0]), model(shard[0]))
        info["logits0"] = forward(first).float().cpu()
        for _ in range(args.warmup):
            forward(shard[0])
        sync(device)
        gathered = [None] * world
        dist.all_gather_object(gathered, info)
        ref0 = gathered[0]["logits0"]
        errs0 = [pipelines.max_err(g["logits0"], ref0) for g in gathered]
        # identical devices give identical logits (0); the bar admits different GPU models
        ok = all(g["ok"] and e0 <= g["tolerance"] and g.get("graph_vs_eager", 0.0)
                 <= g["tolerance"] for g, e0 in zip(gathered, errs0, strict=True))
        if rank == 0:
            for r, (g, e0) in enumerate(zip(gathered, errs0, strict=True)):
                print(f"rank {r}: max |dlogit| vs reference {g['err_reference']:.2e} "
                      f"(tolerance {g['tolerance']:.0e}), vs rank 0 on batch 0 {e0:.2e}"
                      + (f", graph vs eager {g['graph_vs_eager']:.2e}"
                         if "graph_vs_eager" in g else ""), flush=True)
            print("all results match" if ok else "MISMATCH: not timed", flush=True)
        if not ok:
            return 1
        images = args.batch * len(shard)
        one_source = "passed in"
        one_ips = args.one_gpu_ips
        if one_ips is None:
            one_source = "rank 0 alone, same shard, this job"
            if rank == 0:
                alone = time_passes(forward, shard, args.passes, device, together=False)
                one_ips = images / statistics.median(alone)
            barrier(device)
        times = time_passes(forward, shard, args.passes, device, together=True)
    mine = {"rank": rank, "host": socket.gethostname(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "node": int(os.environ.get("GROUP_RANK", 0)),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "images": images, "pass_s": times,
            "images_per_s": images / statistics.median(times),
            "err_reference": info["err_reference"], "err_rank0": errs0[rank],
            "graph_vs_eager": info.get("graph_vs_eager"), "kept": info["kept"],
            "one_ips": one_ips}
    rows = [None] * world
    dist.all_gather_object(rows, mine)
    if rank != 0:
        return 0
    per_pass = [sum(r["images"] for r in rows) / max(r["pass_s"][p] for r in rows)
                for p in range(args.passes)]
    aggregate = statistics.median(per_pass)
    one_ips = rows[0]["one_ips"]
    summary = {"world_size": world, "nodes": len({r["host"] for r in rows}),
               "model": args.model, "dtype": args.dtype, "batch": args.batch,
               "img_size": args.img_size, "keep": args.keep, "layers": list(args.layers),
               "graph": args.graph, "batches_per_rank": args.batches_per_rank,
               "passes": args.passes, "device_type": device.type,
               "aggregate_images_per_s": aggregate, "one_gpu_images_per_s": one_ips,
               "one_gpu_source": one_source, "speedup": aggregate / one_ips,
               "efficiency": aggregate / (world * one_ips)}
    env = report.environment(device.type, backend=dist.get_backend(), summary=summary)
    table = render(rows, summary, env)
    print(table, flush=True)
    if args.out:
        for path in report.write_report(args.out, table, env, rows):
            print(f"wrote {path}")
    return 0


def _default_size(name: str) -> int:
    """The resolution a timm model name was made for (its trailing _<size>), else 224."""
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 224


if __name__ == "__main__":
    sys.exit(main())
