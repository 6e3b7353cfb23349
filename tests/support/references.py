"""float64 references that more than one test file needs (ragvit.reference holds the
attention, pack and ViT references; each other op's lives in its test file).

segment_mean_reference: per-sequence means, one sequence at a time (test_segment_mean.py,
and the pack family's graph replay that ends in segment_mean).
"""

from __future__ import annotations

import torch


def segment_mean_reference(packed, cu_seqlens, skip):
    """(B, C) float64 means of rows [cu[b] + skip, cu[b+1]); zeros when empty."""
    packed = packed.detach().cpu().double()
    cu = cu_seqlens.cpu().tolist()
    out = torch.zeros((len(cu) - 1, packed.shape[1]), dtype=torch.float64)
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if start + skip < end:
            out[b] = packed[start + skip : end].mean(dim=0)
    return out
