"""The pack family against references: pack, pack_into, unpack, gather_prefix, repack and
repack_into (plain and with EViT's fuse_weights), every user-reachable error, and on CUDA
graph capture and garbage device contents (never out of bounds, flagged, raised in debug).

Data movement is checked exactly: integer-valued inputs, torch.equal. Rows that must not be
copied (dropped rows, rows outside every sequence) are NaN, outputs are NaN/INT32_POISON-
poisoned and capacity buffers hold guard rows that must keep their poison. The fused token
is compared with a float64 reference. CPU cases are sized for two slow cores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.cuda import (
    GARBAGE_PACKED_CU_SEQLENS,
    call_with_debug,
    capture_graph,
    flagged_contents_test,
)
from support.devices import device_param, devices, gpu_marks, requires_cuda
from support.errors import (
    PACKED_INPUT_ERRORS,
    assert_rejected,
    cu_seqlens_errors,
    error_params,
    packed_args,
    self_overlap_errors,
)
from support.errors import set_args as _set
from support.inputs import (
    INT32_POISON,
    as_numpy,
    make_cu_seqlens,
    packed_rows,
    poison,
    random_lengths,
    same_bits,
    seed_note,
)
from support.references import segment_mean_reference
from support.tolerances import DTYPE_IDS, DTYPES, TOL, dtype_params

import ragvit
from ragvit.reference import pack_reference, unpack_reference

GAP = 3  # rows before cu_seqlens[0] and after cu_seqlens[B]: outside every sequence


# ---- references (plain torch, one sequence at a time) ----


def repack_reference(packed, cu_seqlens, keep):
    """(packed2, cu_seqlens2, src) on the CPU: kept rows of each sequence, in order."""
    flags = (keep.cpu() != 0).tolist()
    cu = cu_seqlens.cpu().tolist()
    rows, counts = [], [0]
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        kept = [t for t in range(start, end) if flags[t]]
        rows += kept
        counts.append(counts[-1] + len(kept))
    src = torch.tensor(rows, dtype=torch.int64)
    return (
        packed.cpu()[src],
        torch.tensor(counts, dtype=torch.int32),
        src.to(torch.int32),
    )


def fuse_reference(packed, cu_seqlens, keep, weights):
    """(packed2 float64, cu_seqlens2, src): kept rows then sum(w x)/sum(w) of the dropped."""
    packed, weights = packed.cpu().double(), weights.cpu().double()
    flags = keep.cpu() != 0
    cu = cu_seqlens.cpu().long()
    B, C = cu.numel() - 1, packed.shape[1]
    rows = torch.arange(int(cu[0]), int(cu[-1]))
    seq = torch.repeat_interleave(torch.arange(B), cu[1:] - cu[:-1])  # sequence of each row
    dropped = rows[~flags[rows]]
    seq_dropped = seq[~flags[rows]]
    num = torch.zeros((B, C), dtype=torch.float64)
    num.index_add_(0, seq_dropped, weights[dropped, None] * packed[dropped])
    den = torch.zeros(B, dtype=torch.float64).index_add_(0, seq_dropped, weights[dropped])
    fused = torch.where(den[:, None] != 0, num / den[:, None], torch.zeros_like(num))
    src, counts = [], [0]
    flag_list = flags.tolist()
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        kept = [t for t in range(start, end) if flag_list[t]]
        src += kept + [-1]
        counts.append(counts[-1] + len(kept) + 1)
    src = torch.tensor(src, dtype=torch.int64)
    out = torch.zeros((src.numel(), C), dtype=torch.float64)
    is_fused = src == -1
    out[~is_fused] = packed[src[~is_fused]]
    out[is_fused] = fused
    return out, torch.tensor(counts, dtype=torch.int32), src.to(torch.int32)


# ---- inputs ----


def _make_keep(gen, B, N, keep_kind):
    """(keep as passed to ragvit (bool or uint8), keep as a bool CPU mask)."""
    kind, _, keep_dtype = keep_kind.rpartition("_")
    if kind == "random":
        mask = torch.rand((B, N), generator=gen) < 0.5
    elif kind == "all":
        mask = torch.ones((B, N), dtype=torch.bool)
    elif kind == "cls_only":
        mask = torch.zeros((B, N), dtype=torch.bool)
        mask[:, 0] = True
    elif kind == "none":
        mask = torch.zeros((B, N), dtype=torch.bool)
    else:
        raise ValueError(keep_kind)
    if keep_dtype == "bool":
        return mask.clone(), mask
    # Any nonzero byte keeps the token, not just 1.
    levels = torch.randint(1, 256, (B, N), generator=gen, dtype=torch.int32).to(torch.uint8)
    return mask.to(torch.uint8) * levels, mask


def _make_pack_inputs(gen, shape, dtype, device, keep_kind, layout="contiguous"):
    """Integer-valued x (B, N, C) (dropped tokens NaN) and keep (B, N), both on device, and
    the bool CPU mask of keep.

    layout: "contiguous"; "channel_padded" (x = big[:, :, :C], row stride C+5;
    keep a column slice of a wider mask); "batch_strided" (x = big[::2]).
    """
    B, N, C = shape
    keep, mask = _make_keep(gen, B, N, keep_kind)
    values = torch.randint(-100, 101, (B, N, C), generator=gen).to(torch.float32)
    values[~mask] = math.nan
    if layout == "contiguous":
        x = values.to(dtype=dtype, device=device)
        keep = keep.to(device)
    elif layout == "channel_padded":
        big = torch.full((B, N, C + 5), math.nan)
        big[:, :, :C] = values
        x = big.to(dtype=dtype, device=device)[:, :, :C]
        wide = torch.zeros((B, N + 3), dtype=keep.dtype)
        wide[:, :N] = keep
        keep = wide.to(device)[:, :N]
    elif layout == "batch_strided":
        big = torch.full((2 * B, N, C), math.nan)
        big[::2] = values
        x = big.to(dtype=dtype, device=device)[::2]
        tall = torch.zeros((2 * B, N), dtype=keep.dtype)
        tall[::2] = keep
        keep = tall.to(device)[::2]
    else:
        raise ValueError(layout)
    return x, keep, mask


def _make_packed(gen, lengths, C, dtype, device, keep_kind="random", keep_dtype=torch.bool):
    """Integer-valued packed rows with GAP NaN rows on both sides of the sequences.

    Returns (packed (GAP + T + GAP, C), cu_seqlens starting at GAP, keep (rows,),
    mask (rows,) bool of the rows a correct repack keeps). Dropped rows and rows
    outside every sequence are NaN; keep is set on the outside rows too, which
    must be ignored.
    """
    total = sum(lengths)
    rows = GAP + total + GAP
    inside = torch.zeros(rows, dtype=torch.bool)
    inside[GAP : GAP + total] = True
    if keep_kind == "random":
        keep = torch.rand(rows, generator=gen) < 0.5
    elif keep_kind == "all":
        keep = torch.ones(rows, dtype=torch.bool)
    elif keep_kind == "none":
        keep = torch.zeros(rows, dtype=torch.bool)
    elif keep_kind == "first_only":  # only each sequence's CLS token survives
        keep = torch.zeros(rows, dtype=torch.bool)
        cu = make_cu_seqlens(lengths).tolist()
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            if end > start:
                keep[GAP + start] = True
    else:
        raise ValueError(keep_kind)
    keep[~inside] = True
    mask = keep & inside
    values = torch.randint(-100, 101, (rows, C), generator=gen).to(torch.float32)
    values[~mask] = math.nan
    if keep_dtype == torch.uint8:
        levels = torch.randint(1, 256, (rows,), generator=gen, dtype=torch.int32)
        keep_arg = keep.to(torch.uint8) * levels.to(torch.uint8)
    else:
        keep_arg = keep.clone()
    cu_seqlens = make_cu_seqlens(lengths) + GAP
    cu_seqlens = cu_seqlens.to(torch.int32)
    return (
        values.to(dtype=dtype, device=device),
        cu_seqlens.to(device),
        keep_arg.to(device),
        mask,
    )


def _lengths(gen, device, N=197):
    B = 6 if device == "cpu" else 512
    return random_lengths(gen, B, 0, N, include=(0, 1, N))


def _fuse_inputs(gen, lengths, C, dtype, device, keep_kind, weight_kind):
    packed, cu_seqlens, keep, mask = _make_packed(gen, lengths, C, dtype, device, keep_kind)
    inside = torch.ones(packed.shape[0], dtype=torch.bool)
    inside[:GAP] = False
    inside[packed.shape[0] - GAP :] = False
    values = torch.randn((packed.shape[0], C), generator=gen)
    values[~inside] = math.nan  # dropped rows are fused, so only outside rows stay NaN
    packed = values.to(dtype=dtype, device=device)
    if weight_kind == "random":
        weights = torch.rand(packed.shape[0], generator=gen) + 0.01
    else:  # zero weights: every fused token must be zeros
        weights = torch.zeros(packed.shape[0])
    weights[~inside] = math.nan  # never read
    return packed, cu_seqlens, keep, mask, weights.to(device)


# ---- checks ----


def _assert_pack_result(result, x, mask, seed):
    note = seed_note(seed)
    packed, cu_seqlens, indices = result
    for t in result:
        assert isinstance(t, torch.Tensor) and t.device == x.device
    assert packed.dtype == x.dtype
    assert cu_seqlens.dtype == torch.int32 and indices.dtype == torch.int32
    exp_packed, exp_cu, exp_indices = pack_reference(x, mask.to(x.device))
    assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu()), "cu_seqlens differ" + note
    assert torch.equal(indices.cpu(), exp_indices.cpu()), "indices differ" + note
    assert tuple(packed.shape) == tuple(exp_packed.shape), "packed shape differs" + note
    assert torch.equal(packed.cpu(), exp_packed.cpu()), "packed rows differ" + note
    return int(exp_cu[-1])


def _assert_repacked(result, packed, cu_seqlens, keep, seed):
    note = seed_note(seed)
    out, cu2, src = result
    exp_out, exp_cu, exp_src = repack_reference(packed, cu_seqlens, keep)
    assert out.dtype == packed.dtype and cu2.dtype == torch.int32 and src.dtype == torch.int32
    assert torch.equal(cu2.cpu(), exp_cu), "cu_seqlens2 differs" + note
    assert torch.equal(src.cpu(), exp_src), "src differs" + note
    assert tuple(out.shape) == tuple(exp_out.shape), "packed2 shape differs" + note
    assert torch.equal(out.cpu(), exp_out), "packed2 rows differ" + note
    return int(exp_cu[-1])


def _check_fused(out, cu2, src, packed, cu_seqlens, mask, weights, seed):
    note = seed_note(seed)
    exp_out, exp_cu, exp_src = fuse_reference(packed, cu_seqlens, mask, weights)
    total = int(exp_cu[-1])
    assert torch.equal(cu2.cpu(), exp_cu), "cu_seqlens2 differs" + note
    assert torch.equal(src[:total].cpu(), exp_src), "src differs" + note
    got = out[:total].cpu()
    fused = exp_src == -1
    assert torch.equal(got[~fused], exp_out[~fused].to(packed.dtype)), "kept rows differ" + note
    got_fused = got[fused].double()
    assert torch.isfinite(got_fused).all(), "non-finite fused token" + note
    expected_fused = exp_out[fused].to(packed.dtype).double()  # the one rounding to dtype
    torch.testing.assert_close(
        got_fused, expected_fused, **TOL[packed.dtype], msg=lambda m: m + note
    )
    return total


# ---- pack / pack_into / unpack (exact) ----

PACK_SHAPES = {
    "cpu": [(1, 197, 30), (4, 197, 64), (3, 577, 30), (16, 197, 8)],
    "cuda": [(1, 577, 30), (512, 197, 384), (64, 577, 768), (512, 577, 30)],
}
KEEP_KINDS = (
    "random_bool",
    "random_uint8",
    "all_bool",
    "cls_only_bool",
    "cls_only_uint8",
    "none_bool",
)


def _pack_params():
    return [
        device_param(device, dtype, (B, N, C), keep_kind,
                     id=f"{DTYPE_IDS[dtype]}-B{B}-N{N}-C{C}-{keep_kind}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for B, N, C in PACK_SHAPES[device]
        for keep_kind in KEEP_KINDS
    ]


@pytest.mark.parametrize("device, dtype, shape, keep_kind", _pack_params())
def test_pack_matches_reference(device, dtype, shape, keep_kind, gen, seed):
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, keep_kind)
    total = _assert_pack_result(ragvit.pack(x, keep), x, mask, seed)
    assert (total == 0) == keep_kind.startswith("none")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["channel_padded", "batch_strided"])
def test_pack_strided_inputs(device, dtype, layout, gen, seed):
    shape = (3, 197, 30) if device == "cpu" else (64, 577, 30)
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, "random_uint8", layout)
    assert not x.is_contiguous() and x.stride(-1) == 1
    total = _assert_pack_result(ragvit.pack(x, keep), x, mask, seed)
    assert total > 0


def test_pack_numpy_in_numpy_out(gen, seed):
    x, keep, mask = _make_pack_inputs(gen, (4, 197, 30), torch.float32, "cpu", "random_bool")
    packed, cu_seqlens, indices = ragvit.pack(x.numpy(), keep.numpy())
    for a in (packed, cu_seqlens, indices):
        assert isinstance(a, np.ndarray)
    assert packed.dtype == np.float32
    assert cu_seqlens.dtype == np.int32 and indices.dtype == np.int32
    total = _assert_pack_result(
        tuple(torch.from_numpy(a) for a in (packed, cu_seqlens, indices)), x, mask, seed
    )
    assert total > 0


def _capacity_params(index_name, kinds):
    """(device, dtype, capacity_kind, with_index) for the _into forms: capacity exactly the
    total, the total + 7 guard rows, or the largest possible total; the optional int32
    index output (indices / src) given or not."""
    return [
        device_param(device, dtype, capacity_kind, with_index,
                     id=f"{DTYPE_IDS[dtype]}-{capacity_kind}-"
                     f"{index_name if with_index else 'no_' + index_name}",
                     sanitizer=capacity_kind == "guard" and with_index)
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for capacity_kind in kinds[device]
        for with_index in (True, False)
    ]


@pytest.mark.parametrize(
    "device, dtype, capacity_kind, with_indices",
    _capacity_params("indices", {"cpu": ("exact", "guard"), "cuda": ("exact", "guard", "max")}),
)
def test_pack_into_capacity(device, dtype, capacity_kind, with_indices, gen, seed):
    note = seed_note(seed)
    shape = (4, 197, 30) if device == "cpu" else (64, 577, 30)
    B, N, C = shape
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, "random_bool")
    exp_packed, exp_cu, exp_indices = pack_reference(x, mask.to(device))
    total = int(exp_cu[-1])
    assert total > 0
    capacity = {"exact": total, "guard": total + 7, "max": B * N}[capacity_kind]
    out = poison((capacity, C), dtype, device)
    cu_seqlens = poison((B + 1,), torch.int32, device)
    indices = poison((capacity,), torch.int32, device) if with_indices else None
    assert ragvit.pack_into(x, keep, out, cu_seqlens, indices=indices) is None
    assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu()), "cu_seqlens differ" + note
    assert torch.equal(out[:total].cpu(), exp_packed.cpu()), "packed rows differ" + note
    assert torch.isnan(out[total:]).all(), "rows past the total were written" + note
    if with_indices:
        assert torch.equal(indices[:total].cpu(), exp_indices.cpu()), "indices differ" + note
        assert (indices[total:] == INT32_POISON).all(), "indices past the total written" + note


def test_pack_into_capacity_too_small_raises_on_cpu(gen, seed):
    x, keep, mask = _make_pack_inputs(gen, (4, 197, 30), torch.float32, "cpu", "random_bool")
    total = int(mask.sum())
    out, indices = poison((total - 1, 30)), poison((total - 1,), torch.int32)
    cu_seqlens = poison((5,), torch.int32)
    before = (out.clone(), indices.clone(), cu_seqlens.clone())
    with pytest.raises(ValueError, match=r"capacity|room|out"):
        ragvit.pack_into(x, keep, out, cu_seqlens, indices=indices)
    # A rejected call writes nothing (the _C contract), the prefix sums included.
    after = (out, indices, cu_seqlens)
    assert all(map(same_bits, after, before)), "wrote before raising" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("fill", [None, -2.5, 7.0], ids=["fill_default", "fill-2.5", "fill7"])
@pytest.mark.parametrize("with_out", [True, False], ids=["out_given", "out_omitted"])
def test_unpack_first_rows(device, dtype, fill, with_out, gen, seed):
    B, N, C = (5, 197, 30) if device == "cpu" else (64, 577, 30)
    lengths = random_lengths(gen, B, 0, N, include=(0, N))
    total = sum(lengths)
    packed = torch.full((total + 4, C), math.nan)  # guard rows past cu_seqlens[B]: never read
    packed[:total] = torch.randint(-100, 101, (total, C), generator=gen).to(torch.float32)
    packed = packed.to(dtype=dtype, device=device)
    cu_seqlens = make_cu_seqlens(lengths, device)
    kwargs = {} if fill is None else {"fill": fill}
    if with_out:
        kwargs["out"] = poison((B, N, C), dtype, device)
    result = ragvit.unpack(packed, cu_seqlens, N, **kwargs)
    if with_out:
        assert result is kwargs["out"]
    assert isinstance(result, torch.Tensor) and result.dtype == dtype
    assert result.device == packed.device
    expected = unpack_reference(packed, cu_seqlens, N, fill=0.0 if fill is None else fill)
    assert not torch.isnan(expected).any()
    assert torch.equal(result.cpu(), expected.cpu()), "unpack differs" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "keep_kind", ["random_bool", "random_uint8", "all_bool", "cls_only_bool", "none_bool"]
)
def test_unpack_indices_round_trip(device, dtype, keep_kind, gen, seed):
    shape = (4, 197, 30) if device == "cpu" else (512, 197, 30)
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, keep_kind)
    packed, cu_seqlens, indices = ragvit.pack(x, keep)
    fill = -3.0
    out = poison(shape, dtype, device)
    assert ragvit.unpack(packed, cu_seqlens, shape[1], indices=indices, fill=fill, out=out) is out
    expected = torch.where(mask.to(device)[..., None], x, torch.full_like(x, fill))
    assert torch.equal(out.cpu(), expected.cpu()), "round trip differs" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
def test_unpack_scattered_indices(device, gen, seed):
    B, N, C = (6, 197, 30) if device == "cpu" else (128, 577, 30)
    lengths = random_lengths(gen, B, 0, N, include=(0, N, 1))
    total = sum(lengths)
    indices = torch.cat([torch.randperm(N, generator=gen)[:n] for n in lengths]).to(torch.int32)
    packed = torch.randint(-100, 101, (total, C), generator=gen).to(torch.float16)
    packed, indices = packed.to(device), indices.to(device)
    cu_seqlens = make_cu_seqlens(lengths, device)
    out = ragvit.unpack(packed, cu_seqlens, N, indices=indices, fill=0.5)
    expected = unpack_reference(packed, cu_seqlens, N, indices=indices, fill=0.5)
    assert torch.equal(out.cpu(), expected.cpu()), "scatter differs" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_pack_into_then_unpack_from_capacity_buffers(device, dtype, gen, seed):
    shape = (4, 197, 30) if device == "cpu" else (256, 577, 30)
    B, N, C = shape
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, "random_uint8")
    capacity = B * N + 5  # a graph-friendly bound: rows and indices past the total stay poison
    out = poison((capacity, C), dtype, device)
    cu_seqlens = poison((B + 1,), torch.int32, device)
    indices = poison((capacity,), torch.int32, device)
    ragvit.pack_into(x, keep, out, cu_seqlens, indices=indices)
    padded = ragvit.unpack(out, cu_seqlens, N, indices=indices, fill=0.0)
    expected = torch.where(mask.to(device)[..., None], x, torch.zeros_like(x))
    assert torch.equal(padded.cpu(), expected.cpu()), "pipeline differs" + seed_note(seed)


# ---- pack_into / repack_into across chunkings (exact) ----

# The CUDA gather splits each image into ~2 * SMs / B chunks (at least 4 positions,
# at most N), so these shapes run 1 chunk per image (B = 512, N = 1), multi-tile
# chunks (B = 300, N = 1024: 4 tiles of 256 positions), and 10 to ~260 chunks
# (B = 1, 2, 7; N = 1500), with narrow vectors (C = 30, 40) and wide rows (768).
CHUNK_SHAPES = {
    "cpu": [(1, 197, 30), (3, 1, 8), (2, 40, 8)],
    "cuda": [
        (1, 1, 64),
        (1, 197, 384),
        (1, 197, 768),
        (2, 197, 384),
        (7, 197, 30),
        (7, 1, 64),
        (64, 197, 384),
        (512, 197, 384),
        (512, 1, 40),
        (130, 1025, 64),
        (300, 1024, 8),
        (1, 1500, 768),
        (3, 1500, 40),
    ],
}
CHUNK_CASES = (
    (torch.float16, "random_bool"),
    (torch.float16, "all_bool"),
    (torch.float16, "cls_only_uint8"),
    (torch.float32, "random_uint8"),
)


def _chunk_params():
    return [
        device_param(device, dtype, (B, N, C), keep_kind,
                     id=f"{DTYPE_IDS[dtype]}-B{B}-N{N}-C{C}-{keep_kind}")
        for device in ("cpu", "cuda")
        for B, N, C in CHUNK_SHAPES[device]
        for dtype, keep_kind in CHUNK_CASES
    ]


@pytest.mark.parametrize("device, dtype, shape, keep_kind", _chunk_params())
def test_pack_into_chunked_shapes(device, dtype, shape, keep_kind, gen, seed):
    """pack_into, pack, repack_into (plain and fused) on shapes that select each chunking."""
    note = seed_note(seed)
    B, N, C = shape
    x, keep, mask = _make_pack_inputs(gen, shape, dtype, device, keep_kind)
    exp_packed, exp_cu, exp_indices = pack_reference(x, mask.to(device))
    total = int(exp_cu[-1])
    capacity = B * N + 5  # guard rows past every possible total
    out = poison((capacity, C), dtype, device)
    cu = poison((B + 1,), torch.int32, device)
    indices = poison((capacity,), torch.int32, device)
    ragvit.pack_into(x, keep, out, cu, indices=indices)
    assert torch.equal(cu.cpu(), exp_cu.cpu()), "pack_into cu_seqlens differ" + note
    assert torch.equal(out[:total].cpu(), exp_packed.cpu()), "pack_into rows differ" + note
    assert torch.equal(indices[:total].cpu(), exp_indices.cpu()), "pack_into indices" + note
    assert torch.isnan(out[total:]).all(), "pack_into wrote past the total" + note
    assert (indices[total:] == INT32_POISON).all(), "pack_into indices past the total" + note

    packed, cu_eager, indices_eager = ragvit.pack(x, keep)
    assert torch.equal(cu_eager.cpu(), exp_cu.cpu()), "pack cu_seqlens differ" + note
    assert torch.equal(packed.cpu(), exp_packed.cpu()), "pack rows differ" + note
    assert torch.equal(indices_eager.cpu(), exp_indices.cpu()), "pack indices differ" + note

    # Second stage over the capacity buffer: rows past the total hold keep flags that must
    # be ignored.
    keep2 = (torch.rand((capacity,), generator=gen) < 0.6).to(device)
    exp_out2, exp_cu2, exp_src2 = repack_reference(out, cu, keep2)
    total2 = int(exp_cu2[-1])
    out2 = poison((capacity, C), dtype, device)
    cu2 = poison((B + 1,), torch.int32, device)
    src2 = poison((capacity,), torch.int32, device)
    ragvit.repack_into(out, cu, keep2, out2, cu2, src=src2)
    assert torch.equal(cu2.cpu(), exp_cu2), "repack_into cu_seqlens differ" + note
    assert torch.equal(out2[:total2].cpu(), exp_out2), "repack_into rows differ" + note
    assert torch.equal(src2[:total2].cpu(), exp_src2), "repack_into src differs" + note
    assert torch.isnan(out2[total2:]).all(), "repack_into wrote past the total" + note

    weights = (torch.rand((capacity,), generator=gen) + 0.01).to(device)
    out3 = poison((capacity + B, C), dtype, device)
    cu3 = poison((B + 1,), torch.int32, device)
    src3 = poison((capacity + B,), torch.int32, device)
    ragvit.repack_into(out, cu, keep2, out3, cu3, src=src3, fuse_weights=weights)
    total3 = _check_fused(out3, cu3, src3, out, cu, keep2, weights, seed)
    assert torch.isnan(out3[total3:]).all(), "fused repack_into wrote past the total" + note


# ---- repack / repack_into (exact) ----

REPACK_KEEPS = ("random", "all", "none", "first_only")
REPACK_WIDTHS = {"cpu": (30, 64), "cuda": (30, 384, 768)}
KEEP_DTYPE_IDS = {torch.bool: "bool", torch.uint8: "uint8"}


def _repack_params():
    return [
        device_param(device, dtype, C, keep_kind, keep_dtype,
                     id=f"{DTYPE_IDS[dtype]}-C{C}-{keep_kind}-{KEEP_DTYPE_IDS[keep_dtype]}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for C in REPACK_WIDTHS[device]
        for keep_kind in REPACK_KEEPS
        for keep_dtype in KEEP_DTYPE_IDS
    ]


@pytest.mark.parametrize("device, dtype, C, keep_kind, keep_dtype", _repack_params())
def test_repack_matches_reference(device, dtype, C, keep_kind, keep_dtype, gen, seed):
    lengths = _lengths(gen, device)
    packed, cu_seqlens, keep, mask = _make_packed(
        gen, lengths, C, dtype, device, keep_kind, keep_dtype
    )
    result = ragvit.repack(packed, cu_seqlens, keep)
    for t in result:
        assert isinstance(t, torch.Tensor) and t.device == packed.device
    total = _assert_repacked(result, packed, cu_seqlens, mask, seed)
    assert (total == 0) == (keep_kind == "none")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("N", [197, 577])
def test_repack_after_pack_equals_pack_of_both_masks(device, N, gen, seed):
    B, C = (3, 30) if device == "cpu" else (64, 384)
    x = torch.randint(-100, 101, (B, N, C), generator=gen).to(torch.float16)
    first = torch.rand((B, N), generator=gen) < 0.7
    second = torch.rand((B, N), generator=gen) < 0.6
    x, first, second = x.to(device), first.to(device), second.to(device)
    packed, cu_seqlens, indices = ragvit.pack(x, first)
    cu = cu_seqlens.cpu().tolist()
    # The second stage's mask, read at each packed token's original position.
    keep2 = torch.cat([second[b][indices[cu[b] : cu[b + 1]].long()] for b in range(B)])
    packed2, cu2, src = ragvit.repack(packed, cu_seqlens, keep2)
    exp_packed, exp_cu, exp_indices = ragvit.pack(x, first & second)
    note = seed_note(seed)
    assert torch.equal(cu2.cpu(), exp_cu.cpu()), "cu_seqlens differ" + note
    assert torch.equal(packed2.cpu(), exp_packed.cpu()), "rows differ" + note
    assert torch.equal(indices[src.long()].cpu(), exp_indices.cpu()), "src chain differs" + note


@pytest.mark.parametrize(
    "device, dtype, capacity_kind, with_src",
    _capacity_params("src", {"cpu": ("exact", "guard", "max"), "cuda": ("exact", "guard", "max")}),
)
def test_repack_into_capacity(device, dtype, capacity_kind, with_src, gen, seed):
    note = seed_note(seed)
    lengths = (
        _lengths(gen, device) if device == "cuda" else random_lengths(gen, 4, 0, 40, (0, 1, 40))
    )
    C = 30
    packed, cu_seqlens, keep, mask = _make_packed(gen, lengths, C, dtype, device)
    exp_out, exp_cu, exp_src = repack_reference(packed, cu_seqlens, mask)
    total = int(exp_cu[-1])
    assert total > 0
    capacity = {"exact": total, "guard": total + 7, "max": packed.shape[0]}[capacity_kind]
    B = len(lengths)
    out = poison((capacity, C), dtype, device)
    cu2 = poison((B + 1,), torch.int32, device)
    src = poison((capacity,), torch.int32, device) if with_src else None
    assert ragvit.repack_into(packed, cu_seqlens, keep, out, cu2, src=src) is None
    assert torch.equal(cu2.cpu(), exp_cu), "cu_seqlens_out differs" + note
    assert torch.equal(out[:total].cpu(), exp_out), "rows differ" + note
    assert torch.isnan(out[total:]).all(), "rows past the total were written" + note
    if with_src:
        assert torch.equal(src[:total].cpu(), exp_src), "src differs" + note
        assert (src[total:] == INT32_POISON).all(), "src past the total written" + note


def test_repack_into_capacity_too_small_raises_on_cpu(gen, seed):
    packed, cu_seqlens, keep, mask = _make_packed(gen, [40, 1, 30], 30, torch.float32, "cpu")
    total = int(repack_reference(packed, cu_seqlens, mask)[1][-1])
    out, src = poison((total - 1, 30)), poison((total - 1,), torch.int32)
    cu_seqlens_out = poison((4,), torch.int32)
    before = (out.clone(), src.clone(), cu_seqlens_out.clone())
    with pytest.raises(ValueError, match=r"room|capacity"):
        ragvit.repack_into(packed, cu_seqlens, keep, out, cu_seqlens_out, src=src)
    after = (out, src, cu_seqlens_out)
    assert all(map(same_bits, after, before)), "wrote before raising" + seed_note(seed)


@pytest.mark.parametrize("form", ["pack_into", "repack_into"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu_marks(), id="cuda")])
def test_into_capacity_too_small_on_cuda(device, form, gen, seed):
    """On CUDA the count lives on the device: a too-small capacity is flagged by the one
    launch and raised in debug mode after it. What the docstrings promise by then: rows
    and index entries [0, capacity) hold the first tokens, nothing past capacity is written
    (guard rows), and the prefix sums are the full counts (cu_seqlens[B] > capacity)."""
    if form == "pack_into":
        x, keep, mask = _make_pack_inputs(gen, (4, 197, 30), torch.float32, device, "random_bool")
        exp_packed, exp_cu, exp_index = pack_reference(x, mask.to(device))
    else:
        packed, cu_in, keep, mask = _make_packed(gen, [40, 1, 30], 30, torch.float32, device)
        exp_packed, exp_cu, exp_index = repack_reference(packed, cu_in, mask)
    capacity = int(exp_cu[-1]) - 3
    out_buf = poison((capacity + GAP, 30), device=device)
    index_buf = poison((capacity + GAP,), torch.int32, device)
    cu_seqlens = poison((exp_cu.numel(),), torch.int32, device)
    out, index = out_buf[:capacity], index_buf[:capacity]
    ragvit.set_debug(True)
    with pytest.raises(ValueError, match="more kept tokens than out can hold"):
        if form == "pack_into":
            ragvit.pack_into(x, keep, out, cu_seqlens, indices=index)
        else:
            ragvit.repack_into(packed, cu_in, keep, out, cu_seqlens, src=index)
    note = seed_note(seed)
    assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu()), "prefix sums differ" + note
    assert torch.equal(out.cpu(), exp_packed[:capacity].cpu()), "rows differ" + note
    assert torch.equal(index.cpu(), exp_index[:capacity].cpu()), "index entries differ" + note
    assert torch.isnan(out_buf[capacity:]).all(), "wrote past capacity" + note
    assert (index_buf[capacity:] == INT32_POISON).all(), "wrote past capacity" + note


def test_repack_numpy_in_numpy_out(gen, seed):
    packed, cu_seqlens, keep, mask = _make_packed(gen, [20, 0, 7], 8, torch.float32, "cpu")
    result = ragvit.repack(packed.numpy(), cu_seqlens.numpy(), keep.numpy())
    assert all(isinstance(a, np.ndarray) for a in result)
    _assert_repacked(tuple(torch.from_numpy(a) for a in result), packed, cu_seqlens, mask, seed)


# ---- repack with fuse_weights (EViT's fused token; float64 reference) ----

FUSE_CASES = (
    ("random", "random"),
    ("all", "random"),
    ("none", "random"),
    ("random", "zero"),
)


def _fuse_params():
    return [
        device_param(device, dtype, keep_kind, weight_kind,
                     id=f"{DTYPE_IDS[dtype]}-{keep_kind}-{weight_kind}_weights")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for keep_kind, weight_kind in FUSE_CASES
    ]


@pytest.mark.parametrize("device, dtype, keep_kind, weight_kind", _fuse_params())
@pytest.mark.parametrize("form", ["eager", "into"])
def test_repack_fuse_matches_reference(device, dtype, keep_kind, weight_kind, form, gen, seed):
    lengths = _lengths(gen, device)
    C = 30 if device == "cpu" else 384
    packed, cu_seqlens, keep, mask, weights = _fuse_inputs(
        gen, lengths, C, dtype, device, keep_kind, weight_kind
    )
    if form == "eager":
        out, cu2, src = ragvit.repack(packed, cu_seqlens, keep, fuse_weights=weights)
        assert out.shape[0] == int(cu2[-1])
    else:
        capacity = packed.shape[0] + len(lengths)  # T + B always suffices
        out = poison((capacity, C), dtype, device)
        cu2 = poison((len(lengths) + 1,), torch.int32, device)
        src = poison((capacity,), torch.int32, device)
        ragvit.repack_into(packed, cu_seqlens, keep, out, cu2, src=src, fuse_weights=weights)
    total = _check_fused(out, cu2, src, packed, cu_seqlens, mask, weights, seed)
    if form == "into":
        assert torch.isnan(out[total:]).all(), "rows past the total written" + seed_note(seed)
        assert (src[total:] == INT32_POISON).all()
    if weight_kind == "zero" or keep_kind == "all":
        fused_rows = out[:total][src[:total] == -1]
        assert (fused_rows == 0).all(), "empty or zero-weight fusion must give zeros"


def test_repack_fuse_rejects_bad_weights():
    a = _repack_base("cpu")
    args = (a["packed"], a["cu_seqlens"], a["keep"])
    with pytest.raises(TypeError, match="fuse_weights must be float32"):
        ragvit.repack(*args, fuse_weights=torch.ones(12, dtype=torch.float64))
    with pytest.raises(ValueError, match="fuse_weights must have shape"):
        ragvit.repack(*args, fuse_weights=torch.ones(11))
    with pytest.raises(TypeError, match="fuse_weights must be an array"):
        ragvit.repack(*args, fuse_weights=[1.0] * 12)
    out = poison((12, 6))
    with pytest.raises(ValueError, match="alias"):
        ragvit.repack_into(*args, out, poison((4,), torch.int32), fuse_weights=out[:2].view(-1))
    assert torch.isnan(out).all()
    small = poison((7, 6))  # 7 kept + 3 fused tokens do not fit
    with pytest.raises(ValueError, match="room"):
        ragvit.repack_into(*args, small, poison((4,), torch.int32), fuse_weights=torch.ones(12))
    assert torch.isnan(small).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("op", ["repack", "repack_into"])
def test_repack_fuse_rejects_totals_past_int32(device, op):
    """2^31 - 1 rows of one sequence plus its fused token do not fit int32 cu_seqlens_out:
    refused before anything is written (C = 0 and stride-0 keep and weights: no memory)."""
    T = 2**31 - 1
    packed = torch.empty((T, 0), device=device)
    cu_seqlens = make_cu_seqlens([T], device)
    keep = torch.ones(1, dtype=torch.bool, device=device).expand(T)
    weights = torch.ones(1, device=device).expand(T)
    cu_seqlens_out = poison((2,), torch.int32, device)
    pattern = (rf"^{op}: packed rows plus one fused token per sequence must be at most 2\^31-1 "
               r"for int32 cu_seqlens_out, got 2147483647 rows and 1 sequences$")
    with pytest.raises(ValueError, match=pattern):
        if op == "repack":
            ragvit.repack(packed, cu_seqlens, keep, fuse_weights=weights)
        else:
            out = torch.empty((T + 1, 0), device=device)
            ragvit.repack_into(packed, cu_seqlens, keep, out, cu_seqlens_out,
                               fuse_weights=weights)
    assert (cu_seqlens_out == INT32_POISON).all()


@pytest.mark.parametrize("device", devices())
def test_repack_fuse_with_no_rows_appends_zero_tokens(device):
    packed = torch.empty((0, 6), device=device)
    cu_seqlens = make_cu_seqlens([0, 0], device)
    empty = torch.empty((0,), dtype=torch.bool, device=device)
    weights = torch.empty((0,), device=device)
    out, cu2, src = ragvit.repack(packed, cu_seqlens, empty, fuse_weights=weights)
    assert cu2.cpu().tolist() == [0, 1, 2] and src.cpu().tolist() == [-1, -1]
    assert torch.equal(out.cpu(), torch.zeros((2, 6)))
    out = poison((3, 6), device=device)
    cu2 = poison((3,), torch.int32, device)
    ragvit.repack_into(packed, cu_seqlens, empty, out, cu2, fuse_weights=weights)
    assert cu2.cpu().tolist() == [0, 1, 2]
    assert (out[:2] == 0).all() and torch.isnan(out[2]).all()


# ---- gather_prefix (exact) ----


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("with_out", [True, False], ids=["out_given", "out_omitted"])
def test_gather_prefix_matches_reference(device, dtype, k, with_out, gen, seed):
    B, C = (5, 30) if device == "cpu" else (256, 384)
    lengths = random_lengths(gen, B, k, 197, include=(k, 197))
    packed, cu_seqlens, _, _ = _make_packed(gen, lengths, C, dtype, device, "all")
    cu = cu_seqlens.cpu().tolist()
    host = packed.cpu()  # once: a device-to-host copy per sequence took seconds per case
    expected = torch.stack([host[cu[b] : cu[b] + k] for b in range(B)])
    kwargs = {}
    if with_out:
        guard = poison((B * k + 4, C), dtype, device)
        kwargs["out"] = guard[: B * k].view(B, k, C)
    result = ragvit.gather_prefix(packed, cu_seqlens, k, **kwargs)
    if with_out:
        assert result is kwargs["out"]
        assert torch.isnan(guard[B * k :]).all(), "wrote past out" + seed_note(seed)
    assert result.shape == (B, k, C) and result.dtype == dtype and result.device == packed.device
    assert torch.equal(result.cpu(), expected), "gather_prefix differs" + seed_note(seed)


def test_gather_prefix_short_sequence_raises_on_cpu():
    packed = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    out = poison((3, 2, 3))
    with pytest.raises(ValueError, match=r"at least k=2.*length 1 for sequence 1"):
        ragvit.gather_prefix(packed, make_cu_seqlens([5, 1, 6]), 2, out=out)
    assert torch.isnan(out).all(), "a rejected call wrote rows"


@pytest.mark.parametrize("device", devices())
def test_gather_prefix_strided_packed(device, gen):
    """packed as a column slice of a wider NaN buffer (row stride C + 6)."""
    packed, cu_seqlens = packed_rows(gen, [3, 1, 7, 4], 30, device=device, gap=GAP, pad_cols=6)
    prefix = ragvit.gather_prefix(packed, cu_seqlens, 1)
    assert torch.equal(prefix[:, 0].cpu(), packed.cpu()[cu_seqlens.cpu()[:-1].long()])


# ---- strided inputs (the one-launch kernel's non-contiguous keep paths) ----


def _strided_params():
    return [
        pytest.param("cpu", (3, 197, 30), id="cpu"),
        pytest.param("cuda", (64, 577, 30), marks=gpu_marks(), id="cuda"),
        pytest.param("cuda", (4, 197, 30), marks=[*gpu_marks(), pytest.mark.sanitizer],
                     id="cuda-small"),
    ]


@pytest.mark.parametrize("device, shape", _strided_params())
@pytest.mark.parametrize("layout", ["contiguous", "channel_padded", "batch_strided"])
def test_pack_into_strided_inputs(device, shape, layout, gen, seed):
    x, keep, mask = _make_pack_inputs(gen, shape, torch.float16, device, "random_uint8", layout)
    exp_packed, exp_cu, exp_indices = pack_reference(x, mask.to(device))
    total = int(exp_cu[-1])
    B, N, C = shape
    out = poison((B * N + 3, C), torch.float16, device)
    cu_seqlens = poison((B + 1,), torch.int32, device)
    indices = poison((B * N + 3,), torch.int32, device)
    ragvit.set_debug(device == "cuda")
    ragvit.pack_into(x, keep, out, cu_seqlens, indices=indices)
    note = seed_note(seed)
    assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu()), "cu_seqlens differ" + note
    assert torch.equal(out[:total].cpu(), exp_packed.cpu()), "rows differ" + note
    assert torch.equal(indices[:total].cpu(), exp_indices.cpu()), "indices differ" + note
    assert torch.isnan(out[total:]).all() and (indices[total:] == INT32_POISON).all()


@pytest.mark.parametrize("device, shape", _strided_params())
@pytest.mark.parametrize("form", ["eager", "into"])
def test_repack_strided_inputs(device, shape, form, gen, seed):
    B, N, C = shape
    lengths = random_lengths(gen, B, 0, N, include=(0, N))
    packed, cu_seqlens, keep, mask = _make_packed(gen, lengths, C, torch.bfloat16, "cpu")
    wide = poison((packed.shape[0], C + 5), torch.bfloat16)
    wide[:, :C] = packed
    tall = torch.zeros((2 * keep.shape[0],), dtype=keep.dtype)
    tall[::2] = keep
    packed_view = wide.to(device)[:, :C]
    keep_view = tall.to(device)[::2]
    cu_seqlens = cu_seqlens.to(device)
    assert not packed_view.is_contiguous() and keep_view.stride(0) == 2
    ragvit.set_debug(device == "cuda")
    if form == "eager":
        result = ragvit.repack(packed_view, cu_seqlens, keep_view)
    else:
        capacity = packed.shape[0]
        result = (
            poison((capacity, C), torch.bfloat16, device),
            poison((B + 1,), torch.int32, device),
            poison((capacity,), torch.int32, device),
        )
        ragvit.repack_into(packed_view, cu_seqlens, keep_view, result[0], result[1], src=result[2])
        total = int(result[1][-1])
        assert torch.isnan(result[0][total:]).all()
        result = (result[0][:total], result[1], result[2][:total])
    _assert_repacked(result, packed_view, cu_seqlens, mask, seed)


# ---- errors: type and message; a rejected call writes nothing ----


def _pack_base(device):
    """pack's and pack_into's arguments: x (2, 5, 6), keep 3 + 2 tokens, capacity 10."""
    x = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6).to(device)
    keep = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool, device=device)
    return {
        "x": x,
        "keep": keep,
        "out": poison((10, 6), device=device),
        "cu_seqlens": poison((3,), torch.int32, device),
        "indices": poison((10,), torch.int32, device),
    }


def _unpack_base(device):
    """unpack's arguments: 7 packed rows of 2 sequences (3, 4) scattered into N = 5."""
    packed = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6).to(device)
    return {
        "packed": packed,
        "cu_seqlens": make_cu_seqlens([3, 4], device),
        "N": 5,
        "indices": torch.tensor([0, 2, 4, 1, 0, 3, 2], dtype=torch.int32, device=device),
        "fill": 0.0,
        "out": poison((2, 5, 6), device=device),
    }


def _repack_base(device):
    """repack's, repack_into's and gather_prefix's arguments over support.errors'
    packed_args: 12 rows, lengths [5, 0, 7], 7 rows kept."""
    keep = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.bool, device=device)
    return packed_args(device) | {
        "keep": keep,
        "out": poison((12, 6), device=device),
        "cu_seqlens_out": poison((4,), torch.int32, device),
        "src": poison((12,), torch.int32, device),
        "k": 0,
        "prefix_out": poison((3, 0, 6), device=device),
    }


def _call_pack(a):
    return ragvit.pack(a["x"], a["keep"])


def _call_pack_into(a):
    return ragvit.pack_into(a["x"], a["keep"], a["out"], a["cu_seqlens"], indices=a["indices"])


def _call_unpack(a):
    return ragvit.unpack(
        a["packed"], a["cu_seqlens"], a["N"], indices=a["indices"], fill=a["fill"], out=a["out"]
    )


def _call_repack(a):
    return ragvit.repack(a["packed"], a["cu_seqlens"], a["keep"], stream=a["stream"])


def _call_repack_into(a):
    return ragvit.repack_into(
        a["packed"],
        a["cu_seqlens"],
        a["keep"],
        a["out"],
        a["cu_seqlens_out"],
        src=a["src"],
        stream=a["stream"],
    )


def _call_gather_prefix(a):
    return ragvit.gather_prefix(
        a["packed"], a["cu_seqlens"], a["k"], out=a["prefix_out"], stream=a["stream"]
    )


def _x_device(a):
    return a["x"].device


def _packed_device(a):
    return a["packed"].device


# (id, mutation, exception, message regex, cpu_only)
PACK_ERRORS = [
    (
        "keep_wrong_shape",
        _set(keep=lambda a: torch.ones((2, 6), dtype=torch.bool, device=_x_device(a))),
        ValueError,
        "keep",
        False,
    ),
    (
        "keep_other_batch",
        _set(keep=lambda a: a["keep"][:1]),
        ValueError,
        r"pack\w*: keep must have shape \(2, 5\), got \(1, 5\)",
        False,
    ),
    ("keep_1d", _set(keep=lambda a: a["keep"].reshape(-1)), ValueError, "keep", False),
    ("keep_float32", _set(keep=lambda a: a["keep"].float()), TypeError, "keep", False),
    ("keep_int64", _set(keep=lambda a: a["keep"].long()), TypeError, "keep", False),
    ("x_int32", _set(x=lambda a: a["x"].to(torch.int32)), TypeError, r"\bx\b", False),
    ("x_2d", _set(x=lambda a: a["x"].reshape(10, 6)), ValueError, r"\bx\b", False),
    (
        "x_channels_strided",
        _set(x=lambda a: torch.randn((2, 6, 5), device=_x_device(a)).transpose(1, 2)),
        ValueError,
        "contiguous",
        False,
    ),
    ("x_list", _set(x=lambda a: a["x"].tolist()), TypeError, r"\bx\b", False),
]

# The _into forms' out (capacity, C): another dtype, C + 1 columns, 1-D.
def _capacity_too_small(op, index_name, capacity, kept):
    """The row of an _into form given out and index rows for `capacity` < `kept` tokens
    (checked on the CPU; CUDA flags it on the device: test_into_capacity_too_small_on_cuda)."""
    return (
        "capacity_too_small",
        _set(
            out=lambda a: poison((capacity, 6), device=a["out"].device),
            **{index_name: lambda a: poison((capacity,), torch.int32, a["out"].device)},
        ),
        ValueError,
        rf"{op}: out must have room for every kept token \(capacity {capacity}\), got {kept}",
        True,
    )


def _prefix_sums_out_errors(name):
    """Rows of an _into form's (B + 1,) int32 prefix-sum output: one entry short, int64."""
    return [
        (f"{name}_too_short", _set(**{name: lambda a: a[name][:-1]}), ValueError, name, False),
        (f"{name}_int64", _set(**{name: lambda a: a[name].long()}), TypeError, name, False),
    ]


PACKED_OUT_ERRORS = [
    ("out_dtype_differs", _set(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "out_channels_differ",
        _set(out=lambda a: poison((a["out"].shape[0], 7), device=a["out"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    (
        "out_1d",
        _set(out=lambda a: poison((a["out"].numel(),), device=a["out"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
]

def _with_prefix_out(rows):
    """gather_prefix rows over a (3, 1, 6) out (k = 1): the base's k = 0 has no element."""

    def wrap(mutate):
        def wrapped(a):
            a["k"] = 1
            a["prefix_out"] = poison((3, 1, 6), device=_packed_device(a))
            mutate(a)

        return wrapped

    return [(case_id, wrap(mutate), *rest) for case_id, mutate, *rest in rows]


PACK_INTO_ERRORS = PACK_ERRORS + PACKED_OUT_ERRORS + _prefix_sums_out_errors("cu_seqlens") + [
    ("indices_int64", _set(indices=lambda a: a["indices"].long()), TypeError, "indices", False),
    (
        "indices_wrong_length",
        _set(indices=lambda a: poison((11,), torch.int32, _x_device(a))),
        ValueError,
        "indices",
        False,
    ),
    ("out_aliases_x", _set(out=lambda a: a["x"].reshape(10, 6)), ValueError, "alias", False),
    _capacity_too_small("pack_into", "indices", capacity=4, kept=5),
    *self_overlap_errors("pack_into", "out"),
    *self_overlap_errors("pack_into", "cu_seqlens"),
    *self_overlap_errors("pack_into", "indices"),
]

UNPACK_ERRORS = cu_seqlens_errors() + [
    (
        "N_below_a_length",
        _set(N=3, out=lambda a: poison((2, 3, 6), device=_packed_device(a)), indices=None),
        ValueError,
        r"\bN\b|cu_seqlens|length",
        True,
    ),
    ("N_negative", _set(N=-1), ValueError, r"\bN\b", False),
    ("N_float", _set(N=5.0), TypeError, r"\bN\b", False),
    (
        "packed_int32",
        _set(packed=lambda a: a["packed"].to(torch.int32)),
        TypeError,
        "packed",
        False,
    ),
    ("packed_3d", _set(packed=lambda a: a["packed"][None]), ValueError, "packed", False),
    (
        "packed_channels_strided",
        _set(packed=lambda a: torch.randn((6, 7), device=_packed_device(a)).t()),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "out_channels_differ",
        _set(out=lambda a: poison((2, 5, 7), device=_packed_device(a))),
        ValueError,
        r"\bout\b",
        False,
    ),
    (
        "out_rows_differ_from_N",
        _set(out=lambda a: poison((2, 6, 6), device=_packed_device(a))),
        ValueError,
        r"\bout\b|\bN\b",
        False,
    ),
    (
        "out_batch_differs",
        _set(out=lambda a: poison((3, 5, 6), device=_packed_device(a))),
        ValueError,
        r"\bout\b",
        False,
    ),
    ("out_dtype_differs", _set(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "out_aliases_packed",
        _set(
            out=lambda a: torch.full((2, 5, 6), math.nan, device=_packed_device(a)),
            packed=lambda a: a["out"].view(10, 6)[:7],
        ),
        ValueError,
        "alias",
        False,
    ),
    ("indices_int64", _set(indices=lambda a: a["indices"].long()), TypeError, "indices", False),
    (
        "indices_wrong_length",
        _set(indices=lambda a: a["indices"][:6]),
        ValueError,
        "indices",
        False,
    ),
    (
        "indices_out_of_range",
        _set(indices=lambda a: torch.tensor([0, 2, 9, 1, 0, 3, 2], dtype=torch.int32)),
        ValueError,
        "indices",
        True,
    ),
    (
        "indices_negative",
        _set(indices=lambda a: torch.tensor([0, 2, 4, 1, -1, 3, 2], dtype=torch.int32)),
        ValueError,
        "indices",
        True,
    ),
    (
        "cu_seqlens_past_T",
        _set(cu_seqlens=lambda a: torch.tensor([0, 3, 8], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    (
        "cu_seqlens_decreasing",
        _set(cu_seqlens=lambda a: torch.tensor([0, 4, 3], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    ("fill_str", _set(fill="0"), TypeError, "fill", False),
    (
        "fill_inf_in_float32",
        _set(fill=-1e39),  # finite in double
        ValueError,
        r"unpack: fill must be finite in float32 when it is finite \(\|fill\| < 3.40282e\+38\), "
        r"got -1e\+39",
        False,
    ),
    (
        "fill_inf_in_float16",
        _set(
            packed=lambda a: a["packed"].half(),
            out=lambda a: poison((2, 5, 6), torch.float16, _packed_device(a)),
            fill=65520.0,
        ),
        ValueError,
        r"unpack: fill must be finite in float16 when it is finite \(\|fill\| < 65520\), got 65520",
        False,
    ),
    ("packed_dict", _set(packed={}), TypeError, "packed", False),
    *self_overlap_errors("unpack", "out"),
]

REPACK_ERRORS = PACKED_INPUT_ERRORS + [
    ("keep_float", _set(keep=lambda a: a["keep"].float()), TypeError, "keep", False),
    ("keep_2d", _set(keep=lambda a: a["keep"].reshape(3, 4)), ValueError, "keep", False),
    ("keep_short", _set(keep=lambda a: a["keep"][:11]), ValueError, "keep", False),
]

REPACK_INTO_ERRORS = (
    REPACK_ERRORS + PACKED_OUT_ERRORS + _prefix_sums_out_errors("cu_seqlens_out")
) + [
    ("out_aliases_packed", _set(out=lambda a: a["packed"]), ValueError, "alias", False),
    (
        "cu_seqlens_out_aliases_cu_seqlens",
        _set(cu_seqlens_out=lambda a: a["cu_seqlens"]),
        ValueError,
        "alias",
        False,
    ),
    ("src_int64", _set(src=lambda a: a["src"].long()), TypeError, r"\bsrc\b", False),
    (
        "src_wrong_length",
        _set(src=lambda a: poison((11,), torch.int32, _packed_device(a))),
        ValueError,
        r"\bsrc\b",
        False,
    ),
    _capacity_too_small("repack_into", "src", capacity=5, kept=7),
    *self_overlap_errors("repack_into", "out"),
    *self_overlap_errors("repack_into", "cu_seqlens_out"),
    *self_overlap_errors("repack_into", "src"),
]

GATHER_PREFIX_ERRORS = PACKED_INPUT_ERRORS + [
    ("k_negative", _set(k=-1), ValueError, r"\bk\b", False),
    ("k_float", _set(k=1.0), TypeError, r"\bk\b", False),
    ("k_bool", _set(k=True), TypeError, r"\bk\b", False),
    ("k_huge", _set(k=2**40), ValueError, r"\bk\b", False),
    ("out_k_differs", _set(k=1), ValueError, r"\bout\b", False),
    (
        "out_dtype",
        _set(prefix_out=lambda a: a["prefix_out"].half()),
        TypeError,
        r"\bout\b",
        False,
    ),
    (
        "short_sequence",
        _set(k=1, prefix_out=lambda a: poison((3, 1, 6), device=_packed_device(a))),
        ValueError,
        "at least k=1",
        True,
    ),
    *_with_prefix_out(self_overlap_errors("gather_prefix", "out", key="prefix_out")),
]

# op: (base arguments, call, error rows)
CALLS = {
    "pack": (_pack_base, _call_pack, PACK_ERRORS),
    "pack_into": (_pack_base, _call_pack_into, PACK_INTO_ERRORS),
    "unpack": (_unpack_base, _call_unpack, UNPACK_ERRORS),
    "repack": (_repack_base, _call_repack, REPACK_ERRORS),
    "repack_into": (_repack_base, _call_repack_into, REPACK_INTO_ERRORS),
    "gather_prefix": (_repack_base, _call_gather_prefix, GATHER_PREFIX_ERRORS),
}


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(op, device):
    base, call, _ = CALLS[op]
    a = base(device)
    result = call(a)
    if op == "pack":
        assert result[1].cpu().tolist() == [0, 3, 5]
        assert result[2].cpu().tolist() == [0, 2, 3, 0, 1]
    elif op == "pack_into":
        assert a["cu_seqlens"].cpu().tolist() == [0, 3, 5]
        assert a["indices"][:5].cpu().tolist() == [0, 2, 3, 0, 1]
        assert torch.equal(a["out"][:5].cpu(), ragvit.pack(a["x"], a["keep"])[0].cpu())
    elif op == "unpack":
        assert result is a["out"]
        expected = unpack_reference(a["packed"], a["cu_seqlens"], 5, indices=a["indices"])
        assert torch.equal(a["out"].cpu(), expected.cpu())
    elif op == "repack_into":
        assert a["cu_seqlens_out"].cpu().tolist() == [0, 3, 3, 7]
        assert a["src"][:7].cpu().tolist() == [0, 2, 3, 5, 6, 10, 11]


ERROR_PARAMS = [p for op, (_, _, cases) in CALLS.items() for p in error_params(cases, op)]


@pytest.mark.parametrize("op, device, mutate, exc, pattern", ERROR_PARAMS)
def test_rejects(op, device, mutate, exc, pattern):
    base, call, _ = CALLS[op]
    assert_rejected(call, base(device), mutate, exc, pattern)


def test_rejects_missing_and_unknown_arguments():
    a = _repack_base("cpu")
    with pytest.raises(TypeError, match="missing required argument 'keep'"):
        ragvit.repack(a["packed"], a["cu_seqlens"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'index'"):
        ragvit.repack_into(
            a["packed"], a["cu_seqlens"], a["keep"], a["out"], a["cu_seqlens_out"], index=None
        )
    with pytest.raises(TypeError, match="missing required argument 'k'"):
        ragvit.gather_prefix(a["packed"], a["cu_seqlens"])


def test_rejects_read_only_numpy_outputs():
    x = np.arange(2 * 5 * 6, dtype=np.float32).reshape(2, 5, 6)
    keep = np.ones((2, 5), dtype=np.bool_)
    for name in ("out", "cu_seqlens", "indices"):
        bufs = {
            "out": np.full((10, 6), np.nan, np.float32),
            "cu_seqlens": np.full((3,), -7, np.int32),
            "indices": np.full((10,), -7, np.int32),
        }
        bufs[name].flags.writeable = False
        with pytest.raises(ValueError, match=r"read-only|read only"):
            ragvit.pack_into(x, keep, bufs["out"], bufs["cu_seqlens"], indices=bufs["indices"])
        assert np.isnan(bufs["out"]).all() and (bufs["indices"] == -7).all()

    out = np.full((2, 5, 6), np.nan, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.unpack(x.reshape(10, 6), np.array([0, 5, 10], np.int32), 5, out=out)
    assert np.isnan(out).all()

    a = as_numpy(_repack_base("cpu"))
    for name in ("out", "cu_seqlens_out", "src"):
        bufs = {n: a[n].copy() for n in ("out", "cu_seqlens_out", "src")}
        bufs[name].flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            ragvit.repack_into(
                a["packed"],
                a["cu_seqlens"],
                a["keep"],
                bufs["out"],
                bufs["cu_seqlens_out"],
                src=bufs["src"],
            )
        assert np.isnan(bufs["out"]).all() and (bufs["src"] == INT32_POISON).all()


# ---- CUDA: graphs, garbage contents ----


@pytest.mark.gpu
@requires_cuda
def test_pack_into_unpack_cuda_graph_replay(gen, seed):
    ragvit.set_debug(False)  # debug mode synchronizes, which capture forbids
    B, N, C, dtype = 64, 197, 30, torch.float16
    x = torch.empty((B, N, C), dtype=dtype, device="cuda")
    keep = torch.empty((B, N), dtype=torch.bool, device="cuda")
    out = poison((B * N, C), dtype, "cuda")
    cu_seqlens = poison((B + 1,), torch.int32, "cuda")
    indices = poison((B * N,), torch.int32, "cuda")
    padded = poison((B, N, C), dtype, "cuda")

    def refill():
        x.copy_(torch.randint(-100, 101, (B, N, C), generator=gen).to(dtype))
        keep.copy_(torch.rand((B, N), generator=gen) < 0.5)

    def run():
        ragvit.pack_into(x, keep, out, cu_seqlens, indices=indices)
        ragvit.unpack(out, cu_seqlens, N, indices=indices, fill=-1.0, out=padded)

    refill()
    graph = capture_graph(run)
    for _ in range(2):  # new masks each replay: nothing about T was baked in
        refill()
        padded.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.where(keep[..., None], x, torch.full_like(x, -1.0))
        assert torch.equal(padded, expected), "replayed pack_into/unpack differs" + seed_note(seed)
        assert torch.equal(cu_seqlens.cpu(), pack_reference(x, keep)[1].cpu())


@pytest.mark.gpu
@requires_cuda
def test_repack_into_segment_helpers_cuda_graph_replay(gen, seed):
    ragvit.set_debug(False)
    lengths = random_lengths(gen, 64, 1, 197, include=(1, 197))
    rows, C, dtype = sum(lengths), 384, torch.float16
    cu_seqlens = make_cu_seqlens(lengths, "cuda")
    packed = torch.empty((rows, C), dtype=dtype, device="cuda")
    keep = torch.empty((rows,), dtype=torch.bool, device="cuda")
    out = poison((rows, C), dtype, "cuda")
    cu2 = poison((65,), torch.int32, "cuda")
    src = poison((rows,), torch.int32, "cuda")
    cls = poison((64, 1, C), dtype, "cuda")
    mean = poison((64, C), dtype, "cuda")

    def refill():
        packed.copy_(torch.randint(-100, 101, (rows, C), generator=gen).to(dtype))
        flags = torch.rand((rows,), generator=gen) < 0.5
        flags[cu_seqlens[:-1].cpu().long()] = True  # every sequence keeps its CLS token
        keep.copy_(flags)

    def run():
        ragvit.repack_into(packed, cu_seqlens, keep, out, cu2, src=src)
        ragvit.gather_prefix(out, cu2, 1, out=cls)
        ragvit.segment_mean(out, cu2, skip=1, out=mean)

    refill()
    graph = capture_graph(run)
    for _ in range(2):
        refill()
        graph.replay()
        torch.cuda.synchronize()
        exp_out, exp_cu, exp_src = repack_reference(packed, cu_seqlens, keep)
        total = int(exp_cu[-1])
        assert torch.equal(cu2.cpu(), exp_cu), "replayed cu_seqlens_out differs" + seed_note(seed)
        assert torch.equal(out[:total].cpu(), exp_out), "replayed rows differ" + seed_note(seed)
        assert torch.equal(src[:total].cpu(), exp_src)
        assert torch.equal(cls[:, 0].cpu(), exp_out[exp_cu[:-1].long()])
        torch.testing.assert_close(
            mean.cpu().double(), segment_mean_reference(exp_out, exp_cu, 1), **TOL[dtype]
        )


@flagged_contents_test
def test_pack_into_capacity_too_small_on_cuda(debug, gen, seed):
    x, keep, mask = _make_pack_inputs(gen, (8, 197, 30), torch.float16, "cuda", "random_bool")
    exp_packed, exp_cu, _ = pack_reference(x, mask.to("cuda"))
    total = int(exp_cu[-1])
    capacity = total // 2
    guard = poison((capacity + 16, 30), torch.float16, "cuda")
    out = guard[:capacity]  # rows past capacity are a guard band that must stay poison
    cu_seqlens = poison((9,), torch.int32, "cuda")

    def kept_rows_written():
        assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu())
        assert torch.equal(out.cpu(), exp_packed[:capacity].cpu()), "kept rows differ"

    call_with_debug(lambda: ragvit.pack_into(x, keep, out, cu_seqlens), debug,
                    r"capacity|room|\bout\b", kept_rows_written)
    assert torch.isnan(guard[capacity:]).all(), "wrote past capacity" + seed_note(seed)
    ragvit.set_debug(True)
    roomy = poison((total, 30), torch.float16, "cuda")
    ragvit.pack_into(x, keep, roomy, cu_seqlens)  # flag clear: succeeds in debug mode
    assert torch.equal(roomy.cpu(), exp_packed.cpu())


GARBAGE_UNPACK = {
    "length_over_N": ([0, 3, 12], None),
    "past_T": ([0, 3, 500], None),
    "decreasing": ([0, 8, 2], None),
    "indices_out_of_range": ([0, 3, 7], [0, 2, 90, 1, -4, 3, 2**31 - 1]),
}


@flagged_contents_test
@pytest.mark.parametrize("case", list(GARBAGE_UNPACK))
def test_unpack_garbage_contents_never_crash(case, debug):
    values, index_values = GARBAGE_UNPACK[case]
    packed = torch.arange(12 * 6, dtype=torch.float32, device="cuda").reshape(12, 6)
    packed = packed[:7] if index_values is not None else packed
    cu_seqlens = torch.tensor(values, dtype=torch.int32, device="cuda")
    indices = None
    if index_values is not None:
        indices = torch.tensor(index_values, dtype=torch.int32, device="cuda")
    guard = poison((2 * 5 + 4, 6), device="cuda")
    out = guard[:10].view(2, 5, 6)
    call_with_debug(lambda: ragvit.unpack(packed, cu_seqlens, 5, indices=indices, out=out),
                    debug, r"cu_seqlens|indices|index|\bN\b")
    assert torch.isnan(guard[10:]).all(), "unpack wrote past out"
    ragvit.set_debug(True)
    padded = ragvit.unpack(packed[:7], make_cu_seqlens([3, 4], "cuda"), 5)
    torch.cuda.synchronize()
    expected = unpack_reference(packed[:7], make_cu_seqlens([3, 4], "cuda"), 5)
    assert torch.equal(padded, expected)


@flagged_contents_test
@pytest.mark.parametrize("case", list(GARBAGE_PACKED_CU_SEQLENS))
@pytest.mark.parametrize("op", ["repack_into", "gather_prefix"])
def test_garbage_cu_seqlens_never_crash(op, case, debug):
    packed = torch.arange(24 * 6, dtype=torch.float32, device="cuda").reshape(24, 6)
    cu_seqlens = torch.tensor(GARBAGE_PACKED_CU_SEQLENS[case], dtype=torch.int32, device="cuda")
    B = cu_seqlens.numel() - 1
    keep = torch.ones((24,), dtype=torch.bool, device="cuda")
    guard = poison((24 + 8, 6), device="cuda")
    cu2 = poison((B + 1,), torch.int32, "cuda")
    calls = {
        "repack_into": lambda: ragvit.repack_into(packed, cu_seqlens, keep, guard[:24], cu2),
        "gather_prefix": lambda: ragvit.gather_prefix(
            packed, cu_seqlens, 2, out=guard[: 2 * B].view(B, 2, 6)
        ),
    }
    limit = {"repack_into": 24, "gather_prefix": 2 * B}[op]
    call_with_debug(calls[op], debug, r"cu_seqlens|room|shorter")
    assert torch.isnan(guard[limit:]).all(), "wrote past out"
    ragvit.set_debug(True)
    repacked, cu_good, _ = ragvit.repack(packed, make_cu_seqlens([10, 14], "cuda"), keep)
    assert torch.equal(repacked, packed) and cu_good.cpu().tolist() == [0, 10, 24]


@flagged_contents_test
def test_repack_into_capacity_too_small_on_cuda(debug, gen, seed):
    lengths = [40, 1, 0, 30, 197]
    packed, cu_seqlens, keep, mask = _make_packed(gen, lengths, 30, torch.float16, "cuda")
    exp_out, exp_cu, _ = repack_reference(packed, cu_seqlens, mask)
    total = int(exp_cu[-1])
    capacity = total // 2
    guard = poison((capacity + 16, 30), torch.float16, "cuda")
    src_guard = poison((capacity + 16,), torch.int32, "cuda")
    cu2 = poison((len(lengths) + 1,), torch.int32, "cuda")
    out, src = guard[:capacity], src_guard[:capacity]

    def kept_rows_written():
        assert torch.equal(cu2.cpu(), exp_cu)
        assert torch.equal(out.cpu(), exp_out[:capacity]), "kept rows differ"

    call_with_debug(lambda: ragvit.repack_into(packed, cu_seqlens, keep, out, cu2, src=src),
                    debug, r"room|capacity|\bout\b", kept_rows_written)
    assert torch.isnan(guard[capacity:]).all(), "wrote past capacity" + seed_note(seed)
    assert (src_guard[capacity:] == INT32_POISON).all(), "src written past capacity"


@flagged_contents_test
def test_gather_prefix_short_sequence_on_cuda(debug):
    packed = torch.arange(12 * 3, dtype=torch.float32, device="cuda").reshape(12, 3)
    cu_seqlens = make_cu_seqlens([5, 1, 6], "cuda")
    guard = poison((3 * 2 + 4, 3), device="cuda")
    out = guard[:6].view(3, 2, 3)
    call_with_debug(lambda: ragvit.gather_prefix(packed, cu_seqlens, 2, out=out), debug,
                    r"shorter than k")
    expected = torch.stack(
        [packed[0:2], torch.cat([packed[5:6], packed.new_zeros(1, 3)]), packed[6:8]]
    )
    assert torch.equal(out, expected), "short sequence: copied rows then zeros"
    assert torch.isnan(guard[6:]).all(), "wrote past out"


@pytest.mark.gpu
@pytest.mark.sanitizer
@requires_cuda
def test_repack_fuse_small_on_cuda(gen, seed):
    lengths = [5, 0, 1, 9]
    packed, cu_seqlens, keep, mask, weights = _fuse_inputs(
        gen, lengths, 30, torch.float16, "cuda", "random", "random"
    )
    capacity = packed.shape[0] + len(lengths)
    guard = poison((capacity + 8, 30), torch.float16, "cuda")
    src_guard = poison((capacity + 8,), torch.int32, "cuda")
    cu2 = poison((5,), torch.int32, "cuda")
    out, src = guard[:capacity], src_guard[:capacity]
    ragvit.set_debug(True)
    ragvit.repack_into(packed, cu_seqlens, keep, out, cu2, src=src, fuse_weights=weights)
    _check_fused(out, cu2, src, packed, cu_seqlens, mask, weights, seed)
    assert torch.isnan(guard[capacity:]).all() and (src_guard[capacity:] == INT32_POISON).all()
