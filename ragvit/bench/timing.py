"""The one timer of ragvit's benchmarks, ragvit.demo and `python -m ragvit.bench`.

Host µs (host_us, host_us_interleaved): perf_counter_ns per call, medians; contenders run in
alternating blocks so clock drift cancels in per-round ratios. GPU µs (gpu_us_graph(s)):
CUDA-graph replays timed with CUDA events, warm-up by time, L2 flushed before each replay,
contenders in blocks whose order rotates. End-to-end ms (time_ms, interleaved_ms): CUDA events
around each call (perf_counter on the CPU), contenders interleaved call by call. Never a
single sample. torch is imported only where a GPU is timed: the host timers run without it.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import dataclass

__all__ = [
    "GraphTimer", "L2Flusher", "Stats", "cuda_sync", "gpu_us_graph", "gpu_us_graphs",
    "host_us", "host_us_interleaved", "interleaved_ms", "rotated_blocks", "time_ms",
]


@dataclass
class Stats:
    """Per-call time in µs or ms (or a ratio): median and the 10/20/80/90th percentiles."""

    median: float
    p20: float
    p80: float
    p10: float = float("nan")
    p90: float = float("nan")

    def __str__(self) -> str:
        return f"{self.median:.2f}"


def _stats(samples: list[float]) -> Stats:
    if len(samples) == 1:  # quantiles need two points; one sample is its own spread
        samples = samples * 2
    median = statistics.median(samples)
    # quantiles interpolates as (a * (n - d) + b * d) / n, which for tied samples a == b can
    # land an ulp off a: keep the percentiles within the samples and ordered
    lo, hi = min(samples), max(samples)
    p10, p20, _, _, _, _, _, p80, p90 = (min(max(q, lo), hi) for q in
                                          statistics.quantiles(samples, n=10, method="inclusive"))
    p20 = min(p20, median)
    p80 = max(p80, median)
    return Stats(median, p20, p80, min(p10, p20), max(p90, p80))


def cuda_sync() -> None:
    """torch.cuda.synchronize() when torch is loaded and sees a GPU; otherwise nothing.

    Looks torch up in sys.modules instead of importing it: a process that never imported
    torch has queued no torch work, and the host timers stay usable without torch."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int = 1000, warmup: int = 50, sync=cuda_sync,
            sync_every: int = 200) -> Stats:
    """Host µs per call of fn() (Python → enqueued), over `calls` calls after `warmup`.

    sync() runs after the warm-up, after every `sync_every` timed calls (so the launch queue
    never fills up and blocks a launch: 1 for calls that each enqueue a whole forward) and
    at the end; it is not timed."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1e3)
        if len(samples) % sync_every == 0:
            sync()
    sync()
    return _stats(samples)


def host_us_interleaved(fns: dict, pairs: dict, calls: int = 2000, block: int = 50,
                        warmup: int = 50, sync=cuda_sync) -> tuple[dict, dict]:
    """Host µs per call of each fn in `fns` (name -> callable), measured side by side.

    Every round runs one block of `block` calls of each fn (untimed sync and three
    untimed calls before each block; the order rotates every round), each call timed
    with perf_counter_ns; calls // block rounds in all (at least 2), GC off meanwhile. So
    the floor and the op see the same clock, frequency and queue state, and drift between
    them cancels in the per-round ratio.

    Returns (stats, ratios): stats[name].median is the median of the per-round block
    medians, p10..p90 are over all calls; ratios[key] for pairs[key] = (num, den) holds
    the median and p10..p90 across rounds of median(num block) / median(den block).
    """
    names = list(fns)
    rounds = max(2, calls // block)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    sync()
    clock = time.perf_counter_ns
    samples = {name: [] for name in names}
    round_medians = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                fn = fns[name]
                sync()  # every block starts from an empty queue
                for _ in range(3):
                    fn()
                block_samples = []
                for _ in range(block):
                    t0 = clock()
                    fn()
                    block_samples.append((clock() - t0) / 1e3)
                samples[name] += block_samples
                round_medians[name].append(statistics.median(block_samples))
        sync()
    finally:
        if gc_was_enabled:
            gc.enable()
    stats = {}
    for name in names:
        s = _stats(samples[name])
        s.median = statistics.median(round_medians[name])
        stats[name] = s
    ratios = {
        key: _stats([a / b for a, b in zip(round_medians[num], round_medians[den], strict=True)])
        for key, (num, den) in pairs.items()
    }
    return stats, ratios


class L2Flusher:
    """Writes a buffer larger than the L2 so each timed replay starts cold."""

    def __init__(self, nbytes: int = 256 << 20):
        import torch

        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")

    def __call__(self):
        self.buf.zero_()


class GraphTimer:
    """fn() captured `calls_per_graph` times in one CUDA graph (after three eager calls on a
    side stream). Each call of the timer replays it for `warmup_s` seconds, each replay
    waited for (so the warm-up is that much GPU time, not however many replays the host can
    queue in it: seconds of backlog behind a slow fn), then times `reps` replays with CUDA
    events (L2 flushed before each by `flusher`, if given) and returns the GPU µs per fn()
    of each replay. Capture errors (a non-capturable fn) propagate from the constructor,
    torch's CUDA generators left usable (ragvit.graph.rearm_generators)."""

    def __init__(self, fn, calls_per_graph: int = 20, warmup_s: float = 0.05,
                 flusher: L2Flusher | None = None):
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(self.graph):
                for _ in range(calls_per_graph):
                    fn()
        except Exception:
            from ..graph import rearm_generators

            torch.cuda.set_stream(caller)  # the graph's __exit__ may not have restored it
            rearm_generators()  # torch's generators stay usable after a failed capture
            raise
        self.calls_per_graph, self.warmup_s, self.flusher = calls_per_graph, warmup_s, flusher

    def __call__(self, reps: int) -> list[float]:
        import torch

        deadline = time.perf_counter() + self.warmup_s
        while True:
            self.graph.replay()
            torch.cuda.synchronize()
            if time.perf_counter() >= deadline:
                break
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            if self.flusher is not None:
                self.flusher()
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / self.calls_per_graph)
        return samples


def gpu_us_graph(fn, calls_per_graph: int = 20, reps: int = 50, warmup_s: float = 0.05,
                 flusher: L2Flusher | None = None) -> Stats:
    """GPU µs per call of fn(), from CUDA-graph replays of `calls_per_graph` calls."""
    return _stats(GraphTimer(fn, calls_per_graph, warmup_s, flusher)(reps))


def rotated_blocks(timers: dict, rounds: int = 3, reps: int = 50) -> dict:
    """Runs `rounds` rounds of one block per timer (name -> callable(reps) returning `reps`
    samples), the order rotating by one each round, and returns {name: Stats} over each
    timer's rounds x reps samples."""
    if rounds < 1 or reps < 1:
        raise ValueError(f"rotated_blocks: rounds and reps must be >= 1, got {rounds}, {reps}")
    names = list(timers)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            samples[name] += timers[name](reps)
    return {name: _stats(samples[name]) for name in names}


def gpu_us_graphs(fns: dict, rounds: int = 3, reps: int = 50, calls_per_graph: int = 20,
                  warmup_s: float = 0.05, flusher: L2Flusher | None = None) -> dict:
    """GPU µs per call of each fn in `fns` (name -> callable) that a CUDA graph can capture,
    compared side by side: each captured once (GraphTimer), then timed in `rounds` rotating
    rounds of sequential blocks (rotated_blocks): within a block a fn runs alone, warmed up
    for `warmup_s` on its own graph, as gpu_us_graph times it. A fn whose capture fails is
    left out of the result (the caller reports it as not timed)."""
    timers = {}
    for name, fn in fns.items():
        try:
            timers[name] = GraphTimer(fn, calls_per_graph, warmup_s, flusher)
        except Exception:  # noqa: BLE001  (not capturable, e.g. NestedTensor)
            continue
    return rotated_blocks(timers, rounds, reps)


def time_ms(fn, device: str = "cuda", warmup: int = 10, reps: int = 50) -> Stats:
    """Milliseconds per fn() over `reps` calls after `warmup`: CUDA events around each call
    (device "cuda"), perf_counter on the CPU. End-to-end timing of one callable."""
    return interleaved_ms({"fn": fn}, warmup, reps, device)["fn"]


def interleaved_ms(fns: dict, warmup: int = 10, reps: int = 50, device: str = "cuda",
                   burst: int = 1) -> dict:
    """Milliseconds per call of each fn in `fns` (name -> callable), timed side by side.

    After `warmup` calls of each, `reps` rounds run every fn `burst` times back to back
    (the order of the fns rotating each round) and time the last of those calls alone:
    CUDA events around it (device "cuda", synchronized after) or perf_counter (CPU). A
    stretch of host noise (another process, a clock change) then lands on every pipeline
    of a row alike instead of on whichever happened to be timed during it, which matters
    for host-bound (small-batch) forwards. burst > 1 times each fn in its steady state
    (its own weights back in L2 after the other fns ran), as a model served alone runs.

    Returns:
        {name: Stats} (median, p20/p80, p10/p90 over that fn's `reps` calls; at least one).

    Raises:
        ValueError: burst < 1.
    """
    if burst < 1:
        raise ValueError(f"interleaved_ms: burst must be >= 1, got {burst}")
    names = list(fns)
    gpu = device == "cuda"
    if gpu:
        import torch
    for name in names:
        for _ in range(warmup):
            fns[name]()
    if gpu:
        torch.cuda.synchronize()
    samples = {name: [] for name in names}
    for r in range(max(reps, 1)):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            for _ in range(burst - 1):
                fns[name]()
            if gpu:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: _stats(samples[name]) for name in names}
