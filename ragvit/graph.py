"""ragvit.cuda_graph(model): a model's forward replayed as CUDA graphs, one per input shape.

At batch 1 a DeiT forward is host-bound: ~180 eager ops of 10-30 µs of host time each
against a few µs of GPU work apiece. `cuda_graph` captures the whole forward (patched and
pruned, or a plain timm model as a baseline) once per (shape, dtype, device, autocast)
into a CUDA graph with a static input buffer, and afterwards copies the input in, replays
the graph on the caller's current stream and returns the output. Graphs live in an LRU
cache of `max_graphs` entries that share one memory pool per device; a call with the key
of an earlier one is one C call (`ragvit._C.graph_replay`: copy in, launch, copy out),
whose host cost is what batch 1 waits for. Decision that is
not obvious: data-dependent pruning (ThresholdL2 threshold=, ATS) reads per-image counts
on the host in an eager forward, which cannot be captured, so every capture runs the
patched model in capacity mode (timm_patch.graph_capture): buffers keep their worst-case
row count and only the device knows the real lengths. That is exact, and it costs GPU
work; see `cuda_graph`'s docstring for when eager is faster.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from . import _C, ops, timm_patch

__all__ = ["CudaGraphFallbackWarning", "GraphCacheInfo", "GraphedModel", "cuda_graph"]


class CudaGraphFallbackWarning(RuntimeWarning):
    """ragvit.cuda_graph ran a call eagerly (issued once per reason and wrapper)."""


class GraphCacheInfo(NamedTuple):
    """Counters of a GraphedModel (see GraphedModel.cache_info)."""

    hits: int  # calls that replayed an existing graph
    captures: int  # graphs captured (a call with a new key; also after an eviction or reset)
    evictions: int  # graphs dropped to stay within max_graphs
    eager_calls: int  # calls that ran eagerly (see CudaGraphFallbackWarning)
    num_graphs: int  # graphs held now
    max_graphs: int


class _LRU:
    """A mapping bounded to `maxsize` entries; the least recently used one goes first.

    Eviction returns the dropped (key, value) pairs instead of dropping them, so the caller
    can wait for a graph's last replay before its buffers are freed.
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._items: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        """Keys, least recently used first."""
        return list(self._items)

    def get(self, key):
        """The value of key (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def reserve(self) -> list:
        """Evicts until one more entry fits; returns the evicted (key, value) pairs."""
        evicted = []
        while self._items and len(self._items) >= self.maxsize:
            evicted.append(self._items.popitem(last=False))
        return evicted

    def put(self, key, value) -> list:
        """Inserts key as the most recently used; returns what had to be evicted."""
        self._items[key] = value
        self._items.move_to_end(key)
        evicted = []
        while len(self._items) > self.maxsize:
            evicted.append(self._items.popitem(last=False))
        return evicted

    def items(self) -> list:
        """(key, value) pairs, least recently used first."""
        return list(self._items.items())

    def pop_all(self) -> list:
        """Removes and returns every (key, value) pair."""
        items = list(self._items.items())
        self._items.clear()
        return items


class _Graph:
    """One captured forward: the graph, its static input and outputs, what they read."""

    __slots__ = ("device", "exec_handle", "graph", "keepalive", "kind", "outputs", "replay_outputs",
                 "static_x")

    def __init__(self, graph, static_x, outputs, kind, keepalive, device):
        self.graph = graph
        self.static_x = static_x  # (x's shape) outside the pool, written by every call
        self.outputs = outputs  # tuple of tensors in the graph's pool
        self.kind = kind  # None: one tensor; tuple or list
        self.keepalive = keepalive  # the patched model's cu_seqlens cache used in capture
        self.device = device
        # The graph's cudaGraphExec_t for _C.graph_replay once the first replay showed the C
        # call replays it as torch does (_replay_handle); 0: torch replays it; None: not known
        self.exec_handle = None
        self.replay_outputs = outputs[0] if kind is None else outputs  # as graph_replay takes them

    def used_on(self, stream) -> None:
        """Tells the caching allocator that replays on `stream` read the tensors this graph
        keeps outside its pool, so freeing them later waits for those replays."""
        self.static_x.record_stream(stream)
        for t in (self.keepalive or {}).values():
            t.record_stream(stream)



def _flatten(out):
    """(tuple of tensors, kind) of a forward's result; kind None for a single tensor."""
    if isinstance(out, torch.Tensor):
        return (out,), None
    if type(out) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out), type(out)
    raise TypeError("ragvit.cuda_graph: the model must return a tensor or a tuple/list of "
                    f"tensors, got {type(out).__name__}")


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # 0.2 µs vs 7.6 µs


def _raw_stream(device_index: int) -> int:
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


# The dtypes _C.graph_replay takes (ragvit's).
_REPLAY_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                            torch.int32, torch.int64, torch.uint8, torch.bool})
# Global replay hooks that torch's CUDAGraph.replay() runs (profilers register them; torch
# versions without them: none). While one is registered, calls replay through torch.
_TORCH_REPLAY_HOOKS = tuple(
    hooks for hooks in (getattr(torch.cuda.graphs, "_global_replay_start_hooks", None),
                        getattr(torch.cuda.graphs, "_global_replay_end_hooks", None))
    if hooks is not None)


def _default_generator(device_index: int):
    """The device's default CUDA generator, or None if torch does not expose it."""
    try:
        return torch.cuda.default_generators[device_index]
    except (AttributeError, IndexError, RuntimeError):  # pragma: no cover
        return None


def _rng_offset(generator) -> int | None:
    try:
        return generator.get_offset()
    except (AttributeError, RuntimeError):  # pragma: no cover
        return None


def _replay_handle(entry: _Graph, generator, offset_before) -> int:
    """The graph's cudaGraphExec_t when _C.graph_replay replays it as torch's replay() does,
    else 0. torch's replay() launches the graph on the current stream of its device after
    a prologue per random generator the capture drew from (it refills the graph's seed and
    offset and advances the generator); that prologue does nothing for a graph that drew
    no random numbers, which is what an unchanged offset of the device's default generator
    across the first replay shows. The C call also needs tensors it can copy whole."""
    if not _C.cuda_is_compiled() or len(entry.outputs) > _C.GRAPH_MAX_OUTPUTS:
        return 0
    for t in (entry.static_x, *entry.outputs):
        if (t.dtype not in _REPLAY_DTYPES or t.dim() > _C.MAX_DIMS
                or not t.is_contiguous()):
            return 0
    if offset_before is None or _rng_offset(generator) != offset_before:
        return 0
    raw = getattr(entry.graph, "raw_cuda_graph_exec", None)
    if raw is None:  # pragma: no cover (torch before raw_cuda_graph_exec)
        return 0
    try:
        handle = raw()
    except RuntimeError:  # pragma: no cover
        return 0
    return handle if isinstance(handle, int) else 0


def _autocast_key():
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


class GraphedModel:
    """The callable `cuda_graph` returns; see there. Not thread-safe."""

    def __init__(self, model: torch.nn.Module, max_graphs: int, clone_output: bool,
                 warmup: int):
        self.model = model
        self.clone_output = clone_output
        self.warmup = warmup
        self._graphs = _LRU(max_graphs)
        self._pools: dict[int, Any] = {}
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self._forward = vars(model).get("forward")  # patch/unpatch replace it
        self._stream_key = None  # (device, raw stream) of the last replay
        self._last_key = self._last_entry = None  # the last call's key and graph
        self._stream = None
        self._warned: set[str] = set()
        self._hits = self._captures = self._evictions = self._eager_calls = 0

    @property
    def max_graphs(self) -> int:
        """The most graphs held at once (cuda_graph's max_graphs); the least recently used
        one is dropped to make room."""
        return self._graphs.maxsize

    def __repr__(self) -> str:
        return (f"GraphedModel({type(self.model).__name__}, graphs={len(self._graphs)}/"
                f"{self.max_graphs}, clone_output={self.clone_output})")

    def cache_info(self) -> GraphCacheInfo:
        """Hits, captures, evictions, eager calls, graphs held now and the bound."""
        return GraphCacheInfo(self._hits, self._captures, self._evictions, self._eager_calls,
                              len(self._graphs), self.max_graphs)

    def cached_keys(self) -> list:
        """(shape, dtype, device, autocast dtype or None) of the graphs held, least recently
        used first."""
        return [(shape, dtype, torch.device("cuda", index), amp)
                for shape, dtype, index, amp in self._graphs.keys()]

    def clear(self) -> None:
        """Drops every graph (after their replays finish); the next call captures anew.

        Call it after replacing the model's parameter tensors (`model.half()`, `.to()`,
        `load_state_dict(..., assign=True)`): graphs would read freed memory otherwise.
        """
        self._last_key = self._last_entry = None
        self._drop(self._graphs.pop_all())

    def __call__(self, x: torch.Tensor):
        """The model's output for x: replayed from a graph, captured on first sight of
        x's shape, dtype, device and autocast state (or eager, see `cuda_graph`)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ragvit.cuda_graph: input must be a torch.Tensor, got "
                            f"{type(x).__name__}")
        model = self.model
        if model.training:
            return self._eager(x, "the model is in training mode (call model.eval())")
        if torch.is_grad_enabled():
            return self._eager(x, "gradients are enabled (call it under "
                                  "torch.inference_mode() or torch.no_grad())")
        if not x.is_cuda:
            return self._eager(x, f"the input is on the {x.device.type}, not on a CUDA device")
        forward = vars(model).get("forward")
        if forward is not self._forward:  # patched, unpatched or re-patched since capture
            self.clear()
            self._forward = forward
        # the device as its index: x.device builds a torch.device object on every call
        key = (x.shape, x.dtype, x.get_device(), _autocast_key())
        if key == self._last_key:  # the same input as the last call: already most recent
            entry = self._last_entry
            self._hits += 1
        else:
            entry = self._graphs.get(key)
            if entry is None:
                reason = self._capture_blocker()
                if reason is not None:
                    return self._eager(x, reason)
                entry = self._capture(key, x)
            else:
                self._hits += 1
            self._last_key, self._last_entry = key, entry
        stream_key = (entry.device, _raw_stream(entry.device))
        if stream_key != self._stream_key:
            self._follow(stream_key)
        if (entry.exec_handle and self.clone_output and x.is_contiguous()
                and not any(_TORCH_REPLAY_HOOKS)):
            out = _C.graph_replay(entry.exec_handle, x, entry.static_x, entry.replay_outputs)
            return list(out) if entry.kind is list else out
        entry.static_x.copy_(x)
        if entry.exec_handle is None:
            generator = _default_generator(entry.device)
            offset = None if generator is None else _rng_offset(generator)
            entry.graph.replay()
            entry.exec_handle = _replay_handle(entry, generator, offset)
        else:
            entry.graph.replay()
        if not self.clone_output:
            return entry.outputs[0] if entry.kind is None else entry.kind(entry.outputs)
        if entry.kind is None:
            return entry.outputs[0].clone()
        return entry.kind(t.clone() for t in entry.outputs)

    # ---- helpers ----

    def _eager(self, x, reason: str):
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"ragvit.cuda_graph: running the model eagerly: {reason}",
                          CudaGraphFallbackWarning, stacklevel=3)
        self._eager_calls += 1
        return self.model(x)

    def _capture_blocker(self) -> str | None:
        if timm_patch.is_patched(self.model) and ops.is_debug():
            return ("ragvit debug mode is on (it synchronizes after every op); "
                    "ragvit.set_debug(False) to capture")
        if torch.cuda.is_current_stream_capturing():
            return "called while another CUDA graph is being captured"
        return None

    def _follow(self, stream_key) -> None:
        """Orders this call's stream after everything the previous call's stream queued
        (its replay and output copy): graphs share their static buffers and pool."""
        current = torch.cuda.current_stream(stream_key[0])
        if self._stream is not None:
            current.wait_stream(self._stream)
        for _, entry in self._graphs.items():
            if entry.device == stream_key[0]:
                entry.used_on(current)
        self._stream, self._stream_key = current, stream_key

    def _drop(self, evicted: list) -> None:
        """Frees evicted graphs once the GPU is done with them (a graph is not destroyed
        mid-replay; its outputs go back to the pool the next capture draws from)."""
        for device in {entry.device for _, entry in evicted}:
            torch.cuda.synchronize(device)
        evicted.clear()

    def _capture(self, key, x: torch.Tensor) -> _Graph:
        self._last_key = self._last_entry = None  # the last call's graph may be evicted
        evicted = self._graphs.reserve()
        self._evictions += len(evicted)
        self._drop(evicted)
        dev = x.get_device()
        autocast_dtype = key[3]
        amp = (torch.autocast("cuda", dtype=autocast_dtype, cache_enabled=False)
               if autocast_dtype is not None else contextlib.nullcontext())
        # Static buffers are normal tensors (not inference tensors), so calls both inside
        # and outside torch.inference_mode can copy into them.
        with torch.cuda.device(dev), torch.inference_mode(False), torch.no_grad(), amp:
            caller = torch.cuda.current_stream()
            side = self._side_streams.get(dev)
            if side is None:  # one per device: warm-ups and captures (pool sharing wants it)
                side = self._side_streams[dev] = torch.cuda.Stream()
            pool = self._pools.get(dev)
            if pool is None:
                pool = self._pools[dev] = torch.cuda.graph_pool_handle()
            static_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            static_x.copy_(x)
            side.wait_stream(caller)
            with timm_patch.graph_capture(self.model) as keepalive:
                with torch.cuda.stream(side):  # warm-up off the caller's stream
                    for _ in range(self.warmup - 1):
                        _flatten(self.model(static_x))
                    # The last warm-up refuses host syncs: a forward that syncs would fail
                    # mid-capture, and torch leaves its CUDA generator in capture mode after
                    # a failed capture (later torch.randn on the device raises).
                    _check_sync_free(lambda: _flatten(self.model(static_x)), side)
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=side):
                        outputs, kind = _flatten(self.model(static_x))
                except Exception as e:
                    torch.cuda.set_stream(caller)  # graph's __exit__ may not have restored it
                    rearm_generators()
                    raise RuntimeError(f"{_CAPTURE_FAILED}: {type(e).__name__}: {e}") from e
            caller.wait_stream(side)
            entry = _Graph(graph, static_x, outputs, kind, keepalive, dev)
            entry.used_on(caller)  # later streams: _follow
        self._graphs.put(key, entry)
        self._captures += 1
        return entry


_CAPTURE_FAILED = ("ragvit.cuda_graph: capturing the forward failed (something in it "
                   "synchronizes with the host or is not capturable, e.g. a policy calling "
                   ".item() or nonzero)")


def rearm_generators() -> None:
    """Leaves torch's CUDA random generators usable after a failed capture.

    A capture that fails never runs the generators' capture epilogue, so they stay in capture
    mode and the next torch.randn on the device raises ("Offset increment outside graph
    capture"). One empty capture runs their prologue and epilogue again."""
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        pass


def _check_sync_free(fn, stream) -> None:
    """Runs fn() with torch's sync debug mode set to raise; RuntimeError if it syncs."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        raise RuntimeError(f"{_CAPTURE_FAILED}: {e}") from e
    finally:
        torch.cuda.set_sync_debug_mode(before)
    stream.synchronize()


def cuda_graph(model: torch.nn.Module, *, max_graphs: int = 8, clone_output: bool = True,
               warmup: int = 3) -> GraphedModel:
    """Wraps a model so each input shape runs as one captured CUDA graph (batch-1 latency).

    The first call with a new (shape, dtype, device, autocast dtype) key runs `warmup`
    eager forwards on a side stream, captures one forward into a CUDA graph that reads a
    static copy of the input, and replays it; later calls with that key copy the input
    in, replay the graph on the caller's current stream and return the output. Use it
    under torch.inference_mode() or torch.no_grad(), with the model in eval.

    Those three steps are one C call (`ragvit._C.graph_replay` instead of three torch
    calls: about 0.8x their host time on an H200, benchmarks/bench_graph_call.py) when
    the forward draws no random numbers, returns at most 6 contiguous tensors of ragvit's
    dtypes, the input is contiguous and clone_output is True; otherwise torch's copy_,
    replay() and clone() run them.

    Pruning policies: fixed-count ones (ThresholdL2 keep=, EViT, ToMe, DynamicViT) are
    captured exactly as they run eagerly. Data-dependent ones (ThresholdL2 threshold=,
    ATS) are captured in capacity mode whatever `patch(..., capacity=)` says (the switch
    lasts only for the warm-up and capture; eager calls of the model are unchanged):
    after the first ragged pruning point every block's LayerNorm and linear layers run
    over the worst-case row count (B·L rows before that point) with the real lengths known
    only on the device, so the MLP/projection work is not pruned (attention is: its
    grid is bounded by the policy's max_seqlen and blocks past a sequence's length exit).
    That is the right trade while the forward is host-bound (batch 1 to ~16 on an H200,
    where eager costs ms of host time); at large batches, where the GPU is the bottleneck,
    the eager patched model (one host read per pruning stage, only kept rows computed)
    is faster. Fixed-count policies pay nothing extra.

    Eager fallback (a CudaGraphFallbackWarning once per reason and wrapper; the model is
    called as is): CPU inputs, a model in training mode, gradients enabled (an unpatched
    model then gets autograd; a patched one raises its usual RuntimeError), ragvit debug
    mode on, or a call during another graph's capture. Never replayed silently stale: a
    model patched, unpatched or re-patched after a capture is captured anew.

    Memory: the graphs of one wrapper share a memory pool per device (intermediates are
    reused across shapes, so N graphs cost about one forward's activations plus their
    outputs); at most `max_graphs` graphs are held, least recently used evicted first
    (an evicted graph's memory is reused by later captures and released with the
    wrapper). Replays allocate nothing but the returned copy.

    The graphs read the model's parameters in place: in-place updates (load_state_dict,
    copy_) are seen by later replays; after replacing parameter tensors (model.half(),
    .to(), load_state_dict(..., assign=True)) call `.clear()` (not detected: the graphs
    would read freed memory).

    Args:
        model: a torch.nn.Module taking one tensor (a ragvit-patched timm ViT, or any
            capturable model, e.g. an unpatched timm ViT as a baseline) returning a tensor
            or a tuple/list of tensors.
        max_graphs: graphs held at most (an int >= 1).
        clone_output: True: return fresh tensors (one extra device copy per call).
            False: return the graph's static output tensor itself, valid until the next
            call of this wrapper with any shape (graphs share their pool).
        warmup: eager forwards before each capture (an int >= 1; cuBLAS handles and
            lazy initialisation must not happen during capture).

    Returns:
        A GraphedModel: call it with the input tensor; `.cache_info()`, `.cached_keys()`,
        `.clear()`, `.model`.

    Raises:
        TypeError: model is not a torch.nn.Module, max_graphs or warmup is not an int,
            clone_output is not a bool. Calls: the input is not a tensor, or the model
            returns something other than a tensor or a tuple/list of tensors.
        ValueError: max_graphs or warmup < 1.
        RuntimeError (at a call): the capture failed (the forward synchronizes with the
            host: e.g. a custom policy calling .item()); the message names the cause.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ragvit.cuda_graph: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for name, value in (("max_graphs", max_graphs), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"ragvit.cuda_graph: {name} must be an int >= 1, got "
                            f"{type(value).__name__}")
        if value < 1:
            raise ValueError(f"ragvit.cuda_graph: {name} must be an int >= 1, got {value}")
    if not isinstance(clone_output, bool):
        raise TypeError(f"ragvit.cuda_graph: clone_output must be a bool, got "
                        f"{type(clone_output).__name__}")
    return GraphedModel(model, max_graphs, clone_output, warmup)
