"""ragvit.attention vs the attention paths PyTorch users have, on ViT-sized ragged batches.

Grid: DeiT-S (H=6) and DeiT-B (H=12), head_dim 64, fp16; S in {1, 4, 32, 256} images;
mean keep in {1.0, 0.5, 0.2} of 196 patches + CLS with per-image lengths jittered ±20%
(named distributions `deit224_keepXX`, seeded); plus 577-token images (`deit384_full`).
q/k/v are views of one (T, 3, H, D) qkv buffer, as a ViT block produces them.
Correctness is checked first against ragvit.reference.attention_reference (float64, one
sequence at a time); then host time (Python → enqueued, median of --calls calls) and GPU
time (CUDA-graph replay) are measured for ragvit and every baseline in the same process,
with the empty-kernel launch floor. On the GPU the contenders of a grid point are timed in
sequential blocks (each alone, warmed up on its own graph), 3 rounds with the order rotating
(ragvit.bench.timing.gpu_us_graphs), so no contender is always the one measured right after
the previous grid point's load.
ragvit and the floor are timed interleaved (alternating blocks, many rounds) and called
with the same Python call shape (a method loading six attributes, one module global, a
METH_FASTCALL call with five positional arguments, plus out= for the out= path), so the
host ratio is the median of per-round ratios and its p10–p90 spread is reported. The
ratio takes 200 rounds (--ratio-calls 10000): a shared host's vCPUs can change speed for
seconds at a time (the H200 host's do), and CPU-bound work (Python, torch, the allocator)
slows more than a launch does, so with few rounds one transient stall could move a row's
median.
``python benchmarks/bench_attention.py [--quick] [--out PREFIX]`` writes PREFIX.md/.json.
``--rows MODEL:DIST:S ... [--tag NAME]`` compares builds instead: it checks and times only
those rows, ragvit (out= given) before and after padded SDPA without a mask, and prints one
line a row with the ratio of the faster ragvit figure to SDPA's. SDPA is the anchor that
makes runs of different builds comparable: run it once per build (scripts/build_variant.sh),
each build's package first on PYTHONPATH, alternating builds over rounds. DIST is a named
distribution or allN (every length N).
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

import ragvit
from ragvit.bench import report, sweep, timing
from ragvit.reference import attention_reference

HEAD_DIM = 64
MODELS = {"DeiT-S": 6, "DeiT-B": 12}
# Module globals, so ragvit and the floor are each reached through one global load.
attention = ragvit.attention
launch_empty = ragvit._C._launch_empty


def lengths_for(dist: str, num_seqs: int, seed: int) -> np.ndarray:
    """Per-image token counts of a named distribution (CLS included)."""
    rng = np.random.default_rng(seed * 1000 + num_seqs)
    if dist == "deit384_full":
        return np.full(num_seqs, 577, dtype=np.int32)
    keep = int(dist.split("keep")[1]) / 100
    mean = round(196 * keep) + 1
    if keep >= 1.0:
        return np.full(num_seqs, 197, dtype=np.int32)
    jitter = rng.uniform(-0.2, 0.2, num_seqs)
    return np.clip(np.round(mean * (1 + jitter)), 1, 197).astype(np.int32)


class Case:
    """One grid point: inputs for ragvit and every baseline, built once (lengths, when
    given, replace the distribution's draw: an integer array of num_seqs lengths)."""

    def __init__(self, model: str, dist: str, num_seqs: int, seed: int = 0, lengths=None):
        self.model, self.dist, self.num_seqs = model, dist, num_seqs
        self.heads = MODELS[model]
        self.lengths = lengths_for(dist, num_seqs, seed) if lengths is None else lengths
        lens = torch.from_numpy(self.lengths)
        self.cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
        self.cu[1:] = torch.cumsum(lens, 0)
        self.cu = self.cu.cuda()
        self.total = int(self.lengths.sum())
        self.max_seqlen = int(self.lengths.max())
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.qkv = torch.randn(
            self.total, 3, self.heads, HEAD_DIM, device="cuda", dtype=torch.float16, generator=gen
        )
        self.q, self.k, self.v = self.qkv.unbind(1)
        self.out = torch.empty(self.total, self.heads, HEAD_DIM, device="cuda", dtype=torch.float16)
        self.scale = HEAD_DIM**-0.5
        self.device = self.q.device.index or 0
        self.stream = torch.cuda.current_stream().cuda_stream
        # Padded (S, H, L, D) copies for SDPA, plus a boolean key mask.
        L = self.max_seqlen
        idx = torch.arange(L, device="cuda")
        valid = idx[None, :] < lens.cuda()[:, None]
        self.key_mask = valid[:, None, None, :]
        pos = self.cu[:-1, None].long() + idx[None, :]
        pos = torch.where(valid, pos, torch.zeros_like(pos))

        def pad(t):
            p = t[pos.flatten()].view(num_seqs, L, self.heads, HEAD_DIM)
            return (p * valid[:, :, None, None]).transpose(1, 2).contiguous()

        self.pq, self.pk, self.pv = pad(self.q), pad(self.k), pad(self.v)
        self.valid, self.pos = valid, pos
        self.flops = (
            4.0 * float((self.lengths.astype(np.float64) ** 2).sum()) * self.heads * HEAD_DIM
        )

    # ---- the calls being compared ----
    def ragvit_out(self):
        return attention(self.q, self.k, self.v, self.cu, self.max_seqlen, out=self.out)

    def ragvit_alloc(self):
        return attention(self.q, self.k, self.v, self.cu, self.max_seqlen)

    # The floor: an empty kernel launched from C on the current stream, called with the
    # call shape of ragvit_out / ragvit_alloc (_launch_empty ignores the extra arguments).
    def launch_floor(self):
        return launch_empty(self.device, self.stream, self.q, self.k, self.v, out=self.out)

    def launch_floor_alloc(self):
        return launch_empty(self.device, self.stream, self.q, self.k, self.v)

    def fa2(self):
        return torch.ops.aten._flash_attention_forward(
            self.q,
            self.k,
            self.v,
            self.cu,
            self.cu,
            self.max_seqlen,
            self.max_seqlen,
            0.0,
            False,
            False,
            scale=self.scale,
        )[0]

    def varlen(self):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            self.q,
            self.k,
            self.v,
            self.cu,
            self.cu,
            self.max_seqlen,
            self.max_seqlen,
            scale=self.scale,
        )

    def sdpa(self):
        return F.scaled_dot_product_attention(self.pq, self.pk, self.pv, scale=self.scale)

    def sdpa_masked(self):
        return F.scaled_dot_product_attention(
            self.pq, self.pk, self.pv, attn_mask=self.key_mask, scale=self.scale
        )

    def nested_setup(self):
        offsets = self.cu.long()
        mk = lambda t: torch.nested.nested_tensor_from_jagged(  # noqa: E731
            t.contiguous(), offsets, max_seqlen=self.max_seqlen
        ).transpose(1, 2)
        self.nq, self.nk, self.nv = mk(self.q), mk(self.k), mk(self.v)

    def nested(self):
        return F.scaled_dot_product_attention(self.nq, self.nk, self.nv, scale=self.scale)

    def unpad(self, padded):
        out = padded.transpose(1, 2)[self.valid]  # (T, H, D) in image order
        return out


def packed_result(case: Case, name: str) -> torch.Tensor:
    fn = getattr(case, name)
    res = fn()
    if name in ("sdpa", "sdpa_masked"):
        res = case.unpad(res)
    elif name == "nested":
        res = res.transpose(1, 2).values()
    return res


BASELINES = ["fa2", "varlen", "sdpa_masked", "sdpa", "nested"]


def check_case(case: Case) -> dict:
    """Errors of ragvit and each baseline against the float64 reference."""
    row = {
        "model": case.model,
        "dist": case.dist,
        "num_seqs": case.num_seqs,
        "total_tokens": case.total,
        "max_seqlen": case.max_seqlen,
        "mean_len": float(case.lengths.mean()),
        "flops": case.flops,
    }
    # float64 on the GPU: the same math, and the check leaves the host's CPUs alone
    ref = attention_reference(case.q, case.k, case.v, case.cu, case.scale, device=case.q.device)
    errors, available = {}, {}
    try:
        case.nested_setup()
    except Exception as exc:  # noqa: BLE001
        available["nested"] = f"unavailable: {type(exc).__name__}"
    for name in ["ragvit_out"] + BASELINES:
        if name in available:
            continue
        try:
            out = packed_result(case, name)
            torch.cuda.synchronize()
            errors[name] = float((out.double() - ref).abs().max())
            available[name] = "ok"
        except Exception as exc:  # noqa: BLE001
            available[name] = f"unavailable: {type(exc).__name__}: {str(exc)[:80]}"
    floor = 1e-3
    sdpa_err = errors.get("sdpa_masked", 0.0)
    row["errors"] = errors
    row["available"] = available
    row["ragvit_ok"] = errors.get("ragvit_out", math.inf) <= 2 * sdpa_err + floor
    return row


def time_case(case: Case, row: dict, args, flusher) -> None:
    """Host and GPU figures for ragvit, the launch floor and each available baseline."""
    available = row["available"]
    host, ratios = timing.host_us_interleaved(
        {
            "launch_floor": case.launch_floor,
            "ragvit_out": case.ragvit_out,
            "launch_floor_alloc": case.launch_floor_alloc,
            "ragvit_alloc": case.ragvit_alloc,
        },
        {"ragvit_out": ("ragvit_out", "launch_floor"),
         "ragvit_alloc": ("ragvit_alloc", "launch_floor_alloc")},
        calls=args.ratio_calls,
        block=args.block,
    )
    timed = {"ragvit_out": case.ragvit_out}
    for name in BASELINES:
        if available.get(name) != "ok":
            continue
        fn = timed[name] = getattr(case, name)
        host[name] = timing.host_us(
            fn, args.calls if name != "nested" else max(50, args.calls // 20)
        )
    gpu = timing.gpu_us_graphs(timed, rounds=args.rounds, reps=args.reps, flusher=flusher)
    row["host_us"] = {k: vars(v) for k, v in host.items()}
    row["host_ratio"] = {k: vars(v) for k, v in ratios.items()}
    row["gpu_us"] = {k: vars(v) for k, v in gpu.items()}


def fmt(row, kind, name):
    v = row.get(kind, {}).get(name)
    return f"{v['median']:.1f}" if v else "–"


def pdl_setting() -> str:
    """What RAGVIT_PDL asks of this run (docs/architecture.md): the GPU figures of ragvit's
    launches depend on it, the baselines' (torch's plain launches) do not."""
    value = os.environ.get("RAGVIT_PDL")
    return "on (default)" if value is None else f"RAGVIT_PDL={value}"


def render(rows, env) -> str:
    lines = [
        f"# ragvit.attention on {env['device']}",
        "",
        f"driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"ragvit {env['ragvit']} @ {env['git_sha']}; fp16, head_dim 64, q/k/v strided views "
        f"of one (T, 3, H, D) buffer; ragvit's programmatic dependent launch: {env['pdl']} "
        "(the baselines launch plainly). Host µs = Python → enqueued (median of many calls), "
        "like for like: calls that allocate their output (ragvit without out=, every "
        "baseline), and ragvit's out= call beside the empty-launch floor (an empty kernel "
        "launched as ragvit launches, same Python call shape). Host ratios: ragvit and the "
        "floor timed interleaved "
        f"({env['ratio_rounds']} rounds of one block of {env['block']} calls each); "
        "median over rounds of the per-round ratio of block medians, p10–p90 across rounds; "
        "the alloc ratio is against the floor called like the alloc call (no out=). "
        "GPU µs = CUDA-graph replay per call (L2 flushed per replay), median over "
        f"{env['rounds']} rounds of one block of {env['reps']} replays per "
        "contender (each warmed up alone for 50 ms), the order rotating each round. "
        "fastest = fastest correct baseline among FA2 varlen, varlen_attn and "
        "masked padded SDPA (on the GPU; for host µs, among the allocating calls).",
        "",
        "| model | dist | S | T | host µs, allocating: ragvit / FA2 / varlen_attn / SDPA+mask / "
        "SDPA / nested | host ratio ragvit alloc / fastest | host µs, out=: ragvit / "
        "empty-launch floor | host ratio out=/floor (p10–p90) | host ratio alloc/floor "
        "(p10–p90) | GPU µs: ragvit | GPU µs: FA2 / varlen_attn / SDPA+mask / SDPA | "
        "GPU ratio vs fastest | GPU ratio vs SDPA (no mask) | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("ragvit_ok"):
            lines.append(
                f"| {r['model']} | {r['dist']} | {r['num_seqs']} | {r['total_tokens']} | "
                f"FAILED correctness: {r['errors']} | | | | | | | | | |"
            )
            continue
        g, h = r["gpu_us"], r["host_us"]
        fastest = min(
            (g[n]["median"] for n in ("fa2", "varlen", "sdpa_masked") if n in g), default=math.nan
        )
        host_fastest = min(
            (h[n]["median"] for n in ("fa2", "varlen", "sdpa_masked") if n in h),
            default=math.nan)
        ours = g["ragvit_out"]["median"]
        ratio_out, ratio_alloc = r["host_ratio"]["ragvit_out"], r["host_ratio"]["ragvit_alloc"]
        sdpa_ratio = ours / g["sdpa"]["median"] if "sdpa" in g else math.nan
        tflops = r["flops"] / ours / 1e6
        lines.append(
            f"| {r['model']} | {r['dist']} | {r['num_seqs']} | {r['total_tokens']} | "
            f"{fmt(r, 'host_us', 'ragvit_alloc')} / "
            + " / ".join(fmt(r, "host_us", n) for n in BASELINES)
            + f" | {h['ragvit_alloc']['median'] / host_fastest:.2f} | "
            f"{fmt(r, 'host_us', 'ragvit_out')} / {fmt(r, 'host_us', 'launch_floor')} | "
            f"{ratio_out['median']:.2f} ({ratio_out['p10']:.2f}–{ratio_out['p90']:.2f}) | "
            f"{ratio_alloc['median']:.2f} ({ratio_alloc['p10']:.2f}–{ratio_alloc['p90']:.2f}) | "
            f"{ours:.1f} | "
            + " / ".join(fmt(r, "gpu_us", n) for n in BASELINES[:4])
            + f" | {ours / fastest:.2f} | {sdpa_ratio:.2f} | {tflops:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_row(text: str):
    """(model, dist, num_seqs, lengths) of a --rows entry MODEL:DIST:S; ValueError if bad."""
    try:
        model, dist, num_seqs = text.split(":")
        num_seqs = int(num_seqs)
        fixed = int(dist[3:]) if dist.startswith("all") else 0
        if model not in MODELS or num_seqs < 1 or (dist.startswith("all") and fixed < 1):
            raise ValueError
        lengths = (np.full(num_seqs, fixed, dtype=np.int32) if fixed
                   else lengths_for(dist, num_seqs, 0))  # an unknown distribution raises
    except (ValueError, IndexError):
        raise ValueError(f"bad row {text!r}: want MODEL:DIST:S, MODEL one of {list(MODELS)}, "
                         "DIST a distribution (deit224_keepXX, deit384_full) or allN") from None
    return model, dist, num_seqs, lengths


def time_row_ab(case: Case, tag: str, reps: int, flusher) -> None:
    """One --rows line: GPU µs of ragvit, padded SDPA (no mask), ragvit again, and the ratio
    of the faster ragvit figure to SDPA's."""
    ours = [timing.gpu_us_graph(case.ragvit_out, flusher=flusher, reps=reps).median]
    sdpa = timing.gpu_us_graph(case.sdpa, flusher=flusher, reps=reps).median
    ours.append(timing.gpu_us_graph(case.ragvit_out, flusher=flusher, reps=reps).median)
    print(f"{tag:8s} {case.model} {case.dist:16s} S={case.num_seqs:3d} ragvit {ours[0]:7.1f} "
          f"{ours[1]:7.1f} sdpa {sdpa:7.1f} ratio {min(ours) / sdpa:.3f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few grid points, fewer calls")
    parser.add_argument("--calls", type=int, default=2000, help="host-time calls per figure")
    parser.add_argument("--ratio-calls", type=int, default=10000,
                        help="calls per figure of the interleaved ragvit/floor timing")
    parser.add_argument("--block", type=int, default=50,
                        help="calls per interleaved block (ragvit vs floor); "
                             "rounds = ratio-calls/block")
    parser.add_argument("--reps", type=int, default=50, help="graph replays per GPU block")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rotating rounds of GPU blocks (one block per contender each)")
    parser.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json")
    parser.add_argument("--rows", nargs="+", metavar="MODEL:DIST:S",
                        help="compare builds: check, then time only these rows against "
                             "unmasked padded SDPA (DIST: a distribution or allN)")
    parser.add_argument("--tag", default="ragvit", help="--rows: this build's label")
    args = parser.parse_args(argv)
    report.start_run()  # the host-speed probe at the run's start
    if min(args.reps, args.rounds, args.block, args.calls, args.ratio_calls) < 1:
        parser.error("--reps, --rounds, --block, --calls and --ratio-calls must be >= 1, got "
                     f"{args.reps}, {args.rounds}, {args.block}, {args.calls} and "
                     f"{args.ratio_calls}")
    try:
        rows_ab = [parse_row(text) for text in args.rows or ()]
    except ValueError as e:
        parser.error(str(e))
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        parser.error("needs a CUDA device and a CUDA build of ragvit")
    flusher = timing.L2Flusher()
    if rows_ab:
        cases = [Case(model, dist, num_seqs, lengths=lengths)
                 for model, dist, num_seqs, lengths in rows_ab]
        _, bad = sweep.check_then_time(
            cases, check_case, lambda case, row: time_row_ab(case, args.tag, args.reps, flusher),
            lambda row: row["ragvit_ok"])
        return 1 if bad else 0
    grid = [
        (m, d, s)
        for m in MODELS
        for d in ("deit224_keep100", "deit224_keep50", "deit224_keep20")
        for s in (1, 4, 32, 256)
    ]
    grid += [(m, "deit384_full", s) for m in MODELS for s in (1, 32)]
    if args.quick:
        grid = [
            ("DeiT-S", "deit224_keep50", 1),
            ("DeiT-S", "deit224_keep50", 32),
            ("DeiT-B", "deit224_keep100", 256),
        ]
        args.calls = min(args.calls, 500)
        args.ratio_calls = min(args.ratio_calls, 500)
        args.block = min(args.block, 25)
    cases = [Case(*g) for g in grid]
    rows, bad = sweep.check_then_time(
        cases, check_case, lambda case, row: time_case(case, row, args, flusher),
        lambda row: row["ragvit_ok"])
    return report.publish(rows, bad, render, args.out, "cuda", rounds=args.rounds,
                          reps=args.reps, ratio_rounds=max(2, args.ratio_calls // args.block),
                          block=args.block, pdl=pdl_setting())


if __name__ == "__main__":
    raise SystemExit(main())
