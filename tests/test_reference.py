"""The tests' own machinery: ragvit.reference's attention, cls_attn and padded SDPA agree
with a dense masked computation, and the poison helpers compare bits.

Every op test trusts these as its oracle; this file guards them with the simplest possible
independent computation (one sequence at a time, einsum and softmax in float64).
"""

from __future__ import annotations

import math

import torch
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
