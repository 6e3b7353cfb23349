"""ragvit on a CUDA device other than the current one (the `multi_gpu` marker: two GPUs).

Every op, ragvit.patch and ragvit.cuda_graph run on cuda:1 while cuda:0 is current and the
other way round; two patched models on two devices are called alternately and from two
threads. The property checked is the device rule of docs/interop.md: the call runs on its
arrays' device whatever device is current, its outputs live there, nothing is allocated on
the other device (torch.cuda.memory_allocated per device) and the caller's current device
is unchanged afterwards. Each op's result away from home must equal, bit for bit, the same
call made with its own device current (the same kernels on the same inputs); attention is
also checked against the float64 reference, the patched forwards against the padded
reference with bars derived from its own fp16 error (support.models). Outputs are
NaN-poisoned. test_gpu_op_from_new_thread runs on one GPU: a thread that never chose a
device runs every op, and its device stays.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from support.checks import check_attention
from support.devices import CUDA_OK, requires_cuda
from support.inputs import (
    make_cu_seqlens,
    make_qkv,
    packed_rows,
    poison,
    random_lengths,
    same_bits,
    seed_note,
)

import ragvit

TWO_GPUS = CUDA_OK and torch.cuda.device_count() >= 2


def multi_gpu_test(fn):
    """Marks a test gpu and multi_gpu, skipped without two GPUs and a CUDA build."""
    for mark in (pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA GPUs and a CUDA build"),
                 pytest.mark.multi_gpu, pytest.mark.gpu):
        fn = mark(fn)
    return fn


# (device the arrays live on, device current during the call)
DIRECTIONS = [pytest.param(1, 0, id="on1_current0"), pytest.param(0, 1, id="on0_current1")]


# ---- the ops: inputs built on the CPU from the test's generator, run on one device ----


def _attention_case(gen):
    lengths = random_lengths(gen, 6, 1, 80, include=(1, 197))
    q, k, v = make_qkv(gen, sum(lengths), 3, 64, torch.float16)
    return {"q": q, "k": k, "v": v, "cu": make_cu_seqlens(lengths)}


def _attention_run(a, dev):
    out = poison(a["q"].shape, a["q"].dtype, dev)
    cls = poison((a["q"].shape[0],), torch.float32, dev)
    ragvit.attention(a["q"], a["k"], a["v"], a["cu"], 197, out=out, cls_attn=cls)
    return [out, cls, ragvit.attention(a["q"], a["k"], a["v"], a["cu"], 197)]


def _rows_case(gen):
    lengths = random_lengths(gen, 5, 1, 40, include=(1,))
    packed, cu = packed_rows(gen, lengths, 48, torch.float16)
    x = torch.randn(4, 33, 48, generator=gen).to(torch.float16)
    keep = torch.rand(4, 33, generator=gen) < 0.5
    keep_rows = torch.rand(packed.shape[0], generator=gen) < 0.5
    weight = torch.randn(64, 48, generator=gen).to(torch.float16) * 0.1
    return {"packed": packed, "cu": cu, "x": x, "keep": keep, "keep_rows": keep_rows,
            "weight": weight, "bias": torch.randn(64, generator=gen).to(torch.float16),
            "gamma": torch.randn(48, generator=gen).to(torch.float16),
            "scores": torch.randn(4, 33, generator=gen)}


def _pack_run(a, dev):
    packed, cu, idx = ragvit.pack(a["x"], a["keep"])
    out, cu_into = poison((200, 48), torch.float16, dev), poison((5,), torch.int32, dev)
    ragvit.pack_into(a["x"], a["keep"], out, cu_into)
    return [packed, cu, idx, out, cu_into, ragvit.unpack(packed, cu, 33, indices=idx)]


def _repack_run(a, dev):
    packed, cu, src = ragvit.repack(a["packed"], a["cu"], a["keep_rows"])
    out = poison(a["packed"].shape, torch.float16, dev)
    cu_into = poison(a["cu"].shape, torch.int32, dev)
    ragvit.repack_into(a["packed"], a["cu"], a["keep_rows"], out, cu_into)
    return [packed, cu, src, out, cu_into, ragvit.gather_prefix(a["packed"], a["cu"], 1),
            ragvit.segment_mean(a["packed"], a["cu"], skip=1)]


def _row_ops_run(a, dev):
    x = a["packed"].nan_to_num(0.0)
    out = poison((x.shape[0], 64), torch.float16, dev)
    ragvit.linear(x, a["weight"], a["bias"], out=out)
    norm = ragvit.layer_norm(x, a["gamma"])
    return [out, norm, ragvit.gelu(norm), ragvit.topk_index(a["scores"], 8, prefix=1)]


OPS = {
    "attention": (_attention_case, _attention_run),
    "pack_unpack": (_rows_case, _pack_run),
    "repack_segments": (_rows_case, _repack_run),
    "row_ops_topk": (_rows_case, _row_ops_run),
}


def _on(inputs: dict, dev: int) -> dict:
    return {name: t.to(f"cuda:{dev}") for name, t in inputs.items()}


def _run_with_current(run, inputs, on: int, current: int):
    """run(inputs, on) with cuda:`current` the current device; checks that it stays so."""
    with torch.cuda.device(current):
        outputs = run(inputs, torch.device("cuda", on))
        assert torch.cuda.current_device() == current, "the call changed the current device"
    torch.cuda.synchronize(on)
    return outputs


@multi_gpu_test
@pytest.mark.parametrize("on,current", DIRECTIONS)
@pytest.mark.parametrize("op", list(OPS))
def test_op_on_other_device(op, on, current, gen, seed):
    case, run = OPS[op]
    inputs = _on(case(gen), on)
    home = _run_with_current(run, inputs, on, on)  # also the first use of the device
    before = torch.cuda.memory_allocated(current)
    away = _run_with_current(run, inputs, on, current)
    assert torch.cuda.memory_allocated(current) == before, \
        f"cuda:{current} allocated during a call on cuda:{on}" + seed_note(seed)
    for i, (h, a) in enumerate(zip(home, away, strict=True)):
        assert a.device == torch.device("cuda", on), f"output {i} on {a.device}"
        assert same_bits(h, a), f"output {i} differs from the call made on its own " \
                                f"device" + seed_note(seed)
    if op == "attention":
        check_attention(away[0], inputs["q"], inputs["k"], inputs["v"], inputs["cu"],
                        seed=seed)


# ---- whole models ----


def _model_pair(gen, seed, device):
    """An fp16 DeiT-Tiny (random init, perturbed from gen) patched with ThresholdL2 keep 50%
    after block 4 on `device`, its fp32 twin (for the derived bar) and images."""
    pytest.importorskip("timm")
    from support.models import images, make_model

    model32 = make_model("deit_tiny_patch16_224", gen, 224, device=device)
    model = copy.deepcopy(model32).half()
    x = images(gen, 8, 224, torch.float16, device)
    return model, model32, x


def _check_forward(model, model32, x, got, decided, seed):
    from support.models import derived_atol, max_diff, reference_error

    from ragvit.pruning import ThresholdL2

    policy = ThresholdL2(0.5, layers=(4,))
    expected, exact, err_ref = reference_error(model, x, policy, decided, model32)
    bar = derived_atol(err_ref)
    err, err_ours = max_diff(got, expected), max_diff(got, exact)
    note = f" err vs fp16 ref {err}, vs fp32 ref {err_ours} (ref's own {err_ref}, bar {bar})"
    assert torch.isfinite(got).all(), note + seed_note(seed)
    assert err <= bar and err_ours <= bar, note + seed_note(seed)


@multi_gpu_test
@pytest.mark.parametrize("on,current", DIRECTIONS)
def test_patch_on_other_device(on, current, gen, seed):
    from ragvit import timm_patch
    from ragvit.pruning import ThresholdL2

    model, model32, x = _model_pair(gen, seed, f"cuda:{on}")
    ragvit.patch(model, ThresholdL2(0.5, layers=(4,)))
    with torch.inference_mode():
        home = model(x)  # the device's first use: probes, workspaces
        torch.cuda.synchronize(on)
        before = torch.cuda.memory_allocated(current)
        with torch.cuda.device(current):
            got, decided = timm_patch.forward_with_decisions(model, x)
            assert torch.cuda.current_device() == current
        torch.cuda.synchronize(on)
    assert got.device == x.device
    assert torch.cuda.memory_allocated(current) == before
    assert torch.equal(got, home), "the forward differs with another device current" + \
        seed_note(seed)
    _check_forward(model, model32, x, got, decided, seed)


@multi_gpu_test
@pytest.mark.parametrize("on,current", DIRECTIONS)
def test_cuda_graph_on_other_device(on, current, gen, seed):
    from ragvit.pruning import ThresholdL2

    model, _, x = _model_pair(gen, seed, f"cuda:{on}")
    ragvit.patch(model, ThresholdL2(0.5, layers=(4,)))
    graphed = ragvit.cuda_graph(model)
    with torch.inference_mode():
        expected = model(x)
        torch.cuda.synchronize(on)
        before = torch.cuda.memory_allocated(current)
        with torch.cuda.device(current):
            first = graphed(x)  # capture on cuda:on with cuda:current current
            x2 = x.flip(0)
            second = graphed(x2)
            assert torch.cuda.current_device() == current
        torch.cuda.synchronize(on)
        expected2 = model(x2)
    assert first.device == x.device and second.device == x.device
    assert torch.cuda.memory_allocated(current) == before
    for got, want in ((first, expected), (second, expected2)):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3,
                                   msg=lambda m: m + seed_note(seed))
    assert graphed.cache_info().captures == 1


def _two_models(gen, seed):
    pairs = [_model_pair(gen, seed, f"cuda:{d}") for d in (0, 1)]
    from ragvit.pruning import ThresholdL2

    for model, _, _ in pairs:
        ragvit.patch(model, ThresholdL2(0.5, layers=(4,)))
    return pairs


@multi_gpu_test
def test_two_models_alternately(gen, seed):
    from ragvit import timm_patch

    pairs = _two_models(gen, seed)
    with torch.inference_mode():
        expected = [model(x) for model, _, x in pairs]
        results = []
        for _ in range(3):
            for model, _, x in pairs:
                results.append(timm_patch.forward_with_decisions(model, x))
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    for i, (got, _) in enumerate(results):
        assert got.device == torch.device("cuda", i % 2)
        assert torch.equal(got, expected[i % 2]), f"call {i} differs" + seed_note(seed)
    for d, (model, model32, x) in enumerate(pairs):
        _check_forward(model, model32, x, *results[d], seed)


@multi_gpu_test
def test_two_models_two_threads(gen, seed):
    """Each thread sets its own device (the one-replica-per-GPU layout in one process) and
    calls its model 20 times; the other thread runs meanwhile."""
    pairs = _two_models(gen, seed)
    with torch.inference_mode():
        expected = [model(x).clone() for model, _, x in pairs]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    outputs: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def serve(d):
        try:
            model, _, x = pairs[d]
            torch.cuda.set_device(d)
            start.wait()
            with torch.inference_mode():
                for _ in range(20):
                    outputs[d].append(model(x))
            torch.cuda.synchronize(d)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, f"a serving thread raised: {errors[0]!r}" + seed_note(seed)
    for d in (0, 1):
        assert len(outputs[d]) == 20
        for got in outputs[d]:
            assert got.device == torch.device("cuda", d)
            assert torch.equal(got, expected[d]), f"cuda:{d} differs" + seed_note(seed)


@multi_gpu_test
def test_replica_on_device1_leaves_device0_untouched():
    """The launcher's recipe (docs/distributed.md): a process that sets cuda:1 as its device
    and runs a patched model there creates no CUDA context on cuda:0 (a child process, so
    this process's contexts do not count)."""
    pytest.importorskip("timm")
    code = textwrap.dedent("""
        import timm, torch, ragvit
        from ragvit.pruning import ThresholdL2
        torch.cuda.set_device(1)
        model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
        model = model.half().to("cuda:1")
        ragvit.patch(model, ThresholdL2(0.5, layers=(4,)))
        with torch.inference_mode():
            model(torch.randn(4, 3, 224, 224, device="cuda:1").half())
            ragvit.cuda_graph(model)(torch.randn(2, 3, 224, 224, device="cuda:1").half())
        torch.cuda.synchronize(1)
        print("context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "context on cuda:0: False" in done.stdout, done.stdout + done.stderr


# ---- one GPU ----


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_op_from_new_thread(op, gen, seed):
    """A thread that never chose a device runs the op on cuda:0: the result equals the
    main thread's, and the thread's current device is what it was."""
    case, run = OPS[op]
    inputs = _on(case(gen), 0)
    home = _run_with_current(run, inputs, 0, 0)
    found: dict = {}

    def call():
        try:
            found["before"] = torch.cuda.current_device()
            found["outputs"] = run(inputs, torch.device("cuda", 0))
            found["after"] = torch.cuda.current_device()
            torch.cuda.synchronize(0)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            found["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(timeout=120)
    assert "error" not in found, repr(found.get("error"))
    assert found["before"] == found["after"]
    for i, (h, a) in enumerate(zip(home, found["outputs"], strict=True)):
        assert same_bits(h, a), f"output {i} differs from the main thread's" + seed_note(seed)
