"""ragvit.attention against the float64 reference: every dtype and head_dim, the named length
sets, q/k/v layouts, cls_attn, the per-key bias, explicit scales and max_seqlen, every
user-reachable error, and on CUDA graphs, streams and garbage device-side cu_seqlens.

Outputs are NaN-poisoned before each call, and so are the q/k/v rows of no sequence (a stray
read shows); support.checks.check_attention applies the dtype table and err <= 2 * err(SDPA
on the padded batch) + floor. CPU cases are sized for two slow cores: large shapes are CUDA's.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from support.checks import check_attention, check_cls_attn
from support.cuda import call_with_debug, capture_graph, flagged_contents_test, sleep_then
from support.devices import device_param, devices, requires_cuda
from support.errors import (
    assert_rejected,
    cu_seqlens_errors,
    error_params,
    self_overlap_errors,
    set_args,
)
from support.inputs import (
    covered_rows,
    make_cu_seqlens,
    make_qkv,
    poison,
    poison_uncovered_rows,
    random_lengths,
    same_bits,
    seed_note,
)
from support.lengths import LENGTH_SETS
from support.tolerances import DTYPE_IDS, DTYPES, dtype_params

import ragvit

NUM_HEADS = {"cpu": 2, "cuda": 6}
HEAD_DIMS = {"cpu": (32, 64, 80, 128), "cuda": (32, 64, 80, 96, 128)}
LAYOUTS = ("contiguous", "qkv_view")
SANITIZER_CASES = ("one_token", "zero_length", "capacity_tail")


def _attention_params():
    return [
        device_param(
            device, dtype, head_dim, case, layout,
            id=f"{DTYPE_IDS[dtype]}-D{head_dim}-{case}-{layout}",
            sanitizer=case in SANITIZER_CASES and layout == "qkv_view" and head_dim in (64, 128),
        )
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for head_dim in HEAD_DIMS[device]
        for case in LENGTH_SETS
        for layout in LAYOUTS
    ]


# ---- attention vs the reference ----


@pytest.mark.parametrize("device, dtype, head_dim, case, layout", _attention_params())
def test_attention_matches_reference(device, dtype, head_dim, case, layout, gen, seed):
    lengths, total = LENGTH_SETS[case](gen, device == "cuda")
    num_heads = NUM_HEADS[device]
    q, k, v = make_qkv(gen, total, num_heads, head_dim, dtype, device, layout=layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison((total, num_heads, head_dim), dtype, device)
    result = ragvit.attention(q, k, v, cu_seqlens, out=out)
    assert result is out
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params((torch.float32, torch.float16)))
@pytest.mark.parametrize(
    "scale, std, fp32_tol_scale",
    [
        pytest.param(0.05, 1.0, 1.0, id="scale0.05"),
        pytest.param(0.3, 1.0, 1.0, id="scale0.3"),
        # logits ~ N(0, 64): needs max-subtraction; fp32 score rounding grows with |logit|
        pytest.param(1.0, 1.0, 8.0, id="scale1-peaky"),
        pytest.param(0.125, 3.0, 16.0, id="scale0.125-large-inputs"),
    ],
)
def test_attention_explicit_scale(device, dtype, scale, std, fp32_tol_scale, gen, seed):
    lengths = [1, 50, 129, 0, 7]
    total = sum(lengths)
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device, std=std)
    cu_seqlens = make_cu_seqlens(lengths, device)
    out = poison(q.shape, dtype, device)
    cls_attn = poison((total,), torch.float32, device)
    ragvit.attention(q, k, v, cu_seqlens, scale=scale, out=out, cls_attn=cls_attn)
    tol_scale = fp32_tol_scale if dtype == torch.float32 else 1.0
    check_attention(out, q, k, v, cu_seqlens, scale=scale, seed=seed, tol_scale=tol_scale)
    check_cls_attn(cls_attn, q, k, cu_seqlens, scale=scale, seed=seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params((torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("ramp", [4.0, 16.0])
def test_attention_growing_row_maxima(device, dtype, ramp, gen, seed):
    """Keys scaled by 1 + ramp * position / length: row maxima grow along each sequence,
    from one 64-key tile to the next by a little (ramp 4) and by far (ramp 16), so the
    online softmax's rescale factors of O range from near 1 to near 0."""
    lengths = [577, 197, 300, 64, 1, 130]
    total = sum(lengths)
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device, layout="qkv_view")
    position = torch.cat([torch.arange(n, dtype=torch.float32) / n for n in lengths])
    k.mul_((1.0 + ramp * position).to(dtype=dtype, device=device)[:, None, None])
    cu_seqlens = make_cu_seqlens(lengths, device)
    out = poison(q.shape, dtype, device)
    ragvit.attention(q, k, v, cu_seqlens, out=out)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


def _check_with_exact_max_seqlen(q, k, v, lengths, seed):
    """attention over sequences of `lengths` (rows past them NaN-poisoned in q/k/v) with
    max_seqlen = max(lengths), into a poisoned out, checked against the reference."""
    cu_seqlens = make_cu_seqlens(lengths, q.device)
    poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, q.dtype, q.device)
    ragvit.attention(q, k, v, cu_seqlens, max(lengths), out=out)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params((torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "lengths",
    [[577, 570, 1, 0, 513, 200, 576], [197, 193, 5, 129, 64, 196], [5, 1, 8, 0, 3, 7]],
    ids=["577", "197", "max8"],
)
def test_attention_thin_last_query_tiles(device, dtype, layout, lengths, gen, seed):
    """max_seqlen exact and 1-8 rows past a multiple of 64: on Hopper the sequences that
    reach the last 64-row query tile take the thin-tile path there (mma.sync, the keys
    split over the warps, their partial results merged); the rows before it, and the
    sequences that stop short of it, take the regular tiles."""
    total = sum(lengths) + 3
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device, layout=layout)
    _check_with_exact_max_seqlen(q, k, v, lengths, seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params((torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("layout", ["qkv_view", "contiguous", "heads_major", "one_head"])
def test_attention_long_sequences_any_layout(device, dtype, layout, gen, seed):
    """Sequences past 256 tokens among short ones at head_dim 64, over more than one wave of
    blocks: on Hopper every 64-key tile that lies wholly inside a sequence comes by TMA where
    the layout allows it (token-major q/k/v, views of one qkv buffer or separate tensors, one
    head or several), the partial last tile and the folded tail by cp.async; head-major k
    and v ((H, T, D) tensors seen as (T, H, D)) cannot be described that way and take
    cp.async throughout. Every layout must match the reference."""
    lengths = [577, 300, 1, 64, 257, 256, 65, 0, 128, 449] * 2
    total = sum(lengths) + 5
    heads = 1 if layout == "one_head" else NUM_HEADS[device]
    made = "qkv_view" if layout == "qkv_view" else "contiguous"
    q, k, v = make_qkv(gen, total, heads, 64, dtype, device, layout=made)
    if layout == "heads_major":
        q, k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
        assert k.stride(1) > k.stride(0)
    _check_with_exact_max_seqlen(q, k, v, lengths, seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("max_seqlen_kind", ["default", "exact", "loose"])
def test_attention_max_seqlen(device, max_seqlen_kind, gen, seed):
    lengths = [5, 64, 0, 33, 1]
    total = sum(lengths) + 3
    max_seqlen = {"default": None, "exact": max(lengths), "loose": total}[max_seqlen_kind]
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, torch.float16, device, "qkv_view")
    cu_seqlens = make_cu_seqlens(lengths, device)
    poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, q.dtype, device)
    if max_seqlen is None:
        ragvit.attention(q, k, v, cu_seqlens, out=out)
    else:
        ragvit.attention(q, k, v, cu_seqlens, max_seqlen, out=out)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls_layout", ["contiguous", "strided"])
def test_cls_attn_matches_reference(device, dtype, layout, cls_layout, gen, seed):
    lengths = [0, 1, 17, 0, 97 if device == "cpu" else 197, 64]
    total = sum(lengths) + 5
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device, layout=layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, dtype, device)
    if cls_layout == "strided":
        cls_buffer = poison((2 * total,), torch.float32, device)
        cls_attn = cls_buffer[::2]
    else:
        cls_buffer = cls_attn = poison((total,), torch.float32, device)
    ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn)
    check_cls_attn(cls_attn, q, k, cu_seqlens, seed=seed)
    check_attention(out, q, k, v, cu_seqlens, seed=seed)
    if cls_layout == "strided":
        assert torch.isnan(cls_buffer[1::2]).all(), "cls_attn wrote between its strided rows"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
def test_attention_out_omitted_allocates_like_q(device, dtype, gen, seed):
    lengths = [7, 1, 40]
    total = sum(lengths)
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 32, dtype, device, "qkv_view")
    cu_seqlens = make_cu_seqlens(lengths, device)
    result = ragvit.attention(q, k, v, cu_seqlens)
    assert isinstance(result, torch.Tensor)
    assert result.dtype == q.dtype and result.device == q.device
    assert tuple(result.shape) == tuple(q.shape)
    check_attention(result, q, k, v, cu_seqlens, seed=seed, poisoned=False)
    given = poison(q.shape, dtype, device)
    assert ragvit.attention(q, k, v, cu_seqlens, out=given) is given
    assert same_bits(result, given), "out= given and omitted disagree"


@pytest.mark.parametrize("device", devices())
def test_attention_out_is_a_strided_view(device, gen, seed):
    lengths = [9, 0, 31]
    total = sum(lengths) + 2
    num_heads = NUM_HEADS[device]
    q, k, v = make_qkv(gen, total, num_heads, 64, torch.float16, device)
    cu_seqlens = make_cu_seqlens(lengths, device)
    poison_uncovered_rows(cu_seqlens, q, k, v)
    buffer = poison((total, 3, num_heads, 64), torch.float16, device)
    out = buffer[:, 1]
    assert ragvit.attention(q, k, v, cu_seqlens, out=out) is out
    check_attention(out, q, k, v, cu_seqlens, seed=seed)
    assert torch.isnan(buffer[:, 0]).all() and torch.isnan(buffer[:, 2]).all(), (
        "attention wrote outside its strided out view"
    )


@pytest.mark.parametrize("device", devices())
def test_attention_all_sequences_empty_writes_nothing(device, gen):
    total, num_heads = 9, NUM_HEADS[device]
    q, k, v = make_qkv(gen, total, num_heads, 32, torch.float32, device)
    cu_seqlens = make_cu_seqlens([0, 0], device)
    out = poison(q.shape, torch.float32, device)
    cls_attn = poison((total,), torch.float32, device)
    assert ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn) is out
    assert torch.isnan(out).all() and torch.isnan(cls_attn).all()


@pytest.mark.parametrize("device", devices())
def test_attention_zero_tokens(device):
    q = torch.empty((0, 2, 32), device=device)
    out = ragvit.attention(q, q.clone(), q.clone(), make_cu_seqlens([], device))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (0, 2, 32)


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("with_out", [False, True], ids=["out_omitted", "out_given"])
def test_attention_numpy_in_numpy_out(np_dtype, with_out, gen, seed):
    lengths = [3, 0, 21, 1]
    total, num_heads, head_dim = sum(lengths) + 2, 2, 32
    qkv = torch.randn((total, 3, num_heads, head_dim), generator=gen).numpy().astype(np_dtype)
    covered = covered_rows(make_cu_seqlens(lengths), total).numpy()
    qkv[~covered] = np.nan
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    cu_seqlens = np.asarray(make_cu_seqlens(lengths).numpy(), dtype=np.int32)
    kwargs = {}
    if with_out:
        kwargs["out"] = np.full((total, num_heads, head_dim), np.nan, dtype=np_dtype)
        kwargs["cls_attn"] = np.full((total,), np.nan, dtype=np.float32)
    result = ragvit.attention(q, k, v, cu_seqlens, **kwargs)
    assert isinstance(result, np.ndarray)
    assert result.dtype == np_dtype and result.shape == (total, num_heads, head_dim)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    if with_out:
        assert result is kwargs["out"]
        check_cls_attn(kwargs["cls_attn"], tq, tk, cu_seqlens, seed=seed)
    check_attention(torch.from_numpy(result), tq, tk, tv, cu_seqlens, seed=seed,
                    poisoned=with_out)


# ---- bias: the per-key additive logit bias (ToMe's proportional attention) ----

# logits[i, j] = scale * q_i . k_j + bias[j] for keys j of i's sequence: one float32 value per
# packed token, shared by all heads and queries (typically log(size_j)). The CPU checks the
# bias only on the tokens of sequences, so NaN poison in the other rows is legal there too.

BIAS_HEAD_DIMS = (64, 80)
BIAS_LENGTH_SETS = ("one_token", "deit_197", "deit_577", "ragged_mix", "zero_length",
                    "capacity_tail")
# (q/k/v layout, bias layout): the qkv_view run also reads a strided bias
BIAS_LAYOUTS = (("contiguous", "contiguous"), ("qkv_view", "strided"))
BIAS_SANITIZER_CASES = {("one_token", 64), ("capacity_tail", 64), ("zero_length", 80)}


def _bias_params():
    return [
        device_param(
            device, dtype, head_dim, case, layout, bias_layout, with_cls,
            id=f"{DTYPE_IDS[dtype]}-D{head_dim}-{case}-{layout}-bias_{bias_layout}-"
            f"{'cls' if with_cls else 'nocls'}",
            sanitizer=(case, head_dim) in BIAS_SANITIZER_CASES
            and dtype == torch.float16
            and layout == "qkv_view"
            and with_cls,
        )
        for device in ("cpu", "cuda")
        for dtype in DTYPES
        for head_dim in BIAS_HEAD_DIMS
        for case in BIAS_LENGTH_SETS
        for layout, bias_layout in BIAS_LAYOUTS
        for with_cls in (False, True)
    ]


def _make_bias(gen, total, device, layout="contiguous"):
    """(T,) float32 bias of log token sizes (ToMe: sizes 1..8 -> 0 .. 2.08), as `layout`.

    Returns:
        (bias, buffer): the (T,) view handed to attention and the tensor that owns it.
    """
    sizes = torch.randint(1, 9, (total,), generator=gen).to(torch.float32)
    values = torch.log(sizes)
    if layout == "strided":
        buffer = torch.full((3 * total,), math.nan, dtype=torch.float32)
        buffer[::3] = values
        buffer = buffer.to(device)
        return buffer[::3], buffer
    if layout == "contiguous":
        bias = values.to(device)
        return bias, bias
    raise ValueError(f"unknown layout {layout!r}")


@pytest.mark.parametrize("device, dtype, head_dim, case, layout, bias_layout, with_cls",
                         _bias_params())
def test_attention_bias_matches_reference(
    device, dtype, head_dim, case, layout, bias_layout, with_cls, gen, seed
):
    lengths, total = LENGTH_SETS[case](gen, device == "cuda")
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], head_dim, dtype, device, layout=layout)
    bias, bias_buffer = _make_bias(gen, total, device, bias_layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    poison_uncovered_rows(cu_seqlens, q, k, v, bias)
    bias_before = bias_buffer.clone()
    out = poison(q.shape, dtype, device)
    cls_attn = poison((total,), torch.float32, device) if with_cls else None
    result = ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn, bias=bias)
    assert result is out
    check_attention(out, q, k, v, cu_seqlens, bias=bias, seed=seed)
    if with_cls:
        check_cls_attn(cls_attn, q, k, cu_seqlens, bias=bias, seed=seed)
    assert same_bits(bias_buffer, bias_before), "attention wrote into bias" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params((torch.float32, torch.float16)))
def test_attention_bias_dominates(device, dtype, gen, seed):
    """A large bias range (+-8: probabilities spread over e^16) with an explicit scale."""
    lengths = [1, 50, 129, 0, 7]
    total = sum(lengths)
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device)
    bias = (torch.rand((total,), generator=gen) * 16.0 - 8.0).to(device)
    cu_seqlens = make_cu_seqlens(lengths, device)
    out = poison(q.shape, dtype, device)
    cls_attn = poison((total,), torch.float32, device)
    ragvit.attention(q, k, v, cu_seqlens, scale=0.05, out=out, cls_attn=cls_attn, bias=bias)
    check_attention(out, q, k, v, cu_seqlens, bias=bias, seed=seed, scale=0.05)
    check_cls_attn(cls_attn, q, k, cu_seqlens, bias=bias, seed=seed, scale=0.05)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["contiguous", "qkv_view"])
def test_attention_zero_bias_is_bitwise_no_bias_on_cpu(dtype, layout, gen):
    lengths = [0, 1, 37, 197, 0, 5]
    total = sum(lengths) + 3
    q, k, v = make_qkv(gen, total, 2, 64, dtype, "cpu", layout=layout)
    cu_seqlens = make_cu_seqlens(lengths)
    outs, clss = [], []
    for bias in (None, torch.zeros(total), torch.zeros(2 * total)[::2]):
        out = poison(q.shape, dtype)
        cls_attn = poison((total,))
        ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn, bias=bias)
        outs.append(out)
        clss.append(cls_attn)
    for i in (1, 2):
        assert same_bits(outs[i], outs[0]), "zero bias changed out"
        assert same_bits(clss[i], clss[0]), "zero bias changed cls_attn"


@pytest.mark.parametrize("device", devices())
def test_attention_bias_none_is_no_bias(device, gen):
    q, k, v = make_qkv(gen, 20, 2, 32, torch.float32, device)
    cu_seqlens = make_cu_seqlens([8, 12], device)
    a = ragvit.attention(q, k, v, cu_seqlens)
    b = ragvit.attention(q, k, v, cu_seqlens, bias=None)
    assert same_bits(a, b)


@pytest.mark.parametrize("device", devices())
def test_attention_bias_shifts_per_sequence(device, gen, seed):
    """A constant added to the bias of one sequence cancels in its softmax."""
    lengths = [9, 0, 30]
    total = sum(lengths)
    q, k, v = make_qkv(gen, total, 2, 64, torch.float32, device)
    bias = _make_bias(gen, total, "cpu")[0]
    shifted = bias.clone()
    shifted[9:] += 3.0
    cu_seqlens = make_cu_seqlens(lengths, device)
    a = ragvit.attention(q, k, v, cu_seqlens, bias=bias.to(device))
    b = ragvit.attention(q, k, v, cu_seqlens, bias=shifted.to(device))
    torch.testing.assert_close(
        a.cpu(), b.cpu(), atol=1e-5, rtol=1e-5, msg=lambda m: m + seed_note(seed)
    )


def test_attention_bias_nonfinite_outside_sequences_is_accepted_on_cpu(gen, seed):
    """Only the tokens of sequences are checked: a capacity tail may hold anything."""
    lengths = [0, 4, 6]
    total = sum(lengths) + 3
    q, k, v = make_qkv(gen, total, 2, 32)
    bias = torch.zeros(total)
    bias[10:] = math.inf
    out = poison(q.shape)
    ragvit.attention(q, k, v, make_cu_seqlens(lengths), out=out, bias=bias)
    assert torch.isfinite(out[:10]).all() and torch.isnan(out[10:]).all()


# ---- errors: type and message, and a rejected call writes nothing ----


def _attention_base(device, dtype=torch.float32, head_dim=32):
    gen = torch.Generator().manual_seed(1234)
    lengths, total, num_heads = [5, 0, 7], 12, 2
    q, k, v = make_qkv(gen, total, num_heads, head_dim, dtype, device)
    return {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens": make_cu_seqlens(lengths, device),
        "max_seqlen": None,
        "scale": None,
        "out": poison((total, num_heads, head_dim), dtype, device),
        "cls_attn": poison((total,), torch.float32, device),
        "bias": None,
    }


def _bias_base(device):
    a = _attention_base(device)
    a["bias"] = torch.zeros(a["q"].shape[0], device=device)
    return a


def _call_attention(a):
    return ragvit.attention(
        a["q"],
        a["k"],
        a["v"],
        a["cu_seqlens"],
        a["max_seqlen"],
        scale=a["scale"],
        out=a["out"],
        cls_attn=a["cls_attn"],
        bias=a["bias"],
    )


def _with_head_dim(head_dim):
    def mutate(a):
        fresh = _attention_base(a["q"].device.type, a["q"].dtype, head_dim)
        a.update(fresh)

    return mutate


def _overlapping_out(a):
    buf = torch.randn((13, 2, 32), device=a["q"].device)
    a["k"] = buf[:-1]
    a["out"] = buf[1:]


def _transposed(shape, device, fill=None):
    """(T, H, D) tensor whose last dim has stride H (made by transposing (T, D, H))."""
    T, H, D = shape
    base = (
        torch.randn((T, D, H), device=device)
        if fill is None
        else torch.full((T, D, H), fill, device=device)
    )
    return base.transpose(1, 2)


def _q_device(a):
    return a["q"].device


# (id, mutation, exception, message regex, cpu_only)
ATTENTION_ERRORS = cu_seqlens_errors() + [
    ("q_int32", set_args(q=lambda a: a["q"].to(torch.int32)), TypeError, r"\bq\b", False),
    ("q_float64", set_args(q=lambda a: a["q"].double()), TypeError, r"\bq\b", False),
    ("k_dtype_differs", set_args(k=lambda a: a["k"].half()), TypeError, r"\bk\b", False),
    ("v_dtype_differs", set_args(v=lambda a: a["v"].bfloat16()), TypeError, r"\bv\b", False),
    ("out_dtype_differs", set_args(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "cu_seqlens_float",
        set_args(cu_seqlens=lambda a: a["cu_seqlens"].float()),
        TypeError,
        "cu_seqlens",
        False,
    ),
    ("q_2d", set_args(q=lambda a: a["q"].reshape(12, -1)), ValueError, r"\bq\b", False),
    ("k_4d", set_args(k=lambda a: a["k"][None]), ValueError, r"\bk\b", False),
    ("out_2d", set_args(out=lambda a: a["out"].reshape(12, -1)), ValueError, r"\bout\b", False),
    (
        "k_tokens_differ",
        set_args(k=lambda a: torch.randn((13, 2, 32), device=_q_device(a))),
        ValueError,
        r"\bk\b",
        False,
    ),
    (
        "v_heads_differ",
        set_args(v=lambda a: torch.randn((12, 3, 32), device=_q_device(a))),
        ValueError,
        r"\bv\b",
        False,
    ),
    (
        "k_head_dim_differs",
        set_args(k=lambda a: torch.randn((12, 2, 64), device=_q_device(a))),
        ValueError,
        r"\bk\b",
        False,
    ),
    (
        "out_tokens_differ",
        set_args(out=lambda a: poison((11, 2, 32), device=_q_device(a))),
        ValueError,
        r"\bout\b",
        False,
    ),
    ("head_dim_48", _with_head_dim(48), ValueError, "head_dim", False),
    ("head_dim_16", _with_head_dim(16), ValueError, "head_dim", False),
    ("head_dim_256", _with_head_dim(256), ValueError, "head_dim", False),
    (
        "q_last_dim_strided",
        set_args(q=lambda a: _transposed((12, 2, 32), _q_device(a))),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "v_last_dim_strided",
        set_args(v=lambda a: _transposed((12, 2, 32), _q_device(a))),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "out_last_dim_strided",
        set_args(out=lambda a: _transposed((12, 2, 32), _q_device(a), fill=math.nan)),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "cls_attn_fp16",
        set_args(cls_attn=lambda a: a["cls_attn"].half()),
        TypeError,
        "cls_attn",
        False,
    ),
    (
        "cls_attn_too_long",
        set_args(cls_attn=lambda a: poison((13,), device=_q_device(a))),
        ValueError,
        "cls_attn",
        False,
    ),
    (
        "cls_attn_2d",
        set_args(cls_attn=lambda a: poison((12, 1), device=_q_device(a))),
        ValueError,
        "cls_attn",
        False,
    ),
    ("out_is_q", set_args(out=lambda a: a["q"]), ValueError, "alias", False),
    ("out_is_v", set_args(out=lambda a: a["v"]), ValueError, "alias", False),
    ("out_overlaps_k", _overlapping_out, ValueError, "alias", False),
    (
        "cls_attn_inside_out",
        set_args(cls_attn=lambda a: a["out"].view(-1)[:12]),
        ValueError,
        "alias",
        False,
    ),
    (
        "cu_seqlens_decreasing",
        set_args(cu_seqlens=lambda a: torch.tensor([0, 7, 5, 12], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    (
        "cu_seqlens_past_T",
        set_args(cu_seqlens=lambda a: torch.tensor([0, 5, 13], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    (
        "cu_seqlens_negative_first",
        set_args(cu_seqlens=lambda a: torch.tensor([-1, 5, 12], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    ("length_over_max_seqlen", set_args(max_seqlen=6), ValueError, r"cu_seqlens|max_seqlen",
     True),
    ("scale_zero", set_args(scale=0.0), ValueError, "scale", False),
    ("scale_negative", set_args(scale=-0.125), ValueError, "scale", False),
    ("scale_nan", set_args(scale=math.nan), ValueError, "scale", False),
    ("scale_inf", set_args(scale=math.inf), ValueError, "scale", False),
    ("scale_str", set_args(scale="0.1"), TypeError, "scale", False),
    *[
        (f"scale_{case}", set_args(scale=value), ValueError,
         rf"attention: scale must be finite and > 0 in float32 .*, "
         rf"got {re.escape(f'{value:g}')}", False)
        for case, value in [
            ("inf_in_float32", 1e39),  # finite in double
            ("zero_in_float32", 1e-50),
            ("subnormal_in_float32", 1e-39),  # flushed to zero by the kernels
            ("times_log2e_inf", 3e38),  # the kernels scale by scale * log2(e)
        ]
    ],
    ("scale_bool", set_args(scale=True), TypeError, r"attention: scale must be a float, got bool",
     False),
    ("max_seqlen_negative", set_args(max_seqlen=-1), ValueError, "max_seqlen", False),
    *[
        (f"max_seqlen_{case}", set_args(max_seqlen=value), ValueError,
         rf"^attention: max_seqlen must be in \[0, 2\*\*31\), got {re.escape(text)}$", False)
        for case, value, text in [
            ("int64_min", -(2**63), str(-(2**63))),
            ("past_int64", 2**70, f"an int beyond {2**63 - 1}"),
            ("below_int64", -(2**70), f"an int beyond {-(2**63)}"),
        ]
    ],
    ("max_seqlen_float", set_args(max_seqlen=7.5), TypeError, "max_seqlen", False),
    ("q_list", set_args(q=lambda a: a["q"].tolist()), TypeError, r"\bq\b", False),
    ("q_int", set_args(q=3), TypeError, r"\bq\b", False),
    ("cu_seqlens_list", set_args(cu_seqlens=[0, 5, 5, 12]), TypeError, "cu_seqlens", False),
    ("out_str", set_args(out="out"), TypeError, r"\bout\b", False),
    *self_overlap_errors("attention", "out"),
    *self_overlap_errors("attention", "cls_attn"),
]


@pytest.mark.parametrize("device", devices())
def test_attention_error_base_args_are_valid(device, seed):
    a = _attention_base(device)
    assert _call_attention(a) is a["out"]
    check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(ATTENTION_ERRORS))
def test_attention_rejects(device, mutate, exc, pattern):
    assert_rejected(_call_attention, _attention_base(device), mutate, exc, pattern)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("given_out", [True, False], ids=["out", "allocated"])
def test_attention_rejects_more_sequences_than_int32(device, given_out, gen):
    """The kernels count sequences in int32: 2^31 of them are refused before anything
    runs. cu_seqlens is a stride-0 view, so its 2^31 + 1 entries take no memory."""
    q, k, v = make_qkv(gen, 4, 2, 32, torch.float32, device)
    cu_seqlens = torch.zeros(1, dtype=torch.int32, device=device).expand(2**31 + 1)
    out = poison(q.shape, q.dtype, device)
    pattern = (r"^attention: cu_seqlens must hold at most 2\^31-1 sequences \(2\^31 entries\), "
               r"got 2147483649 entries$")
    with pytest.raises(ValueError, match=pattern):
        ragvit.attention(q, k, v, cu_seqlens, out=out if given_out else None)
    assert torch.isnan(out).all()


DEVICE_MISMATCH = ["k", "cu_seqlens", "out", "cls_attn"]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", DEVICE_MISMATCH)
def test_attention_rejects_device_mismatch(name):
    on_cpu = set_args(**{name: lambda a: a[name].cpu()})
    assert_rejected(_call_attention, _attention_base("cuda"), on_cpu, ValueError, "device")


def test_attention_rejects_read_only_numpy_outputs():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (t.numpy() for t in make_qkv(gen, 12, 2, 32))
    cu_seqlens = make_cu_seqlens([5, 7]).numpy()

    def read_only(shape):
        a = np.full(shape, np.nan, dtype=np.float32)
        a.flags.writeable = False
        return a

    out = read_only((12, 2, 32))
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.attention(q, k, v, cu_seqlens, out=out)
    assert np.isnan(out).all()
    cls_attn = read_only((12,))
    with pytest.raises(ValueError, match=r"read-only|read only"):
        ragvit.attention(
            q, k, v, cu_seqlens, out=np.full((12, 2, 32), np.nan, np.float32), cls_attn=cls_attn
        )
    assert np.isnan(cls_attn).all()


def _bias_aliasing(name):
    def mutate(a):
        if name == "out":
            a["bias"] = a["out"].view(-1)[: a["q"].shape[0]]
        else:
            a["bias"] = a["cls_attn"]

    return mutate


def _nonfinite(value, token):
    def mutate(a):
        a["bias"] = a["bias"].clone()
        a["bias"][token] = value

    return mutate


# (id, mutation, exception, message regex, cpu_only)
BIAS_ERRORS = [
    ("float64", set_args(bias=lambda a: a["bias"].double()), TypeError, "bias", False),
    ("float16", set_args(bias=lambda a: a["bias"].half()), TypeError, "bias", False),
    ("int32", set_args(bias=lambda a: a["bias"].to(torch.int32)), TypeError, "bias", False),
    ("list", set_args(bias=lambda a: a["bias"].tolist()), TypeError, "bias", False),
    ("too_short", set_args(bias=lambda a: a["bias"][:-1]), ValueError, "bias", False),
    (
        "too_long",
        set_args(bias=lambda a: torch.zeros(13, device=_q_device(a))),
        ValueError,
        "bias",
        False,
    ),
    ("2d", set_args(bias=lambda a: a["bias"].reshape(12, 1)), ValueError, "bias", False),
    (
        "per_head",
        set_args(bias=lambda a: torch.zeros((12, 2), device=_q_device(a))),
        ValueError,
        "bias",
        False,
    ),
    ("alias_out", _bias_aliasing("out"), ValueError, r"\bout\b.*bias|bias.*\bout\b", False),
    ("alias_cls_attn", _bias_aliasing("cls_attn"), ValueError, "cls_attn", False),
    ("nan", _nonfinite(math.nan, 3), ValueError, "bias", True),
    ("inf", _nonfinite(math.inf, 0), ValueError, "bias", True),
    ("neg_inf", _nonfinite(-math.inf, 11), ValueError, "bias", True),
]


@pytest.mark.parametrize("device", devices())
def test_attention_bias_error_base_is_valid(device, seed):
    a = _bias_base(device)
    assert _call_attention(a) is a["out"]
    check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], bias=a["bias"], seed=seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(BIAS_ERRORS))
def test_attention_bias_rejects(device, mutate, exc, pattern):
    assert_rejected(_call_attention, _bias_base(device), mutate, exc, pattern)


def test_attention_bias_nonfinite_message_names_token():
    a = _bias_base("cpu")
    a["bias"][6] = math.nan
    with pytest.raises(ValueError, match=r"attention: bias must be finite.*token 6"):
        _call_attention(a)


def test_attention_bias_is_keyword_only():
    a = _bias_base("cpu")
    with pytest.raises(TypeError):
        ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], None, a["bias"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("on", ["cpu_bias", "cuda_bias"])
def test_attention_bias_rejects_device_mismatch(on):
    a = _bias_base("cuda" if on == "cpu_bias" else "cpu")
    a["bias"] = a["bias"].cpu() if on == "cpu_bias" else a["bias"].cuda()
    with pytest.raises(ValueError, match="device"):
        _call_attention(a)


# ---- CUDA: graphs, streams, garbage contents ----


@pytest.mark.gpu
@requires_cuda
def test_attention_cuda_graph_replay_matches_eager(gen, seed):
    note = seed_note(seed)
    ragvit.set_debug(False)  # debug mode synchronizes, which capture forbids
    device, dtype, num_heads, head_dim, n_calls = "cuda", torch.float16, 6, 64, 10
    lengths = random_lengths(gen, 16, 1, 300, include=(1, 197))
    total = sum(lengths) + 3
    max_seqlen = max(lengths)
    cu_seqlens = make_cu_seqlens(lengths, device)
    q0 = torch.empty((total, num_heads, head_dim), dtype=dtype, device=device)
    ks = [torch.empty_like(q0) for _ in range(n_calls)]
    vs = [torch.empty_like(q0) for _ in range(n_calls)]
    cls_attn = poison((total,), torch.float32, device)

    def refill_inputs():
        for t in [q0] + ks + vs:
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))

    def run(outs, cls):
        q = q0
        for i in range(n_calls):
            ragvit.attention(
                q,
                ks[i],
                vs[i],
                cu_seqlens,
                max_seqlen if i % 2 else None,
                out=outs[i],
                cls_attn=cls if i == n_calls - 1 else None,
            )
            q = outs[i]  # chained: call i+1 reads what call i wrote

    refill_inputs()
    graph_outs = [poison(q0.shape, dtype, device) for _ in range(n_calls)]
    graph = capture_graph(lambda: run(graph_outs, cls_attn))

    refill_inputs()
    for t in graph_outs + [cls_attn]:
        t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    eager_outs = [poison(q0.shape, dtype, device) for _ in range(n_calls)]
    eager_cls = poison((total,), torch.float32, device)
    run(eager_outs, eager_cls)
    torch.cuda.synchronize()
    for i in range(n_calls):
        assert same_bits(graph_outs[i], eager_outs[i]), f"replayed call {i} differs{note}"
    assert same_bits(cls_attn, eager_cls), "replayed cls_attn differs" + note
    check_attention(graph_outs[0], q0, ks[0], vs[0], cu_seqlens, seed=seed)
    check_cls_attn(cls_attn, graph_outs[n_calls - 2], ks[-1], cu_seqlens, seed=seed)


@pytest.mark.gpu
@requires_cuda
def test_attention_runs_on_the_current_stream(gen, seed):
    lengths = [197, 1, 64]
    total = sum(lengths)
    q_src, k, v = make_qkv(gen, total, 6, 64, torch.float16, "cuda")
    cu_seqlens = make_cu_seqlens(lengths, "cuda")
    q = torch.zeros_like(q_src)  # what a launch on the wrong stream would read
    out = poison(q.shape, q.dtype, "cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    sleep_then(stream, lambda: q.copy_(q_src))
    with torch.cuda.stream(stream):
        ragvit.attention(q, k, v, cu_seqlens, out=out)
    stream.synchronize()
    torch.cuda.synchronize()
    check_attention(out, q_src, k, v, cu_seqlens, seed=seed)


class _StreamObject:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("form", ["int_handle", "cuda_stream_protocol"])
def test_attention_explicit_stream_wins(form, gen, seed):
    lengths = [5, 130]
    total = sum(lengths)
    q_src, k, v = make_qkv(gen, total, 6, 64, torch.float16, "cuda")
    cu_seqlens = make_cu_seqlens(lengths, "cuda")
    q = torch.zeros_like(q_src)
    out = poison(q.shape, q.dtype, "cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    sleep_then(stream, lambda: q.copy_(q_src))
    arg = handle if form == "int_handle" else _StreamObject(handle)
    ragvit.attention(q, k, v, cu_seqlens, out=out, stream=arg)  # called from the default stream
    stream.synchronize()
    torch.cuda.synchronize()
    check_attention(out, q_src, k, v, cu_seqlens, seed=seed)


GARBAGE_CU_SEQLENS = {
    # total_tokens is 64 in every case
    "decreasing": ([0, 50, 20, 64], None),
    "past_T": ([0, 10, 64 + 1000], None),
    "far_past_T": ([0, 2**31 - 1], None),
    "negative": ([-100, 10, 64], None),
    "decreasing_to_negative": ([0, 30, -5, 64], None),
    "over_max_seqlen": ([0, 40, 64], 16),
}


@flagged_contents_test
@pytest.mark.parametrize("case", list(GARBAGE_CU_SEQLENS))
def test_attention_garbage_cu_seqlens_never_crashes(case, debug, gen, seed):
    values, max_seqlen = GARBAGE_CU_SEQLENS[case]
    total = 64
    q, k, v = make_qkv(gen, total, 6, 64, torch.float16, "cuda")
    cu_seqlens = torch.tensor(values, dtype=torch.int32, device="cuda")
    out = poison(q.shape, q.dtype, "cuda")
    cls_attn = poison((total,), torch.float32, "cuda")
    call_with_debug(
        lambda: ragvit.attention(q, k, v, cu_seqlens, max_seqlen, out=out, cls_attn=cls_attn),
        debug,
        r"cu_seqlens|max_seqlen",
    )
    # The device is healthy and the flag was cleared: a clean call right after succeeds,
    # checked in debug mode.
    ragvit.set_debug(True)
    good = make_cu_seqlens([20, 44], "cuda")
    out = poison(q.shape, q.dtype, "cuda")
    ragvit.attention(q, k, v, good, out=out)
    torch.cuda.synchronize()
    check_attention(out, q, k, v, good, seed=seed)
