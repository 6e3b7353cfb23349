"""The tests' own machinery: ragvit.reference's attention, cls_attn and padded SDPA agree
with a dense masked computation, and the poison helpers compare bits.

Every op test trusts these as its oracle; this file guards them with the simplest possible
independent computation (one sequence at a time, einsum and softmax in float64).
"""

from __future__ import annotations

import math

import pytest
import torch
from support.devices import requires_cuda
from support.inputs import bits, make_cu_seqlens, make_qkv, poison

from ragvit.reference import (
    attention_reference,
    cls_attn_reference,
    pack_reference,
    padded_sdpa,
    unpack_reference,
)


def test_reference_helpers_are_self_consistent(gen):
    lengths = [3, 0, 5]
    q, k, v = make_qkv(gen, 10, 2, 32, torch.float64, "cpu")
    cu_seqlens = make_cu_seqlens(lengths)
    ref = attention_reference(q, k, v, cu_seqlens)
    for start, end in [(0, 3), (3, 3), (3, 8)]:
        if end == start:
            continue
        scores = torch.einsum("ihd,jhd->hij", q[start:end], k[start:end]) / math.sqrt(32)
        dense = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[start:end])
        torch.testing.assert_close(ref[start:end], dense)
    assert torch.isnan(ref[8:]).all()
    sdpa = padded_sdpa(q, k, v, cu_seqlens)
    torch.testing.assert_close(sdpa[:8], ref[:8])
    cls = cls_attn_reference(q, k, cu_seqlens)
    assert torch.allclose(cls[0:3].sum(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(cls[3:8].sum(), torch.tensor(1.0, dtype=torch.float64))
    assert bits(poison((2,))).dtype == torch.int32


def _qkv(T=5):
    gen = torch.Generator().manual_seed(T)
    return make_qkv(gen, T, 2, 8, torch.float32, "cpu")


REFERENCE_ERRORS = {
    "cu_2d": (lambda: attention_reference(*_qkv(), torch.zeros(1, 2, dtype=torch.int32)),
              r"cu_seqlens must be 1-D with S\+1 >= 1 entries, got \(1, 2\)"),
    "cu_empty": (lambda: attention_reference(*_qkv(), torch.zeros(0, dtype=torch.int32)),
                 r"cu_seqlens must be 1-D with S\+1 >= 1 entries, got \(0,\)"),
    "cu_negative": (lambda: attention_reference(*_qkv(), [-1, 3]),
                    r"cu_seqlens\[0\] must be >= 0, got -1"),
    "cu_decreasing": (lambda: attention_reference(*_qkv(), [0, 4, 2]),
                      "cu_seqlens must be non-decreasing, got 4 > 2 at 1"),
    "cu_past_t": (lambda: attention_reference(*_qkv(), [0, 6]),
                  r"cu_seqlens\[-1\] must be <= T=5, got 6"),
    "qkv_shapes": (lambda: attention_reference(_qkv()[0], _qkv(6)[1], _qkv()[2], [0, 5]),
                   r"q, k, v must all be \(T, H, D\), got \(5, 2, 8\), \(6, 2, 8\)"),
    "bias_shape": (lambda: attention_reference(*_qkv(), [0, 5], bias=torch.zeros(4)),
                   r"bias must be \(T,\) = \(5,\), got \(4,\)"),
    "cls_bias_shape": (lambda: cls_attn_reference(*_qkv()[:2], [0, 5], bias=torch.zeros(6)),
                       r"bias must be \(T,\) = \(5,\), got \(6,\)"),
    "pack_keep_shape": (lambda: pack_reference(torch.zeros(2, 3, 4), torch.ones(2, 4)),
                        r"x must be \(B, N, C\) and keep \(B, N\), got \(2, 3, 4\), "
                        r"\(2, 4\)"),
    "unpack_2d": (lambda: unpack_reference(torch.zeros(5), [0, 5], 5),
                  r"packed must be \(T, C\), got \(5,\)"),
    "unpack_long": (lambda: unpack_reference(torch.zeros(5, 2), [0, 5], 4),
                    "every length must be <= N=4, got 5 at image 0"),
    "unpack_indices": (lambda: unpack_reference(torch.zeros(2, 2), [0, 2], 4,
                                                indices=torch.tensor([0, 4])),
                       r"indices must lie in \[0, N=4\) for image 0"),
}


@pytest.mark.parametrize("case", list(REFERENCE_ERRORS))
def test_reference_helpers_refuse_bad_inputs(case):
    """The oracle refuses what it cannot compute instead of returning a wrong answer."""
    make, message = REFERENCE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.gpu
@requires_cuda
def test_attention_reference_on_the_gpu_equals_the_cpu(gen):
    """device= moves the float64 math, not the result: the GPU reference (with a bias and an
    uncovered row) matches the CPU one to float64 rounding, NaN where no sequence is."""
    lengths = [5, 1, 0, 7]
    q, k, v = make_qkv(gen, 14, 3, 64, torch.float16, "cuda")
    cu_seqlens = make_cu_seqlens(lengths, "cuda")
    bias = torch.randn(14, generator=gen).cuda()
    cpu = attention_reference(q, k, v, cu_seqlens, 0.3, bias)
    gpu = attention_reference(q, k, v, cu_seqlens, 0.3, bias, device=q.device)
    assert gpu.device == q.device and gpu.dtype == torch.float64
    torch.testing.assert_close(gpu[:13].cpu(), cpu[:13], rtol=1e-12, atol=1e-12)
    assert torch.isnan(gpu[13:]).all() and torch.isnan(cpu[13:]).all()
