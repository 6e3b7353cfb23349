"""attention(..., bias=) — the per-key additive logit bias (ToMe proportional attention).

logits[i, j] = scale * q_i . k_j + bias[j] for keys j of i's sequence, one float32 value per
packed token shared by all heads and queries (typically log(size_j)). Checked against the
float64 reference (attention_reference / cls_attn_reference with bias=) with the same rules as
tests/test_ops.py: NaN-poisoned outputs, NaN in every q/k/v/bias row outside a sequence (the
CPU checks bias only on the tokens of sequences, so the poison is legal there too), the dtype
table, and err <= 2 * err(SDPA with the bias as a float mask) + floor. cls_attn must include
the bias. On the CPU a zero bias equals no bias bit for bit. Then every bias error.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    CLS_ATTN_ATOL,
    DTYPE_IDS,
    DTYPES,
    ERROR_FLOOR,
    TOL,
    covered_rows,
    devices,
    error_params,
    gpu_marks,
    lengths_deit_197,
    lengths_deit_577,
    lengths_one_token,
    lengths_zero_length,
    make_cu_seqlens,
    make_qkv,
    poison,
    random_lengths,
    requires_cuda,
    same_bits,
    seed_note,
)

import ragvit
from ragvit.reference import attention_reference, cls_attn_reference, padded_sdpa

NUM_HEADS = {"cpu": 2, "cuda": 6}
HEAD_DIMS = (64, 80)


def _ragged_mix(gen, on_cuda):
    if on_cuda:
        lengths = random_lengths(gen, 32, 1, 577, include=(1, 197, 198, 577))
    else:
        lengths = random_lengths(gen, 5, 2, 96, include=(1, 197, 65))
    return lengths, sum(lengths)


def _capacity_tail(gen, on_cuda):
    # rows before the first and after the last sequence: never read, never written
    lengths = [0, 13, 64, 1] if not on_cuda else [0, 13, 197, 1, 64]
    return lengths, sum(lengths) + 17


LENGTH_CASES = {
    "one_token": lengths_one_token,
    "deit_197": lengths_deit_197,
    "deit_577": lengths_deit_577,
    "ragged_mix": _ragged_mix,
    "zero_length": lengths_zero_length,
    "capacity_tail": _capacity_tail,
}
# (q/k/v layout, bias layout): the qkv_view run also reads a strided bias
LAYOUTS = (("contiguous", "contiguous"), ("qkv_view", "strided"))
SANITIZER = {("one_token", 64), ("capacity_tail", 64), ("zero_length", 80)}


def _params():
    params = []
    for device in ("cpu", "cuda"):
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                for case in LENGTH_CASES:
                    for layout, bias_layout in LAYOUTS:
                        for with_cls in (False, True):
                            marks = []
                            if device == "cuda":
                                marks += gpu_marks()
                                if (
                                    (case, head_dim) in SANITIZER
                                    and dtype == torch.float16
                                    and layout == "qkv_view"
                                    and with_cls
                                ):
                                    marks.append(pytest.mark.sanitizer)
                            name = (
                                f"{device}-{DTYPE_IDS[dtype]}-D{head_dim}-{case}-{layout}"
                                f"-bias_{bias_layout}-{'cls' if with_cls else 'nocls'}"
                            )
                            params.append(
                                pytest.param(
                                    device,
                                    dtype,
                                    head_dim,
                                    case,
                                    layout,
                                    bias_layout,
                                    with_cls,
                                    marks=marks,
                                    id=name,
                                )
                            )
    return params


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


def _poison_uncovered(cu_seqlens, *tensors):
    """NaN into every row that belongs to no sequence (a stray read shows)."""
    uncovered = ~covered_rows(cu_seqlens, tensors[0].shape[0])
    if uncovered.any():
        for t in tensors:
            t[uncovered.to(t.device)] = math.nan


def _check_attention_bias(out, q, k, v, cu_seqlens, bias, *, seed, scale=None):
    """out vs the float64 reference with bias on covered rows; poison elsewhere."""
    note = seed_note(seed)
    covered = covered_rows(cu_seqlens, q.shape[0])
    assert covered.any(), "test bug: no covered rows to compare"
    expected = attention_reference(q, k, v, cu_seqlens, scale, bias=bias)[covered]
    got_all = out.detach().to("cpu", torch.float64)
    got = got_all[covered]
    assert torch.isfinite(got).all(), "non-finite values in rows of a sequence" + note
    assert torch.isnan(got_all[~covered]).all(), "rows outside every sequence were written" + note
    torch.testing.assert_close(got, expected, **TOL[q.dtype], msg=lambda m: m + note)
    baseline = padded_sdpa(q, k, v, cu_seqlens, scale=scale, bias=bias)
    baseline = baseline.to("cpu", torch.float64)[covered]
    err = (got - expected).abs().max().item()
    err_sdpa = (baseline - expected).abs().max().item()
    assert math.isfinite(err_sdpa), "test bug: SDPA baseline is not finite"
    bound = 2 * err_sdpa + ERROR_FLOOR[q.dtype]
    assert err <= bound, f"err {err:.3g} > 2*err(SDPA) {err_sdpa:.3g} + floor" + note


def _check_cls_attn_bias(cls_attn, q, k, cu_seqlens, bias, *, seed, scale=None):
    note = seed_note(seed)
    covered = covered_rows(cu_seqlens, q.shape[0])
    got_all = cls_attn.detach().to("cpu", torch.float64)
    expected = cls_attn_reference(q, k, cu_seqlens, scale, bias=bias)
    assert torch.isfinite(got_all[covered]).all(), "non-finite cls_attn in a sequence" + note
    assert torch.isnan(got_all[~covered]).all(), "cls_attn written outside sequences" + note
    torch.testing.assert_close(
        got_all[covered], expected[covered], atol=CLS_ATTN_ATOL, rtol=0, msg=lambda m: m + note
    )


# ---- vs the reference ----


@pytest.mark.parametrize("device, dtype, head_dim, case, layout, bias_layout, with_cls", _params())
def test_attention_bias_matches_reference(
    device, dtype, head_dim, case, layout, bias_layout, with_cls, gen, seed
):
    lengths, total = LENGTH_CASES[case](gen, device == "cuda")
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], head_dim, dtype, device, layout=layout)
    bias, bias_buffer = _make_bias(gen, total, device, bias_layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    _poison_uncovered(cu_seqlens, q, k, v, bias)
    bias_before = bias_buffer.clone()
    out = poison(q.shape, dtype, device)
    cls_attn = poison((total,), torch.float32, device) if with_cls else None
    result = ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn, bias=bias)
    assert result is out
    _check_attention_bias(out, q, k, v, cu_seqlens, bias, seed=seed)
    if with_cls:
        _check_cls_attn_bias(cls_attn, q, k, cu_seqlens, bias, seed=seed)
    assert same_bits(bias_buffer, bias_before), "attention wrote into bias" + seed_note(seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
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
    _check_attention_bias(out, q, k, v, cu_seqlens, bias, seed=seed, scale=0.05)
    _check_cls_attn_bias(cls_attn, q, k, cu_seqlens, bias, seed=seed, scale=0.05)


@pytest.mark.parametrize("dtype", [pytest.param(d, id=DTYPE_IDS[d]) for d in DTYPES])
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


# ---- errors ----


def _base(device):
    gen = torch.Generator().manual_seed(4321)
    lengths, total, num_heads, head_dim = [5, 0, 7], 12, 2, 32
    q, k, v = make_qkv(gen, total, num_heads, head_dim, torch.float32, device)
    return {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens": make_cu_seqlens(lengths, device),
        "out": poison((total, num_heads, head_dim), torch.float32, device),
        "cls_attn": poison((total,), torch.float32, device),
        "bias": torch.zeros(total, device=device),
    }


def _call(a):
    return ragvit.attention(
        a["q"],
        a["k"],
        a["v"],
        a["cu_seqlens"],
        out=a["out"],
        cls_attn=a["cls_attn"],
        bias=a["bias"],
    )


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


def _set(name, fn):
    def mutate(a):
        a[name] = fn(a)

    return mutate


# (id, mutation, exception, message regex, cpu_only)
BIAS_ERRORS = [
    ("float64", _set("bias", lambda a: a["bias"].double()), TypeError, "bias", False),
    ("float16", _set("bias", lambda a: a["bias"].half()), TypeError, "bias", False),
    ("int32", _set("bias", lambda a: a["bias"].to(torch.int32)), TypeError, "bias", False),
    ("list", _set("bias", lambda a: a["bias"].tolist()), TypeError, "bias", False),
    ("too_short", _set("bias", lambda a: a["bias"][:-1]), ValueError, "bias", False),
    (
        "too_long",
        _set("bias", lambda a: torch.zeros(13, device=a["q"].device)),
        ValueError,
        "bias",
        False,
    ),
    ("2d", _set("bias", lambda a: a["bias"].reshape(12, 1)), ValueError, "bias", False),
    (
        "per_head",
        _set("bias", lambda a: torch.zeros((12, 2), device=a["q"].device)),
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
def test_attention_bias_error_base_is_valid(device):
    a = _base(device)
    assert _call(a) is a["out"]


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(BIAS_ERRORS))
def test_attention_bias_rejects(device, mutate, exc, pattern):
    a = _base(device)
    mutate(a)
    before = {n: t.detach().clone() for n, t in a.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(exc, match=pattern):
        _call(a)
    for name, value in before.items():
        assert same_bits(a[name], value), f"rejected call modified {name}"


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


def test_attention_bias_nonfinite_message_names_token():
    a = _base("cpu")
    a["bias"][6] = math.nan
    with pytest.raises(ValueError, match=r"attention: bias must be finite.*token 6"):
        _call(a)


def test_attention_bias_is_keyword_only():
    a = _base("cpu")
    with pytest.raises(TypeError):
        ragvit.attention(a["q"], a["k"], a["v"], a["cu_seqlens"], None, a["bias"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("on", ["cpu_bias", "cuda_bias"])
def test_attention_bias_rejects_device_mismatch(on):
    a = _base("cuda" if on == "cpu_bias" else "cpu")
    a["bias"] = a["bias"].cpu() if on == "cpu_bias" else a["bias"].cuda()
    with pytest.raises(ValueError, match="device"):
        _call(a)
