"""Host cost of one ragvit.attention call on the CPU, for profiling the Python → C path.

A (T=1, H=1, D=32) problem of torch CPU tensors, q/k/v views of one (T, 3, H, D) buffer,
so the C glue (argument parsing, five exchange-API imports, validation, result) dominates
and the CPU kernel is a 32-element dot product. Modes: out (out= given), alloc (out
allocated through torch's exchange API), none (the loop alone).

    python dev/host_call_cpu.py out            # best of 5 loops, ns per call
    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=py_attention \\
        python dev/host_call_cpu.py out 2000   # Ir inside py_attention / 11000 calls
"""

import sys
import time

import torch

import ragvit

T, H, D = 1, 1, 32
qkv = torch.randn(T, 3, H, D)
q, k, v = qkv.unbind(1)
cu = torch.tensor([0, T], dtype=torch.int32)
out = torch.empty(T, H, D)
attention = ragvit.attention


def loop_out(n):
    for _ in range(n):
        attention(q, k, v, cu, 1, out=out)


def loop_alloc(n):
    for _ in range(n):
        attention(q, k, v, cu, 1)


def loop_none(n):
    for _ in range(n):
        pass


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "out"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    fn = {"out": loop_out, "alloc": loop_alloc, "none": loop_none}[mode]
    fn(1000)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        fn(n)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    print(f"{mode}: {best:.0f} ns/call ({1000 + 5 * n} calls)")


if __name__ == "__main__":
    main()
