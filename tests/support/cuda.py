"""CUDA helpers of the GPU tests: graph capture, streams, the debug switch and the device
error flag.

Kernels never trust device contents (cu_seqlens, indices, capacities): they stay in bounds
and OR error bits into a per-device flag, which a debug-mode call reads back and clears
(raising ValueError). call_with_debug runs a call on such contents both ways. Only used by
tests marked with gpu_marks() or flagged_contents_test.
"""

from __future__ import annotations

import pytest
import torch

import ragvit
from support.devices import requires_cuda


def capture_graph(fn, *, capture_on_side_stream=False) -> torch.cuda.CUDAGraph:
    """Runs fn once on a side stream, then captures fn into a CUDA graph and returns it.

    The eager run does the first-call work (per-device setup, a stream's cuBLASLt
    workspace) outside the capture. capture_on_side_stream captures on that same stream
    (what a workspace tied to the stream needs), otherwise on torch.cuda.graph's own.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side if capture_on_side_stream else None):
        fn()
    return graph


def sleep_then(stream, fn, cycles=200_000_000):
    """Queues a long spin (~0.1 s) and then fn() on stream: work launched on any other
    stream runs before fn's effects land."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        fn()


def drain_device_error_flag():
    """Kernels OR error bits into the device's flag even with debug off; only a debug-mode
    call reads (and clears) it. After a garbage call with debug off, a throwaway debug-mode
    call consumes any stale bits, so no later test sees them."""
    ragvit.set_debug(True)
    packed = torch.zeros((1, 4), device="cuda")
    try:
        ragvit.segment_mean(packed, torch.tensor([0, 1], dtype=torch.int32, device="cuda"))
    except ValueError:
        pass
    torch.cuda.synchronize()


def flagged_contents_test(fn):
    """Marks a test of device contents a kernel must flag (it runs call_with_debug): a GPU
    test, small enough for compute-sanitizer, parametrized over the debug switch (ids
    debug / no_debug)."""
    fn = pytest.mark.parametrize("debug", [True, False], ids=["debug", "no_debug"])(fn)
    for mark in (requires_cuda, pytest.mark.sanitizer, pytest.mark.gpu):
        fn = mark(fn)
    return fn


def call_with_debug(call, debug: bool, pattern: str, inspect=None):
    """call() on device contents a kernel must flag (garbage cu_seqlens, too little room).

    With debug on, the call must raise ValueError matching pattern (the read-back of the
    flag, which clears it). With debug off, it must return; inspect() may then look at what
    it wrote, and the flag's bits are drained. Synchronizes before returning.
    """
    ragvit.set_debug(debug)
    if debug:
        with pytest.raises(ValueError, match=pattern):
            call()
    else:
        call()
        torch.cuda.synchronize()
        if inspect is not None:
            inspect()
        drain_device_error_flag()
    torch.cuda.synchronize()


# Garbage cu_seqlens for a packed input of 24 rows (repack_into, gather_prefix,
# segment_mean): kernels must stay inside packed and their outputs whatever these say.
GARBAGE_PACKED_CU_SEQLENS = {
    "decreasing": [0, 20, 10, 24],
    "past_T": [0, 10, 24 + 1000],
    "far_past_T": [0, 2**31 - 1],
    "negative": [-100, 10, 24],
}
