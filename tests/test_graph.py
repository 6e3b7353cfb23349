"""ragvit.cuda_graph: replayed CUDA graphs equal the eager forward of the same model.

CPU: argument errors, the eager fallback (one CudaGraphFallbackWarning per reason, outputs
equal to eager), the LRU bound, timm_patch.graph_capture's temporary capacity mode, and the
bench pipeline accepting data-dependent policies, the C replay's argument errors and its
refusal in a CPU-only build, and the rule that picks it. GPU: replays vs eager (fixed-count and
capacity-mode policies, batch 1 and 8, DeiT-S and distilled DeiT-S), fresh inputs per replay,
a poisoned static output, flat memory over 100 replays, streams, autocast, re-patching, and
the C replay (`_C.graph_replay`) against torch's: bitwise equal, fresh outputs, streams,
tuple/list outputs, what falls back to torch, and refused arguments that change nothing.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from support.devices import requires_cuda
from support.inputs import seed_note
from support.tolerances import TOL

timm = pytest.importorskip("timm")

from support.models import (  # noqa: E402
    CPU_ATOL,
    derived_atol,
    images,
    make_model,
    reference_error,
)

import ragvit  # noqa: E402
from ragvit import bench, graph, timm_patch  # noqa: E402
from ragvit.graph import CudaGraphFallbackWarning, cuda_graph  # noqa: E402
from ragvit.pruning import ATS, ThresholdL2  # noqa: E402
from ragvit.timm_patch import patch, unpatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def mode_switch_atol(model16, x, policy, decided, model32):
    """fp16 logits, eager (trimmed rows) vs graph (capacity rows) or autocast: GEMM shapes
    differ, so cuBLAS sums in another order and each mode rounds differently. Each is an fp16
    forward whose rounding error is that of the fp16 padded reference on the same images and
    decisions (measured here against the fp32 reference), so they differ by at most twice
    that plus the floor (support.models.derived_atol)."""
    _, _, err_ref = reference_error(model16, x.half(), policy, decided, model32)
    return derived_atol(err_ref)


def fallback_warnings(records):
    return [w for w in records if issubclass(w.category, CudaGraphFallbackWarning)]


# ---- arguments ----


def test_exported():
    assert ragvit.cuda_graph is cuda_graph
    assert ragvit.CudaGraphFallbackWarning is CudaGraphFallbackWarning
    assert ragvit.GraphedModel is graph.GraphedModel
    for name in ("cuda_graph", "CudaGraphFallbackWarning", "GraphedModel"):
        assert name in ragvit.__all__


@pytest.mark.parametrize("kwargs,exc,message", [
    ({"model": torch.ones(1)}, TypeError, "model must be a torch.nn.Module, got Tensor"),
    ({"max_graphs": 0}, ValueError, "max_graphs must be an int >= 1, got 0"),
    ({"max_graphs": -3}, ValueError, "max_graphs must be an int >= 1, got -3"),
    ({"max_graphs": 2.0}, TypeError, "max_graphs must be an int >= 1, got float"),
    ({"max_graphs": True}, TypeError, "max_graphs must be an int >= 1, got bool"),
    ({"warmup": 0}, ValueError, "warmup must be an int >= 1, got 0"),
    ({"warmup": "3"}, TypeError, "warmup must be an int >= 1, got str"),
    ({"clone_output": 1}, TypeError, "clone_output must be a bool, got int"),
], ids=["model", "max_graphs_0", "max_graphs_neg", "max_graphs_float", "max_graphs_bool",
        "warmup_0", "warmup_str", "clone_output_int"])
def test_argument_errors(kwargs, exc, message):
    args = {"model": torch.nn.Linear(2, 2), **kwargs}
    model = args.pop("model")
    with pytest.raises(exc) as info:
        cuda_graph(model, **args)
    assert type(info.value) is exc
    assert str(info.value) == f"ragvit.cuda_graph: {message}"


def test_input_must_be_a_tensor():
    g = cuda_graph(torch.nn.Identity())
    with pytest.raises(TypeError, match=r"^ragvit.cuda_graph: input must be a torch.Tensor, "
                                        r"got list$"):
        g([1.0, 2.0])
    import numpy as np

    with pytest.raises(TypeError, match="got ndarray"):
        g(np.zeros(3))
    assert g.cache_info().eager_calls == 0


def test_output_structure():
    t = torch.zeros(2)
    assert graph._flatten(t) == ((t,), None)
    outs, kind = graph._flatten((t, t))
    assert kind is tuple and len(outs) == 2
    assert graph._flatten([t])[1] is list
    with pytest.raises(TypeError, match="must return a tensor or a tuple/list of tensors, "
                                        "got dict"):
        graph._flatten({"logits": t})
    with pytest.raises(TypeError, match="got tuple"):
        graph._flatten((t, 1))


# ---- LRU bound (the cache logic, without a GPU) ----


def test_lru_evicts_least_recently_used():
    lru = graph._LRU(2)
    assert lru.put("a", 1) == [] and lru.put("b", 2) == []
    assert lru.get("a") == 1  # a is now the most recent
    assert lru.keys() == ["b", "a"]
    assert lru.put("c", 3) == [("b", 2)]
    assert lru.keys() == ["a", "c"] and len(lru) == 2
    assert lru.get("b") is None
    assert lru.reserve() == [("a", 1)]  # room for one more
    assert lru.keys() == ["c"]
    assert lru.put("d", 4) == []
    assert lru.pop_all() == [("c", 3), ("d", 4)] and len(lru) == 0


def test_lru_bound_one():
    lru = graph._LRU(1)
    lru.put("a", 1)
    assert lru.reserve() == [("a", 1)] and len(lru) == 0
    lru.put("b", 2)
    assert lru.put("c", 3) == [("b", 2)]
    assert lru.keys() == ["c"]


# ---- eager fallback (CPU) ----

CPU_POLICIES = {
    "none": lambda: None,
    "keep50": lambda: ThresholdL2(0.5, layers=(4,)),
    "threshold": lambda: ThresholdL2(threshold=1.0, layers=(4,)),
    "ats": lambda: ATS(num_samples=8, layers=(3,)),
}


@pytest.mark.parametrize("policy_name", list(CPU_POLICIES))
def test_cpu_falls_back_once_and_equals_eager(policy_name, gen, seed):
    model = make_model("deit_tiny_patch16_224", gen)
    patch(model, CPU_POLICIES[policy_name]())
    state = vars(model)[timm_patch._STATE_ATTR]
    g = cuda_graph(model)
    x1, x2 = images(gen, 2, 64), images(gen, 3, 64)
    with torch.inference_mode():
        expected1, expected2 = model(x1), model(x2)
        with pytest.warns(CudaGraphFallbackWarning,
                          match="running the model eagerly: the input is on the cpu"):
            got1 = g(x1)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            got2 = g(x2)
    assert not fallback_warnings(rec), "the fallback warning must be issued once"
    assert torch.equal(got1, expected1), seed_note(seed)
    assert torch.equal(got2, expected2), seed_note(seed)
    info = g.cache_info()
    assert (info.eager_calls, info.captures, info.hits, info.num_graphs) == (2, 0, 0, 0)
    assert state.capacity is False


def test_training_and_grad_fall_back_with_autograd(gen):
    """An unpatched model keeps autograd through the fallback; each reason warns once."""
    model = make_model("deit_tiny_patch16_224", gen)
    g = cuda_graph(model)
    x = images(gen, 1, 64)
    with pytest.warns(CudaGraphFallbackWarning, match="gradients are enabled"):
        out = g(x)
    assert out.requires_grad
    out.sum().backward()
    assert model.head.weight.grad is not None
    model.train()
    with torch.no_grad():
        with pytest.warns(CudaGraphFallbackWarning, match="training mode"):
            g(x)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            g(x)
    assert not fallback_warnings(rec)
    assert g.cache_info().eager_calls == 3


def test_patched_model_with_grad_still_raises(gen):
    """Never silently wrong: the fallback calls the patched forward, which refuses autograd."""
    model = make_model("deit_tiny_patch16_224", gen)
    patch(model, ThresholdL2(0.5))
    g = cuda_graph(model)
    with pytest.warns(CudaGraphFallbackWarning, match="gradients are enabled"), \
            pytest.raises(RuntimeError, match="torch.no_grad"):
        g(images(gen, 1, 64))


# ---- capacity mode for the capture ----


def test_graph_capture_switches_capacity_temporarily(gen, seed):
    model = make_model("deit_tiny_patch16_224", gen)
    policy = ThresholdL2(threshold=1.0, layers=(4,))
    patch(model, policy)  # capacity=False: eager reads the totals on the host
    state = vars(model)[timm_patch._STATE_ATTR]
    x = images(gen, 3, 64)
    with torch.inference_mode():
        expected = model(x)
        cache_before = state.cu_cache
        with timm_patch.graph_capture(model) as cache:
            assert state.capacity is True
            assert cache == {} and cache is state.cu_cache and cache is not cache_before
            got = model(x)
            assert cache, "the capture's cu_seqlens must land in the yielded cache"
        assert state.capacity is False and state.cu_cache is cache_before
        with pytest.raises(KeyError), timm_patch.graph_capture(model):
            raise KeyError("boom")
        assert state.capacity is False and state.cu_cache is cache_before
    assert float((got.double() - expected.double()).abs().max()) <= CPU_ATOL, seed_note(seed)


def test_graph_capture_keeps_capacity_true(gen):
    model = make_model("deit_tiny_patch16_224", gen)
    patch(model, ThresholdL2(threshold=1.0), capacity=True)
    with timm_patch.graph_capture(model):
        pass
    assert vars(model)[timm_patch._STATE_ATTR].capacity is True


def test_graph_capture_unpatched_is_a_no_op(gen):
    model = make_model("deit_tiny_patch16_224", gen)
    with timm_patch.graph_capture(model) as cache:
        assert cache is None


# ---- bench pipeline ----


def test_bench_graph_pipeline_takes_data_dependent_policies(gen, seed):
    """ragvit_graph no longer refuses threshold policies (on the CPU it runs eagerly)."""
    model = make_model("deit_tiny_patch16_224", gen)
    policy = bench.make_policy(keep=None, threshold=1.0, layers=(4,))
    x = images(gen, 2, 64)
    with torch.inference_mode():
        with bench.patched(model, policy):
            expected = model(x)
        with pytest.warns(CudaGraphFallbackWarning), \
                bench.make_pipeline("ragvit_graph", model, policy, x) as fn:
            got = fn()
            assert timm_patch.is_patched(model)
    assert not timm_patch.is_patched(model)
    assert torch.equal(got, expected), seed_note(seed)


# ---- the C replay: arguments, the CPU-only build, the rule that picks it ----


@pytest.mark.parametrize("args,exc,message", [
    (("1", 0, 0, 0), TypeError, "graph_replay: graph_exec must be an int (a cudaGraphExec_t "
                                "handle), got str"),
    ((1, 0, 0, [0]), TypeError, "graph_replay: outputs must be a tensor or a tuple of tensors, "
                                "got list"),
    ((1, 0, 0, (0,) * 7), ValueError, "graph_replay: outputs must hold at most 6 tensors, got 7"),
    ((1, 0, 0, (None,)), TypeError, "graph_replay: outputs[0] must be a tensor, got None"),
    ((1, 0, 0), TypeError, "graph_replay() missing required argument 'outputs'"),
], ids=["graph_exec_str", "outputs_list", "outputs_7", "outputs_none", "missing"])
def test_graph_replay_argument_errors(args, exc, message):
    """Refused while parsing, before any import, in every build."""
    with pytest.raises(exc) as info:
        ragvit._C.graph_replay(*args)
    assert type(info.value) is exc
    assert str(info.value) == message


@pytest.mark.skipif(ragvit._C.cuda_is_compiled(), reason="a CPU-only build refuses")
def test_graph_replay_refused_by_a_cpu_only_build():
    x, static_x, out = torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(4)
    with pytest.raises(RuntimeError, match=r"^graph_replay: replaying a CUDA graph needs a CUDA "
                                           r"build of ragvit, got a CPU-only build"):
        ragvit._C.graph_replay(1, x, static_x, out)
    assert torch.equal(static_x, torch.zeros(2, 3)), "a refused call writes nothing"


@pytest.mark.skipif(not ragvit._C.cuda_is_compiled(), reason="needs a CUDA build")
def test_graph_replay_refuses_host_tensors():
    x, static_x, out = torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(4)
    with pytest.raises(ValueError, match="graph_replay: x must be on a CUDA device"):
        ragvit._C.graph_replay(1, x, static_x, out)
    assert torch.equal(static_x, torch.zeros(2, 3))


class _FakeGraph:
    def __init__(self, handle):
        self.handle = handle

    def raw_cuda_graph_exec(self):
        return self.handle


class _FakeGenerator:
    def __init__(self, offset):
        self.offset = offset

    def get_offset(self):
        return self.offset


@pytest.mark.parametrize("case,expected", [
    ("eligible", 1234),
    ("rng", 0),  # the graph advanced the generator: torch's replay prologue matters
    ("no_generator", 0),
    ("strided_output", 0),
    ("complex_output", 0),
    ("seven_outputs", 0),
    ("tuple", 1234),
    ("no_cuda", 0),
])
def test_replay_handle_rule(case, expected, monkeypatch):
    """_replay_handle, the rule deciding between the C replay and torch's, without a GPU."""
    monkeypatch.setattr(graph._C, "cuda_is_compiled", lambda: case != "no_cuda")
    outputs, kind = (torch.zeros(1, 10),), None
    if case == "strided_output":
        outputs = (torch.zeros(10, 4)[:, 0],)
    elif case == "complex_output":
        outputs = (torch.zeros(3, dtype=torch.complex64),)
    elif case == "seven_outputs":
        outputs, kind = (torch.zeros(2),) * 7, tuple
    elif case == "tuple":
        outputs, kind = (torch.zeros(2), torch.zeros(3, dtype=torch.int64)), tuple
    entry = graph._Graph(_FakeGraph(1234), torch.zeros(1, 3, 8, 8), outputs, kind, None, 0)
    assert entry.exec_handle is None
    assert entry.replay_outputs is (outputs[0] if kind is None else outputs)
    generator = None if case == "no_generator" else _FakeGenerator(8)
    before = None if generator is None else graph._rng_offset(generator)
    if case == "rng":
        generator.offset += 4
    assert graph._replay_handle(entry, generator, before) == expected


# ---- GPU ----

GPU_MODELS = [
    pytest.param("deit_small_patch16_224", id="deit_small"),
    pytest.param("deit_small_distilled_patch16_224", id="deit_small_distilled"),
]

GPU_POLICIES = {
    "keep50": lambda: ThresholdL2(0.5, layers=(4,)),  # fixed counts
    "threshold": lambda: ThresholdL2(threshold=1.0, layers=(4,)),  # data-dependent
    "ats": lambda: ATS(num_samples=108, layers=(3,)),  # data-dependent
}

FP16 = TOL[torch.float16]


def gpu_model(name, gen, dtype=torch.float16):
    return make_model(name, gen, 224, dtype=dtype, device="cuda")


def gpu_images(gen, batch, dtype=torch.float16):
    return images(gen, batch, 224, dtype=dtype, device="cuda")


def assert_close(got, expected, seed, **tol):
    torch.cuda.synchronize()
    assert got.shape == expected.shape
    assert torch.isfinite(got).all(), seed_note(seed)
    torch.testing.assert_close(got, expected, **(tol or FP16), msg=lambda m: m + seed_note(seed))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("policy_name", list(GPU_POLICIES))
@pytest.mark.parametrize("name", GPU_MODELS)
def test_gpu_replay_equals_eager(name, policy_name, batch, gen, seed):
    """Same patched model (data-dependent policies patched with capacity=True, so eager
    runs the same kernels as the graph), fresh inputs on every replay."""
    model = gpu_model(name, gen)
    policy = GPU_POLICIES[policy_name]()
    patch(model, policy, capacity=not policy.is_fixed)
    g = cuda_graph(model)
    previous = []
    with torch.inference_mode():
        for _ in range(3):
            x = gpu_images(gen, batch)
            expected = model(x)
            got = g(x)
            assert_close(got, expected, seed)
            for old, old_copy in previous:  # fresh outputs: earlier ones untouched
                assert torch.equal(old, old_copy)
                assert not torch.equal(got, old), "a new input must change the output"
            previous.append((got, got.clone()))
    info = g.cache_info()
    assert (info.captures, info.hits, info.eager_calls, info.num_graphs) == (1, 2, 0, 1)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("policy_name", ["keep50", "threshold"])
def test_gpu_static_output_is_overwritten(policy_name, gen, seed):
    """clone_output=False returns the static buffer: poisoned with NaN, the next replay
    must overwrite all of it."""
    model = gpu_model("deit_small_patch16_224", gen)
    policy = GPU_POLICIES[policy_name]()
    patch(model, policy, capacity=not policy.is_fixed)
    g = cuda_graph(model, clone_output=False)
    with torch.inference_mode():
        x1, x2 = gpu_images(gen, 4), gpu_images(gen, 4)
        out1 = g(x1)
        out1.fill_(math.nan)
        out2 = g(x2)
        assert out2 is out1
        assert_close(out2, model(x2), seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("policy", [ThresholdL2(threshold=1.0, layers=(4,)), ATS(108, (3,))],
                         ids=["threshold", "ats"])
def test_gpu_capture_switches_to_capacity_mode(policy, gen, seed):
    """A model patched with capacity=False is captured in capacity mode; eager stays as is."""
    model = gpu_model("deit_small_patch16_224", gen)
    model32 = copy.deepcopy(model).float()
    patch(model, policy)
    state = vars(model)[timm_patch._STATE_ATTR]
    g = cuda_graph(model)
    with torch.inference_mode():
        for _ in range(2):
            x = gpu_images(gen, 8)
            got = g(x)
            assert state.capacity is False
            # eager: trimmed to the real totals (one host read)
            expected, decided = timm_patch.forward_with_decisions(model, x)
            atol = mode_switch_atol(model, x, policy, decided, model32)
            assert_close(got, expected, seed, atol=atol, rtol=FP16["rtol"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("policy_name", ["keep50", "threshold"])
def test_gpu_memory_flat_over_100_replays(policy_name, gen):
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES[policy_name](), capacity=policy_name != "keep50")
    g = cuda_graph(model)
    with torch.inference_mode():
        x = gpu_images(gen, 1)
        out = g(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(100):
            x = gpu_images(gen, 1)
            out = g(x)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    assert out.shape == (1, 1000)
    assert after == before, f"memory_allocated grew from {before} to {after}"
    info = g.cache_info()
    assert (info.captures, info.hits, info.num_graphs) == (1, 100, 1)


@pytest.mark.gpu
@requires_cuda
def test_gpu_non_default_streams(gen, seed):
    """Capture on a side stream, replay on the default and another stream, no manual syncs
    between calls: the wrapper orders each call after the previous call's stream."""
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model)
    with torch.inference_mode():
        x, y = gpu_images(gen, 2), gpu_images(gen, 2)
        ex, ey = model(x), model(y)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            gx = g(x)  # capture + replay, caller on s1
        gy = g(y)  # default stream
        with torch.cuda.stream(s2):
            gx2 = g(x)
        gy2 = g(y)
        torch.cuda.synchronize()
    assert_close(gx, ex, seed)
    assert_close(gy, ey, seed)
    assert_close(gx2, ex, seed)
    assert_close(gy2, ey, seed)
    assert g.cache_info().captures == 1


@pytest.mark.gpu
@requires_cuda
def test_gpu_new_batch_size_captures_and_lru_evicts(gen, seed):
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model, max_graphs=2)

    def call(batch):
        x = gpu_images(gen, batch)
        assert_close(g(x), model(x), seed)

    def batches():
        return [key[0][0] for key in g.cached_keys()]

    with torch.inference_mode():
        call(1)
        call(2)
        assert batches() == [1, 2] and g.cache_info().captures == 2
        call(1)  # hit: 1 becomes the most recent
        assert batches() == [2, 1]
        call(3)  # evicts 2
        assert batches() == [1, 3]
        call(2)  # captured again, evicts 1
        assert batches() == [3, 2]
    info = g.cache_info()
    assert (info.captures, info.hits, info.evictions, info.num_graphs) == (4, 1, 2, 2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_unpatched_baseline_and_repatching(gen, seed):
    """A plain timm model graphs too; patching or unpatching afterwards is seen."""
    model = gpu_model("deit_small_patch16_224", gen)
    g = cuda_graph(model)
    with torch.inference_mode():
        x = gpu_images(gen, 1)
        assert_close(g(x), model(x), seed)
        patch(model, GPU_POLICIES["keep50"]())
        assert_close(g(x), model(x), seed)  # captured anew: the pruned forward
        unpatch(model)
        assert_close(g(x), model(x), seed)
    assert g.cache_info().captures == 3


@pytest.mark.gpu
@requires_cuda
def test_gpu_autocast_is_part_of_the_key(gen, seed):
    model = gpu_model("deit_small_patch16_224", gen, dtype=torch.float32)
    model16 = copy.deepcopy(model).half()
    policy = GPU_POLICIES["keep50"]()
    patch(model, policy)
    g = cuda_graph(model)
    x = gpu_images(gen, 2, dtype=torch.float32)
    with torch.inference_mode():
        with torch.autocast("cuda", dtype=torch.float16):
            got16 = g(x)
            expected16, decided = timm_patch.forward_with_decisions(model, x)
        got32, expected32 = g(x), model(x)
        atol = mode_switch_atol(model16, x, policy, decided, model)
    assert_close(got32, expected32, seed, atol=1e-4, rtol=1e-4)
    assert_close(got16.float(), expected16.float(), seed, atol=atol, rtol=FP16["rtol"])
    assert [key[3] for key in g.cached_keys()] == [torch.float16, None]


@pytest.mark.gpu
@requires_cuda
def test_gpu_debug_mode_falls_back(gen, seed):
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model)
    ragvit.set_debug(True)  # conftest restores it
    with torch.inference_mode():
        x = gpu_images(gen, 1)
        with pytest.warns(CudaGraphFallbackWarning, match="debug mode"):
            got = g(x)
        assert_close(got, model(x), seed)
    assert g.cache_info().captures == 0


class _SyncingPolicy(ThresholdL2):
    """Fixed counts, but reads the device on the host: not capturable."""

    def select(self, batch):
        float(batch.rows.float().sum().item())
        return super().select(batch)


@pytest.mark.gpu
@requires_cuda
def test_gpu_capture_failure_is_an_error(gen, seed):
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, _SyncingPolicy(0.5, layers=(4,)))
    state = vars(model)[timm_patch._STATE_ATTR]
    g = cuda_graph(model)
    x = gpu_images(gen, 1)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="capturing the forward failed"):
            g(x)
        assert state.capacity is False
        out = model(x)  # eager still works afterwards
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert g.cache_info().num_graphs == 0


# A patched DeiT-S with EViT-style pruning (cls_attn, top-k, pack + fuse) run eager and
# replayed as a graph, in a fresh process (RAGVIT_PDL is read when the device is first used).
_PDL_SCRIPT = r"""
import sys, torch, timm, ragvit
from ragvit.graph import cuda_graph
from ragvit.pruning import EViT, ThresholdL2
torch.manual_seed(int(sys.argv[2]))
outs = {}
for name, policy in (("l2", ThresholdL2(0.5, layers=(4,))), ("evit", EViT(0.7, (3, 6, 9)))):
    model = timm.create_model("deit_small_patch16_224", pretrained=False).cuda().half().eval()
    ragvit.patch(model, policy)
    g = cuda_graph(model)
    with torch.inference_mode():
        for step in range(2):
            x = torch.randn(2, 3, 224, 224, device="cuda").half()
            outs[f"{name}_eager_{step}"] = model(x).cpu()
            outs[f"{name}_graph_{step}"] = g(x).cpu()
torch.save(outs, sys.argv[1])
"""


@pytest.mark.gpu
@requires_cuda
def test_gpu_programmatic_dependent_launch_changes_no_bit(tmp_path, seed):
    """Kernels launched with PDL (the default on sm_90+: RAGVIT_PDL unset, every op family)
    wait for the kernel before them: outputs equal plain launches (RAGVIT_PDL=0) bit for
    bit, eager and replayed."""
    results = {}
    for mask in ("0", "default"):
        path = tmp_path / f"pdl_{mask}.pt"
        env = {k: v for k, v in os.environ.items() if k != "RAGVIT_PDL"}
        if mask != "default":
            env["RAGVIT_PDL"] = mask
        done = subprocess.run([sys.executable, "-c", _PDL_SCRIPT, str(path), str(seed)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        results[mask] = torch.load(path)
    assert results["0"].keys() == results["default"].keys()
    for key, plain in results["0"].items():
        assert torch.isfinite(plain).all(), key + seed_note(seed)
        assert torch.equal(results["default"][key], plain), key + seed_note(seed)


# ---- the C replay on the GPU ----


class _TwoOutputs(torch.nn.Module):
    """A capturable model with two outputs of different dtypes, as a tuple or a list."""

    def __init__(self, gen, as_list=False):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8).half().cuda()
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 16, generator=gen).half())
        self.as_list = as_list

    def forward(self, x):
        y = self.lin(x)
        out = (y, y.argmax(-1))
        return list(out) if self.as_list else out


class _Noisy(torch.nn.Module):
    """Draws random numbers in its forward: torch's replay must advance the generator."""

    def forward(self, x):
        return x * 2 + torch.rand_like(x)


def _entry(g):
    [entry] = [e for _, e in g._graphs.items()]
    return entry


@pytest.fixture
def replay_calls(monkeypatch):
    """Counts the calls GraphedModel makes to _C.graph_replay."""
    calls = []
    real = ragvit._C.graph_replay

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(ragvit._C, "graph_replay", spy)
    return calls


def _torch_path(entry):
    """Context: this entry replays through torch (copy_, replay(), clone())."""
    @contextlib.contextmanager
    def scope():
        handle, entry.exec_handle = entry.exec_handle, 0
        try:
            yield
        finally:
            entry.exec_handle = handle
    return scope()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_c_replay_equals_torch_replay_and_eager(batch, gen, seed, replay_calls):
    """The repeated-key call is one _C.graph_replay: bitwise what torch's copy_, replay()
    and clone() give on the same graph, within the graph-vs-eager bar, and a fresh tensor on
    x's device every call (never the static output, earlier ones untouched)."""
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model)
    seen = []
    with torch.inference_mode():
        g(gpu_images(gen, batch))  # capture + the first replay (through torch)
        entry = _entry(g)
        assert entry.exec_handle, "a DeiT forward draws no random numbers"
        assert not replay_calls
        for _ in range(3):
            x = gpu_images(gen, batch)
            got = g(x)
            with _torch_path(entry):
                through_torch = g(x)
            expected = model(x)
            torch.cuda.synchronize()
            assert torch.equal(got, through_torch), seed_note(seed)
            assert_close(got, expected, seed)
            assert got.device == x.device and got.dtype == entry.outputs[0].dtype
            assert got.data_ptr() != entry.outputs[0].data_ptr()
            for old, old_copy in seen:
                assert old.data_ptr() != got.data_ptr()
                assert torch.equal(old, old_copy)
            seen.append((got, got.clone()))
    assert len(replay_calls) == 3
    assert g.cache_info().hits == 6


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("as_list", [False, True], ids=["tuple", "list"])
def test_gpu_c_replay_tuple_and_list_outputs(as_list, gen, seed, replay_calls):
    model = _TwoOutputs(gen, as_list).eval()
    g = cuda_graph(model)
    with torch.inference_mode():
        g(torch.randn(4, 16, generator=gen).half().cuda())
        for _ in range(2):
            x = torch.randn(4, 16, generator=gen).half().cuda()
            got, expected = g(x), model(x)
            assert type(got) is (list if as_list else tuple) and len(got) == 2
            assert_close(got[0], expected[0], seed)
            assert got[1].dtype == torch.int64
            assert torch.equal(got[1], got[0].argmax(-1)), seed_note(seed)
            for fresh, static in zip(got, _entry(g).outputs, strict=True):
                assert fresh.data_ptr() != static.data_ptr()
    assert len(replay_calls) == 2


@pytest.mark.gpu
@requires_cuda
def test_gpu_c_replay_on_other_streams(gen, seed, replay_calls):
    """On a non-default current stream, and with the stream changing between calls and no
    synchronization in between: each call runs on the current stream, ordered after the
    previous call's (the graphs share their static buffers)."""
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model)
    with torch.inference_mode():
        xs = [gpu_images(gen, 1) for _ in range(6)]
        expected = [model(x) for x in xs]
        g(xs[0])  # capture on the default stream
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        got = []
        for i, x in enumerate(xs):
            if i % 3 == 2:
                got.append(g(x))  # the default stream
                continue
            with torch.cuda.stream(streams[i % 3]):
                got.append(g(x))
        torch.cuda.synchronize()
    for out, ref in zip(got, expected, strict=True):
        assert_close(out, ref, seed)
    assert len(replay_calls) == 6


@pytest.mark.gpu
@requires_cuda
def test_gpu_c_replay_refused_arguments_change_nothing(gen, seed):
    """Mismatched inputs are refused with the rule broken, before anything is queued: the
    static input keeps its contents and the next call is right."""
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    g = cuda_graph(model)
    with torch.inference_mode():
        x = gpu_images(gen, 2)
        g(x)
        entry = _entry(g)
        before = entry.static_x.clone()
        handle, static_x, out = entry.exec_handle, entry.static_x, entry.replay_outputs
        wide = gpu_images(gen, 2).repeat(1, 1, 1, 2)
        cases = [
            (gpu_images(gen, 3), ValueError, "x must have shape (2, 3, 224, 224), got "
                                             "(3, 3, 224, 224)"),
            (gpu_images(gen, 2).float(), TypeError, "x must have the dtype of static_x "
                                                    "(float16), got float32"),
            (wide[..., :224], ValueError, "x must be contiguous (row-major, no gaps), got "
                                          "strides"),
            (gpu_images(gen, 2).cpu(), ValueError, "static_x must be on the device of x "
                                                   "(cpu:0), got cuda:0"),
        ]
        for bad, exc, message in cases:
            with pytest.raises(exc) as info:
                ragvit._C.graph_replay(handle, bad, static_x, out)
            assert type(info.value) is exc and message in str(info.value), str(info.value)
        with pytest.raises(ValueError, match="graph_exec must be an instantiated"):
            ragvit._C.graph_replay(0, x, static_x, out)
        with pytest.raises(ValueError, match="outputs\\[0\\] must be contiguous"):
            ragvit._C.graph_replay(handle, x, static_x, (out.t(),))
        torch.cuda.synchronize()
        assert torch.equal(entry.static_x, before), "a refused call must write nothing"
        y = gpu_images(gen, 2)
        assert_close(g(y), model(y), seed)


@pytest.mark.gpu
@requires_cuda
def test_gpu_torch_replays_what_the_c_call_cannot(gen, seed, replay_calls):
    """torch's copy_/replay()/clone() run a non-contiguous input, clone_output=False and a
    forward that draws random numbers (torch's replay advances the generator: fresh noise
    on every call, as without ragvit)."""
    model = gpu_model("deit_small_patch16_224", gen)
    patch(model, GPU_POLICIES["keep50"]())
    with torch.inference_mode():
        g = cuda_graph(model)
        x = gpu_images(gen, 1)
        g(x)
        strided = gpu_images(gen, 1).repeat(1, 1, 1, 2)[..., :224]
        assert_close(g(strided), model(strided.contiguous()), seed)
        assert not replay_calls
        static = cuda_graph(model, clone_output=False)
        static(x)
        assert static(x) is _entry(static).outputs[0]
        assert not replay_calls
        noisy = cuda_graph(_Noisy().eval())
        z = torch.zeros(64, device="cuda")
        first, second, third = noisy(z), noisy(z), noisy(z)
        assert _entry(noisy).exec_handle == 0
        torch.cuda.synchronize()
        assert not torch.equal(second, third) and not torch.equal(first, second)
        assert not replay_calls
