"""What handing a tensor to C costs on the host, next to a launch: the figures behind
docs/interop.md.

Times, per call (host µs, Python -> returned, median of 2000 calls after a warm-up): the
array protocols a C entry point could read a torch CUDA tensor through (`__dlpack__`,
`__cuda_array_interface__`, `data_ptr`), two ways to ask torch for the current stream, a
small torch allocation, the empty-kernel launch from C (`ragvit._C._launch_empty`, the floor
of any op that launches a kernel), and `ragvit.attention` on one token (five tensors imported
through the DLPack C exchange API, the current stream, checks and one launch). The launch
floor and the attention call are also timed side by side in alternating blocks, so their
ratio is free of clock drift. With CuPy installed, the same attention call on CuPy arrays with
`out=` and without it (the output a ragvit.Buffer from ragvit's stream-ordered pool, returned
as a CuPy array through `cupy.from_dlpack`), also timed side by side: their difference is the
host cost of an output ragvit allocates for a library without an allocator. Needs a CUDA GPU.
``python benchmarks/bench_interop.py [--out PREFIX]`` writes PREFIX.md/.json.
"""

from __future__ import annotations

import argparse

import torch

import ragvit
from ragvit.bench import report, timing


def calls(device: int) -> tuple[dict, torch.Tensor]:
    """name -> (what it is, a callable that makes one call); and the attention call's v."""
    t = torch.randn(64, 64, device="cuda")
    qkv = torch.randn(1, 3, 1, 64, device="cuda", dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    launch_empty, attention = ragvit._C._launch_empty, ragvit.attention
    return {
        "dlpack": ("`t.__dlpack__()` (a capsule, dropped)", lambda: t.__dlpack__()),
        "cai": ("`t.__cuda_array_interface__` (a Python property)",
                lambda: t.__cuda_array_interface__),
        "data_ptr": ("`t.data_ptr()`", lambda: t.data_ptr()),
        "stream_object": ("`torch.cuda.current_stream().cuda_stream`",
                          lambda: torch.cuda.current_stream().cuda_stream),
        "stream_raw": ("`torch._C._cuda_getCurrentRawStream(0)`",
                       lambda: torch._C._cuda_getCurrentRawStream(device)),
        "empty": ('`torch.empty(4, 8, device="cuda")`',
                  lambda: torch.empty(4, 8, device="cuda")),
        "launch_floor": ("an empty kernel launched from C (`ragvit._C._launch_empty`)",
                         lambda: launch_empty(device, stream)),
        "attention": ("`ragvit.attention(q, k, v, cu_seqlens, 1, out=out)`, T = 1, H = 1, D = 64 "
                      "(5 tensors imported, stream, checks, one launch)",
                      lambda: attention(q, k, v, cu, 1, out=out)),
    }, v


def cupy_calls() -> tuple[dict, object] | None:
    """The CuPy rows (None without CuPy): attention on CuPy arrays with and without out=."""
    try:
        import cupy
    except ImportError:
        return None
    qkv = cupy.random.standard_normal((1, 3, 1, 64)).astype(cupy.float16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = cupy.empty_like(q)
    cu = cupy.asarray([0, 1], dtype=cupy.int32)
    attention = ragvit.attention
    return {
        "cupy_out": ("CuPy: `ragvit.attention(q, k, v, cu_seqlens, 1, out=out)`, T = 1",
                     lambda: attention(q, k, v, cu, 1, out=out)),
        "cupy_alloc": ("CuPy: the same call without `out=` (a CuPy array over a ragvit.Buffer, "
                       "dropped)", lambda: attention(q, k, v, cu, 1)),
    }, v


def render(rows: list, env: dict) -> str:
    lines = [
        "# Host cost of the tensor hand-off",
        "",
        f"{env['device']}, driver {env['driver']}, torch {env['torch']}, Python "
        f"{env['python']}, tree {env['git_sha']}, host probe {env['host_probe_start_us']} / "
        f"{env['host_probe_us']} µs (start / end). Host µs per call, Python -> returned: median "
        "(p20-p80) of the calls, each call timed alone.",
        "",
        "| call | µs (p20-p80) |",
        "| --- | --- |",
    ]
    for r in rows:
        if r["name"] in ("attention_over_floor", "cupy_alloc_over_out"):
            continue
        lines.append(f"| {r['what']} | {r['median']:.2f} ({r['p20']:.2f}-{r['p80']:.2f}) |")
    ratio = next(r for r in rows if r["name"] == "attention_over_floor")
    lines += ["", f"`ragvit.attention` / launch floor, timed in alternating blocks: "
              f"{ratio['median']:.2f} (p10-p90 {ratio['p10']:.2f}-{ratio['p90']:.2f}); "
              f"the blocks' medians: attention {ratio['attention_us']:.2f} µs, floor "
              f"{ratio['floor_us']:.2f} µs.", ""]
    cupy_pair = next((r for r in rows if r["name"] == "cupy_alloc_over_out"), None)
    if cupy_pair is not None:
        c = cupy_pair
        lines += [f"CuPy `ragvit.attention` without / with `out=`, timed in alternating blocks: "
                  f"{c['median']:.2f} (p10-p90 {c['p10']:.2f}-{c['p90']:.2f}); the blocks' "
                  f"medians: without {c['alloc_us']:.2f} µs, with {c['out_us']:.2f} µs, "
                  f"difference {c['alloc_us'] - c['out_us']:.2f} µs.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls per figure")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls must be >= 1, got {args.calls}")
    report.start_run()  # the host-speed probe at the run's start
    if not (torch.cuda.is_available() and ragvit.cuda_available()):
        p.error("needs a CUDA GPU and a CUDA build of ragvit")
    device = torch.cuda.current_device()
    fns, v = calls(device)
    got = fns["attention"][1]()  # one token attends to itself alone: its output is its value
    torch.cuda.synchronize()
    if not torch.equal(got, v):
        print("ragvit.attention on one token differs from its value row")
        return 1
    cupy_fns = cupy_calls()
    if cupy_fns is not None:
        cupy_fns, cupy_v = cupy_fns
        for name, (_, fn) in cupy_fns.items():
            got = fn()
            if type(got) is not type(cupy_v) or not bool((got == cupy_v).all()):
                print(f"{name}: the CuPy call returned {type(got).__name__}, not its value row")
                return 1
        fns.update(cupy_fns)
    else:
        print("CuPy is not installed: no CuPy rows")
    print("all results match")
    rows = []
    for name, (what, fn) in fns.items():
        s = timing.host_us(fn, calls=args.calls, warmup=200)
        rows.append({"name": name, "what": what, "median": s.median, "p20": s.p20,
                     "p80": s.p80})
    stats, ratios = timing.host_us_interleaved(
        {"attention": fns["attention"][1], "floor": fns["launch_floor"][1]},
        {"ratio": ("attention", "floor")}, calls=args.calls)
    r = ratios["ratio"]
    rows.append({"name": "attention_over_floor", "what": "ratio", "median": r.median,
                 "p10": r.p10, "p90": r.p90, "attention_us": stats["attention"].median,
                 "floor_us": stats["floor"].median})
    if cupy_fns is not None:
        stats, ratios = timing.host_us_interleaved(
            {"alloc": fns["cupy_alloc"][1], "out": fns["cupy_out"][1]},
            {"ratio": ("alloc", "out")}, calls=args.calls)
        r = ratios["ratio"]
        rows.append({"name": "cupy_alloc_over_out", "what": "ratio", "median": r.median,
                     "p10": r.p10, "p90": r.p90, "alloc_us": stats["alloc"].median,
                     "out_us": stats["out"].median})
    return report.publish(rows, 0, render, args.out, device="cuda", calls=args.calls)


if __name__ == "__main__":
    raise SystemExit(main())
