"""ragvit.layer_norm against float64 torch.nn.functional.layer_norm: every dtype, M in {0, 1,
7, 197, 577} (larger packed batches on CUDA), C not a multiple of 8 (37, 100, 1001), DeiT
widths and 1024 (the CUDA kernel keeps such rows in registers), 1025-2500 (its path that
re-reads the row); weight and bias absent or present, eps; in place, strided views, NumPy,
and every user-reachable error. Rows have their own scale and offset, and one all-zero row
(a padding token) must give exactly bias; support.checks applies the dtype table and err <=
2 * err(torch in the same dtype) + floor.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.checks import assert_matches_reference
from support.devices import device_param, devices, requires_cuda
from support.errors import (
    assert_device_mismatch_rejected,
    assert_rejected,
    error_params,
    row_op_args,
    row_op_errors,
    vector_arg_errors,
)
from support.errors import set_args as _set
from support.inputs import (
    column_layout_params,
    padding_is_nan,
    place_columns,
    poison,
    same_bits,
    seed_note,
)
from support.tolerances import DTYPE_IDS, DTYPES, dtype_params

import ragvit

# (M, C) per device.
SHAPES = {
    "cpu": [(0, 100), (1, 37), (7, 100), (197, 384), (577, 768), (5, 1001), (13, 2048), (7, 2049),
            (5, 2500)],
    "cuda": [
        (0, 768),
        (1, 37),
        (7, 100),
        (197, 192),
        (577, 384),
        (577, 768),
        (64, 1024),
        (33, 1001),
        (9, 1025),
        (13, 2048),
        (13, 2049),
        (7, 2500),
        (4099, 3072),  # rows not a multiple of the 4 rows a block
        (36928, 768),  # DeiT-B on 64 packed images of 577 tokens
    ],
}
AFFINES = ("none", "weight", "bias", "both")


# ---- inputs, reference, check ----


def _ln_rows(gen, M, C):
    """(M, C) float32 rows, each with its own scale in [0.5, 3] and offset in [-5, 5]."""
    scale = 0.5 + 2.5 * torch.rand((M, 1), generator=gen)
    shift = 10 * torch.rand((M, 1), generator=gen) - 5
    x = torch.randn((M, C), generator=gen) * scale + shift
    if M >= 7:
        x[3] = 0  # an all-zero row (padding token): variance 0, y = bias exactly
    return x


def _ln_affine(gen, C, affine, dtype, device):
    weight = (1 + 0.5 * torch.randn((C,), generator=gen)).to(dtype=dtype, device=device)
    bias = (0.5 * torch.randn((C,), generator=gen)).to(dtype=dtype, device=device)
    return (
        weight if affine in ("weight", "both") else None,
        bias if affine in ("bias", "both") else None,
    )


def layer_norm_reference(x, weight, bias, eps):
    """float64 torch.nn.functional.layer_norm over the last dim, on x's device."""
    return F.layer_norm(
        x.double(),
        (x.shape[-1],),
        None if weight is None else weight.double(),
        None if bias is None else bias.double(),
        eps,
    )


def _check_layer_norm(got, x, weight, bias, eps, seed):
    """x is the input as it was before the call (a copy when the call ran in place)."""
    C = x.shape[1]
    expected = layer_norm_reference(x, weight, bias, eps)
    baseline = F.layer_norm(x, (C,), weight, bias, eps)
    assert_matches_reference(got, expected, baseline, x.dtype, seed)
    if x.shape[0] >= 7 and not x[3].any():  # the zero row: exactly bias (or zeros)
        zero_row = torch.zeros(C, dtype=x.dtype) if bias is None else bias.cpu()
        assert torch.equal(got[3].cpu(), zero_row), "all-zero row must give bias" + seed_note(seed)


# ---- layer_norm vs the reference ----


def _ln_params():
    return [
        device_param(device, dtype, (M, C), affine, eps,
                     id=f"{DTYPE_IDS[dtype]}-M{M}-C{C}-{affine}-"
                     f"{'eps_default' if eps is None else f'eps{eps:g}'}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for M, C in SHAPES[device]
        for affine in AFFINES
        for eps in (None, 1e-6)
    ]


@pytest.mark.parametrize("device, dtype, shape, affine, eps", _ln_params())
def test_layer_norm_matches_reference(device, dtype, shape, affine, eps, gen, seed):
    M, C = shape
    x = _ln_rows(gen, M, C).to(dtype=dtype, device=device)
    weight, bias = _ln_affine(gen, C, affine, dtype, device)
    before = [t.clone() for t in (x, weight, bias) if t is not None]
    out = poison((M, C), dtype, device)
    kwargs = {} if eps is None else {"eps": eps}
    assert ragvit.layer_norm(x, weight, bias, out=out, **kwargs) is out
    _check_layer_norm(out, x, weight, bias, 1e-5 if eps is None else eps, seed)
    for t, b in zip([t for t in (x, weight, bias) if t is not None], before, strict=True):
        assert same_bits(t, b), "layer_norm modified an input"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-2, 1.0])
def test_layer_norm_eps_matters(device, dtype, eps, gen, seed):
    """Rows of variance ~1e-6, where eps is not negligible: eps must be added to var."""
    M, C = 9, 100
    x = (1e-3 * torch.randn((M, C), generator=gen)).to(dtype=dtype, device=device)
    out = poison((M, C), dtype, device)
    ragvit.layer_norm(x, out=out, eps=eps)
    _check_layer_norm(out, x, None, None, eps, seed)


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", column_layout_params())
@pytest.mark.parametrize("C", [100, 768, 2500])
def test_layer_norm_in_place(device, dtype, layout, C, gen, seed):
    """out is x itself (every CUDA path: 16-byte chunks, one element a load in registers,
    and the re-reading fallback); 9001 rows on CUDA: more than the vector path's grid has
    warps, so warps loop over rows."""
    M = 37 if device == "cpu" else 9001
    x, buffer = place_columns(_ln_rows(gen, M, C), dtype, device, layout)
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    x_before = x.clone()
    assert ragvit.layer_norm(x, weight, bias, out=x) is x
    _check_layer_norm(x, x_before, weight, bias, 1e-5, seed)
    assert padding_is_nan(buffer, layout, C), "wrote outside x"


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", column_layout_params())
@pytest.mark.parametrize("C", [100, 2500])
def test_layer_norm_strided_views(device, dtype, layout, C, gen, seed):
    """x and out are column slices of NaN-padded buffers (out in another layout)."""
    M = 37 if device == "cpu" else 577
    x, _ = place_columns(_ln_rows(gen, M, C), dtype, device, layout)
    out_layout = {"contiguous": "offset", "padded": "contiguous", "offset": "padded"}[layout]
    out, out_buf = place_columns(torch.full((M, C), math.nan), dtype, device, out_layout)
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    assert ragvit.layer_norm(x, weight, bias, out=out) is out
    _check_layer_norm(out, x, weight, bias, 1e-5, seed)
    assert padding_is_nan(out_buf, out_layout, C), "wrote outside out"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_layer_norm_affine_views(device, dtype, gen, seed):
    """weight and bias as strided / offset views of larger NaN buffers."""
    M, C = 11, 100
    x = _ln_rows(gen, M, C).to(dtype=dtype, device=device)
    w_buf = poison((2 * C,), dtype, device)
    b_buf = poison((C + 1,), dtype, device)
    weight, bias = w_buf[::2], b_buf[1:]
    w, b = _ln_affine(gen, C, "both", dtype, device)
    weight.copy_(w)
    bias.copy_(b)
    out = ragvit.layer_norm(x, weight, bias)
    _check_layer_norm(out, x, weight, bias, 1e-5, seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_layer_norm_out_omitted_allocates_like_x(device, dtype, gen, seed):
    M, C = 19, 100
    x, _ = place_columns(_ln_rows(gen, M, C), dtype, device, "padded")
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    result = ragvit.layer_norm(x, weight, bias, eps=1e-6)
    assert isinstance(result, torch.Tensor) and result.is_contiguous()
    assert result.dtype == dtype and result.device == x.device and tuple(result.shape) == (M, C)
    _check_layer_norm(result, x, weight, bias, 1e-6, seed)
    given = poison((M, C), dtype, device)
    assert ragvit.layer_norm(x, weight, bias, eps=1e-6, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_out", [False, True], ids=["out_omitted", "out_given"])
def test_layer_norm_numpy_in_numpy_out(np_dtype, with_out, gen, seed):
    """NumPy inputs (read-only ones too: they are only read) give a NumPy out."""
    M, C = 9, 37
    x = _ln_rows(gen, M, C).numpy().astype(np_dtype)
    weight = (1 + 0.5 * torch.randn((C,), generator=gen)).numpy().astype(np_dtype)
    bias = (0.5 * torch.randn((C,), generator=gen)).numpy().astype(np_dtype)
    for array in (x, weight, bias):
        array.flags.writeable = False
    kwargs = {"out": np.full((M, C), np.nan, dtype=np_dtype)} if with_out else {}
    y = ragvit.layer_norm(x, weight, bias, eps=1e-6, **kwargs)
    assert isinstance(y, np.ndarray) and y.dtype == np_dtype and y.shape == (M, C)
    if with_out:
        assert y is kwargs["out"]
    xt, wt, bt = (torch.from_numpy(np.array(a)) for a in (x, weight, bias))
    _check_layer_norm(torch.from_numpy(y), xt, wt, bt, 1e-6, seed)


# ---- errors: type and message; a rejected call writes nothing ----


def _call(a):
    return ragvit.layer_norm(
        a["x"], a["weight"], a["bias"], eps=a["eps"], out=a["out"], stream=a["stream"]
    )


# (id, mutation, exception, message regex, cpu_only): support.errors' rows of x, out, stream,
# weight and bias, and layer_norm's own.
LAYER_NORM_ERRORS = (
    row_op_errors("layer_norm")
    + vector_arg_errors("weight", 12, torch.float16, out_row=1)
    + vector_arg_errors("bias", 12, torch.bfloat16, out_row=4)
) + [
    (
        "weight_list",
        _set(weight=lambda a: a["weight"].tolist()),
        TypeError,
        r"weight must be an array",
        False,
    ),
    ("eps_zero", _set(eps=0.0), ValueError, r"eps must be finite and in \(0, 1\], got 0", False),
    (
        "eps_negative",
        _set(eps=-1e-5),
        ValueError,
        r"eps must be finite and in \(0, 1\], got -1e-05",
        False,
    ),
    ("eps_nan", _set(eps=math.nan), ValueError, r"eps must be finite and in \(0, 1\]", False),
    ("eps_inf", _set(eps=math.inf), ValueError, r"eps must be finite and in \(0, 1\]", False),
    (
        "eps_above_one",
        _set(eps=1.5),
        ValueError,
        r"eps must be finite and in \(0, 1\], got 1.5",
        False,
    ),
    *[
        (f"eps_{case}", _set(eps=value), ValueError,
         rf"layer_norm: eps must be >= 1.17549e-38 \(the smallest normal float32\) in float32, "
         rf"the kernels' dtype, got {re.escape(f'{value:g}')}", False)
        for case, value in [
            ("zero_in_float32", 1e-50),  # > 0 in double
            ("subnormal_in_float32", 1e-39),  # flushed to zero by the kernels
            ("just_below_flt_min", 1.1754942e-38),
        ]
    ],
    ("eps_str", _set(eps="1e-5"), TypeError, r"layer_norm: eps must be a float, got str", False),
    ("eps_bool", _set(eps=True), TypeError, r"layer_norm: eps must be a float, got bool", False),
    (
        "eps_tensor",
        _set(eps=lambda a: torch.tensor(1e-5)),
        TypeError,
        r"eps must be a float, got Tensor",
        False,
    ),
]


@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(device, seed):
    a = row_op_args(device)
    assert _call(a) is a["out"]
    _check_layer_norm(a["out"], a["x"], a["weight"], a["bias"], a["eps"], seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(LAYER_NORM_ERRORS))
def test_rejects(device, mutate, exc, pattern):
    assert_rejected(_call, row_op_args(device), mutate, exc, pattern)


@pytest.mark.parametrize("eps", [np.float32(1e-3), np.float64(1e-3), np.int64(1)],
                         ids=lambda v: type(v).__name__)
def test_eps_takes_numpy_scalars(eps):
    """Any real number is a float argument: NumPy's scalars give the bits of float(eps)."""
    a, b = row_op_args("cpu"), row_op_args("cpu")
    a["eps"], b["eps"] = eps, float(eps)
    assert same_bits(_call(a), _call(b))


def test_rejects_missing_and_unknown_arguments():
    a = row_op_args("cpu")
    x, w, b = a["x"], a["weight"], a["bias"]
    with pytest.raises(TypeError, match=r"layer_norm\(\) missing required argument 'x'"):
        ragvit.layer_norm()
    with pytest.raises(TypeError, match=r"layer_norm\(\) missing required argument 'x'"):
        ragvit.layer_norm(None, w, b)
    with pytest.raises(TypeError, match=r"layer_norm\(\) takes at most 3 positional arguments"):
        ragvit.layer_norm(x, w, b, 1e-5)
    with pytest.raises(
        TypeError, match=r"layer_norm\(\) got an unexpected keyword argument 'epsilon'"
    ):
        ragvit.layer_norm(x, epsilon=1e-5)
    with pytest.raises(TypeError, match=r"multiple values for argument 'weight'"):
        ragvit.layer_norm(x, w, weight=w)
    assert torch.isnan(a["out"]).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "x_device, name",
    [("cuda", "weight"), ("cuda", "bias"), ("cuda", "out"), ("cpu", "out")],
    ids=["weight", "bias", "out", "cpu_x-out"],
)
def test_rejects_device_mismatch(x_device, name):
    assert_device_mismatch_rejected(_call, row_op_args(x_device), name, "layer_norm")
