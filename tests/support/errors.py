"""The error tables: every error a user can reach, its exception type and message.

A table row is (case_id, mutate, exception, message regex, cpu_only): mutate(args) turns an
op's valid base arguments (a dict) into the failing call's. error_params makes the rows
pytest params for "cpu" and "cuda" (cpu_only rows, contents only the CPU can check without
a sync, run on the CPU alone); assert_rejected runs one and checks that the rejected call
wrote nothing. Rows several ops share are made here: matrix inputs and outputs, vector
arguments, cu_seqlens, packed inputs, the row ops' x and out, outputs that overlap themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.devices import gpu_marks
from support.inputs import as_numpy, make_cu_seqlens, poison, same_bits


def set_args(**changes):
    """A mutation: sets args[name] = value(args) (or the plain value) for each change."""

    def mutate(a):
        for name, value in changes.items():
            a[name] = value(a) if callable(value) else value

    return mutate


def error_params(cases, *leading) -> list:
    """pytest params (*leading, device, mutate, exc, pattern) of an error table, for "cpu"
    and "cuda" (CUDA rows marked gpu_marks(), cpu_only rows left out); ids
    "<leading>-<device>-<case_id>"."""
    params = []
    for device in ("cpu", "cuda"):
        for case_id, mutate, exc, pattern, cpu_only in cases:
            if cpu_only and device == "cuda":
                continue
            marks = gpu_marks() if device == "cuda" else []
            params.append(pytest.param(*leading, device, mutate, exc, pattern, marks=marks,
                                       id="-".join([*map(str, leading), device, case_id])))
    return params


def _copy(value) -> torch.Tensor:
    """A torch copy of a tensor or NumPy array (read-only arrays included)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))
    return value.detach().clone()


def assert_rejected(call, args, mutate, exc, pattern):
    """mutate(args); call(args) must raise exc matching pattern and leave every tensor and
    array of args bit-identical (outputs are poisoned: untouched means unwritten)."""
    mutate(args)
    arrays = (torch.Tensor, np.ndarray)
    watched = [name for name, value in args.items() if isinstance(value, arrays)]
    assert watched, "test bug: no tensor argument to watch"
    before = {name: _copy(args[name]) for name in watched}
    with pytest.raises(exc, match=pattern):
        call(args)
    for name in watched:
        assert same_bits(_copy(args[name]), before[name]), f"rejected call modified {name}"


def assert_device_mismatch_rejected(call, args, name, op, x_name="x"):
    """args[name] moved to the other device than args[x_name]: call(args) must raise
    "<op>: <name> must be on the device of <x_name> (...), got ..." and write nothing."""
    here = args[x_name].device.type
    there = "cpu" if here == "cuda" else "cuda"
    pattern = rf"{op}: {name} must be on the device of {x_name} \({here}:0\), got {there}:0"
    move = set_args(**{name: lambda a: a[name].to(there)})
    assert_rejected(call, args, move, ValueError, pattern)


# ---- rows shared by several ops ----


def matrix_input_errors(op: str, name: str, shape: tuple[int, int]) -> list:
    """Rows of the ops whose argument `name` is a (rows, cols) float matrix with a unit
    column stride (linear's and the row ops' x, topk_index's scores): 1-D and 3-D, int32
    and float64, a list, a column stride, and NumPy float64 / int64 with out omitted (the
    dtype is refused before anything is allocated). `shape` is the base argument's (cols
    even)."""
    rows, cols = shape

    def change(fn, **more):
        return set_args(**{name: fn}, **more)

    def numpy_as(dtype):
        return change(lambda a: a[name].cpu().numpy().astype(dtype), out=None)

    dims = rf"{op}: {name} must have 2 dimensions"
    dtype = rf"{op}: {name} must be float16, bfloat16 or float32, got "
    return [
        (f"{name}_1d", change(lambda a: a[name].reshape(-1)), ValueError, dims, False),
        (f"{name}_3d", change(lambda a: a[name].reshape(rows, 2, cols // 2)), ValueError, dims,
         False),
        (f"{name}_int32", change(lambda a: a[name].to(torch.int32)), TypeError, dtype + "int32",
         False),
        (f"{name}_float64", change(lambda a: a[name].double()), TypeError, dtype + "float64",
         False),
        (f"{name}_list", change(lambda a: a[name].tolist()), TypeError,
         rf"{op}: {name} must be an array", False),
        (f"{name}_last_dim_strided",
         change(lambda a: torch.randn((cols, rows), device=a[name].device).t()), ValueError,
         rf"{op}: {name} must be contiguous in its last dimension \(stride 1\), got stride "
         rf"{rows}", False),
        (f"{name}_numpy_float64_out_omitted", numpy_as(np.float64), TypeError, dtype + "float64",
         True),
        (f"{name}_numpy_int64_out_omitted", numpy_as(np.int64), TypeError, dtype + "int64", True),
    ]


def matrix_out_errors(op: str, shape: tuple[int, int], make_out, same_dtype_as_x=True) -> list:
    """Rows of the ops whose out is a (rows, cols) matrix with a unit column stride, and
    which take a stream: out of the wrong cols, rows or rank, with a column stride, not an
    array, in another dtype than a float32 x (same_dtype_as_x); stream not a handle.
    make_out(shape, device) makes a poisoned out; `shape` is the base out's."""
    rows, cols = shape

    def out_of(shape_, transpose=False):
        def make(a):
            out = make_out(shape_, a["out"].device)
            return out.t() if transpose else out

        return set_args(out=make)

    got = rf"{op}: out must have shape \({rows}, {cols}\), got "
    dtype_rows = [
        ("out_float16", set_args(out=lambda a: a["out"].half()), TypeError,
         rf"{op}: out must have the dtype of x \(float32\), got float16", False),
    ] if same_dtype_as_x else []
    return dtype_rows + [
        ("out_wrong_cols", out_of((rows, cols + 1)), ValueError,
         got + rf"\({rows}, {cols + 1}\)", False),
        ("out_wrong_rows", out_of((rows - 1, cols)), ValueError,
         got + rf"\({rows - 1}, {cols}\)", False),
        ("out_1d", out_of((rows * cols,)), ValueError, got + rf"\({rows * cols},\)", False),
        ("out_last_dim_strided", out_of((cols, rows), transpose=True), ValueError,
         rf"{op}: out must be contiguous in its last dimension \(stride 1\), got stride {rows}",
         False),
        ("out_str", set_args(out="out"), TypeError, rf"{op}: out must be an array", False),
        ("stream_str", set_args(stream="s"), TypeError, rf"{op}: stream must be an int handle",
         False),
        ("stream_past_pointer", set_args(stream=2**64), ValueError,
         rf"^{op}: stream must be a handle in \[-2\*\*63, 2\*\*64\), got an int outside it$",
         False),
    ]


def vector_arg_errors(name: str, length: int, other_dtype: torch.dtype, out_row: int) -> list:
    """Rows of a (length,) argument of a float32 x's dtype (linear's bias, layer_norm's
    weight and bias): too short, 2-D, another dtype, and out's row out_row itself."""
    dtype_name = str(other_dtype).removeprefix("torch.")
    return [
        (f"{name}_wrong_length", set_args(**{name: lambda a: a[name][:-1]}), ValueError,
         rf"{name} must have shape \({length},\), got \({length - 1},\)", False),
        (f"{name}_2d", set_args(**{name: lambda a: a[name].reshape(1, length)}), ValueError,
         rf"{name} must have shape \({length},\), got \(1, {length}\)", False),
        (f"{name}_{dtype_name}", set_args(**{name: lambda a: a[name].to(other_dtype)}),
         TypeError, rf"{name} must have the dtype of x \(float32\), got {dtype_name}", False),
        (f"out_aliases_{name}", set_args(**{name: lambda a: a["out"][out_row]}), ValueError,
         rf"out must not alias \(overlap\) {name}", False),
    ]


def cu_seqlens_errors() -> list:
    """Rows of every op that reads a cu_seqlens: int64, 2-D, empty."""
    return [
        ("cu_seqlens_int64", set_args(cu_seqlens=lambda a: a["cu_seqlens"].long()), TypeError,
         "cu_seqlens", False),
        ("cu_seqlens_2d", set_args(cu_seqlens=lambda a: a["cu_seqlens"][None]), ValueError,
         "cu_seqlens", False),
        ("cu_seqlens_empty", set_args(cu_seqlens=lambda a: a["cu_seqlens"][:0]), ValueError,
         "cu_seqlens", False),
    ]


def packed_args(device) -> dict:
    """packed (12, 6) float32 and cu_seqlens of lengths [5, 0, 7]: the arguments the rows
    of PACKED_INPUT_ERRORS change (repack, repack_into, gather_prefix, segment_mean)."""
    return {
        "packed": torch.arange(12 * 6, dtype=torch.float32, device=device).reshape(12, 6),
        "cu_seqlens": make_cu_seqlens([5, 0, 7], device),
        "stream": None,
    }


def _packed_device(a):
    return a["packed"].device


def _cu_seqlens(values):
    return set_args(
        cu_seqlens=lambda a: torch.tensor(values, dtype=torch.int32, device=_packed_device(a))
    )


PACKED_INPUT_ERRORS = cu_seqlens_errors() + [
    (
        "packed_int32",
        set_args(packed=lambda a: a["packed"].to(torch.int32)),
        TypeError,
        "packed",
        False,
    ),
    (
        "packed_3d",
        set_args(packed=lambda a: a["packed"].reshape(2, 6, 6)),
        ValueError,
        "packed",
        False,
    ),
    (
        "packed_channels_strided",
        set_args(packed=lambda a: a["packed"].t().contiguous().t()),
        ValueError,
        "contiguous",
        False,
    ),
    ("packed_list", set_args(packed=lambda a: a["packed"].tolist()), TypeError, "packed", False),
    ("cu_seqlens_decreasing", _cu_seqlens([0, 5, 3, 12]), ValueError, "non-decreasing", True),
    ("cu_seqlens_past_T", _cu_seqlens([0, 5, 5, 13]), ValueError, "total_tokens", True),
    ("cu_seqlens_negative", _cu_seqlens([-1, 5, 5, 12]), ValueError, r"cu_seqlens\[0\]", True),
    ("stream_str", set_args(stream="s"), TypeError, "stream", False),
]


def row_op_args(device) -> dict:
    """Valid arguments of layer_norm (all of them) and gelu (x, out, stream)."""
    gen = torch.Generator().manual_seed(4321)
    return {
        "x": torch.randn((5, 12), generator=gen).to(device),
        "weight": torch.randn((12,), generator=gen).to(device),
        "bias": torch.randn((12,), generator=gen).to(device),
        "eps": 1e-5,
        "out": poison((5, 12), device=device),
        "stream": None,
    }


def _x_device(a):
    return a["x"].device


def _out_overlaps_x(a):
    buf = torch.randn((6, 12), device=_x_device(a))
    a["x"] = buf[:-1]
    a["out"] = buf[1:]  # shares x's last four rows


def _out_is_x_with_other_stride(a):
    buf = torch.randn((5, 24), device=_x_device(a))
    a["x"] = buf[:, :12]  # row stride 24
    a["out"] = buf.view(-1)[:60].view(5, 12)  # same first element, row stride 12


def _numpy_read_only_out(a):
    a.update(as_numpy(a))
    a["out"].flags.writeable = False


def _numpy_read_only_in_place(a):
    a.update(as_numpy(a))
    a["x"].flags.writeable = False
    a["out"] = a["x"]  # in place on a read-only array: out is read-only


def row_op_errors(op: str) -> list:
    """Rows of the row ops (layer_norm, gelu) about x, out and stream, for row_op_args."""
    return (
        matrix_input_errors(op, "x", (5, 12))
        + matrix_out_errors(op, (5, 12), lambda shape, device: poison(shape, device=device))
        + [
            ("out_overlaps_x", _out_overlaps_x, ValueError,
             rf"{op}: out must not alias \(overlap\) x", False),
            ("out_is_x_with_other_stride", _out_is_x_with_other_stride, ValueError,
             r"out must have x's row stride when it is x \(in place\), got 12 and 24", False),
            ("out_read_only_numpy", _numpy_read_only_out, ValueError,
             rf"{op}: out must be writable, got a read-only array", True),
            ("in_place_read_only_numpy", _numpy_read_only_in_place, ValueError,
             r"out must be writable", True),
        ]
        + self_overlap_errors(op, "out")
    )


def self_overlap_errors(op: str, name: str, key: str | None = None) -> list:
    """Rows of an output `name` that reaches one element through two indices: its first
    entry (row) expand()ed over the leading dim, a torch view with zero strides on every
    dim but a matrix's last, and a NumPy view made with np.lib.stride_tricks.as_strided
    (host only). Dtype, device and shape stay the base argument's (args[key], key
    defaulting to name): only strides differ."""
    pattern = rf"{op}: {name} must not overlap itself"
    key = key or name

    def expanded(a):
        t = a[key]
        return poison((1, *t.shape[1:]), t.dtype, t.device).expand(t.shape)

    def zero_strides(a):  # a unit stride kept on the last dim of a matrix (checked first)
        t = a[key]
        strides = (0,) * (t.dim() - 1) + ((1,) if t.dim() > 1 else (0,))
        return poison((t.shape[-1],), t.dtype, t.device).as_strided(t.shape, strides)

    def numpy_view(a):
        base = a[key].cpu().numpy().copy()
        strides = (0, *base.strides[1:])  # every leading index reaches the first row
        return np.lib.stride_tricks.as_strided(base, base.shape, strides, writeable=True)

    return [
        (f"{name}_expanded", set_args(**{key: expanded}), ValueError, pattern, False),
        (f"{name}_zero_strides", set_args(**{key: zero_strides}), ValueError, pattern, False),
        (f"{name}_numpy_zero_stride", set_args(**{key: numpy_view}), ValueError, pattern, True),
    ]
