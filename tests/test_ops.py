"""ragvit's ops against the float64 reference, on ragged shapes and every dtype.

attention: dtypes {fp32, fp16, bf16} x head_dim {32, 64, 80, 128} (+96 on CUDA)
x named length sets (seqlen 1, 197, 577, ragged mixes, S=256, zero-length
sequences, cu_seqlens[S] < T) x q/k/v layouts (separate tensors, views of one
(T, 3, H, D) buffer). Outputs are NaN-poisoned before each call; a check passes
when covered rows are finite and within the dtype table, err <= 2*err(SDPA on
the padded batch) + floor, and every other row still holds its poison. Rows of
q/k/v that belong to no sequence are NaN as well, so a stray read shows.
pack / pack_into / unpack move data only: integer-valued inputs, torch.equal.
Then every user-reachable error (type and message), CUDA graphs and streams,
and garbage device-side cu_seqlens (must never crash; debug mode raises).
CPU cases are sized for two slow cores; the large shapes run on CUDA only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    CLS_ATTN_ATOL,
    DTYPE_IDS,
    DTYPES,
    ERROR_FLOOR,
    INT32_POISON,
    TOL,
    bits,
    covered_rows,
    devices,
    dtype_params,
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
from conftest import set_args as _set  # error-table mutations

import ragvit
from ragvit.reference import (
    attention_reference,
    cls_attn_reference,
    pack_reference,
    padded_sdpa,
    unpack_reference,
)

NUM_HEADS = {"cpu": 2, "cuda": 6}
HEAD_DIMS = {"cpu": (32, 64, 80, 128), "cuda": (32, 64, 80, 96, 128)}
LAYOUTS = ("contiguous", "qkv_view")


# ---- named length sets: (gen, on_cuda) -> (lengths, total_tokens) ----


def _ragged_mix(gen, on_cuda):
    if on_cuda:
        lengths = random_lengths(gen, 32, 1, 577, include=(1, 197, 198, 577))
    else:
        lengths = random_lengths(gen, 6, 2, 96, include=(1, 197, 577))
    return lengths, sum(lengths)


def _many_seqs_256(gen, on_cuda):
    if on_cuda:
        lengths = random_lengths(gen, 256, 1, 300, include=(1, 197, 577))
    else:
        lengths = random_lengths(gen, 256, 0, 12, include=(1, 0))
    return lengths, sum(lengths)


def _capacity_tail(gen, on_cuda):
    # cu_seqlens[S] < T: the rows past the last sequence are capacity, never written.
    lengths = [13, 64, 1] if not on_cuda else [13, 197, 1, 64]
    return lengths, sum(lengths) + 17


def _tile_edges(gen, on_cuda):
    return [63, 64, 65, 127, 128, 129, 198], 774


def _long_among_short(gen, on_cuda):
    lengths = [3, 1, 2, 257, 5, 1, 4] if not on_cuda else [3, 1, 2, 577, 5, 1, 4, 2, 7, 1]
    return lengths, sum(lengths)


LENGTH_CASES = {
    "one_token": lengths_one_token,
    "deit_197": lengths_deit_197,
    "deit_577": lengths_deit_577,
    "ragged_mix": _ragged_mix,
    "many_seqs_256": _many_seqs_256,
    "zero_length": lengths_zero_length,
    "capacity_tail": _capacity_tail,
    "tile_edges": _tile_edges,
    "long_among_short": _long_among_short,
}
SANITIZER_CASES = ("one_token", "zero_length", "capacity_tail")


def _attention_params():
    params = []
    for device in ("cpu", "cuda"):
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS[device]:
                for case in LENGTH_CASES:
                    for layout in LAYOUTS:
                        marks = []
                        if device == "cuda":
                            marks += gpu_marks()
                            if (
                                case in SANITIZER_CASES
                                and layout == "qkv_view"
                                and head_dim in (64, 128)
                            ):
                                marks.append(pytest.mark.sanitizer)
                        name = f"{device}-{DTYPE_IDS[dtype]}-D{head_dim}-{case}-{layout}"
                        params.append(
                            pytest.param(
                                device, dtype, head_dim, case, layout, marks=marks, id=name
                            )
                        )
    return params


# ---- helpers ----


def _poison_uncovered_rows(cu_seqlens, *tensors):
    """NaN into every row of q/k/v that belongs to no sequence (stray reads show)."""
    total = tensors[0].shape[0]
    uncovered = ~covered_rows(cu_seqlens, total)
    if uncovered.any():
        for t in tensors:
            t[uncovered.to(t.device)] = math.nan


def _check_attention(out, q, k, v, cu_seqlens, *, seed, scale=None, poisoned=True, tol_scale=1.0):
    """Asserts out is attention(q, k, v) on covered rows and poison elsewhere.

    tol_scale multiplies the assert_close tolerances (for logits far from unit
    size, where fp32 rounding of the scores alone exceeds the fp32 table); the
    flash-attention rule against SDPA is never loosened.

    Returns:
        The number of rows compared (always > 0).
    """
    note = seed_note(seed)
    out = torch.as_tensor(out)
    q, k, v = (torch.as_tensor(t) for t in (q, k, v))
    total = q.shape[0]
    covered = covered_rows(cu_seqlens, total)
    compared = int(covered.sum())
    assert compared > 0, "test bug: no covered rows to compare"
    expected = attention_reference(q, k, v, cu_seqlens, scale)[covered]
    got_all = out.detach().to("cpu", torch.float64)
    got = got_all[covered]
    assert torch.isfinite(got).all(), "non-finite values in rows of a sequence" + note
    if poisoned:
        assert torch.isnan(got_all[~covered]).all(), (
            "rows outside every sequence were written" + note
        )
    tol = {name: value * tol_scale for name, value in TOL[q.dtype].items()}
    torch.testing.assert_close(got, expected, **tol, msg=lambda m: m + note)
    baseline = padded_sdpa(q, k, v, cu_seqlens, scale=scale).to("cpu", torch.float64)[covered]
    err = (got - expected).abs().max().item()
    err_sdpa = (baseline - expected).abs().max().item()
    assert math.isfinite(err_sdpa), "test bug: SDPA baseline is not finite"
    bound = 2 * err_sdpa + ERROR_FLOOR[q.dtype]
    assert err <= bound, f"err {err:.3g} > 2*err(SDPA) {err_sdpa:.3g} + floor" + note
    return compared


def _check_cls_attn(cls_attn, q, k, cu_seqlens, *, seed, scale=None):
    note = seed_note(seed)
    total = q.shape[0]
    covered = covered_rows(cu_seqlens, total)
    assert covered.any(), "test bug: no covered rows to compare"
    got_all = torch.as_tensor(cls_attn).detach().to("cpu", torch.float64)
    expected = cls_attn_reference(q, k, cu_seqlens, scale)
    assert torch.isfinite(got_all[covered]).all(), "non-finite cls_attn in a sequence" + note
    assert torch.isnan(got_all[~covered]).all(), "cls_attn written outside sequences" + note
    torch.testing.assert_close(
        got_all[covered], expected[covered], atol=CLS_ATTN_ATOL, rtol=0, msg=lambda m: m + note
    )


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


# ---- attention vs the reference ----


@pytest.mark.parametrize("device, dtype, head_dim, case, layout", _attention_params())
def test_attention_matches_reference(device, dtype, head_dim, case, layout, gen, seed):
    lengths, total = LENGTH_CASES[case](gen, device == "cuda")
    num_heads = NUM_HEADS[device]
    q, k, v = make_qkv(gen, total, num_heads, head_dim, dtype, device, layout=layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    _poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison((total, num_heads, head_dim), dtype, device)
    result = ragvit.attention(q, k, v, cu_seqlens, out=out)
    assert result is out
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)


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
    _check_attention(out, q, k, v, cu_seqlens, scale=scale, seed=seed, tol_scale=tol_scale)
    _check_cls_attn(cls_attn, q, k, cu_seqlens, scale=scale, seed=seed)


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
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)


def _check_with_exact_max_seqlen(q, k, v, lengths, seed):
    """attention over sequences of `lengths` (rows past them NaN-poisoned in q/k/v) with
    max_seqlen = max(lengths), into a poisoned out, checked against the reference."""
    cu_seqlens = make_cu_seqlens(lengths, q.device)
    _poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, q.dtype, q.device)
    ragvit.attention(q, k, v, cu_seqlens, max(lengths), out=out)
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)


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
    _poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, q.dtype, device)
    if max_seqlen is None:
        ragvit.attention(q, k, v, cu_seqlens, out=out)
    else:
        ragvit.attention(q, k, v, cu_seqlens, max_seqlen, out=out)
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cls_layout", ["contiguous", "strided"])
def test_cls_attn_matches_reference(device, dtype, layout, cls_layout, gen, seed):
    lengths = [0, 1, 17, 0, 97 if device == "cpu" else 197, 64]
    total = sum(lengths) + 5
    q, k, v = make_qkv(gen, total, NUM_HEADS[device], 64, dtype, device, layout=layout)
    cu_seqlens = make_cu_seqlens(lengths, device)
    _poison_uncovered_rows(cu_seqlens, q, k, v)
    out = poison(q.shape, dtype, device)
    if cls_layout == "strided":
        cls_buffer = poison((2 * total,), torch.float32, device)
        cls_attn = cls_buffer[::2]
    else:
        cls_buffer = cls_attn = poison((total,), torch.float32, device)
    ragvit.attention(q, k, v, cu_seqlens, out=out, cls_attn=cls_attn)
    _check_cls_attn(cls_attn, q, k, cu_seqlens, seed=seed)
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)
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
    _check_attention(result, q, k, v, cu_seqlens, seed=seed, poisoned=False)
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
    _poison_uncovered_rows(cu_seqlens, q, k, v)
    buffer = poison((total, 3, num_heads, 64), torch.float16, device)
    out = buffer[:, 1]
    assert ragvit.attention(q, k, v, cu_seqlens, out=out) is out
    _check_attention(out, q, k, v, cu_seqlens, seed=seed)
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
    if with_out:
        assert result is kwargs["out"]
        tq, tk = torch.from_numpy(q), torch.from_numpy(k)
        _check_cls_attn(kwargs["cls_attn"], tq, tk, cu_seqlens, seed=seed)
    _check_attention(
        torch.from_numpy(result),
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(v),
        cu_seqlens,
        seed=seed,
        poisoned=with_out,
    )


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
    }


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


# (id, mutation, exception, message regex, cpu_only)
ATTENTION_ERRORS = [
    ("q_int32", _set(q=lambda a: a["q"].to(torch.int32)), TypeError, r"\bq\b", False),
    ("q_float64", _set(q=lambda a: a["q"].double()), TypeError, r"\bq\b", False),
    ("k_dtype_differs", _set(k=lambda a: a["k"].half()), TypeError, r"\bk\b", False),
    ("v_dtype_differs", _set(v=lambda a: a["v"].bfloat16()), TypeError, r"\bv\b", False),
    ("out_dtype_differs", _set(out=lambda a: a["out"].half()), TypeError, r"\bout\b", False),
    (
        "cu_seqlens_int64",
        _set(cu_seqlens=lambda a: a["cu_seqlens"].long()),
        TypeError,
        "cu_seqlens",
        False,
    ),
    (
        "cu_seqlens_float",
        _set(cu_seqlens=lambda a: a["cu_seqlens"].float()),
        TypeError,
        "cu_seqlens",
        False,
    ),
    ("q_2d", _set(q=lambda a: a["q"].reshape(12, -1)), ValueError, r"\bq\b", False),
    ("k_4d", _set(k=lambda a: a["k"][None]), ValueError, r"\bk\b", False),
    (
        "cu_seqlens_2d",
        _set(cu_seqlens=lambda a: a["cu_seqlens"][None]),
        ValueError,
        "cu_seqlens",
        False,
    ),
    (
        "cu_seqlens_empty",
        _set(cu_seqlens=lambda a: a["cu_seqlens"][:0]),
        ValueError,
        "cu_seqlens",
        False,
    ),
    ("out_2d", _set(out=lambda a: a["out"].reshape(12, -1)), ValueError, r"\bout\b", False),
    (
        "k_tokens_differ",
        _set(k=lambda a: torch.randn((13, 2, 32), device=a["q"].device)),
        ValueError,
        r"\bk\b",
        False,
    ),
    (
        "v_heads_differ",
        _set(v=lambda a: torch.randn((12, 3, 32), device=a["q"].device)),
        ValueError,
        r"\bv\b",
        False,
    ),
    (
        "k_head_dim_differs",
        _set(k=lambda a: torch.randn((12, 2, 64), device=a["q"].device)),
        ValueError,
        r"\bk\b",
        False,
    ),
    (
        "out_tokens_differ",
        _set(out=lambda a: poison((11, 2, 32), device=a["q"].device)),
        ValueError,
        r"\bout\b",
        False,
    ),
    ("head_dim_48", _with_head_dim(48), ValueError, "head_dim", False),
    ("head_dim_16", _with_head_dim(16), ValueError, "head_dim", False),
    ("head_dim_256", _with_head_dim(256), ValueError, "head_dim", False),
    (
        "q_last_dim_strided",
        _set(q=lambda a: _transposed((12, 2, 32), a["q"].device)),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "v_last_dim_strided",
        _set(v=lambda a: _transposed((12, 2, 32), a["q"].device)),
        ValueError,
        "contiguous",
        False,
    ),
    (
        "out_last_dim_strided",
        _set(out=lambda a: _transposed((12, 2, 32), a["q"].device, fill=math.nan)),
        ValueError,
        "contiguous",
        False,
    ),
    ("cls_attn_fp16", _set(cls_attn=lambda a: a["cls_attn"].half()), TypeError, "cls_attn", False),
    (
        "cls_attn_too_long",
        _set(cls_attn=lambda a: poison((13,), device=a["q"].device)),
        ValueError,
        "cls_attn",
        False,
    ),
    (
        "cls_attn_2d",
        _set(cls_attn=lambda a: poison((12, 1), device=a["q"].device)),
        ValueError,
        "cls_attn",
        False,
    ),
    ("out_is_q", _set(out=lambda a: a["q"]), ValueError, "alias", False),
    ("out_is_v", _set(out=lambda a: a["v"]), ValueError, "alias", False),
    ("out_overlaps_k", _overlapping_out, ValueError, "alias", False),
    (
        "cls_attn_inside_out",
        _set(cls_attn=lambda a: a["out"].view(-1)[:12]),
        ValueError,
        "alias",
        False,
    ),
    (
        "cu_seqlens_decreasing",
        _set(cu_seqlens=lambda a: torch.tensor([0, 7, 5, 12], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    (
        "cu_seqlens_past_T",
        _set(cu_seqlens=lambda a: torch.tensor([0, 5, 13], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    (
        "cu_seqlens_negative_first",
        _set(cu_seqlens=lambda a: torch.tensor([-1, 5, 12], dtype=torch.int32)),
        ValueError,
        "cu_seqlens",
        True,
    ),
    ("length_over_max_seqlen", _set(max_seqlen=6), ValueError, r"cu_seqlens|max_seqlen", True),
    ("scale_zero", _set(scale=0.0), ValueError, "scale", False),
    ("scale_negative", _set(scale=-0.125), ValueError, "scale", False),
    ("scale_nan", _set(scale=math.nan), ValueError, "scale", False),
    ("scale_inf", _set(scale=math.inf), ValueError, "scale", False),
    ("scale_str", _set(scale="0.1"), TypeError, "scale", False),
    ("max_seqlen_negative", _set(max_seqlen=-1), ValueError, "max_seqlen", False),
    ("max_seqlen_float", _set(max_seqlen=7.5), TypeError, "max_seqlen", False),
    ("q_list", _set(q=lambda a: a["q"].tolist()), TypeError, r"\bq\b", False),
    ("q_int", _set(q=3), TypeError, r"\bq\b", False),
    ("cu_seqlens_list", _set(cu_seqlens=[0, 5, 5, 12]), TypeError, "cu_seqlens", False),
    ("out_str", _set(out="out"), TypeError, r"\bout\b", False),
]


@pytest.mark.parametrize("device", devices())
def test_attention_error_base_args_are_valid(device, seed):
    a = _attention_base(device)
    assert _call_attention(a) is a["out"]
    _check_attention(a["out"], a["q"], a["k"], a["v"], a["cu_seqlens"], seed=seed)


@pytest.mark.parametrize("device, mutate, exc, pattern", error_params(ATTENTION_ERRORS))
def test_attention_rejects(device, mutate, exc, pattern):
    a = _attention_base(device)
    mutate(a)
    before = _snapshot(a)
    with pytest.raises(exc, match=pattern):
        _call_attention(a)
    _assert_untouched(a, before)


DEVICE_MISMATCH = [
    ("k", lambda a: a["k"].cpu()),
    ("cu_seqlens", lambda a: a["cu_seqlens"].cpu()),
    ("out", lambda a: a["out"].cpu()),
    ("cls_attn", lambda a: a["cls_attn"].cpu()),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name, move", DEVICE_MISMATCH, ids=[n for n, _ in DEVICE_MISMATCH])
def test_attention_rejects_device_mismatch(name, move):
    a = _attention_base("cuda")
    a[name] = move(a)
    before = _snapshot(a)
    with pytest.raises(ValueError, match="device"):
        _call_attention(a)
    _assert_untouched(a, before)


def test_rejects_read_only_numpy_outputs():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (t.numpy() for t in make_qkv(gen, 12, 2, 32))
    cu_seqlens = make_cu_seqlens([5, 7]).numpy()

    def read_only(shape, dtype=np.float32):
        a = np.full(shape, np.nan if dtype == np.float32 else -7, dtype=dtype)
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

    out = read_only((2, 5, 6))
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(graph_outs, cls_attn)  # warm-up: per-device setup happens outside capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graph_outs, cls_attn)

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
    _check_attention(graph_outs[0], q0, ks[0], vs[0], cu_seqlens, seed=seed)
    _check_cls_attn(cls_attn, graph_outs[n_calls - 2], ks[-1], cu_seqlens, seed=seed)


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
    _sleep_then(stream, lambda: q.copy_(q_src))
    with torch.cuda.stream(stream):
        ragvit.attention(q, k, v, cu_seqlens, out=out)
    stream.synchronize()
    torch.cuda.synchronize()
    _check_attention(out, q_src, k, v, cu_seqlens, seed=seed)


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
    _sleep_then(stream, lambda: q.copy_(q_src))
    arg = handle if form == "int_handle" else _StreamObject(handle)
    ragvit.attention(q, k, v, cu_seqlens, out=out, stream=arg)  # called from the default stream
    stream.synchronize()
    torch.cuda.synchronize()
    _check_attention(out, q_src, k, v, cu_seqlens, seed=seed)


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


GARBAGE_CU_SEQLENS = {
    # total_tokens is 64 in every case
    "decreasing": ([0, 50, 20, 64], None),
    "past_T": ([0, 10, 64 + 1000], None),
    "far_past_T": ([0, 2**31 - 1], None),
    "negative": ([-100, 10, 64], None),
    "decreasing_to_negative": ([0, 30, -5, 64], None),
    "over_max_seqlen": ([0, 40, 64], 16),
}


@pytest.mark.gpu
@pytest.mark.sanitizer
@requires_cuda
@pytest.mark.parametrize("debug", [True, False], ids=["debug", "no_debug"])
@pytest.mark.parametrize("case", list(GARBAGE_CU_SEQLENS))
def test_attention_garbage_cu_seqlens_never_crashes(case, debug, gen, seed):
    values, max_seqlen = GARBAGE_CU_SEQLENS[case]
    total = 64
    q, k, v = make_qkv(gen, total, 6, 64, torch.float16, "cuda")
    cu_seqlens = torch.tensor(values, dtype=torch.int32, device="cuda")
    out = poison(q.shape, q.dtype, "cuda")
    cls_attn = poison((total,), torch.float32, "cuda")
    ragvit.set_debug(debug)
    if debug:
        with pytest.raises(ValueError, match=r"cu_seqlens|max_seqlen"):
            ragvit.attention(q, k, v, cu_seqlens, max_seqlen, out=out, cls_attn=cls_attn)
    else:
        ragvit.attention(q, k, v, cu_seqlens, max_seqlen, out=out, cls_attn=cls_attn)
        torch.cuda.synchronize()
        _drain_device_error_flag()
    torch.cuda.synchronize()
    # The device is healthy and the flag was cleared (by the raising call in debug
    # mode): a clean call right after succeeds, checked in debug mode.
    ragvit.set_debug(True)
    good = make_cu_seqlens([20, 44], "cuda")
    out = poison(q.shape, q.dtype, "cuda")
    ragvit.attention(q, k, v, good, out=out)
    torch.cuda.synchronize()
    _check_attention(out, q, k, v, good, seed=seed)


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


def test_reference_helpers_are_self_consistent(gen):
    """Guards the tests' own machinery: reference vs a dense masked computation."""
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
