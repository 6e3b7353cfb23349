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

from ragvit.reference import attention_reference, cls_attn_reference, padded_sdpa


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
