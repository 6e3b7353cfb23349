"""Input factories and poison: seeded random tensors, cu_seqlens, NaN-padded views, bits.

Every factory draws from the caller's CPU torch.Generator (conftest's `gen`, seeded from the
test id) and moves the result afterwards, so a node id gives the same numbers on every
device. Poison is NaN for floats and INT32_POISON for integers; a check that a buffer still
holds its poison compares bits (bits, same_bits), where NaN equals itself.
"""

from __future__ import annotations

import math

import torch

from support.devices import device_param
from support.tolerances import DTYPE_IDS, DTYPES

INT32_POISON = -(2**31) + 7  # poison for int32 outputs (cu_seqlens, indices)


def seed_note(seed: int) -> str:
    """Suffix for assertion messages that names the seed."""
    return f" [seed={seed}]"


def random_lengths(gen: torch.Generator, num_seqs: int, lo: int, hi: int, include=()) -> list[int]:
    """num_seqs lengths: every value of `include` once, the rest uniform in [lo, hi].

    Args:
        gen: CPU generator.
        num_seqs: S, how many lengths in all (>= len(include)).
        lo, hi: inclusive bounds of the random lengths.
        include: lengths that must appear (e.g. 1, 197, 577), placed at random
            positions.

    Returns:
        A list of S non-negative ints.
    """
    include = list(include)
    if len(include) > num_seqs:
        raise ValueError("num_seqs must be >= len(include)")
    count = num_seqs - len(include)
    rand = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    lengths = rand + include
    order = torch.randperm(num_seqs, generator=gen).tolist()
    return [lengths[i] for i in order]


def make_cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """(S+1,) int32 exclusive prefix sums of lengths, on device."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + int(length))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_qkv(
    gen: torch.Generator,
    total_tokens: int,
    num_heads: int,
    head_dim: int,
    dtype=torch.float32,
    device="cpu",
    layout="contiguous",
    std: float = 1.0,
):
    """Random q, k, v of shape (T, H, D).

    Args:
        gen: CPU generator.
        total_tokens, num_heads, head_dim: T, H, D.
        dtype: float dtype of the results.
        device: where the results live.
        layout: "contiguous" (three separate tensors) or "qkv_view" (q, k, v are
            the views [:, 0], [:, 1], [:, 2] of one (T, 3, H, D) buffer, as a qkv
            projection produces them: token stride 3*H*D).
        std: standard deviation of the normal samples.

    Returns:
        (q, k, v).
    """
    shape = (total_tokens, 3, num_heads, head_dim)
    buf = (torch.randn(shape, generator=gen) * std).to(dtype=dtype, device=device)
    if layout == "qkv_view":
        return buf[:, 0], buf[:, 1], buf[:, 2]
    if layout == "contiguous":
        return tuple(buf[:, i].contiguous() for i in range(3))
    raise ValueError(f"unknown layout {layout!r}")


def poison(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A new tensor filled with poison: NaN for floats, INT32_POISON for ints."""
    if dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    if dtype == torch.bool:
        raise ValueError("bool tensors cannot be poisoned")
    return torch.full(shape, INT32_POISON, dtype=dtype, device=device)


def packed_rows(gen, lengths, C, dtype=torch.float32, device="cpu", gap=0, pad_cols=0):
    """(packed, cu_seqlens): N(0, 1) rows of sequences of `lengths`, with `gap` NaN rows
    before the first and after the last (rows of no sequence: never read), as dtype on
    device. With pad_cols, packed is the first C columns of a NaN buffer pad_cols wider."""
    rows = gap + sum(lengths) + gap
    buffer = poison((rows, C + pad_cols), dtype)
    buffer[gap : rows - gap, :C] = torch.randn((rows - 2 * gap, C), generator=gen).to(dtype)
    packed = buffer.to(device)[:, :C]
    cu_seqlens = (make_cu_seqlens(lengths) + gap).to(torch.int32).to(device)
    return packed, cu_seqlens


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU integer view of t's bits, so NaN compares equal to itself."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        return t.view(view)
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b hold bit-identical values (NaN included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def covered_rows(cu_seqlens, total_tokens: int) -> torch.Tensor:
    """(T,) bool CPU mask of rows covered by some sequence of a valid cu_seqlens."""
    cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64).tolist()
    mask = torch.zeros(total_tokens, dtype=torch.bool)
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        mask[start:end] = True
    return mask


def poison_uncovered_rows(cu_seqlens, *tensors):
    """NaN into every row of tensors (T, ...) that belongs to no sequence (a stray read
    shows)."""
    uncovered = ~covered_rows(cu_seqlens, tensors[0].shape[0])
    if uncovered.any():
        for t in tensors:
            t[uncovered.to(t.device)] = math.nan


# ---- (rows, cols) matrices as column slices of NaN-padded buffers ----

# (first column, extra columns) of the buffer a view is placed in: dense; the first columns
# of a buffer 64 wider (aligned row stride, as a slice of a qkv buffer); columns 1.. of a
# buffer 3 wider (odd row stride, start not 16-byte aligned).
COLUMN_LAYOUTS = {"contiguous": (0, 0), "padded": (0, 64), "offset": (1, 3)}


def place_columns(values, dtype, device, layout):
    """values (rows, cols) as dtype on device, placed as a COLUMN_LAYOUTS layout.

    Returns:
        (view, buffer): the columns of buffer around the view are NaN.
    """
    start, extra = COLUMN_LAYOUTS[layout]
    rows, cols = values.shape
    if layout == "contiguous":
        view = values.to(dtype=dtype, device=device)
        return view, view
    buffer = poison((rows, cols + extra), dtype, device)
    view = buffer[:, start : start + cols]
    view.copy_(values.to(dtype=dtype, device=device))
    return view, buffer


def column_layout_params() -> list:
    """(device, dtype, layout) params over COLUMN_LAYOUTS, ids "<device>-<dtype>-<layout>"."""
    return [
        device_param(device, dtype, layout, id=f"{DTYPE_IDS[dtype]}-{layout}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for layout in COLUMN_LAYOUTS
    ]


def padding_is_nan(buffer, layout, cols) -> bool:
    """True when every column of buffer outside the view place_columns put there is NaN."""
    start, _ = COLUMN_LAYOUTS[layout]
    outside = torch.ones(buffer.shape, dtype=torch.bool)
    outside[:, start : start + cols] = False
    return bool(torch.isnan(buffer.cpu()[outside]).all())


def as_numpy(args: dict) -> dict:
    """args with every (CPU) torch tensor replaced by its NumPy array."""
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
