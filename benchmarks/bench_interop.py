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
`out=`, without it (the output a ragvit.Buffer from ragvit's stream-ordered pool, returned as a
cupy.ndarray built over it in C) and with `out=cupy.empty(...)` made in the call (what a user
writes to allocate the output in CuPy), side by side: the first two differ by the host cost of
an output ragvit allocates for a library without an allocator, the last two compare that
output with the user's own allocation. Next to them, in the same alternating blocks, the ways
a ragvit.Buffer can become a cupy.ndarray from Python: `cupy.from_dlpack` of the buffer, of a
capsule, `cupy.asarray` through the CUDA Array Interface (CuPy synchronizes the host with the
interface's stream), an ndarray over `UnownedMemory` owned by the buffer, the bare ndarray
construction over a ready MemoryPointer (the public constructor's floor), the same through
CuPy's extension base and `_init` (what ragvit calls), `cupy.empty`, and ragvit's own share
(a call that returns the Buffer itself). Needs a CUDA GPU.
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


class _CAIOnly:
    """A CuPy array seen through its CUDA Array Interface alone: ragvit returns Buffers."""

    def __init__(self, array):
        self.__cuda_array_interface__ = array.__cuda_array_interface__
        self.array = array


def cupy_calls() -> tuple[dict, dict] | None:
    """The CuPy rows (None without CuPy): name -> (what, call), and name -> the value each
    call's result must equal (a cupy.ndarray unless the row says otherwise)."""
    try:
        import cupy
    except ImportError:
        return None
    qkv = cupy.random.standard_normal((1, 3, 1, 64)).astype(cupy.float16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = cupy.empty_like(q)
    cu = cupy.asarray([0, 1], dtype=cupy.int32)
    attention = ragvit.attention
    cq, ck, cv, ccu, cout = (_CAIOnly(a) for a in (q, k, v, cu, out))
    buf = attention(cq, ck, cv, ccu, 1)  # a Buffer holding v, read by every hand-off row
    assert isinstance(buf, ragvit.Buffer)
    cai = buf.__cuda_array_interface__
    ptr, shape, dtype = cai["data"][0], buf.shape, cupy.dtype(buf.dtype)
    nbytes, device = v.nbytes, v.device.id
    mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, buf, device), 0)
    ndarray, memory_pointer, unowned = cupy.ndarray, cupy.cuda.MemoryPointer, \
        cupy.cuda.UnownedMemory
    from_dlpack, asarray, empty = cupy.from_dlpack, cupy.asarray, cupy.empty
    current_stream = cupy.cuda.get_current_stream
    base = type(v).__mro__[1]  # CuPy's extension base (CuPy 11+), under its Python ndarray

    def construct_init():
        array = base.__new__(ndarray)
        array._init(shape, dtype, mem)
        return array

    fns = {
        "cupy_out": ("CuPy: `ragvit.attention(q, k, v, cu_seqlens, 1, out=out)`, T = 1",
                     lambda: attention(q, k, v, cu, 1, out=out)),
        "cupy_alloc": ("CuPy: the same call without `out=` (a CuPy array over a ragvit.Buffer, "
                       "dropped)", lambda: attention(q, k, v, cu, 1)),
        "cupy_empty_out": ("CuPy: `out=cupy.empty((1, 1, 64), cupy.float16)` made for the same "
                           "call (the user's own allocation, dropped)",
                           lambda: attention(q, k, v, cu, 1, out=empty((1, 1, 64), cupy.float16))),
        "buffer_alloc": ("ragvit's share: the same call on CAI-only views of the arrays, "
                         "returning the ragvit.Buffer itself (allocation, mark, free)",
                         lambda: attention(cq, ck, cv, ccu, 1)),
        "buffer_out": ("the same call on CAI-only views with `out=` (a CAI-only view)",
                       lambda: attention(cq, ck, cv, ccu, 1, out=cout)),
        "from_dlpack": ("hand-off: `cupy.from_dlpack(buf)` (stream= CuPy's current stream)",
                        lambda: from_dlpack(buf)),
        "from_capsule": ("hand-off: `cupy.from_dlpack(buf.__dlpack__(stream=-1, "
                         "max_version=(1, 0)))` (a capsule: no stream exchange)",
                         lambda: from_dlpack(buf.__dlpack__(stream=-1, max_version=(1, 0)))),
        "capsule": ("`buf.__dlpack__(stream=-1, max_version=(1, 0))` alone (dropped)",
                    lambda: buf.__dlpack__(stream=-1, max_version=(1, 0))),
        "cai": ("hand-off: `cupy.asarray(buf)` (CUDA Array Interface v3; CuPy synchronizes the "
                "host with its stream)", lambda: asarray(buf)),
        "unowned": ("hand-off: `cupy.ndarray(shape, dtype, memptr=MemoryPointer(UnownedMemory("
                    "ptr, nbytes, buf, device), 0))`",
                    lambda: ndarray(shape, dtype, memptr=memory_pointer(
                        unowned(ptr, nbytes, buf, device), 0))),
        "construct": ("`cupy.ndarray(shape, dtype, memptr=mem)` over a ready MemoryPointer "
                      "(CuPy's public constructor alone)",
                      lambda: ndarray(shape, dtype, memptr=mem)),
        "construct_init": ("the same through CuPy's extension base: `base.__new__(ndarray)` then "
                           "`_init(shape, dtype, mem)` (the construction ragvit calls from C)",
                           construct_init),
        "current_stream": ("`cupy.cuda.get_current_stream().ptr`",
                           lambda: current_stream().ptr),
        "empty": ("`cupy.empty((1, 1, 64), cupy.float16)`",
                  lambda: empty((1, 1, 64), cupy.float16)),
    }
    if base.__name__ != "_ndarray_base":  # CuPy's ndarray is the extension type itself
        del fns["construct_init"]
    expected = {name: v for name in fns}
    expected["buffer_alloc"] = expected["buffer_out"] = expected["capsule"] = None
    expected["current_stream"] = expected["empty"] = expected["cupy_empty_out"] = None
    return fns, expected


# The CuPy rows' ratios: (numerator, denominator) of the alternating blocks' medians.
CUPY_PAIRS = {"alloc_over_out": ("cupy_alloc", "cupy_out"),
              "alloc_over_empty": ("cupy_alloc", "cupy_empty_out"),
              "buffer_over_out": ("buffer_alloc", "buffer_out")}


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
        if r["what"] == "ratio" or r["name"].startswith("handoff:"):
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
        e = next(r for r in rows if r["name"] == "cupy_alloc_over_empty")
        lines += [f"Without `out=` against `out=cupy.empty(...)` made for the call, in the same "
                  f"blocks: {e['median']:.2f} (p10-p90 {e['p10']:.2f}-{e['p90']:.2f}); without "
                  f"{e['alloc_us']:.2f} µs, with cupy.empty {e['out_us']:.2f} µs, difference "
                  f"{e['alloc_us'] - e['out_us']:.2f} µs.", ""]
        b = next(r for r in rows if r["name"] == "buffer_alloc_over_out")
        lines += [f"ragvit's own share (the Buffer returned as it is, CAI-only inputs): "
                  f"{b['alloc_us'] - b['out_us']:.2f} µs ({b['alloc_us']:.2f} against "
                  f"{b['out_us']:.2f} µs with `out=`; ratio {b['median']:.2f}).", "",
                  "The CuPy rows, all timed in one set of alternating blocks (median of the "
                  "blocks' medians, p10-p90 over the calls):", "",
                  "| call | µs (p10-p90) |", "| --- | --- |"]
        for r in rows:
            if r["name"].startswith("handoff:"):
                lines.append(f"| {r['what']} | {r['median']:.2f} ({r['p10']:.2f}-"
                             f"{r['p90']:.2f}) |")
        lines.append("")
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
        cupy_fns, cupy_expected = cupy_fns
        for name, (_, fn) in cupy_fns.items():
            got, want = fn(), cupy_expected[name]
            if want is None:
                continue
            if type(got) is not type(want) or not bool((got == want).all()):
                print(f"{name}: the CuPy call returned {type(got).__name__}, not its value row")
                return 1
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
            {name: fn for name, (_, fn) in cupy_fns.items()}, CUPY_PAIRS, calls=args.calls)
        for name, (what, _) in cupy_fns.items():
            s = stats[name]
            rows.append({"name": f"handoff:{name}", "what": what, "median": s.median,
                         "p10": s.p10, "p90": s.p90})
        for key, (num, den) in CUPY_PAIRS.items():
            r = ratios[key]
            rows.append({"name": f"{num}_over_{key.split('_over_')[1]}", "what": "ratio",
                         "median": r.median, "p10": r.p10, "p90": r.p90,
                         "alloc_us": stats[num].median, "out_us": stats[den].median})
    return report.publish(rows, 0, render, args.out, device="cuda", calls=args.calls)


if __name__ == "__main__":
    raise SystemExit(main())
