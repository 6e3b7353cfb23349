"""ragvit.segment_mean against a float64 reference computed one sequence at a time: every
dtype, widths, skip (the prefix rows left out), strided packed rows, every user-reachable
error, and on CUDA garbage device-side cu_seqlens (never out of bounds; debug mode raises).

Packed inputs hold NaN rows before the first and after the last sequence (never read);
outputs are NaN-poisoned with guard rows past them (never written). An empty segment's mean
is zeros. CPU cases are sized for two slow cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.cuda import GARBAGE_PACKED_CU_SEQLENS, call_with_debug, flagged_contents_test
from support.devices import device_param, devices
from support.errors import (
    PACKED_INPUT_ERRORS,
    assert_rejected,
    error_params,
    packed_args,
    self_overlap_errors,
)
from support.errors import set_args as _set
from support.inputs import (
    as_numpy,
    make_cu_seqlens,
    packed_rows,
    poison,
    random_lengths,
    seed_note,
)
from support.references import segment_mean_reference
from support.tolerances import DTYPE_IDS, DTYPES, TOL

import ragvit

GAP = 3  # rows before cu_seqlens[0] and after cu_seqlens[B]: outside every sequence
WIDTHS = {"cpu": (30, 100), "cuda": (30, 384, 768)}


def _segment_mean_params():
    return [
        device_param(device, dtype, C, skip, id=f"{DTYPE_IDS[dtype]}-C{C}-skip{skip}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for C in WIDTHS[device]
        for skip in (0, 1, 3)
    ]


@pytest.mark.parametrize("device, dtype, C, skip", _segment_mean_params())
@pytest.mark.parametrize("with_out", [True, False], ids=["out_given", "out_omitted"])
def test_segment_mean_matches_reference(device, dtype, C, skip, with_out, gen, seed):
    B = 7 if device == "cpu" else 256
    lengths = random_lengths(gen, B, 0, 197, include=(0, 1, skip, skip + 1, 197, 577))
    packed, cu_seqlens = packed_rows(gen, lengths, C, dtype, device, gap=GAP)
    kwargs = {"skip": skip} if skip else {}
    if with_out:
        guard = poison((B + 2, C), dtype, device)
        kwargs["out"] = guard[:B]
    result = ragvit.segment_mean(packed, cu_seqlens, **kwargs)
    if with_out:
        assert result is kwargs["out"]
        assert torch.isnan(guard[B:]).all(), "wrote past out" + seed_note(seed)
    assert result.shape == (B, C) and result.dtype == dtype and result.device == packed.device
    expected = segment_mean_reference(packed, cu_seqlens, skip)
    got = result.cpu().double()
    assert torch.isfinite(got).all(), "non-finite mean" + seed_note(seed)
    empty = torch.tensor([n <= skip for n in lengths])
    assert (got[empty] == 0).all(), "empty segments must be zeros" + seed_note(seed)
    torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m: m + seed_note(seed))


def test_segment_mean_accumulates_in_float32():
    # 4096 fp16 ones plus 1e-3 each: a float16 accumulator would stall at 2048.
    packed = torch.full((4096, 4), 1.0, dtype=torch.float16)
    out = ragvit.segment_mean(packed, make_cu_seqlens([4096]))
    assert torch.equal(out, torch.ones((1, 4), dtype=torch.float16))


@pytest.mark.parametrize("device", devices())
def test_segment_mean_strided_packed(device, gen, seed):
    """packed as a column slice of a wider NaN buffer (row stride C + 6)."""
    packed, cu_seqlens = packed_rows(gen, [3, 1, 7, 4], 30, device=device, gap=GAP, pad_cols=6)
    mean = ragvit.segment_mean(packed, cu_seqlens, skip=1)
    torch.testing.assert_close(
        mean.cpu().double(),
        segment_mean_reference(packed, cu_seqlens, 1),
        **TOL[torch.float32],
        msg=lambda m: m + seed_note(seed),
    )


# ---- errors: type and message; a rejected call writes nothing ----


def _base(device):
    """support.errors' packed_args (12 rows, lengths [5, 0, 7]) with skip and out."""
    return packed_args(device) | {"skip": 0, "out": poison((3, 6), device=device)}


def _call(a):
    return ragvit.segment_mean(
        a["packed"], a["cu_seqlens"], skip=a["skip"], out=a["out"], stream=a["stream"]
    )


# (id, mutation, exception, message regex, cpu_only)
SEGMENT_MEAN_ERRORS = PACKED_INPUT_ERRORS + self_overlap_errors("segment_mean", "out") + [
    ("skip_negative", _set(skip=-1), ValueError, "skip", False),
    ("skip_float", _set(skip=0.5), TypeError, "skip", False),
    (
        "out_shape",
        _set(out=lambda a: poison((3, 7), device=a["packed"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    ("out_dtype", _set(out=lambda a: a["out"].double()), TypeError, r"\bout\b", False),
    ("out_aliases_packed", _set(out=lambda a: a["packed"][:3]), ValueError, "alias", False),
]


@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(device):
    a = _base(device)
    assert _call(a) is a["out"]
    expected = segment_mean_reference(a["packed"], a["cu_seqlens"], 0)
    torch.testing.assert_close(a["out"].cpu().double(), expected)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(SEGMENT_MEAN_ERRORS))
def test_rejects(device, mutate, exc, pattern):
    assert_rejected(_call, _base(device), mutate, exc, pattern)


def test_rejects_missing_and_unknown_arguments():
    a = _base("cpu")
    with pytest.raises(TypeError, match="at most 2 positional"):
        ragvit.segment_mean(a["packed"], a["cu_seqlens"], 1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefix'"):
        ragvit.segment_mean(a["packed"], a["cu_seqlens"], prefix=1)


def test_rejects_read_only_numpy_outputs():
    a = as_numpy(_base("cpu"))
    out = a["out"].copy()
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ragvit.segment_mean(a["packed"], a["cu_seqlens"], out=out)
    assert np.isnan(out).all()


# ---- CUDA: garbage contents ----


@flagged_contents_test
@pytest.mark.parametrize("case", list(GARBAGE_PACKED_CU_SEQLENS))
def test_garbage_cu_seqlens_never_crash(case, debug):
    packed = torch.arange(24 * 6, dtype=torch.float32, device="cuda").reshape(24, 6)
    cu_seqlens = torch.tensor(GARBAGE_PACKED_CU_SEQLENS[case], dtype=torch.int32, device="cuda")
    B = cu_seqlens.numel() - 1
    guard = poison((24 + 8, 6), device="cuda")
    call_with_debug(lambda: ragvit.segment_mean(packed, cu_seqlens, out=guard[:B]), debug,
                    r"cu_seqlens|room|shorter")
    assert torch.isnan(guard[B:]).all(), "wrote past out"
    ragvit.set_debug(True)
    good = make_cu_seqlens([10, 14], "cuda")
    mean = ragvit.segment_mean(packed, good)  # flag clear: succeeds in debug mode
    torch.testing.assert_close(mean.double().cpu(), segment_mean_reference(packed, good, 0))
