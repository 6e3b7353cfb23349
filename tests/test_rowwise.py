"""ragvit.layer_norm and ragvit.gelu against float64 torch, in place, errors.

The oracle is torch.nn.functional.layer_norm / gelu (exact erf form) in float64
on the dtype-valued inputs. A result passes when it is within the conftest TOL
table of that reference and err <= 2 * err(torch in the same dtype on the same
device) + ERROR_FLOOR (flash-attention's rule). Shapes: M in {0, 1, 7, 197, 577}
(larger packed batches on CUDA), C not a multiple of 8 (37, 100, 1001: the CUDA
kernel's one-element-a-load paths), DeiT widths and 1024 (its 16-byte-chunk path
keeps rows up to 1024 in registers), 1025 / 2048 / 2049 / 2500 (its path that
re-reads the row). LayerNorm rows have their own scale and offset
(and one all-zero row, a padding token, which must give exactly bias), weight
and bias absent or present, eps 1e-5 (default) and 1e-6, plus a small-variance
case where eps dominates. GELU inputs span the tails (|x| up to 10, and a row of
extreme finite values). Outputs are NaN-poisoned before the call and must come
back finite; strided inputs are column slices of NaN-padded buffers (a stray
read shows) and strided outputs must leave their padding NaN (a stray write
shows). Then in place (out is x), numpy, and every user-reachable error (type
and message; a rejected call writes nothing). Everything here is cheap on the
CPU (well under a second for the whole file on two cores).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DTYPE_IDS,
    DTYPES,
    ERROR_FLOOR,
    TOL,
    devices,
    dtype_params,
    error_params,
    gpu_marks,
    matrix_input_errors,
    poison,
    requires_cuda,
    same_bits,
    seed_note,
)
from conftest import set_args as _set  # error-table mutations

import ragvit

# (M, C) per device.
LN_SHAPES = {
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
GELU_SHAPES = {
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
AFFINES = ("none", "weight", "bias", "both")
# Layouts of x and out: dense; the first columns of a buffer 64 wider (16-byte
# aligned rows); columns 1.. of a buffer 3 wider (odd row stride, misaligned).
LAYOUTS = {"contiguous": (0, 0), "padded": (0, 64), "offset": (1, 3)}


# ---- inputs, references, check ----


def _place(values, dtype, device, layout):
    """values (rows, cols) as dtype on device in a LAYOUTS layout -> (view, buffer).

    The columns of buffer outside the view are NaN.
    """
    start, extra = LAYOUTS[layout]
    rows, cols = values.shape
    if layout == "contiguous":
        view = values.to(dtype=dtype, device=device)
        return view, view
    buffer = poison((rows, cols + extra), dtype, device)
    view = buffer[:, start : start + cols]
    view.copy_(values.to(dtype=dtype, device=device))
    return view, buffer


def _outside(buffer, layout, cols):
    """Bool CPU mask of buffer's padding columns for a view placed with layout."""
    start, _ = LAYOUTS[layout]
    mask = torch.ones(buffer.shape, dtype=torch.bool)
    mask[:, start : start + cols] = False
    return mask


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


def _check(got, expected, baseline, dtype, seed):
    """got vs the float64 reference: finite, TOL, and the 2 * err(torch) + floor rule."""
    note = seed_note(seed)
    expected = expected.detach().to(torch.float64)
    got = torch.as_tensor(got).detach().to(expected.device, torch.float64)
    assert got.shape == expected.shape
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), (
        "non-finite output: an element left unwritten (NaN poison) or a NaN read" + note
    )
    assert torch.isfinite(expected).all(), "test bug: non-finite reference"
    torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m: m + note)
    baseline = baseline.detach().to(expected.device, torch.float64)
    err = (got - expected).abs().max().item()
    err_torch = (baseline - expected).abs().max().item()
    assert math.isfinite(err_torch), "test bug: torch baseline is not finite"
    bound = 2 * err_torch + ERROR_FLOOR[dtype]
    assert err <= bound, f"err {err:.3g} > 2*err(torch) {err_torch:.3g} + floor" + note


def _check_layer_norm(got, x, weight, bias, eps, seed):
    """x is the input as it was before the call (a copy when the call ran in place)."""
    C = x.shape[1]
    expected = layer_norm_reference(x, weight, bias, eps)
    baseline = F.layer_norm(x, (C,), weight, bias, eps)
    _check(got, expected, baseline, x.dtype, seed)
    if x.shape[0] >= 7 and not x[3].any():  # the zero row: exactly bias (or zeros)
        zero_row = torch.zeros(C, dtype=x.dtype) if bias is None else bias.cpu()
        assert torch.equal(got[3].cpu(), zero_row), "all-zero row must give bias" + seed_note(seed)


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
    expected = F.gelu(x.double())
    baseline = F.gelu(x)
    _check(got, expected, baseline, x.dtype, seed)


# ---- layer_norm vs the reference ----


def _ln_params():
    params = []
    for device in ("cpu", "cuda"):
        marks = gpu_marks() if device == "cuda" else []
        for dtype in DTYPES:
            for M, C in LN_SHAPES[device]:
                for affine in AFFINES:
                    for eps in (None, 1e-6):
                        eps_id = "eps_default" if eps is None else f"eps{eps:g}"
                        name = f"{device}-{DTYPE_IDS[dtype]}-M{M}-C{C}-{affine}-{eps_id}"
                        params.append(
                            pytest.param(device, dtype, (M, C), affine, eps, marks=marks, id=name)
                        )
    return params


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


def _in_place_params():
    params = []
    for device in ("cpu", "cuda"):
        marks = gpu_marks() if device == "cuda" else []
        for dtype in DTYPES:
            for layout in LAYOUTS:
                name = f"{device}-{DTYPE_IDS[dtype]}-{layout}"
                params.append(pytest.param(device, dtype, layout, marks=marks, id=name))
    return params


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", _in_place_params())
@pytest.mark.parametrize("C", [100, 768, 2500])
def test_layer_norm_in_place(device, dtype, layout, C, gen, seed):
    """out is x itself (every CUDA path: 16-byte chunks, one element a load in registers,
    and the re-reading fallback); 9001 rows on CUDA: more than the vector path's grid has
    warps, so warps loop over rows."""
    M = 37 if device == "cpu" else 9001
    x, buffer = _place(_ln_rows(gen, M, C), dtype, device, layout)
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    x_before = x.clone()
    assert ragvit.layer_norm(x, weight, bias, out=x) is x
    _check_layer_norm(x, x_before, weight, bias, 1e-5, seed)
    if layout != "contiguous":
        assert torch.isnan(buffer.cpu()[_outside(buffer, layout, C)]).all(), "wrote outside x"


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", _in_place_params())
@pytest.mark.parametrize("C", [100, 2500])
def test_layer_norm_strided_views(device, dtype, layout, C, gen, seed):
    """x and out are column slices of NaN-padded buffers (out in another layout)."""
    M = 37 if device == "cpu" else 577
    x, _ = _place(_ln_rows(gen, M, C), dtype, device, layout)
    out_layout = {"contiguous": "offset", "padded": "contiguous", "offset": "padded"}[layout]
    out, out_buf = _place(torch.full((M, C), math.nan), dtype, device, out_layout)
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    assert ragvit.layer_norm(x, weight, bias, out=out) is out
    _check_layer_norm(out, x, weight, bias, 1e-5, seed)
    if out_layout != "contiguous":
        assert torch.isnan(out_buf.cpu()[_outside(out_buf, out_layout, C)]).all(), "wrote outside"


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
    x, _ = _place(_ln_rows(gen, M, C), dtype, device, "padded")
    weight, bias = _ln_affine(gen, C, "both", dtype, device)
    result = ragvit.layer_norm(x, weight, bias, eps=1e-6)
    assert isinstance(result, torch.Tensor) and result.is_contiguous()
    assert result.dtype == dtype and result.device == x.device and tuple(result.shape) == (M, C)
    _check_layer_norm(result, x, weight, bias, 1e-6, seed)
    given = poison((M, C), dtype, device)
    assert ragvit.layer_norm(x, weight, bias, eps=1e-6, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


# ---- gelu vs the reference ----


def _gelu_params():
    params = []
    for device in ("cpu", "cuda"):
        marks = gpu_marks() if device == "cuda" else []
        for dtype in DTYPES:
            for M, C in GELU_SHAPES[device]:
                name = f"{device}-{DTYPE_IDS[dtype]}-M{M}-C{C}"
                params.append(pytest.param(device, dtype, (M, C), marks=marks, id=name))
    return params


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
@pytest.mark.parametrize("device, dtype, layout", _in_place_params())
def test_gelu_in_place(device, dtype, layout, gen, seed):
    M, C = (37, 100) if device == "cpu" else (577, 768)
    x, buffer = _place(_gelu_values(gen, M, C, dtype), dtype, device, layout)
    x_before = x.clone()
    assert ragvit.gelu(x, out=x) is x
    _check_gelu(x, x_before, seed)
    if layout != "contiguous":
        assert torch.isnan(buffer.cpu()[_outside(buffer, layout, C)]).all(), "wrote outside x"


@pytest.mark.sanitizer
@pytest.mark.parametrize("device, dtype, layout", _in_place_params())
def test_gelu_strided_views(device, dtype, layout, gen, seed):
    M, C = (37, 256) if device == "cpu" else (577, 1536)
    x, _ = _place(_gelu_values(gen, M, C, dtype), dtype, device, layout)
    out_layout = {"contiguous": "offset", "padded": "padded", "offset": "contiguous"}[layout]
    out, out_buf = _place(torch.full((M, C), math.nan), dtype, device, out_layout)
    assert ragvit.gelu(x, out=out) is out
    _check_gelu(out, x, seed)
    if out_layout != "contiguous":
        assert torch.isnan(out_buf.cpu()[_outside(out_buf, out_layout, C)]).all(), "wrote outside"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_gelu_out_omitted_allocates_like_x(device, dtype, gen, seed):
    M, C = 19, 100
    x, _ = _place(_gelu_values(gen, M, C, dtype), dtype, device, "offset")
    result = ragvit.gelu(x)
    assert isinstance(result, torch.Tensor) and result.is_contiguous()
    assert result.dtype == dtype and result.device == x.device and tuple(result.shape) == (M, C)
    _check_gelu(result, x, seed)
    given = poison((M, C), dtype, device)
    assert ragvit.gelu(x, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


# ---- numpy ----


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_out", [False, True], ids=["out_omitted", "out_given"])
def test_rowwise_numpy_in_numpy_out(np_dtype, with_out, gen, seed):
    M, C = 9, 37
    x = _ln_rows(gen, M, C).numpy().astype(np_dtype)
    weight = (1 + 0.5 * torch.randn((C,), generator=gen)).numpy().astype(np_dtype)
    bias = (0.5 * torch.randn((C,), generator=gen)).numpy().astype(np_dtype)
    for array in (x, weight, bias):
        array.flags.writeable = False  # inputs are only read
    ln_kwargs = {"out": np.full((M, C), np.nan, dtype=np_dtype)} if with_out else {}
    gelu_kwargs = {"out": np.full((M, C), np.nan, dtype=np_dtype)} if with_out else {}
    y = ragvit.layer_norm(x, weight, bias, eps=1e-6, **ln_kwargs)
    g = ragvit.gelu(x, **gelu_kwargs)
    for result, kwargs in ((y, ln_kwargs), (g, gelu_kwargs)):
        assert isinstance(result, np.ndarray) and result.dtype == np_dtype
        assert result.shape == (M, C)
        if with_out:
            assert result is kwargs["out"]
    xt, wt, bt = (torch.from_numpy(np.array(a)) for a in (x, weight, bias))
    _check_layer_norm(torch.from_numpy(y), xt, wt, bt, 1e-6, seed)
    _check_gelu(torch.from_numpy(g), xt, seed)
    # in place on a writable numpy array
    z = np.array(x)
    assert ragvit.gelu(z, out=z) is z
    _check_gelu(torch.from_numpy(z), xt, seed)


# ---- errors: type and message; a rejected call writes nothing ----


def _base(device):
    gen = torch.Generator().manual_seed(4321)
    return {
        "x": torch.randn((5, 12), generator=gen).to(device),
        "weight": torch.randn((12,), generator=gen).to(device),
        "bias": torch.randn((12,), generator=gen).to(device),
        "eps": 1e-5,
        "out": poison((5, 12), device=device),
        "stream": None,
    }


def _call_layer_norm(a):
    return ragvit.layer_norm(
        a["x"], a["weight"], a["bias"], eps=a["eps"], out=a["out"], stream=a["stream"]
    )


def _call_gelu(a):
    return ragvit.gelu(a["x"], out=a["out"], stream=a["stream"])


def _dev(a):
    return a["x"].device


def _out_overlaps_x(a):
    buf = torch.randn((6, 12), device=_dev(a))
    a["x"] = buf[:-1]
    a["out"] = buf[1:]  # shares x's last four rows


def _out_is_x_with_other_stride(a):
    buf = torch.randn((5, 24), device=_dev(a))
    a["x"] = buf[:, :12]  # row stride 24
    a["out"] = buf.view(-1)[:60].view(5, 12)  # same first element, row stride 12


# Rows shared by layer_norm and gelu: (id, mutation, exception, message regex, cpu_only).
# {op} in a pattern is replaced by the op's name.
SHARED_ERRORS = matrix_input_errors("{op}", "x", (5, 12)) + [
    (
        "out_wrong_shape",
        _set(out=lambda a: poison((5, 11), device=_dev(a))),
        ValueError,
        r"out must have shape \(5, 12\), got \(5, 11\)",
        False,
    ),
    (
        "out_1d",
        _set(out=lambda a: poison((60,), device=_dev(a))),
        ValueError,
        r"out must have shape \(5, 12\), got \(60,\)",
        False,
    ),
    (
        "out_float16",
        _set(out=lambda a: a["out"].half()),
        TypeError,
        r"out must have the dtype of x \(float32\), got float16",
        False,
    ),
    (
        "out_last_dim_strided",
        _set(out=lambda a: poison((12, 5), device=_dev(a)).t()),
        ValueError,
        r"out must be contiguous in its last dimension",
        False,
    ),
    (
        "out_overlaps_x",
        _out_overlaps_x,
        ValueError,
        r"{op}: out must not alias \(overlap\) x",
        False,
    ),
    (
        "out_is_x_with_other_stride",
        _out_is_x_with_other_stride,
        ValueError,
        r"out must have x's row stride when it is x \(in place\), got 12 and 24",
        False,
    ),
    ("out_str", _set(out="out"), TypeError, r"out must be an array", False),
    ("stream_str", _set(stream="s"), TypeError, r"stream must be an int handle", False),
]

LAYER_NORM_ERRORS = [
    (
        "weight_wrong_length",
        _set(weight=lambda a: a["weight"][:11]),
        ValueError,
        r"weight must have shape \(12,\), got \(11,\)",
        False,
    ),
    (
        "weight_2d",
        _set(weight=lambda a: a["weight"].reshape(1, 12)),
        ValueError,
        r"weight must have shape \(12,\), got \(1, 12\)",
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
        "weight_list",
        _set(weight=lambda a: a["weight"].tolist()),
        TypeError,
        r"weight must be an array",
        False,
    ),
    (
        "bias_wrong_length",
        _set(bias=lambda a: torch.ones(13, device=_dev(a))),
        ValueError,
        r"bias must have shape \(12,\), got \(13,\)",
        False,
    ),
    (
        "bias_bfloat16",
        _set(bias=lambda a: a["bias"].bfloat16()),
        TypeError,
        r"bias must have the dtype of x \(float32\), got bfloat16",
        False,
    ),
    (
        "out_aliases_weight",
        _set(weight=lambda a: a["out"][1]),
        ValueError,
        r"out must not alias \(overlap\) weight",
        False,
    ),
    (
        "out_aliases_bias",
        _set(bias=lambda a: a["out"][4]),
        ValueError,
        r"out must not alias \(overlap\) bias",
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
    ("eps_str", _set(eps="1e-5"), TypeError, r"layer_norm: eps must be a float, got str", False),
    (
        "eps_tensor",
        _set(eps=lambda a: torch.tensor(1e-5)),
        TypeError,
        r"eps must be a float, got Tensor",
        False,
    ),
]


def _for(op, rows):
    return [
        (case, mutate, exc, pattern.format(op=op), cpu) for case, mutate, exc, pattern, cpu in rows
    ]


CALLS = {
    "layer_norm": (_call_layer_norm, _for("layer_norm", SHARED_ERRORS + LAYER_NORM_ERRORS)),
    "gelu": (_call_gelu, _for("gelu", SHARED_ERRORS)),
}
ERROR_PARAMS = [p for op, (_, cases) in CALLS.items() for p in error_params(cases, op)]


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(op, device, seed):
    a = _base(device)
    assert CALLS[op][0](a) is a["out"]
    if op == "layer_norm":
        _check_layer_norm(a["out"], a["x"], a["weight"], a["bias"], a["eps"], seed)
    else:
        _check_gelu(a["out"], a["x"], seed)


@pytest.mark.parametrize("op, device, mutate, exc, pattern", ERROR_PARAMS)
def test_rejects(op, device, mutate, exc, pattern):
    a = _base(device)
    mutate(a)
    names = [n for n, v in a.items() if isinstance(v, torch.Tensor)]
    before = {n: a[n].detach().clone() for n in names}
    with pytest.raises(exc, match=pattern):
        CALLS[op][0](a)
    for name in names:  # out was NaN-poisoned: bit-identical means nothing written
        assert same_bits(a[name], before[name]), f"rejected call modified {name}"


def test_rejects_missing_and_unknown_arguments():
    a = _base("cpu")
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
    with pytest.raises(TypeError, match=r"gelu\(\) missing required argument 'x'"):
        ragvit.gelu()
    with pytest.raises(TypeError, match=r"gelu\(\) takes at most 1 positional arguments"):
        ragvit.gelu(x, a["out"])
    with pytest.raises(
        TypeError, match=r"gelu\(\) got an unexpected keyword argument 'approximate'"
    ):
        ragvit.gelu(x, approximate="tanh")
    with pytest.raises(TypeError, match=r"gelu\(\) got an unexpected keyword argument 'eps'"):
        ragvit.gelu(x, eps=1e-5)
    assert torch.isnan(a["out"]).all()


def test_rejects_read_only_numpy_outputs():
    a = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in _base("cpu").items()}
    out = a["out"].copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"layer_norm: out must be writable, got a read-only"):
        ragvit.layer_norm(a["x"], a["weight"], a["bias"], out=out)
    with pytest.raises(ValueError, match=r"gelu: out must be writable, got a read-only array"):
        ragvit.gelu(a["x"], out=out)
    assert np.isnan(out).all()
    x = a["x"].copy()
    x.flags.writeable = False  # in place on a read-only array: out is read-only
    for call in (lambda: ragvit.layer_norm(x, out=x), lambda: ragvit.gelu(x, out=x)):
        with pytest.raises(ValueError, match=r"out must be writable"):
            call()
    assert np.array_equal(x, a["x"])


# ---- CUDA only: devices ----

DEVICE_MISMATCH = [
    (
        "layer_norm",
        "weight",
        r"layer_norm: weight must be on the device of x \(cuda:0\), got cpu:0",
    ),
    ("layer_norm", "bias", r"layer_norm: bias must be on the device of x \(cuda:0\), got cpu:0"),
    ("layer_norm", "out", r"layer_norm: out must be on the device of x \(cuda:0\), got cpu:0"),
    ("gelu", "out", r"gelu: out must be on the device of x \(cuda:0\), got cpu:0"),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "op, name, pattern", DEVICE_MISMATCH, ids=[f"{op}-{n}" for op, n, _ in DEVICE_MISMATCH]
)
def test_rejects_device_mismatch(op, name, pattern):
    a = _base("cuda")
    a[name] = a[name].cpu()
    before = {n: v.detach().clone() for n, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=pattern):
        CALLS[op][0](a)
    for n, value in before.items():
        assert same_bits(a[n], value), f"rejected call modified {n}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("op", list(CALLS))
def test_rejects_cpu_x_with_cuda_out(op):
    a = _base("cpu")
    a["out"] = a["out"].cuda()
    with pytest.raises(
        ValueError, match=rf"{op}: out must be on the device of x \(cpu:0\), got cuda:0"
    ):
        CALLS[op][0](a)
    assert torch.isnan(a["out"]).all()
