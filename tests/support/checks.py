"""Assertions against a float64 reference: the dtype table, and flash-attention's rule.

A result passes when it is finite, within TOL[dtype] of the float64 reference, and its
largest error is at most 2 * that of a baseline computed the usual way in the same dtype
(torch's own op, or SDPA on the padded batch for attention) + ERROR_FLOOR[dtype]: ragvit
may round differently from torch, never much worse.
"""

from __future__ import annotations

import math

import torch

from ragvit.reference import attention_reference, cls_attn_reference, padded_sdpa
from support.inputs import covered_rows, seed_note
from support.tolerances import CLS_ATTN_ATOL, ERROR_FLOOR, TOL


def assert_within_baseline(got, expected, baseline, dtype, note="", name="torch"):
    """max |got - expected| <= 2 * max |baseline - expected| + ERROR_FLOOR[dtype] (float64
    tensors on one device)."""
    err = (got - expected).abs().max().item()
    err_baseline = (baseline - expected).abs().max().item()
    assert math.isfinite(err_baseline), f"test bug: {name} baseline is not finite"
    bound = 2 * err_baseline + ERROR_FLOOR[dtype]
    assert err <= bound, f"err {err:.3g} > 2*err({name}) {err_baseline:.3g} + floor" + note


def assert_matches_reference(got, expected, baseline, dtype, seed, *, tol=None, name="torch"):
    """got vs the float64 reference expected: finite, within tol (TOL[dtype] by default)
    and within the baseline rule. Compared on expected's device."""
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
    torch.testing.assert_close(got, expected, **(tol or TOL[dtype]), msg=lambda m: m + note)
    baseline = baseline.detach().to(expected.device, torch.float64)
    assert_within_baseline(got, expected, baseline, dtype, note, name)


def check_attention(
    out, q, k, v, cu_seqlens, *, seed, scale=None, bias=None, poisoned=True, tol_scale=1.0
):
    """Asserts out is attention(q, k, v) (with the per-key bias, if given) on the rows of
    sequences, and still poison (NaN) on every other row when poisoned.

    tol_scale multiplies the dtype table (for logits far from unit size, where fp32
    rounding of the scores alone exceeds the fp32 table); the baseline rule against SDPA
    on the padded batch is never loosened.
    """
    note = seed_note(seed)
    q, k, v = (torch.as_tensor(t) for t in (q, k, v))
    covered = covered_rows(cu_seqlens, q.shape[0])
    assert covered.any(), "test bug: no covered rows to compare"
    got_all = torch.as_tensor(out).detach().to("cpu", torch.float64)
    assert torch.isfinite(got_all[covered]).all(), "non-finite values in rows of a sequence" + note
    if poisoned:
        assert torch.isnan(got_all[~covered]).all(), (
            "rows outside every sequence were written" + note
        )
    expected = attention_reference(q, k, v, cu_seqlens, scale, bias=bias)[covered]
    baseline = padded_sdpa(q, k, v, cu_seqlens, scale=scale, bias=bias).to("cpu")[covered]
    tol = {name: value * tol_scale for name, value in TOL[q.dtype].items()}
    assert_matches_reference(got_all[covered], expected, baseline, q.dtype, seed, tol=tol,
                             name="SDPA")


def check_cls_attn(cls_attn, q, k, cu_seqlens, *, seed, scale=None, bias=None):
    """Asserts cls_attn (float32 (T,)) holds each sequence's head-mean softmax row of its
    first query on the rows of sequences, and NaN poison elsewhere."""
    note = seed_note(seed)
    covered = covered_rows(cu_seqlens, q.shape[0])
    assert covered.any(), "test bug: no covered rows to compare"
    got_all = torch.as_tensor(cls_attn).detach().to("cpu", torch.float64)
    expected = cls_attn_reference(q, k, cu_seqlens, scale, bias=bias)
    assert torch.isfinite(got_all[covered]).all(), "non-finite cls_attn in a sequence" + note
    assert torch.isnan(got_all[~covered]).all(), "cls_attn written outside sequences" + note
    torch.testing.assert_close(
        got_all[covered], expected[covered], atol=CLS_ATTN_ATOL, rtol=0, msg=lambda m: m + note
    )
