"""pack, pack_into and unpack: data movement, checked exactly (integer-valued inputs,
torch.equal), every user-reachable error, and on CUDA graphs and garbage device contents."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    INT32_POISON,
    devices,
    dtype_params,
    error_params,
    gpu_marks,
    make_cu_seqlens,
    poison,
    random_lengths,
    requires_cuda,
    same_bits,
    seed_note,
)
from conftest import set_args as _set  # error-table mutations

import ragvit
from ragvit.reference import (
    pack_reference,
    unpack_reference,
)

# ---- helpers ----


def _snapshot(args: dict) -> dict:
    return {
        name: value.detach().clone()
        for name, value in args.items()
        if isinstance(value, torch.Tensor)
    }


def _assert_untouched(args: dict, before: dict, note: str = ""):
    assert before, "test bug: no tensor argument to watch"
    for name, value in before.items():
        assert same_bits(args[name], value), f"rejected call modified {name}{note}"


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
    params = []
    for device in ("cpu", "cuda"):
        marks = gpu_marks() if device == "cuda" else []
        for dtype in DTYPES:
            for B, N, C in PACK_SHAPES[device]:
                for keep_kind in KEEP_KINDS:
                    name = f"{device}-{DTYPE_IDS[dtype]}-B{B}-N{N}-C{C}-{keep_kind}"
                    params.append(
                        pytest.param(device, dtype, (B, N, C), keep_kind, marks=marks, id=name)
                    )
    return params


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
    """Integer-valued x (dropped tokens NaN) and keep, both on device.

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


def _pack_into_params():
    params = []
    for device in ("cpu", "cuda"):
        kinds = ("exact", "guard") + (("max",) if device == "cuda" else ())
        for dtype in DTYPES:
            for capacity_kind in kinds:
                for with_indices in (True, False):
                    name = (
                        f"{device}-{DTYPE_IDS[dtype]}-{capacity_kind}-"
                        f"{'indices' if with_indices else 'no_indices'}"
                    )
                    marks = gpu_marks() if device == "cuda" else []
                    if device == "cuda" and capacity_kind == "guard" and with_indices:
                        marks.append(pytest.mark.sanitizer)
                    params.append(
                        pytest.param(
                            device, dtype, capacity_kind, with_indices, marks=marks, id=name
                        )
                    )
    return params


@pytest.mark.parametrize("device, dtype, capacity_kind, with_indices", _pack_into_params())
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
    args = {
        "out": poison((total - 1, 30)),
        "cu_seqlens": poison((5,), torch.int32),
        "indices": poison((total - 1,), torch.int32),
    }
    before = _snapshot({"out": args["out"], "indices": args["indices"]})
    with pytest.raises(ValueError, match=r"capacity|room|out"):
        ragvit.pack_into(x, keep, args["out"], args["cu_seqlens"], indices=args["indices"])
    # A rejected call writes nothing (the _C contract). cu_seqlens is left out
    # here: it is the prefix-sum output the capacity check itself needs.
    _assert_untouched(args, before, seed_note(seed))


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


# ---- errors: type and message, and a rejected call writes nothing ----


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


def _pack_base(device):
    x = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6).to(device)
    keep = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool, device=device)
    return {
        "x": x,
        "keep": keep,
        "out": poison((10, 6), device=device),
        "cu_seqlens": poison((3,), torch.int32, device),
        "indices": poison((10,), torch.int32, device),
    }


# Errors shared by pack and pack_into (inputs x, keep).
PACK_INPUT_ERRORS = [
    (
        "keep_wrong_shape",
        _set(keep=lambda a: torch.ones((2, 6), dtype=torch.bool, device=a["x"].device)),
        ValueError,
        "keep",
        False,
    ),
    ("keep_1d", _set(keep=lambda a: a["keep"].reshape(-1)), ValueError, "keep", False),
    ("keep_float32", _set(keep=lambda a: a["keep"].float()), TypeError, "keep", False),
    ("keep_int64", _set(keep=lambda a: a["keep"].long()), TypeError, "keep", False),
    ("x_int32", _set(x=lambda a: a["x"].to(torch.int32)), TypeError, r"\bx\b", False),
    ("x_2d", _set(x=lambda a: a["x"].reshape(10, 6)), ValueError, r"\bx\b", False),
    (
        "x_channels_strided",
        _set(x=lambda a: torch.randn((2, 6, 5), device=a["x"].device).transpose(1, 2)),
        ValueError,
        "contiguous",
        False,
    ),
    ("x_list", _set(x=lambda a: a["x"].tolist()), TypeError, r"\bx\b", False),
]

PACK_INTO_ERRORS = PACK_INPUT_ERRORS + [
    ("out_dtype_differs", _set(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "out_channels_differ",
        _set(out=lambda a: poison((10, 7), device=a["x"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    (
        "out_1d",
        _set(out=lambda a: poison((60,), device=a["x"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    (
        "cu_seqlens_too_short",
        _set(cu_seqlens=lambda a: a["cu_seqlens"][:2]),
        ValueError,
        "cu_seqlens",
        False,
    ),
    (
        "cu_seqlens_int64",
        _set(cu_seqlens=lambda a: a["cu_seqlens"].long()),
        TypeError,
        "cu_seqlens",
        False,
    ),
    ("indices_int64", _set(indices=lambda a: a["indices"].long()), TypeError, "indices", False),
    (
        "indices_wrong_length",
        _set(indices=lambda a: poison((11,), torch.int32, a["x"].device)),
        ValueError,
        "indices",
        False,
    ),
    ("out_aliases_x", _set(out=lambda a: a["x"].reshape(10, 6)), ValueError, "alias", False),
    (
        "capacity_too_small",
        _set(
            out=lambda a: poison((4, 6), device=a["x"].device),
            indices=lambda a: poison((4,), torch.int32, a["x"].device),
        ),
        ValueError,
        r"capacity|room|out",
        True,
    ),
]


@pytest.mark.parametrize("device", devices())
def test_pack_error_base_args_are_valid(device):
    a = _pack_base(device)
    packed, cu_seqlens, indices = ragvit.pack(a["x"], a["keep"])
    assert cu_seqlens.cpu().tolist() == [0, 3, 5]
    ragvit.pack_into(a["x"], a["keep"], a["out"], a["cu_seqlens"], indices=a["indices"])
    assert torch.equal(a["out"][:5].cpu(), packed.cpu())
    assert a["indices"][:5].cpu().tolist() == [0, 2, 3, 0, 1] == indices.cpu().tolist()


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(PACK_INPUT_ERRORS))
def test_pack_rejects(device, mutate, exc, pattern):
    a = _pack_base(device)
    mutate(a)
    before = _snapshot(a)
    with pytest.raises(exc, match=pattern):
        ragvit.pack(a["x"], a["keep"])
    _assert_untouched(a, before)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(PACK_INTO_ERRORS))
def test_pack_into_rejects(device, mutate, exc, pattern):
    a = _pack_base(device)
    mutate(a)
    before = _snapshot({name: a[name] for name in ("x", "keep", "out", "indices")})
    with pytest.raises(exc, match=pattern):
        ragvit.pack_into(a["x"], a["keep"], a["out"], a["cu_seqlens"], indices=a["indices"])
    _assert_untouched(a, before)


def _unpack_base(device):
    packed = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6).to(device)
    return {
        "packed": packed,
        "cu_seqlens": make_cu_seqlens([3, 4], device),
        "N": 5,
        "indices": torch.tensor([0, 2, 4, 1, 0, 3, 2], dtype=torch.int32, device=device),
        "fill": 0.0,
        "out": poison((2, 5, 6), device=device),
    }


def _call_unpack(a):
    return ragvit.unpack(
        a["packed"], a["cu_seqlens"], a["N"], indices=a["indices"], fill=a["fill"], out=a["out"]
    )


UNPACK_ERRORS = [
    (
        "N_below_a_length",
        _set(N=3, out=lambda a: poison((2, 3, 6), device=a["packed"].device), indices=None),
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
        _set(packed=lambda a: torch.randn((6, 7), device=a["packed"].device).t()),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "out_channels_differ",
        _set(out=lambda a: poison((2, 5, 7), device=a["packed"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    (
        "out_rows_differ_from_N",
        _set(out=lambda a: poison((2, 6, 6), device=a["packed"].device)),
        ValueError,
        r"\bout\b|\bN\b",
        False,
    ),
    (
        "out_batch_differs",
        _set(out=lambda a: poison((3, 5, 6), device=a["packed"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    ("out_dtype_differs", _set(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "out_aliases_packed",
        _set(
            out=lambda a: torch.full((2, 5, 6), math.nan, device=a["packed"].device),
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
    (
        "cu_seqlens_int64",
        _set(cu_seqlens=lambda a: a["cu_seqlens"].long()),
        TypeError,
        "cu_seqlens",
        False,
    ),
    ("fill_str", _set(fill="0"), TypeError, "fill", False),
    ("packed_dict", _set(packed={}), TypeError, "packed", False),
]


@pytest.mark.parametrize("device", devices())
def test_unpack_error_base_args_are_valid(device):
    a = _unpack_base(device)
    assert _call_unpack(a) is a["out"]
    expected = unpack_reference(a["packed"], a["cu_seqlens"], 5, indices=a["indices"])
    assert torch.equal(a["out"].cpu(), expected.cpu())


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(UNPACK_ERRORS))
def test_unpack_rejects(device, mutate, exc, pattern):
    a = _unpack_base(device)
    mutate(a)
    before = _snapshot(a)
    with pytest.raises(exc, match=pattern):
        _call_unpack(a)
    _assert_untouched(a, before)


# ---- CUDA: graphs, streams, garbage contents ----


def _sleep_then(stream, fn, cycles=200_000_000):
    """Queues a long spin (~0.1 s) and then fn() on stream: work launched on any
    other stream runs before fn's effects land."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        fn()


@pytest.mark.gpu
@requires_cuda
def test_pack_into_unpack_cuda_graph_replay(gen, seed):
    ragvit.set_debug(False)
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):  # new masks each replay: nothing about T was baked in
        refill()
        padded.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.where(keep[..., None], x, torch.full_like(x, -1.0))
        assert torch.equal(padded, expected), "replayed pack_into/unpack differs" + seed_note(seed)
        assert torch.equal(cu_seqlens.cpu(), pack_reference(x, keep)[1].cpu())


def _drain_device_error_flag():
    """Kernels OR error bits into the device flag even with debug off; only a
    debug-mode call reads (and clears) it. After a garbage call with debug off,
    consume any stale bits with a throwaway call so no later test sees them."""
    ragvit.set_debug(True)
    q = torch.zeros((1, 1, 32), device="cuda")
    try:
        ragvit.attention(q, q, q, make_cu_seqlens([1], "cuda"), out=torch.empty_like(q))
    except ValueError:
        pass
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.sanitizer
@requires_cuda
@pytest.mark.parametrize("debug", [True, False], ids=["debug", "no_debug"])
def test_pack_into_capacity_too_small_on_cuda(debug, gen, seed):
    x, keep, mask = _make_pack_inputs(gen, (8, 197, 30), torch.float16, "cuda", "random_bool")
    exp_packed, exp_cu, _ = pack_reference(x, mask.to("cuda"))
    total = int(exp_cu[-1])
    capacity = total // 2
    guard = poison((capacity + 16, 30), torch.float16, "cuda")
    out = guard[:capacity]  # rows past capacity are a guard band that must stay poison
    cu_seqlens = poison((9,), torch.int32, "cuda")
    ragvit.set_debug(debug)
    if debug:
        with pytest.raises(ValueError, match=r"capacity|room|\bout\b"):
            ragvit.pack_into(x, keep, out, cu_seqlens)
    else:
        ragvit.pack_into(x, keep, out, cu_seqlens)
        torch.cuda.synchronize()
        assert torch.equal(cu_seqlens.cpu(), exp_cu.cpu())
        assert torch.equal(out.cpu(), exp_packed[:capacity].cpu()), "kept rows differ"
        _drain_device_error_flag()
    torch.cuda.synchronize()
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


@pytest.mark.gpu
@pytest.mark.sanitizer
@requires_cuda
@pytest.mark.parametrize("debug", [True, False], ids=["debug", "no_debug"])
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
    ragvit.set_debug(debug)
    if debug:
        with pytest.raises(ValueError, match=r"cu_seqlens|indices|index|\bN\b"):
            ragvit.unpack(packed, cu_seqlens, 5, indices=indices, out=out)
    else:
        ragvit.unpack(packed, cu_seqlens, 5, indices=indices, out=out)
        torch.cuda.synchronize()
        _drain_device_error_flag()
    torch.cuda.synchronize()
    assert torch.isnan(guard[10:]).all(), "unpack wrote past out"
    ragvit.set_debug(True)
    padded = ragvit.unpack(packed[:7], make_cu_seqlens([3, 4], "cuda"), 5)
    torch.cuda.synchronize()
    expected = unpack_reference(packed[:7], make_cu_seqlens([3, 4], "cuda"), 5)
    assert torch.equal(padded, expected)


