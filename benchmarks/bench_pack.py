"""ragvit's token packer vs the packing schemes PyTorch users have, on ViT-sized batches.

Grid: B in {1, 256} images of N = 197 tokens (DeiT 224), C in {384, 768} (DeiT-S/B), fp16;
keep masks with a mean keep of 50% or 70% of the patches, per-image counts jittered ±20%,
CLS always kept (named distributions `keep50`, `keep70`, seeded). Ops: pack_into (one
launch, no host sync) and repack_into (a second stage keeping ~70% of the packed rows),
and the eager pack; baselines: the paper's scheme (cumsum + .item() + nonzero +
index_select) and torch boolean indexing x[keep]. Correctness is checked first (exact,
torch.equal); then host time (Python -> enqueued, median of many calls) against the
empty-kernel launch floor, a no-sync check (the call returns while a long kernel still
runs), GPU time per call from CUDA-graph replay (capturable ops) next to the memory floor
(bytes moved / 4.3 TB/s), and wall time (CUDA events around each call) for all.
``python benchmarks/bench_pack.py [--quick] [--out PREFIX]`` writes PREFIX.md/.json.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import ragvit
from ragvit.bench import report, sweep, timing

N = 197
COPY_BANDWIDTH = 4.3e12  # bytes/s, measured device-to-device copy bandwidth of the H200
DTYPE = torch.float16


def keep_mask(dist: str, batch: int, seed: int) -> torch.Tensor:
    """(B, N) bool mask of a named distribution: CLS kept, patch counts jittered ±20%."""
    rng = np.random.default_rng(seed * 1000 + batch)
    keep = int(dist.removeprefix("keep")) / 100
    mask = np.zeros((batch, N), dtype=bool)
    mask[:, 0] = True
    for b in range(batch):
        count = int(np.clip(round(196 * keep * (1 + rng.uniform(-0.2, 0.2))), 0, 196))
        mask[b, 1 + rng.permutation(196)[:count]] = True
    return torch.from_numpy(mask).cuda()


class Case:
    """One grid point: inputs and capacity buffers for ragvit and the baselines."""

    def __init__(self, dist: str, batch: int, channels: int, seed: int = 0):
        self.dist, self.batch, self.channels = dist, batch, channels
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.x = torch.randint(-100, 101, (batch, N, channels), device="cuda", generator=gen).to(
            DTYPE
        )
        self.keep = keep_mask(dist, batch, seed)
        self.total = int(self.keep.sum())
        capacity = batch * N  # graph-friendly: no host knowledge of T
        self.out = torch.empty((capacity, channels), dtype=DTYPE, device="cuda")
        self.cu = torch.empty((batch + 1,), dtype=torch.int32, device="cuda")
        self.indices = torch.empty((capacity,), dtype=torch.int32, device="cuda")
        # Second stage: keep ~70% of the packed rows (CLS rows always).
        ragvit.pack_into(self.x, self.keep, self.out, self.cu, indices=self.indices)
        packed_keep = torch.rand((capacity,), device="cuda", generator=gen) < 0.7
        packed_keep[self.cu[:-1].long()] = True
        self.keep2 = packed_keep
        self.out2 = torch.empty_like(self.out)
        self.cu2 = torch.empty_like(self.cu)
        self.src2 = torch.empty_like(self.indices)
        self.total2 = 0
        self.device = torch.cuda.current_device()
        self.stream = torch.cuda.current_stream().cuda_stream

    # ---- ragvit ----
    def pack_into(self):
        ragvit.pack_into(self.x, self.keep, self.out, self.cu, indices=self.indices)

    def repack_into(self):
        ragvit.repack_into(self.out, self.cu, self.keep2, self.out2, self.cu2, src=self.src2)

    # ---- the empty-kernel launch floor, called with the same Python call shape ----
    def floor_pack_into(self):
        ragvit._C._launch_empty(self.device, self.stream, self.x, self.keep, indices=self.indices)

    def floor_repack_into(self):
        ragvit._C._launch_empty(self.device, self.stream, self.cu, self.keep2, self.out2,
                                src=self.src2)

    def pack(self):
        return ragvit.pack(self.x, self.keep)

    # ---- baselines ----
    def paper(self):
        """cumsum + .item() + nonzero + gather: two host syncs."""
        counts = self.keep.sum(1, dtype=torch.int32)
        cu = torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
        total = int(cu[-1].item())
        idx = self.keep.reshape(-1).nonzero().squeeze(1)
        packed = self.x.reshape(-1, self.channels).index_select(0, idx)
        return packed[:total], cu

    def boolean_index(self):
        return self.x[self.keep]

    def bytes_moved(self, stage: int) -> int:
        """Bytes a perfect packer reads and writes (rows twice, masks, cu_seqlens, indices)."""
        es = self.x.element_size()
        if stage == 1:
            rows, masks = self.total, self.batch * N
        else:
            rows, masks = self.total2, self.total
        return 2 * rows * self.channels * es + masks + 4 * (self.batch + 1) + 4 * rows


def check_case(case: Case) -> dict:
    """Exact checks of every op and baseline against torch boolean indexing."""
    row = {
        "dist": case.dist,
        "batch": case.batch,
        "channels": case.channels,
        "total_tokens": case.total,
        "errors": [],
    }
    expected = case.x[case.keep]
    case.pack_into()
    torch.cuda.synchronize()
    cu_expected = torch.nn.functional.pad(torch.cumsum(case.keep.sum(1), 0), (1, 0)).int()
    if not (torch.equal(case.cu, cu_expected) and torch.equal(case.out[: case.total], expected)):
        row["errors"].append("pack_into")
    packed, cu, indices = case.pack()
    if not (torch.equal(packed, expected) and torch.equal(cu, cu_expected)):
        row["errors"].append("pack")
    case.repack_into()
    torch.cuda.synchronize()
    keep2 = case.keep2[: case.total]
    case.total2 = int(keep2.sum())
    row["total_tokens_2"] = case.total2
    if not torch.equal(case.out2[: case.total2], expected[keep2]):
        row["errors"].append("repack_into")
    paper_packed, paper_cu = case.paper()
    if not (torch.equal(paper_packed, expected) and torch.equal(paper_cu, cu_expected)):
        row["errors"].append("paper")
    row["ok"] = not row["errors"]
    return row


def is_sync_free(fn) -> bool:
    """True when fn() returns while a long kernel queued before it is still running."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on an H200
    fn()
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return busy


def time_case(case: Case, row: dict, args, flusher) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    # Host floor: the launch alone, on a stream fixed beforehand (no stream query).
    floor = lambda: ragvit._C._launch_empty(0, stream)  # noqa: E731

    # GPU floor: the stream is read inside, so graph capture records the launch on
    # the capturing stream (a stream fixed before capture records nothing).
    def floor_gpu():
        ragvit._C._launch_empty(0, torch.cuda.current_stream().cuda_stream)

    ops = {
        "pack_into": case.pack_into,
        "repack_into": case.repack_into,
        "pack": case.pack,
        "paper": case.paper,
        "boolean_index": case.boolean_index,
        "launch_floor": floor,
    }
    capturable = ("pack_into", "repack_into", "launch_floor")
    # The _into ops and the floor interleaved (same clock and queue state, same call shape);
    # host / launch floor = the median over rounds of the per-round ratio (p10-p90 kept).
    interleaved, ratios = timing.host_us_interleaved(
        {"pack_into": case.pack_into, "repack_into": case.repack_into,
         "floor_pack_into": case.floor_pack_into, "floor_repack_into": case.floor_repack_into},
        {"pack_into": ("pack_into", "floor_pack_into"),
         "repack_into": ("repack_into", "floor_repack_into")}, calls=args.calls)
    row["host_us"] = {k: vars(timing.host_us(fn, args.calls)) for k, fn in ops.items()
                      if k not in interleaved}
    row["host_us"].update({k: vars(v) for k, v in interleaved.items()})
    row["host_ratio"] = {k: vars(v) for k, v in ratios.items()}
    graph_ops = {**ops, "launch_floor": floor_gpu}
    row["gpu_us"] = {
        k: vars(timing.gpu_us_graph(graph_ops[k], flusher=flusher, reps=args.reps))
        for k in capturable
    }
    row["wall_us"] = {
        k: timing.time_ms(fn, reps=args.reps).median * 1e3
        for k, fn in ops.items()
        if k != "launch_floor"
    }
    row["sync_free"] = {k: is_sync_free(ops[k]) for k in ("pack_into", "repack_into", "paper")}
    row["floor_us"] = {
        "pack_into": case.bytes_moved(1) / COPY_BANDWIDTH * 1e6,
        "repack_into": case.bytes_moved(2) / COPY_BANDWIDTH * 1e6,
    }


def render(rows, env) -> str:
    lines = [
        f"# ragvit token packing on {env['device']}",
        "",
        f"driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"ragvit {env['ragvit']} @ {env['git_sha']}; fp16, N = {N}. Host µs = Python → "
        "enqueued (median); host / launch floor for the _into ops: median over rounds of the "
        "per-round ratio to an empty-kernel launch called the same way, timed interleaved "
        "(p10–p90 in brackets); GPU µs = CUDA-graph replay per call (L2 flushed per replay); "
        "wall µs = CUDA events around one call (includes host syncs); memory floor = bytes "
        f"moved / {COPY_BANDWIDTH / 1e12:.1f} TB/s (the target at large B); GPU / empty kernel = "
        "ours over an empty kernel's GPU µs measured the same way (the target at B = 1).",
        "",
        "| dist | B | C | T | op | host µs | host / launch floor | sync-free | GPU µs | "
        "GB/s | GPU / memory floor | GPU / empty kernel | wall µs | wall: paper / ours | "
        "wall: x[keep] / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['dist']} | {r['batch']} | {r['channels']} | {r['total_tokens']} |"
        if not r["ok"]:
            lines.append(f"{head} FAILED correctness: {r['errors']} |||||||||")
            continue
        h, g, w = r["host_us"], r["gpu_us"], r["wall_us"]
        launch = h["launch_floor"]["median"]
        empty_gpu = g["launch_floor"]["median"]
        for op, stage in (("pack_into", 1), ("repack_into", 2)):
            gpu = g[op]["median"]
            moved = r["total_tokens"] if stage == 1 else r["total_tokens_2"]
            gbs = 2 * moved * r["channels"] * DTYPE.itemsize / gpu / 1e3
            ratio = r["host_ratio"][op]
            lines.append(
                f"{head} {op} | {h[op]['median']:.1f} | {ratio['median']:.2f} "
                f"({ratio['p10']:.2f}–{ratio['p90']:.2f}) | "
                f"{'yes' if r['sync_free'][op] else 'NO'} | {gpu:.1f} | {gbs:.0f} | "
                f"{gpu / r['floor_us'][op]:.2f} | {gpu / empty_gpu:.2f} | {w[op]:.1f} | "
                f"{w['paper'] / w[op]:.1f} | {w['boolean_index'] / w[op]:.1f} |"
            )
        for op in ("pack", "paper", "boolean_index"):
            sync = r["sync_free"].get(op)
            lines.append(
                f"{head} {op} | {h[op]['median']:.1f} | {h[op]['median'] / launch:.2f} | "
                f"{'–' if sync is None else ('yes' if sync else 'no')} | – | – | – | – | "
                f"{w[op]:.1f} | | |"
            )
        lines.append(
            f"{head} empty kernel | {launch:.1f} | 1.00 | yes | {empty_gpu:.1f} | | | 1.00 | | | |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two grid points, fewer calls")
    parser.add_argument("--calls", type=int, default=1000, help="host-time calls per figure")
    parser.add_argument("--reps", type=int, default=50, help="graph replays per GPU figure")
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    report.start_run()  # the host-speed probe at the run's start
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    grid = [(d, b, c) for d in ("keep50", "keep70") for b in (1, 256) for c in (384, 768)]
    if args.quick:
        grid = [("keep50", 1, 384), ("keep50", 256, 768)]
        args.calls = min(args.calls, 300)
    ragvit.set_debug(False)
    flusher = timing.L2Flusher()
    cases = [Case(*g) for g in grid]
    rows, bad = sweep.check_then_time(
        cases, check_case, lambda case, row: time_case(case, row, args, flusher),
        lambda row: row["ok"])
    return report.publish(rows, bad, render, args.out, "cuda")


if __name__ == "__main__":
    raise SystemExit(main())
