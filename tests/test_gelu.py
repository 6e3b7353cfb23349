"""ragvit.gelu against float64 torch.nn.functional.gelu (the exact erf form): every dtype, M
in {0, 1, 7, 197, 577} (larger packed batches on CUDA, past the grid-stride loop), C of 37,
100 and 1001 (not a multiple of 8: the one-element-a-chunk path), DeiT MLP widths; in place,
strided views, NumPy, and every user-reachable error. Inputs span the tails (|x| up to 10 and a row
of extreme finite values); support.checks applies the dtype table and err <= 2 * err(torch
in the same dtype) + floor.
"""

from __future__ import annotations

import math

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
)
from support.inputs import column_layout_params, padding_is_nan, place_columns, poison, same_bits
from support.tolerances import DTYPE_IDS, DTYPES, dtype_params

import ragvit

# (M, C) per device.
SHAPES = {
    "cpu": [(0, 100), (1, 37), (7, 100), (197, 768), (577, 1536), (5, 2500)],
    "cuda": [
        (0, 768),
        (1, 37),
        (7, 100),
        (197, 768),
        (577, 1536),
        (577, 3072),
        (12608, 1536),  # more chunks than the grid: the grid-stride loop
        (4099, 1001),  # one element a chunk (C not a multiple of 16 bytes)
    ],
}


def _gelu_values(gen, M, C, dtype):
    """(M, C) float32 ~ N(0, 3^2) with row 0 (when M > 0) holding edge values."""
    x = 3 * torch.randn((M, C), generator=gen)
    if M > 0:
        big = 1e4 if dtype == torch.float16 else 1e30
        edges = [0.0, -0.0, 1e-4, -1e-4, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 5.5, -5.5]
        edges += [10.0, -10.0, 30.0, -30.0, big, -big]
        n = min(C, len(edges))
        x[0, :n] = torch.tensor(edges[:n])
    return x


def _check_gelu(got, x, seed):
    """x is the input as it was before the call."""
    assert_matches_reference(got, F.gelu(x.double()), F.gelu(x), x.dtype, seed)


def _gelu_params():
    return [
        device_param(device, dtype, (M, C), id=f"{DTYPE_IDS[dtype]}-M{M}-C{C}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for M, C in SHAPES[device]
    ]


@pytest.mark.parametrize("device, dtype, shape", _gelu_params())
def test_gelu_matches_reference(device, dtype, shape, gen, seed):
    M, C = shape
    x = _gelu_values(gen, M, C, dtype).to(dtype=dtype, device=device)
    x_before = x.clone()
    out = poison((M, C), dtype, device)
    assert ragvit.gelu(x, out=out) is out
    _check_gelu(out, x, seed)
    assert same_bits(x, x_before), "gelu modified x"


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", column_layout_params())
def test_gelu_in_place(device, dtype, layout, gen, seed):
    M, C = (37, 100) if device == "cpu" else (577, 768)
    x, buffer = place_columns(_gelu_values(gen, M, C, dtype), dtype, device, layout)
    x_before = x.clone()
    assert ragvit.gelu(x, out=x) is x
    _check_gelu(x, x_before, seed)
    assert padding_is_nan(buffer, layout, C), "wrote outside x"


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", column_layout_params())
def test_gelu_strided_views(device, dtype, layout, gen, seed):
    M, C = (37, 256) if device == "cpu" else (577, 1536)
    x, _ = place_columns(_gelu_values(gen, M, C, dtype), dtype, device, layout)
    out_layout = {"contiguous": "offset", "padded": "padded", "offset": "contiguous"}[layout]
    out, out_buf = place_columns(torch.full((M, C), math.nan), dtype, device, out_layout)
    assert ragvit.gelu(x, out=out) is out
    _check_gelu(out, x, seed)
    assert padding_is_nan(out_buf, out_layout, C), "wrote outside out"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_gelu_out_omitted_allocates_like_x(device, dtype, gen, seed):
    M, C = 19, 100
    x, _ = place_columns(_gelu_values(gen, M, C, dtype), dtype, device, "offset")
    result = ragvit.gelu(x)
    assert isinstance(result, torch.Tensor) and result.is_contiguous()
    assert result.dtype == dtype and result.device == x.device and tuple(result.shape) == (M, C)
    _check_gelu(result, x, seed)
    given = poison((M, C), dtype, device)
    assert ragvit.gelu(x, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_out", [False, True], ids=["out_omitted", "out_given"])
def test_gelu_numpy_in_numpy_out(np_dtype, with_out, gen, seed):
    """A read-only NumPy x (only read) gives a NumPy out; in place on a writable array."""
    M, C = 9, 37
    dtype = torch.float16 if np_dtype == np.float16 else torch.float32
    x = _gelu_values(gen, M, C, dtype).numpy().astype(np_dtype)
    x.flags.writeable = False
    kwargs = {"out": np.full((M, C), np.nan, dtype=np_dtype)} if with_out else {}
    g = ragvit.gelu(x, **kwargs)
    assert isinstance(g, np.ndarray) and g.dtype == np_dtype and g.shape == (M, C)
    if with_out:
        assert g is kwargs["out"]
    xt = torch.from_numpy(np.array(x))
    _check_gelu(torch.from_numpy(g), xt, seed)
    z = np.array(x)
    assert ragvit.gelu(z, out=z) is z
    _check_gelu(torch.from_numpy(z), xt, seed)


# ---- errors: type and message; a rejected call writes nothing ----


def _call(a):
    return ragvit.gelu(a["x"], out=a["out"], stream=a["stream"])


@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(device, seed):
    a = row_op_args(device)
    assert _call(a) is a["out"]
    _check_gelu(a["out"], a["x"], seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(row_op_errors("gelu")))
def test_rejects(device, mutate, exc, pattern):
    assert_rejected(_call, row_op_args(device), mutate, exc, pattern)


def test_rejects_missing_and_unknown_arguments():
    a = row_op_args("cpu")
    with pytest.raises(TypeError, match=r"gelu\(\) missing required argument 'x'"):
        ragvit.gelu()
    with pytest.raises(TypeError, match=r"gelu\(\) takes at most 1 positional arguments"):
        ragvit.gelu(a["x"], a["out"])
    with pytest.raises(
        TypeError, match=r"gelu\(\) got an unexpected keyword argument 'approximate'"
    ):
        ragvit.gelu(a["x"], approximate="tanh")
    with pytest.raises(TypeError, match=r"gelu\(\) got an unexpected keyword argument 'eps'"):
        ragvit.gelu(a["x"], eps=1e-5)
    assert torch.isnan(a["out"]).all()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("x_device", ["cuda", "cpu"], ids=["out", "cpu_x-out"])
def test_rejects_device_mismatch(x_device):
    assert_device_mismatch_rejected(_call, row_op_args(x_device), "out", "gelu")
