"""fused_block_check.py — the fused block kernel (dev/fused_block.cu) beside ragvit's present
path, on the same timm block, weights and packed rows.

For each case (DeiT-S and DeiT-B blocks at the row counts of batch 1-16 after pruning, and
ragged lengths 1, 197, 50) it runs one block three ways: the fused kernel, ragvit's present
path (the patched forward's own block code: ragvit.layer_norm, ragvit.linear on cuBLASLt with
the residual in the GEMM, ragvit.attention, ragvit.gelu) and a float64 reference in torch. The
present path's own error against float64 is the bar: the kernel passes where its error is at
most twice that plus 1e-3 (fp16; 8e-3 bf16), every value is finite and its output equals the
present path's to the same bar. Then GPU µs per block of both, each as a CUDA graph of 12
blocks back to back (the blocks of a forward; the weights stay in L2, as in the bench of
fused_block.cu), timed in three rotating rounds of --reps replays each
(ragvit.bench.timing.gpu_us_graphs), median.

Build the kernel as a library, then run (a CUDA GPU of compute capability 9.0; torch, timm and
a built ragvit):
  nvcc -std=c++17 -O3 -Xcompiler -fPIC -shared -DFUSED_BLOCK_LIBRARY -Icsrc/include \\
    -Icsrc/kernels -gencode=arch=compute_90a,code=sm_90a dev/fused_block.cu \\
    -o dev/libfused_block.so
  python3 dev/fused_block_check.py [--lib dev/libfused_block.so] [--reps 50]
      [--barrier generation|flip]
It prints a table and exits 1 if a case fails its check.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys

import torch

from ragvit.bench import timing

BLOCKS_PER_GRAPH = 12
MODELS = {"deit-s": ("deit_small_patch16_224", 384), "deit-b": ("deit_base_patch16_224", 768)}
CASES = [  # (model, dtype, sequence lengths)
    ("deit-s", torch.float16, [99]),
    ("deit-s", torch.float16, [197]),
    ("deit-s", torch.float16, [99] * 4),
    ("deit-s", torch.float16, [99] * 16),
    ("deit-s", torch.float16, [1, 197, 50]),
    ("deit-s", torch.bfloat16, [99]),
    ("deit-b", torch.float16, [99]),
    ("deit-b", torch.float16, [197]),
    ("deit-b", torch.float16, [99] * 4),
]
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
BARRIERS = {"generation": 0, "flip": 1}  # kGenerationBarrier, kFlipBarrier


class Params(ctypes.Structure):
    """fused_block_params of fused_block.cu, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "out", "x", "ln1_w", "ln1_b", "w_qkv", "b_qkv", "w_proj", "b_proj", "ln2_w", "ln2_b",
        "w_fc1", "b_fc1", "w_fc2", "b_fc2", "qkv", "attn", "x1", "hidden", "partials",
        "tile_counters", "barrier", "stamps", "cu_seqlens")] + [
        (name, ctypes.c_int) for name in (
            "num_seqs", "total_tokens", "channels", "num_heads", "max_seqlen", "proj_splits",
            "fc2_splits")] + [("scale_log2", ctypes.c_float), ("is_barriers_only", ctypes.c_int),
                              ("barrier_kind", ctypes.c_int), ("arrivals", ctypes.c_void_p)]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.fused_block_params_size.restype = ctypes.c_size_t
    lib.fused_block_run.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p]
    if lib.fused_block_params_size() != ctypes.sizeof(Params):
        sys.exit(f"{path}: fused_block_params is {lib.fused_block_params_size()} bytes, the "
                 f"mirror here {ctypes.sizeof(Params)}: rebuild the library or update Params")
    return lib


def make_block(model: str, dtype, seed: int):
    """A timm block of the model, random weights, LayerNorm weights and biases randomized too
    (timm initializes them to 1 and 0, which would leave the LN affine path unchecked)."""
    import timm

    torch.manual_seed(seed)
    blk = timm.create_model(MODELS[model][0], pretrained=False).blocks[0]
    with torch.no_grad():
        for norm in (blk.norm1, blk.norm2):
            norm.weight.normal_(1.0, 0.1)
            norm.bias.normal_(0.0, 0.1)
        for linear in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc1, blk.mlp.fc2):
            linear.bias.normal_(0.0, 0.1)
    return blk.eval().to("cuda", dtype)


def reference(blk, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The block in float64, one sequence at a time."""
    p = {k: v.double() for k, v in blk.state_dict().items()}
    x = x.double()
    C = x.shape[1]
    H = blk.attn.num_heads
    D = C // H
    ln = torch.nn.functional.layer_norm
    h = ln(x, (C,), p["norm1.weight"], p["norm1.bias"], blk.norm1.eps)
    qkv = (h @ p["attn.qkv.weight"].T + p["attn.qkv.bias"]).view(-1, 3, H, D)
    o = torch.empty(x.shape[0], H, D, dtype=torch.float64, device=x.device)
    start = 0
    for n in lengths:
        q, k, v = qkv[start:start + n].unbind(1)  # (n, H, D)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        o[start:start + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += n
    x1 = x + o.reshape(-1, C) @ p["attn.proj.weight"].T + p["attn.proj.bias"]
    h2 = ln(x1, (C,), p["norm2.weight"], p["norm2.bias"], blk.norm2.eps)
    hidden = torch.nn.functional.gelu(h2 @ p["mlp.fc1.weight"].T + p["mlp.fc1.bias"])
    return x1 + hidden @ p["mlp.fc2.weight"].T + p["mlp.fc2.bias"]


def present_block(blk, rows: torch.Tensor, cu_seqlens: torch.Tensor, lengths: list[int]):
    """ragvit's present path for one block, as the patched forward runs it on CUDA rows: the
    result is written into rows."""
    from ragvit import ops, timm_patch

    seq_len = lengths[0] if len(set(lengths)) == 1 else None
    cur = timm_patch._Rows(rows, cu_seqlens, seq_len, max(lengths))
    rows, _, _ = timm_patch._attention_half(blk, cur, None, row_ops=ops)
    return timm_patch._mlp_half(blk, rows, ops)


class Fused:
    """The fused kernel's launch for one block: weights from blk, scratch of its own."""

    def __init__(self, lib, blk, x, out, cu_seqlens, lengths, barrier_kind):
        dtype_id = {torch.float16: 0, torch.bfloat16: 1}[x.dtype]
        per_sm = lib.fused_block_occupancy(dtype_id)
        if per_sm < 1:
            sys.exit(f"fused_block_occupancy: {per_sm} (negative: a cudaError_t)")
        self.lib, self.dtype_id = lib, dtype_id
        self.grid = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm
        T, C = x.shape
        proj = lib.fused_block_split_count(C, T, C, self.grid)
        fc2 = lib.fused_block_split_count(4 * C, T, C, self.grid)
        kw = {"device": x.device}
        self.keep = [blk, x, out, cu_seqlens,
                     torch.empty(T, 3 * C, dtype=x.dtype, **kw),
                     torch.empty(T, C, dtype=x.dtype, **kw),
                     torch.empty(T, C, dtype=x.dtype, **kw),
                     torch.empty(T, 4 * C, dtype=x.dtype, **kw),
                     torch.empty(max(proj, fc2), T, C, dtype=torch.float32, **kw),
                     torch.zeros(-(-T // 32) * (C // 64), dtype=torch.int32, **kw),
                     torch.zeros(4, dtype=torch.int32, **kw)]
        qkv, attn, x1, hidden, partials, counters, barrier = self.keep[4:]
        a, m = blk.attn, blk.mlp
        ptr = torch.Tensor.data_ptr
        self.params = Params(
            ptr(out), ptr(x), ptr(blk.norm1.weight), ptr(blk.norm1.bias), ptr(a.qkv.weight),
            ptr(a.qkv.bias), ptr(a.proj.weight), ptr(a.proj.bias), ptr(blk.norm2.weight),
            ptr(blk.norm2.bias), ptr(m.fc1.weight), ptr(m.fc1.bias), ptr(m.fc2.weight),
            ptr(m.fc2.bias), ptr(qkv), ptr(attn), ptr(x1), ptr(hidden), ptr(partials),
            ptr(counters), ptr(barrier), None, ptr(cu_seqlens), len(lengths), T, C,
            a.num_heads, max(lengths), proj, fc2, a.scale * math.log2(math.e), 0,
            barrier_kind, None)
        self.splits = (proj, fc2)

    def __call__(self):
        rc = self.lib.fused_block_run(ctypes.byref(self.params), self.dtype_id, self.grid,
                                      torch.cuda.current_stream().cuda_stream)
        if rc != 0:
            raise RuntimeError(f"fused_block_run: cudaError_t {rc}")


def run_case(lib, model, dtype, lengths, seed, reps, barrier_kind) -> tuple[str, bool]:
    blk = make_block(model, dtype, seed)
    C = MODELS[model][1]
    T = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, C, generator=gen, device="cuda").to(dtype)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    ref = reference(blk, x, lengths)
    with torch.inference_mode():
        present = present_block(blk, x.clone(), cu, lengths)
        out = torch.full_like(x, float("nan"))
        fused = Fused(lib, blk, x, out, cu, lengths, barrier_kind)
        fused()
        torch.cuda.synchronize()
        err_present = float((present.double() - ref).abs().max())
        err_fused = float((out.double() - ref).abs().max())
        diff = float((out.double() - present.double()).abs().max())
        bar = 2 * err_present + FLOOR[dtype]
        ok = bool(torch.isfinite(out).all()) and err_fused <= bar and diff <= bar
        rows = x.clone()
        stats = timing.gpu_us_graphs(
            {"present": lambda: present_block(blk, rows, cu, lengths), "fused": fused},
            rounds=3, reps=reps, calls_per_graph=BLOCKS_PER_GRAPH)
        if "fused" not in stats:
            sys.exit("fused_block_check: the fused launch could not be captured in a CUDA graph")
        us = {name: st.median for name, st in stats.items()}
    shape = (f"{len(lengths)}x{lengths[0]}" if len(set(lengths)) == 1
             else ",".join(map(str, lengths)))
    line = (f"| {model} {shape} | {str(dtype)[6:]} | {T} | {fused.grid} | "
            f"{fused.splits[0]}/{fused.splits[1]} | {err_present:.2e} | {err_fused:.2e} | "
            f"{diff:.2e} | {'ok' if ok else 'FAIL'} | {us['present']:.2f} | "
            f"{us['fused']:.2f} | {us['present'] / us['fused']:.2f} |")
    return line, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default="dev/libfused_block.so")
    p.add_argument("--reps", type=int, default=50, help="timed replays of each graph a round")
    p.add_argument("--barrier", choices=list(BARRIERS), default="generation",
                   help="the fused kernel's grid barrier (fused_block.cu's grid_barrier)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    lib = load(args.lib)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"GPU µs per block in graphs of {BLOCKS_PER_GRAPH} blocks, median of 3 rounds of "
          f"{args.reps} replays; {args.barrier} barrier")
    print("| case | dtype | T | grid | splits | present err | fused err | fused - present | "
          "check | present µs | fused µs | present / fused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for seed, (model, dtype, lengths) in enumerate(CASES):
        line, ok = run_case(lib, model, dtype, lengths, seed, args.reps,
                            BARRIERS[args.barrier])
        print(line, flush=True)
        failures += not ok
    print("ALL PASS" if failures == 0 else f"FAIL: {failures} case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
