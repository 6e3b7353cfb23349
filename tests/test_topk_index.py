"""ragvit.topk_index against a Python reference, exactly (torch.equal).

The reference is the spec: per row, sorted(range(prefix, L), key=(-score, column))[:k] (NaN
first, -0.0 == +0.0) plus the prefix columns, ascending, on the float64 values of the
dtype-rounded scores. Shapes: L in {1, 2, 40, 197, 577, 1024, 8192}, B in {0, 1, 3, 64}, k
in {0, 1, n//2, n} with n = L - prefix, prefix in {0, 1, 2}; int32 and int64 out; ties, NaN,
infinities, signed zeros; strided rows, NumPy, every user-reachable error, CUDA graphs. The
prefix columns of scores are NaN (never read: a NaN would rank first); out is poisoned (-7).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.cuda import capture_graph
from support.devices import device_param, devices, requires_cuda
from support.errors import (
    assert_rejected,
    error_params,
    matrix_input_errors,
    matrix_out_errors,
    self_overlap_errors,
)
from support.errors import set_args as _set
from support.inputs import same_bits, seed_note
from support.tolerances import DTYPE_IDS, DTYPES, dtype_params

import ragvit

OUT_POISON = -7
LENGTHS = (1, 2, 40, 197, 577, 1024, 8192)
PREFIXES = (0, 1, 2)
OUT_DTYPES = {torch.int64: "i64", torch.int32: "i32"}
NUMPY_OUT = {torch.int64: np.int64, torch.int32: np.int32}


# ---- reference and inputs ----


def _rank(value: float, column: int) -> tuple:
    """Sort key of one score: NaN first, then score descending (-0.0 == +0.0), then column."""
    return (0, 0.0, column) if math.isnan(value) else (1, -value, column)


def topk_index_reference(scores, k: int, prefix: int = 0) -> torch.Tensor:
    """(B, prefix + k) int64 on the CPU: per row the prefix columns and the k
    top-ranked columns of [prefix, L), ascending."""
    rows = torch.as_tensor(scores).detach().cpu().double().tolist()
    out = []
    for row in rows:
        chosen = sorted(range(prefix, len(row)), key=lambda c: _rank(row[c], c))[:k]
        out.append(sorted(list(range(prefix)) + chosen))
    return torch.tensor(out, dtype=torch.int64).reshape(len(rows), prefix + k)


def _values(gen, B, L, kind="normal") -> torch.Tensor:
    """(B, L) float32 scores of a named kind.

    normal: N(0, 1) (fp16/bf16 rounding adds ties at large L); ties: integers in
    [-2, 2]; equal: every score 0.5; special: NaN (both signs), +-inf, -0.0 and
    +0.0, +-1 and the smallest float32 subnormal, mixed with normal values.
    """
    if kind == "normal":
        return torch.randn((B, L), generator=gen)
    if kind == "ties":
        return torch.randint(-2, 3, (B, L), generator=gen).float()
    if kind == "equal":
        return torch.full((B, L), 0.5)
    if kind == "special":
        pool = torch.tensor(
            [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45]
        )
        values = pool[torch.randint(0, len(pool), (B, L), generator=gen)]
        is_normal = torch.rand((B, L), generator=gen) < 0.3
        return torch.where(is_normal, torch.randn((B, L), generator=gen), values)
    raise ValueError(f"unknown kind {kind!r}")


def _scores(gen, B, L, dtype, device, kind="normal", prefix=0) -> torch.Tensor:
    """Scores as dtype on device, with NaN in the prefix columns (never read)."""
    values = _values(gen, B, L, kind)
    values[:, :prefix] = math.nan
    return values.to(dtype=dtype, device=device)


def _poisoned(shape, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.full(shape, OUT_POISON, dtype=dtype, device=device)


def _check(result, scores, k, prefix, seed):
    expected = topk_index_reference(scores, k, prefix)
    got = torch.as_tensor(result).cpu().long()
    assert got.shape == expected.shape, f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    assert torch.equal(got, expected), (
        f"topk_index differs in {int((got != expected).any(1).sum())} rows" + seed_note(seed)
    )


def _ks(n: int) -> list[int]:
    """k in {0, 1, n//2, n}, deduplicated, within [0, n]."""
    return sorted({k for k in (0, 1, n // 2, n) if k <= n})


# ---- the grid: L x prefix x k x dtype x out dtype ----


def _grid_params():
    return [
        device_param(device, dtype, out_dtype, L, prefix, k,
                     id=f"{DTYPE_IDS[dtype]}-{out_id}-L{L}-p{prefix}-k{k}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for out_dtype, out_id in OUT_DTYPES.items()
        for L in LENGTHS
        for prefix in PREFIXES
        if prefix <= L
        for k in _ks(L - prefix)
    ]


@pytest.mark.parametrize("device, dtype, out_dtype, L, prefix, k", _grid_params())
def test_topk_index_matches_reference(device, dtype, out_dtype, L, prefix, k, gen, seed):
    B = 3
    scores = _scores(gen, B, L, dtype, device, prefix=prefix)
    before = scores.clone()
    out = _poisoned((B, prefix + k), out_dtype, device)
    assert ragvit.topk_index(scores, k, prefix=prefix, out=out) is out
    assert out.dtype == out_dtype
    _check(out, scores, k, prefix, seed)
    assert same_bits(scores, before), "topk_index modified scores"


def _batch_params():
    return [
        device_param(device, dtype, B, L, id=f"{DTYPE_IDS[dtype]}-B{B}-L{L}")
        for device in ("cpu", "cuda")
        for B in (1, 3, 64)
        for L, dtypes in ((197, DTYPES), (577, (torch.bfloat16,)), (8192, (torch.float32,)))
        for dtype in dtypes
    ]


@pytest.mark.parametrize("device, dtype, B, L", _batch_params())
def test_topk_index_batch_sizes(device, dtype, B, L, gen, seed):
    """Every row its own selection (one block a row on CUDA); DeiT's 197 and 577."""
    prefix, k = 1, (L - 1) // 2
    scores = _scores(gen, B, L, dtype, device, prefix=prefix)
    out = _poisoned((B, prefix + k), device=device)
    ragvit.topk_index(scores, k, prefix=prefix, out=out)
    _check(out, scores, k, prefix, seed)


# ---- ties, NaN, infinities, signed zeros ----


def _value_params():
    return [
        device_param(device, dtype, kind, L, id=f"{DTYPE_IDS[dtype]}-{kind}-L{L}")
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for kind in ("ties", "equal", "special")
        for L in (40, 577, 8192)
    ]


@pytest.mark.parametrize("device, dtype, kind, L", _value_params())
@pytest.mark.parametrize("prefix", [0, 1])
def test_topk_index_ties_and_special_values(device, dtype, kind, L, prefix, gen, seed):
    """Ties keep the lower column; NaN ranks first; -0.0 == +0.0 (radix select's
    threshold bin holds many equal keys, and only `need` of them are kept)."""
    B = 4
    scores = _scores(gen, B, L, dtype, device, kind, prefix)
    n = L - prefix
    for k in sorted({1, n // 3, n // 2, n - 1}):
        out = _poisoned((B, prefix + k), torch.int32, device)
        ragvit.topk_index(scores, k, prefix=prefix, out=out)
        _check(out, scores, k, prefix, seed)


@pytest.mark.sanitizer
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_topk_index_semantics_by_hand(device, dtype):
    """Two rows worked out by hand (prefix 1; column 0 is never ranked). Row 0
    ranks NaN (2), +inf (5), 0.5 (1, then 6), the zeros (-0.0 at 3 ties +0.0 at
    4: the lower column first), -1 (8), -inf (7). Row 1 has the same scores in
    columns 1..8 reversed, so +0.0 (5) now comes before -0.0 (6)."""
    nan, inf = math.nan, math.inf
    rows = [
        [nan, 0.5, nan, -0.0, 0.0, inf, 0.5, -inf, -1.0],
        [nan, -1.0, -inf, 0.5, inf, 0.0, -0.0, nan, 0.5],
    ]
    expected = {
        1: [[0, 2], [0, 7]],
        2: [[0, 2, 5], [0, 4, 7]],
        3: [[0, 1, 2, 5], [0, 3, 4, 7]],
        4: [[0, 1, 2, 5, 6], [0, 3, 4, 7, 8]],
        5: [[0, 1, 2, 3, 5, 6], [0, 3, 4, 5, 7, 8]],
        6: [[0, 1, 2, 3, 4, 5, 6], [0, 3, 4, 5, 6, 7, 8]],
        7: [[0, 1, 2, 3, 4, 5, 6, 8], [0, 1, 3, 4, 5, 6, 7, 8]],
        8: [list(range(9))] * 2,
    }
    scores = torch.tensor(rows, dtype=dtype, device=device)
    for k, want in expected.items():
        assert ragvit.topk_index(scores, k, prefix=1).cpu().tolist() == want, f"k={k}"
        assert topk_index_reference(scores, k, 1).tolist() == want, f"reference, k={k}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("L", [40, 197, 1024])
def test_topk_index_equals_torch_pipeline_on_distinct_scores(device, L, gen, seed):
    """What it replaces: topk + sort + arange + cat (distinct scores, one NaN and
    both infinities per row; torch.topk also ranks NaN highest)."""
    B, prefix = 8, 1
    scores = torch.stack([torch.randperm(L, generator=gen) for _ in range(B)]).float()
    scores[:, 5], scores[:, 7], scores[:, 9] = math.nan, math.inf, -math.inf
    scores = scores.to(device)
    for k in (1, 3, (L - prefix) // 2, L - prefix - 1):
        top = torch.topk(scores[:, prefix:], k, dim=1).indices
        top = torch.sort(top, dim=1).values + prefix
        head = torch.arange(prefix, device=scores.device).expand(B, prefix)
        expected = torch.cat([head, top], dim=1)
        assert torch.equal(ragvit.topk_index(scores, k, prefix=prefix), expected), f"k={k}"


# ---- layouts: strided rows, strided and int32 outputs, omitted out ----

SCORE_LAYOUTS = ("column_slice", "row_stride_0")


@pytest.mark.sanitizer
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", SCORE_LAYOUTS)
@pytest.mark.parametrize("out_dtype", list(OUT_DTYPES), ids=list(OUT_DTYPES.values()))
def test_topk_index_strided_rows_and_out(device, dtype, layout, out_dtype, gen, seed):
    """scores: columns 3..3+L of a NaN-padded matrix (a stray read of the padding
    would rank first), or one row broadcast with row stride 0. out: columns 1..
    of a wider poisoned matrix whose padding must stay poisoned."""
    B, L, prefix = 6, 577, 2  # n = 575: three columns a thread in the CUDA compaction
    if layout == "column_slice":
        buffer = torch.full((B, L + 7), math.nan, dtype=dtype, device=device)
        scores = buffer[:, 3 : 3 + L]
        scores.copy_(_scores(gen, B, L, dtype, device, "ties", prefix))
    else:
        scores = _scores(gen, 1, L, dtype, device, "normal", prefix).expand(B, L)
    assert scores.stride(1) == 1 and scores.stride(0) in (L + 7, 0)
    for k in (0, 1, 287, L - prefix):
        out_buf = _poisoned((B, prefix + k + 3), out_dtype, device)
        out = out_buf[:, 1 : 1 + prefix + k]
        assert ragvit.topk_index(scores, k, prefix=prefix, out=out) is out
        _check(out, scores, k, prefix, seed)
        assert (out_buf[:, :1] == OUT_POISON).all() and (
            out_buf[:, 1 + prefix + k :] == OUT_POISON
        ).all(), "wrote outside out" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_topk_index_out_omitted_allocates_int64_like_scores(device, dtype, gen, seed):
    B, L, prefix, k = 5, 197, 1, 98
    scores = _scores(gen, B, L, dtype, device, prefix=prefix)
    result = ragvit.topk_index(scores, k, prefix=prefix)
    assert isinstance(result, torch.Tensor) and result.is_contiguous()
    assert result.dtype == torch.int64 and result.device == scores.device
    assert tuple(result.shape) == (B, prefix + k)
    _check(result, scores, k, prefix, seed)
    assert ragvit.topk_index(scores, k).shape == (B, k)  # prefix defaults to 0
    given = _poisoned((B, prefix + k), device=device)
    assert ragvit.topk_index(scores, k, prefix=prefix, out=given) is given
    assert torch.equal(result, given), "out= given and omitted disagree"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "shape, k, prefix", [((0, 10), 3, 1), ((4, 10), 0, 0), ((0, 0), 0, 0), ((3, 0), 0, 0)]
)
@pytest.mark.parametrize("with_out", [True, False], ids=["out_given", "out_omitted"])
def test_topk_index_empty(device, shape, k, prefix, with_out):
    """B = 0 or prefix + k = 0: nothing to write, the empty out comes back."""
    scores = torch.randn(shape, device=device)
    kwargs = {"out": _poisoned((shape[0], prefix + k), device=device)} if with_out else {}
    result = ragvit.topk_index(scores, k, prefix=prefix, **kwargs)
    if with_out:
        assert result is kwargs["out"]
    assert tuple(result.shape) == (shape[0], prefix + k) and result.numel() == 0


# ---- numpy ----


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("out_dtype", list(OUT_DTYPES), ids=list(OUT_DTYPES.values()))
def test_topk_index_numpy(np_dtype, out_dtype, gen, seed):
    B, L, prefix, k = 7, 197, 1, 60
    scores = _scores(gen, B, L, torch.float32, "cpu", "ties", prefix).numpy().astype(np_dtype)
    scores.flags.writeable = False  # only read
    result = ragvit.topk_index(scores, k, prefix=prefix)
    assert isinstance(result, np.ndarray) and result.dtype == np.int64
    _check(torch.from_numpy(result), torch.from_numpy(np.array(scores)), k, prefix, seed)
    out = np.full((B, prefix + k), OUT_POISON, dtype=NUMPY_OUT[out_dtype])
    assert ragvit.topk_index(scores, k, prefix=prefix, out=out) is out
    _check(torch.from_numpy(out), torch.from_numpy(np.array(scores)), k, prefix, seed)
    reversed_rows = scores[::-1]  # negative row stride
    got = ragvit.topk_index(reversed_rows, k, prefix=prefix)
    _check(torch.from_numpy(got), torch.from_numpy(np.array(reversed_rows)), k, prefix, seed)


def test_topk_index_rejects_read_only_numpy_out():
    scores = np.random.default_rng(0).standard_normal((3, 10)).astype(np.float32)
    out = np.full((3, 4), OUT_POISON, dtype=np.int64)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="topk_index: out must be writable, got a read-only"):
        ragvit.topk_index(scores, 3, prefix=1, out=out)
    assert (out == OUT_POISON).all()


# ---- errors: type and message; a rejected call writes nothing ----


def _base(device):
    gen = torch.Generator().manual_seed(1234)
    return {
        "scores": torch.randn((4, 10), generator=gen).to(device),
        "k": 3,
        "prefix": 1,
        "out": _poisoned((4, 4), device=device),
        "stream": None,
    }


def _call(a):
    return ragvit.topk_index(
        a["scores"], a["k"], prefix=a["prefix"], out=a["out"], stream=a["stream"]
    )


def _dev(a):
    return a["scores"].device


# (id, mutation, exception, message regex, cpu_only)
TOPK_ERRORS = (
    matrix_input_errors("topk_index", "scores", (4, 10))
    + matrix_out_errors(
        "topk_index", (4, 4), lambda shape, device: _poisoned(shape, device=device),
        same_dtype_as_x=False,
    )
    + self_overlap_errors("topk_index", "out")
) + [
    (
        "scores_too_wide",
        _set(scores=lambda a: torch.randn((4, 8193), device=_dev(a))),
        ValueError,
        r"topk_index: scores must have L <= 8192 columns, got L=8193",
        False,
    ),
    (
        "k_negative",
        _set(k=-1),
        ValueError,
        r"topk_index: k must be in \[0, 2\*\*31\), got -1",
        False,
    ),
    ("k_huge", _set(k=2**40), ValueError, r"topk_index: k must be in \[0, 2\*\*31\)", False),
    ("k_float", _set(k=3.0), TypeError, r"topk_index: k must be an int, got float", False),
    ("k_bool", _set(k=True), TypeError, r"topk_index: k must be an int, got bool", False),
    ("k_none", _set(k=None), TypeError, r"topk_index\(\) missing required argument 'k'", False),
    (
        "k_past_L",
        _set(k=10),
        ValueError,
        r"topk_index: k must be in \[0, L - prefix\] \(k \+ prefix <= L\), got k=10 with "
        r"prefix=1 and L=10",
        False,
    ),
    (
        "k_plus_prefix_past_L",
        _set(k=8, prefix=3),
        ValueError,
        r"k \+ prefix <= L\), got k=8 with prefix=3 and L=10",
        False,
    ),
    (
        "prefix_negative",
        _set(prefix=-1),
        ValueError,
        r"topk_index: prefix must be in \[0, 2\*\*31\), got -1",
        False,
    ),
    (
        "prefix_past_L",
        _set(prefix=11, k=0),
        ValueError,
        r"topk_index: prefix must be in \[0, L=10\], got 11",
        False,
    ),
    (
        "prefix_float",
        _set(prefix=1.0),
        TypeError,
        r"topk_index: prefix must be an int, got float",
        False,
    ),
    (
        "prefix_bool",
        _set(prefix=True),
        TypeError,
        r"topk_index: prefix must be an int, got bool",
        False,
    ),
    (
        "out_float32",
        _set(out=lambda a: a["out"].float()),
        TypeError,
        r"topk_index: out must be int32 or int64, got float32",
        False,
    ),
    (
        "out_uint8",
        _set(out=lambda a: torch.zeros((4, 4), dtype=torch.uint8, device=_dev(a))),
        TypeError,
        r"out must be int32 or int64, got uint8",
        False,
    ),
    (
        "out_rows_overlap",
        _set(out=lambda a: _poisoned((1, 4), device=_dev(a)).expand(4, 4)),
        ValueError,
        r"topk_index: out must not overlap itself, got shape \(4, 4\) with strides \(0, 1\)",
        False,
    ),
    (
        "out_aliases_scores",
        _set(out=lambda a: a["scores"].view(torch.int32)[:, :4]),
        ValueError,
        r"topk_index: out must not alias \(overlap\) scores",
        False,
    ),
]


@pytest.mark.parametrize("device", devices())
def test_error_base_args_are_valid(device):
    a = _base(device)
    _call(a)
    _check(a["out"], a["scores"], 3, 1, 0)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(TOPK_ERRORS))
def test_rejects(device, mutate, exc, pattern):
    assert_rejected(_call, _base(device), mutate, exc, pattern)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(
    "scores_shape, k, prefix, exc, pattern",
    [
        ((40,), 3, 0, ValueError, r"scores must have 2 dimensions, got 1"),
        ((4, 10), 11, 0, ValueError, r"got k=11 with prefix=0 and L=10"),
        ((4, 10), 2**31 - 1, 0, ValueError, r"got k=2147483647 with prefix=0 and L=10"),
        ((4, 10), 1, 11, ValueError, r"prefix must be in \[0, L=10\], got 11"),
        ((2, 8193), 1, 0, ValueError, r"scores must have L <= 8192 columns, got L=8193"),
    ],
    ids=["scores_1d", "k_past_L", "k_int32_max", "prefix_past_L", "scores_too_wide"],
)
def test_rejects_with_out_omitted(device, scores_shape, k, prefix, exc, pattern):
    """The core's message, not an allocation of (B, prefix + k) first."""
    scores = torch.randn(scores_shape, device=device)
    with pytest.raises(exc, match=pattern):
        ragvit.topk_index(scores, k, prefix=prefix)


def test_rejects_bad_argument_lists():
    scores = torch.randn((4, 10))
    with pytest.raises(TypeError, match=r"topk_index\(\) missing required argument 'k'"):
        ragvit.topk_index(scores)
    with pytest.raises(TypeError, match=r"topk_index\(\) takes at most 2 positional"):
        ragvit.topk_index(scores, 3, 1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'skip'"):
        ragvit.topk_index(scores, 3, skip=1)


@pytest.mark.gpu
@requires_cuda
def test_rejects_device_mismatch():
    scores = torch.randn((4, 10), device="cuda")
    out = _poisoned((4, 4))
    with pytest.raises(
        ValueError,
        match=r"topk_index: out must be on the device of scores "
        r"\(cuda:0\), got cpu:0",
    ):
        ragvit.topk_index(scores, 3, prefix=1, out=out)
    assert (out == OUT_POISON).all()


# ---- CUDA: streams and graph capture ----


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", dtype_params())
def test_topk_index_cuda_graph_replay(dtype, gen, seed):
    """Captured once, replayed on new scores: no host sync, no allocation."""
    B, L, prefix, k = 64, 197, 1, 98
    scores = torch.empty((B, L), dtype=dtype, device="cuda")
    out = _poisoned((B, prefix + k), torch.int32, "cuda")

    def refill():
        scores.copy_(_scores(gen, B, L, dtype, "cpu", "ties", prefix))

    refill()
    graph = capture_graph(lambda: ragvit.topk_index(scores, k, prefix=prefix, out=out))
    _check(out, scores, k, prefix, seed)  # the eager run before the capture
    for _ in range(2):
        refill()
        out.fill_(OUT_POISON)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, scores, k, prefix, seed)


@pytest.mark.gpu
@requires_cuda
def test_topk_index_explicit_stream(gen, seed):
    B, L, prefix, k = 16, 577, 1, 200
    scores = _scores(gen, B, L, torch.float16, "cuda", "normal", prefix)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = _poisoned((B, prefix + k), device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    ragvit.topk_index(scores, k, prefix=prefix, out=out, stream=side.cuda_stream)
    side.synchronize()
    _check(out, scores, k, prefix, seed)
