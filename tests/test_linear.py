"""ragvit.linear (out = x @ weight.T + bias + residual) against a float64 reference and torch:
DeiT widths (K, N in 192 ... 3072), M in {0, 1, 7, 197, 577} (larger packed batches on CUDA),
every dtype, bias absent or present, residual absent, separate or out itself (in place),
dense tensors or column slices of NaN-padded buffers; NumPy, every user-reachable error, and
on CUDA mixed devices and graph capture. x ~ N(0, 1) and weight ~ N(0, 1/K), so outputs are
unit-scale like a ViT block's; the accuracy rule is linear_tolerance's. CPU cases keep
M*N*K <= ~3e7 (the CPU backend is a plain C loop).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.checks import assert_within_baseline
from support.cuda import capture_graph
from support.devices import device_param, devices, requires_cuda
from support.errors import (
    assert_rejected,
    error_params,
    matrix_input_errors,
    matrix_out_errors,
    self_overlap_errors,
    vector_arg_errors,
)
from support.errors import set_args as _set
from support.inputs import (
    as_numpy,
    padding_is_nan,
    place_columns,
    poison,
    same_bits,
    seed_note,
)
from support.tolerances import DTYPE_IDS, DTYPES, TOL, dtype_params

import ragvit

# (M, K, N): x (M, K), weight (N, K). CPU: M*N*K <= ~3e7 each.
SHAPES = {
    "cpu": [
        (0, 384, 1152),
        (1, 768, 3072),
        (7, 3072, 768),
        (197, 384, 384),
        (577, 192, 192),
    ],
    "cuda": [
        (0, 768, 2304),
        (1, 192, 576),
        (7, 384, 1152),
        (197, 768, 2304),
        (577, 192, 768),
        (577, 768, 3072),
        (577, 3072, 768),
        (577, 1152, 1536),
        (12608, 384, 1536),  # DeiT-S fc1 on 64 packed images of 197 tokens
        (12608, 1536, 384),  # DeiT-S fc2
    ],
}

# (bias, residual): residual "separate" is its own tensor, "in_place" is out itself.
COMBOS = [
    ("no_bias", "no_residual"),
    ("bias", "no_residual"),
    ("no_bias", "residual"),
    ("bias", "residual"),
    ("bias", "in_place"),
]

# ---- inputs, reference, check ----


def _make_linear_inputs(gen, M, K, N, dtype, device, bias_kind, residual_kind, layout):
    """x, weight, bias, residual (or None), out and the buffers holding them, placed as
    support.inputs.COLUMN_LAYOUTS[layout] (x, weight, residual and out; bias is dense)."""
    x, x_buf = place_columns(torch.randn((M, K), generator=gen), dtype, device, layout)
    weight = torch.randn((N, K), generator=gen) / math.sqrt(K)
    w, w_buf = place_columns(weight, dtype, device, layout)
    bias = None
    if bias_kind == "bias":
        bias = (torch.randn((N,), generator=gen) * 0.5).to(dtype=dtype, device=device)
    residual_values = torch.randn((M, N), generator=gen)
    if residual_kind == "in_place":
        out, out_buf = place_columns(residual_values, dtype, device, layout)
        residual = out
    else:
        out, out_buf = place_columns(torch.full((M, N), math.nan), dtype, device, layout)
        residual = None
        if residual_kind == "residual":
            residual, _ = place_columns(residual_values, dtype, device, layout)
    return {
        "x": x,
        "weight": w,
        "bias": bias,
        "residual": residual,
        "out": out,
        "buffers": (x_buf, w_buf, out_buf),
    }


def linear_reference(x, weight, bias=None, residual=None):
    """float64 x @ weight.T + bias + residual, on x's device (fast on CUDA)."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


def linear_tolerance(dtype, K):
    """The per-element rule |got - ref| <= atol + rtol * (|x w^T + b| + |residual|): TOL at
    the smallest DeiT width, atol growing like sqrt(K / 192) with the float32 accumulation
    error on CUDA (the CPU backend accumulates in double and rounds once, so it sits at
    half an ulp of the dtype). rtol scales with the operands, not their sum: a residual add
    may cancel."""
    tol = TOL[dtype]
    return {"atol": tol["atol"] * math.sqrt(max(K, 1) / 192), "rtol": tol["rtol"]}


def _check_linear(got, x, weight, bias, residual, seed):
    """Asserts got (poisoned before the call) is linear(x, weight, bias, residual): every
    element finite and within linear_tolerance of the float64 reference, and err <= 2 *
    err(F.linear(x, weight, bias) + residual in the same dtype) + floor.

    residual is the value residual held before the call (a copy when in place).
    """
    note = seed_note(seed)
    M, K = x.shape
    N = weight.shape[0]
    assert tuple(got.shape) == (M, N) and got.dtype == x.dtype and got.device == x.device
    if M == 0 or N == 0:
        return
    got64 = torch.as_tensor(got).detach().to(x.device, torch.float64)
    assert torch.isfinite(got64).all(), (
        "non-finite output: an element left unwritten (NaN poison) or a NaN read" + note
    )
    expected = linear_reference(x, weight, bias, residual)
    assert torch.isfinite(expected).all(), "test bug: NaN in an input's view"
    # rtol scales with the operands, |x @ w.T + b| + |residual|, not with their sum: the
    # residual add may cancel (in 16-bit types the GEMM output is rounded before it, as
    # torch's F.linear(...) + residual does too).
    magnitude = linear_reference(x, weight, bias).abs()
    if residual is not None:
        magnitude = magnitude + residual.double().abs()
    tol = linear_tolerance(x.dtype, K)
    excess = (got64 - expected).abs() - (tol["atol"] + tol["rtol"] * magnitude)
    worst = int(excess.argmax())
    assert excess.max().item() <= 0, (
        f"{int((excess > 0).sum())} elements off; worst at flat index {worst}: got "
        f"{got64.flatten()[worst].item()}, expected {expected.flatten()[worst].item()} "
        f"(atol {tol['atol']:.3g}, rtol {tol['rtol']:.3g})" + note
    )
    baseline = F.linear(x, weight, bias)
    if residual is not None:
        baseline = baseline + residual
    assert_within_baseline(got64, expected, baseline.to(torch.float64), x.dtype, note)


def _snapshot(*tensors):
    return [t.detach().clone() for t in tensors if t is not None]


def _assert_same(tensors, before, what):
    for t, b in zip([t for t in tensors if t is not None], before, strict=True):
        assert same_bits(t, b), f"linear modified {what}"


# ---- linear vs the reference ----


def _linear_params():
    return [
        device_param(device, dtype, (M, K, N), bias_kind, residual_kind,
                     id=f"{DTYPE_IDS[dtype]}-M{M}-K{K}-N{N}-{bias_kind}-{residual_kind}")
        for device in ("cpu", "cuda")
        for M, K, N in SHAPES[device]
        for dtype in DTYPES
        for bias_kind, residual_kind in COMBOS
    ]


@pytest.mark.parametrize("device, dtype, shape, bias_kind, residual_kind", _linear_params())
def test_linear_matches_reference(device, dtype, shape, bias_kind, residual_kind, gen, seed):
    M, K, N = shape
    a = _make_linear_inputs(gen, M, K, N, dtype, device, bias_kind, residual_kind, "contiguous")
    x, w, bias, residual, out = (a[n] for n in ("x", "weight", "bias", "residual", "out"))
    residual_before = residual.clone() if residual is not None else None
    inputs_before = _snapshot(x, w, bias)
    if residual_kind != "in_place":
        inputs_before += _snapshot(residual)
    result = ragvit.linear(x, w, bias, residual=residual, out=out)
    assert result is out
    _check_linear(out, x, w, bias, residual_before, seed)
    read_only = [x, w, bias] + ([residual] if residual_kind != "in_place" else [])
    _assert_same(read_only, inputs_before, "an input")


def _strided_params():
    return [
        device_param(device, dtype, layout, residual_kind,
                     id=f"{DTYPE_IDS[dtype]}-{layout}-{residual_kind}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for layout in ("padded", "offset")
        for residual_kind in ("no_residual", "residual", "in_place")
    ]


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout, residual_kind", _strided_params())
def test_linear_strided_views(device, dtype, layout, residual_kind, gen, seed):
    """x, weight, residual and out are column slices of wider NaN-padded buffers."""
    M, K, N = (97, 384, 192) if device == "cpu" else (577, 768, 384)
    a = _make_linear_inputs(gen, M, K, N, dtype, device, "bias", residual_kind, layout)
    x, w, bias, residual, out = (a[n] for n in ("x", "weight", "bias", "residual", "out"))
    assert x.stride(0) != K and out.stride(0) != N
    residual_before = residual.clone() if residual is not None else None
    result = ragvit.linear(x, w, bias, residual=residual, out=out)
    assert result is out
    _check_linear(out, x, w, bias, residual_before, seed)
    assert padding_is_nan(a["buffers"][2], layout, N), "linear wrote outside out" + seed_note(seed)


@pytest.mark.sanitizer
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_linear_bias_offset_view(device, dtype, gen, seed):
    """bias as a view starting one element into a buffer (2- or 4-byte aligned only)."""
    M, K, N = (7, 192, 576) if device == "cpu" else (197, 384, 1152)
    x = torch.randn((M, K), generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn((N, K), generator=gen) / math.sqrt(K)).to(dtype=dtype, device=device)
    values = torch.randn((N,), generator=gen).to(dtype=dtype, device=device)
    buffer = poison((N + 1,), dtype, device)
    bias = buffer[1:]
    bias.copy_(values)
    out = poison((M, N), dtype, device)
    assert ragvit.linear(x, w, bias, out=out) is out
    _check_linear(out, x, w, bias, None, seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_linear_out_omitted_allocates_like_x(device, dtype, gen, seed):
    M, K, N = 13, 192, 384
    a = _make_linear_inputs(gen, M, K, N, dtype, device, "bias", "residual", "padded")
    x, w, bias, residual = a["x"], a["weight"], a["bias"], a["residual"]
    result = ragvit.linear(x, w, bias, residual=residual)
    assert isinstance(result, torch.Tensor)
    assert result.dtype == dtype and result.device == x.device and result.is_contiguous()
    _check_linear(result, x, w, bias, residual, seed)
    given = poison((M, N), dtype, device)
    assert ragvit.linear(x, w, bias, residual=residual, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


@pytest.mark.parametrize("device", devices())
def test_linear_empty_shapes(device):
    """M = 0, N = 0, and K = 0 with M = 0: nothing to compute, no error, nothing written."""
    x = torch.empty((0, 8), device=device)
    out = ragvit.linear(x, torch.ones((6, 8), device=device), torch.ones(6, device=device))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 6)
    x = torch.ones((5, 8), device=device)
    out = ragvit.linear(x, torch.empty((0, 8), device=device), residual=torch.empty((5, 0)).to(x))
    assert tuple(out.shape) == (5, 0)
    out = poison((0, 6), device=device)
    assert (
        ragvit.linear(
            torch.empty((0, 0), device=device), torch.ones((6, 0), device=device), out=out
        )
        is out
    )


@pytest.mark.parametrize("device", devices())
def test_linear_accumulates_beyond_the_dtype(device):
    """fp16: 4096 products 1 * 0.25, + bias 2, + residual -1 = 1025 exactly; an fp16
    accumulator would stall at 512 (where 0.25 is half an ulp) and give 513."""
    x = torch.ones((2, 4096), dtype=torch.float16, device=device)
    w = torch.full((3, 4096), 0.25, dtype=torch.float16, device=device)
    bias = torch.full((3,), 2.0, dtype=torch.float16, device=device)
    residual = torch.full((2, 3), -1.0, dtype=torch.float16, device=device)
    out = ragvit.linear(x, w, bias, residual=residual)
    assert torch.equal(out.cpu(), torch.full((2, 3), 1025.0, dtype=torch.float16))


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_out", [False, True], ids=["out_omitted", "out_given"])
def test_linear_numpy_in_numpy_out(np_dtype, with_out, gen, seed):
    """numpy inputs (read-only ones too: they are only read) give numpy out."""
    M, K, N = 9, 192, 40
    x = torch.randn((M, K), generator=gen).numpy().astype(np_dtype)
    w = (torch.randn((N, K), generator=gen) / math.sqrt(K)).numpy().astype(np_dtype)
    bias = torch.randn((N,), generator=gen).numpy().astype(np_dtype)
    residual = torch.randn((M, N), generator=gen).numpy().astype(np_dtype)
    wide = np.full((M, K + 5), np.nan, dtype=np_dtype)
    wide[:, 2 : 2 + K] = x
    x = wide[:, 2 : 2 + K]  # a strided numpy view
    for array in (x, w, bias, residual):
        array.flags.writeable = False
    kwargs = {"out": np.full((M, N), np.nan, dtype=np_dtype)} if with_out else {}
    result = ragvit.linear(x, w, bias, residual=residual, **kwargs)
    assert isinstance(result, np.ndarray) and result.dtype == np_dtype and result.shape == (M, N)
    if with_out:
        assert result is kwargs["out"]
    t = [torch.from_numpy(np.array(a)) for a in (x, w, bias, residual)]
    _check_linear(torch.from_numpy(result), *t, seed)


# ---- errors: type and message; a rejected call writes nothing ----


def _linear_base(device):
    gen = torch.Generator().manual_seed(1234)
    return {
        "x": torch.randn((5, 8), generator=gen).to(device),
        "weight": torch.randn((6, 8), generator=gen).to(device),
        "bias": torch.randn((6,), generator=gen).to(device),
        "residual": torch.randn((5, 6), generator=gen).to(device),
        "out": poison((5, 6), device=device),
        "stream": None,
    }


def _call_linear(a):
    return ragvit.linear(
        a["x"], a["weight"], a["bias"], residual=a["residual"], out=a["out"], stream=a["stream"]
    )


def _dev(a):
    return a["x"].device


def _overlapping_x_and_out(a):
    buf = torch.randn((5 * 8 + 30,), device=_dev(a))
    a["x"] = buf[:40].view(5, 8)
    a["out"] = buf[38:68].view(5, 6)  # shares x's last two elements


def _overlapping_residual_and_out(a):
    buf = poison((7, 6), device=_dev(a))
    a["out"] = buf[:5]
    a["residual"] = buf[2:]


def _residual_is_out_with_other_stride(a):
    buf = poison((5, 12), device=_dev(a))
    a["residual"] = buf[:, :6]  # row stride 12
    a["out"] = buf.view(-1)[:30].view(5, 6)  # same first element, row stride 6


def _rows_overlap(shape, device):
    """(rows, cols) view whose row stride (cols - 2) makes rows share elements."""
    rows, cols = shape
    return torch.randn((rows * cols,), device=device).as_strided(shape, (cols - 2, 1))


# (id, mutation, exception, message regex, cpu_only)
LINEAR_ERRORS = (
    matrix_input_errors("linear", "x", (5, 8))
    + matrix_out_errors("linear", (5, 6), lambda shape, device: poison(shape, device=device))
    + vector_arg_errors("bias", 6, torch.bfloat16, out_row=2)
    + self_overlap_errors("linear", "out")
) + [
    (
        "x_rows_overlap",
        _set(x=lambda a: _rows_overlap((5, 8), _dev(a))),
        ValueError,
        r"x must have a row stride >= its 8 columns, got 6",
        False,
    ),
    (
        "k_zero",
        _set(
            x=lambda a: torch.empty((5, 0), device=_dev(a)),
            weight=lambda a: torch.empty((6, 0), device=_dev(a)),
        ),
        ValueError,
        r"x must have at least one column \(in_features\), got 0",
        False,
    ),
    (
        "weight_1d",
        _set(weight=lambda a: a["weight"].reshape(-1)),
        ValueError,
        "weight must have 2 dimensions",
        False,
    ),
    (
        "weight_k_mismatch",
        _set(weight=lambda a: a["weight"][:, :7]),
        ValueError,
        r"weight must have shape \(6, 8\), got \(6, 7\)",
        False,
    ),
    (
        "weight_float16",
        _set(weight=lambda a: a["weight"].half()),
        TypeError,
        r"weight must have the dtype of x \(float32\), got float16",
        False,
    ),
    (
        "weight_last_dim_strided",
        _set(weight=lambda a: torch.randn((8, 6), device=_dev(a)).t()),
        ValueError,
        r"weight must be contiguous in its last dimension",
        False,
    ),
    (
        "weight_rows_overlap",
        _set(weight=lambda a: _rows_overlap((6, 8), _dev(a))),
        ValueError,
        r"weight must have a row stride >= its 8 columns, got 6",
        False,
    ),
    (
        "residual_wrong_shape",
        _set(residual=lambda a: torch.randn((5, 7), device=_dev(a))),
        ValueError,
        r"residual must have shape \(5, 6\), got \(5, 7\)",
        False,
    ),
    (
        "residual_transposed",
        _set(residual=lambda a: torch.randn((6, 5), device=_dev(a)).t()),
        ValueError,
        r"residual must be contiguous in its last dimension",
        False,
    ),
    (
        "residual_float16",
        _set(residual=lambda a: a["residual"].half()),
        TypeError,
        r"residual must have the dtype of x \(float32\), got float16",
        False,
    ),
    (
        "residual_overlaps_out",
        _overlapping_residual_and_out,
        ValueError,
        r"out must not alias \(overlap\) residual",
        False,
    ),
    (
        "residual_is_out_with_other_stride",
        _residual_is_out_with_other_stride,
        ValueError,
        r"residual must have out's row stride when it is out \(in place\), got 12 and 6",
        False,
    ),
    (
        "out_aliases_x",
        _set(out=lambda a: a["x"][:, :6]),
        ValueError,
        r"out must not alias \(overlap\) x",
        False,
    ),
    (
        "out_overlaps_x_partially",
        _overlapping_x_and_out,
        ValueError,
        r"out must not alias \(overlap\) x",
        False,
    ),
    (
        "out_aliases_weight",
        _set(out=lambda a: a["weight"][:5, :6]),
        ValueError,
        r"out must not alias \(overlap\) weight",
        False,
    ),
    (
        "bias_strided",
        _set(bias=lambda a: poison((2 * a["weight"].shape[0],), device=_dev(a))[::2]),
        ValueError,
        r"linear: bias must be contiguous \(stride 1\), got stride 2",
        False,
    ),
]


@pytest.mark.parametrize("device", devices())
def test_linear_error_base_args_are_valid(device, seed):
    a = _linear_base(device)
    assert _call_linear(a) is a["out"]
    _check_linear(a["out"], a["x"], a["weight"], a["bias"], a["residual"], seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(LINEAR_ERRORS))
def test_linear_rejects(device, mutate, exc, pattern):
    assert_rejected(_call_linear, _linear_base(device), mutate, exc, pattern)


def test_linear_rejects_missing_and_unknown_arguments():
    a = _linear_base("cpu")
    x, w, bias, residual = a["x"], a["weight"], a["bias"], a["residual"]
    with pytest.raises(TypeError, match=r"linear\(\) missing required argument 'weight'"):
        ragvit.linear(x)
    with pytest.raises(TypeError, match=r"linear\(\) missing required argument 'weight'"):
        ragvit.linear(x, None)  # None is "left out"
    with pytest.raises(TypeError, match=r"missing required argument 'x'"):
        ragvit.linear(weight=w)
    with pytest.raises(TypeError, match=r"linear\(\) takes at most 3 positional arguments"):
        ragvit.linear(x, w, bias, residual)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'residuals'"):
        ragvit.linear(x, w, residuals=residual)
    with pytest.raises(TypeError, match=r"multiple values for argument 'weight'"):
        ragvit.linear(x, w, weight=w)
    assert torch.isnan(a["out"]).all()


def test_linear_rejects_read_only_numpy_out():
    a = as_numpy(_linear_base("cpu"))
    out = a["out"].copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"linear: out must be writable, got a read-only array"):
        ragvit.linear(a["x"], a["weight"], a["bias"], residual=a["residual"], out=out)
    assert np.isnan(out).all()
    # In place on a read-only residual: out is read-only, so it is refused as well.
    residual = a["residual"].copy()
    residual.flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be writable"):
        ragvit.linear(a["x"], a["weight"], residual=residual, out=residual)
    assert np.array_equal(residual, a["residual"])


# ---- CUDA only: devices, graphs ----

DEVICE_MISMATCH = [
    ("weight", r"weight must be on the device of x \(cuda:0\), got cpu:0"),
    ("bias", r"bias must be on the device of x \(cuda:0\), got cpu:0"),
    ("residual", r"residual must be on the device of x \(cuda:0\), got cpu:0"),
    ("out", r"out must be on the device of x \(cuda:0\), got cpu:0"),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name, pattern", DEVICE_MISMATCH, ids=[n for n, _ in DEVICE_MISMATCH])
def test_linear_rejects_device_mismatch(name, pattern):
    on_cpu = _set(**{name: lambda a: a[name].cpu()})
    assert_rejected(_call_linear, _linear_base("cuda"), on_cpu, ValueError, pattern)


@pytest.mark.gpu
@requires_cuda
def test_linear_rejects_cpu_x_with_cuda_weight():
    a = _linear_base("cpu")
    a["weight"] = a["weight"].cuda()
    with pytest.raises(
        ValueError, match=r"weight must be on the device of x \(cpu:0\), got cuda:0"
    ):
        _call_linear(a)
    assert torch.isnan(a["out"]).all()
    with pytest.raises(ValueError, match=r"weight must be on the device of x \(cpu:0\)"):
        ragvit.linear(a["x"], a["weight"])  # out omitted: allocated like x, on the CPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", dtype_params((torch.float16, torch.bfloat16)))
def test_linear_mlp_cuda_graph_replay(dtype, gen, seed):
    """A ViT MLP block (layer_norm, fc1, gelu, fc2 + residual) captured once, replayed.

    The first linear call on a stream allocates its cuBLASLt workspace, so the block runs
    eagerly on the capture stream first (as ragvit.cuda_graph does).
    """
    ragvit.set_debug(False)  # debug mode syncs after each op: not capturable
    M, C, H = 1024, 384, 1536
    x = torch.empty((M, C), dtype=dtype, device="cuda")
    ln_w = (1 + 0.1 * torch.randn((C,), generator=gen)).to(dtype=dtype, device="cuda")
    ln_b = (0.1 * torch.randn((C,), generator=gen)).to(dtype=dtype, device="cuda")
    w1 = (torch.randn((H, C), generator=gen) / math.sqrt(C)).to(dtype=dtype, device="cuda")
    b1 = (0.1 * torch.randn((H,), generator=gen)).to(dtype=dtype, device="cuda")
    w2 = (torch.randn((C, H), generator=gen) / math.sqrt(H)).to(dtype=dtype, device="cuda")
    b2 = (0.1 * torch.randn((C,), generator=gen)).to(dtype=dtype, device="cuda")
    h = poison((M, C), dtype, "cuda")
    hidden = poison((M, H), dtype, "cuda")
    out = poison((M, C), dtype, "cuda")

    def block():
        ragvit.layer_norm(x, ln_w, ln_b, out=h)
        ragvit.linear(h, w1, b1, out=hidden)
        ragvit.gelu(hidden, out=hidden)
        ragvit.linear(hidden, w2, b2, residual=x, out=out)

    x.copy_(torch.randn((M, C), generator=gen))
    graph = capture_graph(block, capture_on_side_stream=True)
    for _ in range(2):
        x.copy_(torch.randn((M, C), generator=gen))
        out.fill_(math.nan)
        hidden.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        # Each stage against its own float64 reference on the graph's actual inputs.
        h_ref = F.layer_norm(x.double(), (C,), ln_w.double(), ln_b.double())
        torch.testing.assert_close(
            h.double(), h_ref, **TOL[dtype], msg=lambda m: m + seed_note(seed)
        )
        # hidden = gelu(fc1 rounded to dtype): twice fc1's tolerance (|gelu'| < 1.13).
        hidden_ref = F.gelu(linear_reference(h, w1, b1))
        tol = {k: 2 * v for k, v in linear_tolerance(dtype, C).items()}
        torch.testing.assert_close(hidden.double(), hidden_ref, **tol)
        _check_linear(out, hidden, w2, b2, x, seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("residual_kind", ["none", "in_place"])
def test_linear_first_call_inside_capture(residual_kind, gen, seed):
    """linear's very first call on a new stream and shape may be inside a capture (no
    warm-up, torch.cuda.graph's own stream): it allocates nothing there (a workspace-free
    algorithm), and the replay is still right; a later eager call too."""
    ragvit.set_debug(False)
    M = 300 + int(torch.randint(0, 500, (1,), generator=gen))  # a shape no other test used
    K, N = 384, 1152 if residual_kind == "none" else 384
    x = torch.randn((M, K), generator=gen).to(device="cuda", dtype=torch.float16)
    w = (torch.randn((N, K), generator=gen) / math.sqrt(K)).to(device="cuda",
                                                                dtype=torch.float16)
    b = torch.randn((N,), generator=gen).to(device="cuda", dtype=torch.float16)
    out = poison((M, N), torch.float16, "cuda")
    kwargs = {"residual": out} if residual_kind == "in_place" else {}
    start = torch.randn((M, N), generator=gen).to(device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ragvit.linear(x, w, b, out=out, **kwargs)
    for _ in range(2):
        x.copy_(torch.randn((M, K), generator=gen))
        out.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        _check_linear(out, x, w, b, start if kwargs else None, seed)
    eager = poison((M, N), torch.float16, "cuda")
    if kwargs:
        eager.copy_(start)
    ragvit.linear(x, w, b, out=eager, **({"residual": eager} if kwargs else {}))
    _check_linear(eager, x, w, b, start if kwargs else None, seed)
