"""The dtypes every op is tested in and the per-dtype tolerance tables.

TOL is torch's own table for its transformer tests (fp32 assumes TF32 off, which conftest's
pytest_configure sets); ERROR_FLOOR is the additive floor of flash-attention's rule
err(ragvit) <= 2 * err(baseline) + floor, applied by support.checks.
"""

from __future__ import annotations

import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# Per-dtype assert_close tolerances against the float64 reference.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    # torch's table says atol 1e-3, but bf16 SDPA itself misses it: rounding the output
    # (and P) to bf16 gives ~1.6e-3 absolute error on unit-variance V at length 577
    # (measured on the CPU, SDPA and a FA2-style P-in-bf16 emulation alike).
    torch.bfloat16: {"atol": 4e-3, "rtol": 1.6e-2},
}

# Additive floors of flash-attention's rule err(ragvit) <= 2 * err(baseline) + floor.
ERROR_FLOOR = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}

# cls_attn is float32 whatever q's dtype; probabilities are compared absolutely.
CLS_ATTN_ATOL = 1e-5


def dtype_params(dtypes=DTYPES) -> list:
    """Parameters for a `dtype` argument, with ids fp32 / fp16 / bf16."""
    return [pytest.param(d, id=DTYPE_IDS[d]) for d in dtypes]
