"""The host cost of this tree's ops against another build of ragvit._C, in one process.

Loads a second extension module (``--base PATH``: a ``_C*.so`` built from another tree) beside
``ragvit._C`` and times the same calls through both in alternating blocks
(timing.host_us_interleaved), so clock drift and the host's speed state cancel in the per-round
ratio this/base. Calls: ``attention`` on one token with ``out=`` and allocating, a
``layer_norm`` with ``out=``, and the empty-kernel launch floor of each module, on CUDA tensors
when a GPU is present, else on CPU tensors (without the floor); torch's grad mode on unless
``--no-grad``. The glue's host path is what
differs between two builds; the kernels are not timed.
``python benchmarks/bench_host_ab.py --base OTHER/_C.so [--out PREFIX]`` writes PREFIX.md/.json.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

import ragvit
from ragvit.bench import report, timing


def load_base(path: str):
    """The other build's extension module, under a name of its own (its init is PyInit__C)."""
    spec = importlib.util.spec_from_file_location("ragvit_base._C", path)
    if spec is None:
        raise SystemExit(f"--base {path}: not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calls(mods: dict, device: str) -> dict:
    """name -> callable, for each module in mods (label -> module) and each call."""
    qkv = torch.randn(1, 3, 1, 64, device=device, dtype=torch.float16 if device == "cuda"
                      else torch.float32)
    q, k, v = qkv.unbind(1)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    x = torch.randn(4, 64, device=device, dtype=q.dtype)
    w, b, y = torch.ones(64, device=device, dtype=q.dtype), torch.zeros_like(x[0]), \
        torch.empty_like(x)
    if device == "cuda":
        stream, dev = torch.cuda.current_stream().cuda_stream, torch.cuda.current_device()
    fns = {}
    for label, m in mods.items():
        fns[f"attention_out/{label}"] = (lambda m=m: m.attention(q, k, v, cu, 1, out=out))
        fns[f"attention_alloc/{label}"] = (lambda m=m: m.attention(q, k, v, cu, 1))
        fns[f"layer_norm_out/{label}"] = (lambda m=m: m.layer_norm(x, w, b, out=y))
        if device == "cuda":
            fns[f"launch_floor/{label}"] = (lambda m=m: m._launch_empty(dev, stream))
    return fns


def render(rows: list, env: dict) -> str:
    lines = [
        "# Host cost: this tree against a base build, one process",
        "",
        f"{env['device']}, torch {env['torch']}, Python {env['python']}, tree {env['git_sha']}, "
        f"base {env['base']}, grad mode {'on' if env['grad_mode'] else 'off'}, host probe "
        f"{env['host_probe_start_us']} / {env['host_probe_us']} "
        "µs (start / end). Host µs per call (median of per-round block medians) and the "
        "ratio this/base across rounds (median, p10-p90).",
        "",
        "| call | this µs | base µs | this/base (p10-p90) |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['call']} | {r['this_us']:.2f} | {r['base_us']:.2f} | "
                     f"{r['ratio']:.3f} ({r['p10']:.3f}-{r['p90']:.3f}) |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="path of the other build's _C*.so")
    p.add_argument("--base-tree", default="unknown", help="the base build's tree, for the record")
    p.add_argument("--calls", type=int, default=4000, help="timed calls per contender")
    p.add_argument("--no-grad", action="store_true",
                   help="time with torch's grad mode off (as under torch.no_grad())")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error(f"--calls must be >= 1, got {args.calls}")
    report.start_run()
    torch.set_grad_enabled(not args.no_grad)
    base = load_base(args.base)
    device = "cuda" if torch.cuda.is_available() and ragvit.cuda_available() else "cpu"
    fns = calls({"this": ragvit._C, "base": base}, device)
    got = {name: fn() for name, fn in fns.items() if name.startswith("attention_alloc")}
    if not torch.equal(got["attention_alloc/this"], got["attention_alloc/base"]):
        print("the two builds' attention results differ")
        return 1
    print("all results match")
    names = sorted({name.split("/")[0] for name in fns})
    stats, ratios = timing.host_us_interleaved(
        fns, {n: (f"{n}/this", f"{n}/base") for n in names}, calls=args.calls)
    rows = [{"call": n, "this_us": stats[f"{n}/this"].median, "base_us": stats[f"{n}/base"].median,
             "ratio": ratios[n].median, "p10": ratios[n].p10, "p90": ratios[n].p90}
            for n in names]
    return report.publish(rows, 0, render, args.out, device=device, calls=args.calls,
                          base=args.base_tree, grad_mode=not args.no_grad)


if __name__ == "__main__":
    raise SystemExit(main())
