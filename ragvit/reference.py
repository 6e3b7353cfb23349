"""Reference math for ragvit's tests and benchmarks (the spec, not a fast path).

Attention is computed one sequence at a time in float64 on the CPU, with no
padding and no masks, so it is correct by construction; rows that belong to no
sequence come back as NaN so a caller cannot mistake them for results. The
SDPA baseline (`padded_sdpa`) is what users run today: the ragged batch
scattered into a zero-padded rectangle, a key-padding mask, and
`torch.nn.functional.scaled_dot_product_attention` in the tested dtype.
Shapes: S sequences, T packed tokens, H heads, D head_dim, B images, N tokens
per padded image, C channels.

`vit_forward_reference` is the padded-masked ViT pipeline: the same pruning decisions
as `ragvit.patch` (same policy object, or decisions replayed from a patched run) executed
on dense padded (B, L, C) tensors with key-padding masks and SDPA in the model's dtype.
`selection_agreement` sets a pruned forward's own decisions beside an independent selection:
that pipeline deciding on its own activations in fp32.

This module imports torch and is imported lazily by tests and benchmarks only;
`ragvit.ops` never imports it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "attention_reference",
    "cls_attn_reference",
    "pack_reference",
    "padded_sdpa",
    "selection_agreement",
    "unpack_reference",
    "vit_forward_reference",
]


def _as_tensor(x: Any) -> torch.Tensor:
    """Returns x as a torch tensor (NumPy arrays are wrapped without a copy)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x)


def _bounds(cu_seqlens: Any, total_tokens: int) -> list[tuple[int, int]]:
    """Host (start, end) pairs of every sequence, validated against the contract.

    Args:
        cu_seqlens: (S+1,) integer array, exclusive prefix sums of the lengths.
        total_tokens: T, the number of packed rows.

    Returns:
        One (start, end) pair per sequence.

    Raises:
        ValueError: cu_seqlens is not 1-D with S+1 >= 1 entries, starts below 0,
            decreases, or ends past total_tokens.
    """
    cu = _as_tensor(cu_seqlens).detach().to("cpu", torch.int64)
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with S+1 >= 1 entries, got {tuple(cu.shape)}")
    values = cu.tolist()
    if values[0] < 0:
        raise ValueError(f"cu_seqlens[0] must be >= 0, got {values[0]}")
    pairs = list(zip(values[:-1], values[1:], strict=True))
    for s, (start, end) in enumerate(pairs):
        if end < start:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {start} > {end} at {s}")
    if values[-1] > total_tokens:
        raise ValueError(f"cu_seqlens[-1] must be <= T={total_tokens}, got {values[-1]}")
    return pairs


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must all be (T, H, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )


def _bias64(bias: Any, total_tokens: int) -> torch.Tensor | None:
    """bias as a float64 CPU (T,) tensor, or None."""
    if bias is None:
        return None
    b = _as_tensor(bias).detach().to("cpu", torch.float64)
    if b.shape != (total_tokens,):
        raise ValueError(f"bias must be (T,) = ({total_tokens},), got {tuple(b.shape)}")
    return b


def attention_reference(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any,
    scale: float | None = None,
    bias: Any = None,
    *,
    device: Any = "cpu",
) -> torch.Tensor:
    """Per-sequence softmax attention in float64 (on the CPU unless `device` says otherwise).

    Args:
        q, k, v: (T, H, D) arrays of any float dtype and any strides (torch
            tensors on any device, or NumPy arrays); upcast to float64.
        cu_seqlens: (S+1,) integer array, exclusive prefix sums of the lengths;
            cu_seqlens[S] <= T.
        scale: softmax scale; default 1/sqrt(D).
        bias: optional (T,) per-key additive logit bias: logits[i, j] =
            scale * q_i . k_j + bias[j] for keys j of i's sequence.
        device: where the float64 math runs (the same math anywhere; a GPU is faster on
            large batches and leaves the host's CPUs alone, e.g. in a benchmark's check).

    Returns:
        (T, H, D) float64 tensor on `device`; rows covered by no sequence are NaN.
    """
    q, k, v = (_as_tensor(t).detach().to(device, torch.float64) for t in (q, k, v))
    _check_qkv(q, k, v)
    b = _bias64(bias, q.shape[0])
    b = b.to(device) if b is not None else None
    total_tokens, _, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    out = torch.full(q.shape, math.nan, dtype=torch.float64, device=q.device)
    for start, end in _bounds(cu_seqlens, total_tokens):
        if end == start:
            continue
        qs = q[start:end].transpose(0, 1)  # (H, L, D)
        ks = k[start:end].transpose(0, 1)
        vs = v[start:end].transpose(0, 1)
        logits = (qs @ ks.transpose(1, 2)) * scale  # (H, L, L)
        if b is not None:
            logits = logits + b[start:end]
        probs = torch.softmax(logits, dim=-1)
        out[start:end] = (probs @ vs).transpose(0, 1)
    return out


def cls_attn_reference(
    q: Any, k: Any, cu_seqlens: Any, scale: float | None = None, bias: Any = None
) -> torch.Tensor:
    """Head-mean softmax probabilities of each sequence's first query, in float64.

    Args:
        q, k: (T, H, D) arrays of any float dtype and any strides.
        cu_seqlens: (S+1,) integer array, exclusive prefix sums of the lengths.
        scale: softmax scale; default 1/sqrt(D).
        bias: optional (T,) per-key additive logit bias (as attention_reference).

    Returns:
        (T,) float64 CPU tensor: entry cu_seqlens[s] + j holds the mean over heads
        of softmax_j(scale * q[cu_seqlens[s]] . k[cu_seqlens[s] + j]); rows covered
        by no sequence are NaN.
    """
    q, k = (_as_tensor(t).detach().to("cpu", torch.float64) for t in (q, k))
    _check_qkv(q, k, k)
    b = _bias64(bias, q.shape[0])
    total_tokens, _, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    out = torch.full((total_tokens,), math.nan, dtype=torch.float64)
    for start, end in _bounds(cu_seqlens, total_tokens):
        if end == start:
            continue
        first = q[start]  # (H, D)
        keys = k[start:end]  # (L, H, D)
        scores = torch.einsum("hd,lhd->hl", first, keys) * scale
        if b is not None:
            scores = scores + b[start:end]
        out[start:end] = torch.softmax(scores, dim=-1).mean(dim=0)
    return out


def pack_reference(x: Any, keep: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gathers the kept tokens of a padded batch, in order.

    Args:
        x: (B, N, C) tensor of any dtype and strides.
        keep: (B, N) bool or integer mask; nonzero keeps the token.

    Returns:
        packed (T, C) of x's dtype, cu_seqlens (B+1,) int32 and indices (T,)
        int32 (each packed token's position n within its image), all on x's
        device.
    """
    x = _as_tensor(x)
    keep = _as_tensor(keep).to(x.device) != 0
    if x.ndim != 3 or keep.shape != x.shape[:2]:
        raise ValueError(
            f"x must be (B, N, C) and keep (B, N), got {tuple(x.shape)}, {tuple(keep.shape)}"
        )
    counts = keep.sum(dim=1, dtype=torch.int64)
    cu_seqlens = torch.zeros(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    cu_seqlens[1:] = torch.cumsum(counts, dim=0).to(torch.int32)
    packed = x[keep]  # row-major boolean indexing keeps image order and token order
    indices = torch.nonzero(keep)[:, 1].to(torch.int32)
    return packed, cu_seqlens, indices


def unpack_reference(
    packed: Any, cu_seqlens: Any, N: int, indices: Any = None, fill: float = 0.0
) -> torch.Tensor:
    """Scatters packed tokens back to a padded batch.

    Args:
        packed: (T, C) tensor; rows past cu_seqlens[B] are never read.
        cu_seqlens: (B+1,) integer array; every length must be <= N.
        N: tokens per padded image.
        indices: optional (T,) integer array: packed token t lands at
            out[b, indices[t]]; default: image b's tokens fill rows [0, len).
        fill: value of every row not written from packed.

    Returns:
        (B, N, C) tensor of packed's dtype on packed's device.
    """
    packed = _as_tensor(packed)
    if packed.ndim != 2:
        raise ValueError(f"packed must be (T, C), got {tuple(packed.shape)}")
    pairs = _bounds(cu_seqlens, packed.shape[0])
    out = torch.full(
        (len(pairs), N, packed.shape[1]), fill, dtype=packed.dtype, device=packed.device
    )
    idx = None
    if indices is not None:
        idx = _as_tensor(indices).detach().to(packed.device, torch.int64)
    for b, (start, end) in enumerate(pairs):
        if end - start > N:
            raise ValueError(f"every length must be <= N={N}, got {end - start} at image {b}")
        if idx is None:
            out[b, : end - start] = packed[start:end]
        else:
            rows = idx[start:end]
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= N):
                raise ValueError(f"indices must lie in [0, N={N}) for image {b}")
            out[b, rows] = packed[start:end]
    return out


def padded_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: Any,
    max_seqlen: int | None = None,
    *,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SDPA baseline: zero-padded batch, key-padding mask, in q's dtype.

    Args:
        q, k, v: (T, H, D) torch tensors of one float dtype on one device.
        cu_seqlens: (S+1,) integer array, exclusive prefix sums of the lengths.
        max_seqlen: padded length Lmax (>= every length); default: the longest.
        scale: softmax scale; default 1/sqrt(D).
        bias: optional (T,) per-key additive logit bias; when given, the mask is
            a float (S, 1, 1, Lmax) attn_mask in q's dtype holding the bias on
            real keys and -inf on padded ones.

    Returns:
        (T, H, D) tensor of q's dtype on q's device, computed by
        torch.nn.functional.scaled_dot_product_attention on (S, H, Lmax, D)
        zero-padded inputs with a boolean (S, 1, 1, Lmax) key mask (or the float
        bias mask) and gathered back; rows covered by no sequence are NaN.
    """
    _check_qkv(q, k, v)
    total_tokens, num_heads, head_dim = q.shape
    pairs = _bounds(cu_seqlens, total_tokens)
    lengths = [end - start for start, end in pairs]
    longest = max(lengths, default=0)
    if max_seqlen is None:
        max_seqlen = longest
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen must be >= every length ({longest}), got {max_seqlen}")
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device=q.device)
    if longest == 0:
        return out
    num_seqs = len(pairs)
    shape = (num_seqs, num_heads, max_seqlen, head_dim)
    padded = [torch.zeros(shape, dtype=q.dtype, device=q.device) for _ in range(3)]
    mask = torch.zeros((num_seqs, 1, 1, max_seqlen), dtype=torch.bool, device=q.device)
    for s, (start, end) in enumerate(pairs):
        for dst, src in zip(padded, (q, k, v), strict=True):
            dst[s, :, : end - start] = src[start:end].transpose(0, 1)
        mask[s, ..., : end - start] = True
    if bias is not None:
        if bias.shape != (total_tokens,):
            raise ValueError(f"bias must be (T,) = ({total_tokens},), got {tuple(bias.shape)}")
        float_mask = torch.full(mask.shape, -math.inf, dtype=q.dtype, device=q.device)
        for s, (start, end) in enumerate(pairs):
            float_mask[s, 0, 0, : end - start] = bias[start:end].to(q.device, q.dtype)
        mask = float_mask
    result = torch.nn.functional.scaled_dot_product_attention(
        padded[0], padded[1], padded[2], attn_mask=mask, scale=scale
    )
    for s, (start, end) in enumerate(pairs):
        out[start:end] = result[s, :, : end - start].transpose(0, 1)
    return out


# ---- the padded-masked ViT pipeline ----


def _reference_attention_half(blk, h: torch.Tensor, mask: torch.Tensor | None, want_cls: bool,
                              want_value_norm: bool = False, want_keys: bool = False,
                              sizes: torch.Tensor | None = None):
    """h + ls1(attn(norm1(h))) on padded (B, L, C) tokens; mask (B, L) marks real tokens.

    With sizes (B, L) float32 (merged tokens), every key's logits get + log(size) (ToMe's
    proportional attention) through a float SDPA mask that is -inf on padding.

    Returns:
        (h, cls_attn, value_norm, keys): cls_attn is (B, L) float32 head-mean softmax
        attention of token 0 over the real keys (zero on padding), or None unless want_cls;
        value_norm is (B, L) float32 head-mean L2 norm of the value vectors, keys (B, L, D)
        float32 head-mean keys, or None.
    """
    attn = blk.attn
    B, L, C = h.shape
    qkv = attn.qkv(blk.norm1(h)).view(B, L, 3, attn.num_heads, attn.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D) each
    bias = None  # (B, L) float32 additive key bias, -inf on padding
    if sizes is not None:
        bias = torch.log(sizes.float())
        if mask is not None:
            bias = bias.masked_fill(~mask, -math.inf)
        key_mask = bias.to(h.dtype)[:, None, None, :]
    else:
        key_mask = None if mask is None else mask[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask,
                                                         scale=attn.scale)
    o = attn.proj_drop(attn.proj(o.transpose(1, 2).reshape(B, L, attn.attn_dim)))
    cls = value_norm = keys = None
    if want_cls:
        logits = (q[:, :, :1].float() @ k.float().transpose(-1, -2)).squeeze(2) * attn.scale
        if bias is not None:
            logits = logits + bias[:, None, :]
        elif mask is not None:
            logits = logits.masked_fill(~mask[:, None, :], -math.inf)
        cls = torch.softmax(logits, dim=-1).mean(dim=1)  # (B, L)
    if want_value_norm:
        value_norm = torch.linalg.vector_norm(v.float(), dim=-1).mean(dim=1)  # (B, L)
    if want_keys:
        keys = k.float().mean(dim=1)  # (B, L, D)
    return h + blk.drop_path1(blk.ls1(o)), cls, value_norm, keys


def _reference_mlp_half(blk, h: torch.Tensor) -> torch.Tensor:
    return h + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(h))))


def _fuse_reference(h, weights, dropped) -> torch.Tensor:
    """(B, C) sum(w x) / sum(w) over dropped tokens of padded h, float32, zeros if sum 0."""
    w = torch.where(dropped, weights.float(), torch.zeros((), device=h.device))
    total = w.sum(1, keepdim=True)
    nonzero = total != 0  # ragvit.repack's rule, for weights of any sign
    fused = (w[:, :, None] * h.float()).sum(1) / torch.where(nonzero, total, 1.0)
    return torch.where(nonzero, fused, 0.0).to(h.dtype)


def _merge_reference(h, sizes, assign, k):
    """Size-weighted merge of padded h (B, L, C) into k slots (float32); (h', sizes')."""
    B, L, C = h.shape
    s = torch.ones(B, L, device=h.device) if sizes is None else sizes.float()
    total = torch.zeros(B, k, device=h.device).index_put_(
        (torch.arange(B, device=h.device)[:, None].expand(B, L), assign), s, accumulate=True)
    slots = (torch.arange(B, device=h.device)[:, None] * k + assign).reshape(-1)
    acc = torch.zeros(B * k, C, device=h.device).index_add_(
        0, slots, (h.float() * s[:, :, None]).reshape(B * L, C)).view(B, k, C)
    return (acc / total[:, :, None]).to(h.dtype), total


def _replay_merge(decision, origin, stage: int, name: str):
    """(index, assign) of a merge decision (forward_with_decisions' int64 map from each
    token's column to the column it merges into) over the padded tokens' origin (B, L);
    kept tokens stay in position order."""
    B, L = origin.shape
    if decision.dtype == torch.bool or decision.shape[0] != B:
        raise ValueError(f"decision {stage} for a merging policy ({name}) must be the "
                         "(B, N + F) int64 merge map of forward_with_decisions")
    target = decision.gather(1, origin)  # (B, L) column each token merges into
    is_kept = target == origin
    counts = is_kept.sum(1)
    k = int(counts[0])
    if bool((target < 0).any()) or bool((counts != k).any()):
        raise ValueError(f"decision {stage} for a merging policy ({name}) does not fit the "
                         "tokens alive before it (replay every earlier decision too)")
    index = torch.sort((~is_kept).to(torch.int8), dim=1, stable=True).indices[:, :k]
    slot = torch.full_like(decision, -1).scatter_(
        1, origin.gather(1, index), torch.arange(k, device=origin.device).expand(B, k))
    assign = slot.gather(1, target)
    if bool((assign < 0).any()):
        raise ValueError(f"decision {stage} for a merging policy ({name}) merges a token into "
                         "one that is not kept")
    return index, assign


def _reference_prune(policy, h, mask, origin, uniform, layer, stage, num_prefix, cls, value_norm,
                     keys, sizes, decision, num_tokens, num_fused):
    """Applies one pruning point to padded tokens (origin: (B, L) decision-mask column of
    each token: its embedded index, or N + f for the f-th fused token).

    Returns:
        (h, mask, origin, uniform, num_fused, sizes, merged): merged is the merge map
        (forward_with_decisions' format) for merging policies, else None.
    """
    from .pruning import TokenBatch, _check_max_seqlen, _check_selection

    B, L, C = h.shape

    def flat(t):
        """Padded (B, L, ...) -> the packed (T, ...) rows the policy sees."""
        if t is None:
            return None
        return t.reshape(B * L, *t.shape[2:]) if uniform else t[mask]

    rows = flat(h)
    if uniform:
        lengths = torch.full((B,), L, dtype=torch.int64, device=h.device)
    else:
        lengths = mask.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=h.device)
    cu[1:] = torch.cumsum(lengths, 0)
    batch = TokenBatch(rows=rows, cu_seqlens=cu, num_prefix=num_prefix,
                       seq_len=L if uniform else None, max_seqlen=L, layer=layer,
                       stage=stage, cls_attn=flat(cls), value_norm=flat(value_norm),
                       keys=flat(keys), sizes=flat(sizes), num_tokens=num_tokens)
    sel = policy.select(batch)
    _check_selection(sel, batch, type(policy).__name__, values=True)
    if sel.assign is not None:  # merging (ToMe): uniform in, uniform out
        index, assign = sel.index, sel.assign
        if decision is not None:
            index, assign = _replay_merge(decision, origin, stage, type(policy).__name__)
        new_origin = origin.gather(1, index)
        merged = torch.full((B, num_tokens + num_fused), -1, dtype=torch.int64,
                            device=h.device).scatter_(1, origin, new_origin.gather(1, assign))
        h, sizes = _merge_reference(h, sizes, assign, index.shape[1])
        return h, None, new_origin, True, num_fused, sizes, merged
    if sizes is not None:
        raise ValueError(f"{type(policy).__name__}.select: merged tokens (sizes) need merging "
                         "Selections in the reference")

    def to_padded(t, fill):
        if t is None:
            return None
        if uniform:
            return t.view(B, L).clone()
        out = torch.full((B, L), fill, dtype=t.dtype, device=h.device)
        out[mask] = t
        return out

    if decision is not None:  # replay: the patched run's choice, the policy's fuse weights
        if decision.dtype != torch.bool:
            raise ValueError(f"decision {stage} for a selecting policy "
                             f"({type(policy).__name__}) must be a bool mask")
        keep = decision.gather(1, origin)
        if mask is not None:
            keep &= mask
        keep[:, :num_prefix] = True
        new_uniform = False
    elif sel.index is not None:
        keep = torch.zeros(B, L, dtype=torch.bool, device=h.device)
        keep.scatter_(1, sel.index, True)
        new_uniform = uniform
    else:
        keep = to_padded(sel.keep | (batch.positions < num_prefix), False)
        _check_max_seqlen(sel, keep.sum(1).tolist(), type(policy).__name__)
        new_uniform = False
    real = torch.ones_like(keep) if mask is None else mask
    fused = None
    if sel.fuse_weights is not None:
        fused = _fuse_reference(h, to_padded(sel.fuse_weights.float(), 0.0), real & ~keep)
    lengths = keep.sum(1)
    if decision is None and new_uniform:
        new_len = sel.index.shape[1]
    else:
        new_len = int(lengths.max()) if B else L  # an empty batch keeps its width
    # Kept tokens first, in their original order (stable sort), then cut to the longest.
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :new_len]
    h = h.gather(1, order[:, :, None].expand(B, new_len, C))
    origin = origin.gather(1, order)
    if fused is not None:  # appended after each image's kept tokens (ragvit.repack's layout)
        h = torch.cat([h, torch.zeros_like(h[:, :1])], dim=1)
        h[torch.arange(B, device=h.device), lengths] = fused
        origin = torch.cat([origin, origin[:, :1]], dim=1)
        origin[torch.arange(B, device=h.device), lengths] = num_tokens + num_fused
        lengths = lengths + 1
        new_len += 1
        num_fused += 1
    new_mask = None
    if not new_uniform:
        new_mask = torch.arange(new_len, device=h.device)[None, :] < lengths[:, None]
    return h, new_mask, origin, new_uniform, num_fused, None, None


def vit_forward_reference(model, x: torch.Tensor, policy=None, *, decisions=None,
                          return_decisions: bool = False):
    """A timm ViT/DeiT forward with pruning on padded tensors, key masks and SDPA.

    Runs in the model's dtype on its device (the baseline users write today, and the
    oracle for `ragvit.patch`): before the first pruning point it is the dense model;
    after a pruning point each image's kept tokens are moved to the front of a padded
    (B, L', C) tensor (L' = the longest image) and attention masks the padding keys.

    Args:
        model: a timm VisionTransformer / VisionTransformerDistilled supported by
            ragvit.patch (patched or not: only its modules are used), in eval.
        x: (B, 3, H, W) images.
        policy: a ragvit.pruning policy or None (no pruning).
        decisions: optional list, one (B, N + F) bool mask per pruning point over the N
            embedded tokens and the F fused tokens made so far (as
            ragvit.timm_patch.forward_with_decisions returns): replayed instead of the
            policy's choice, so numerical noise cannot flip it (fusion weights still come
            from the policy). Merging policies (ToMe) replay the int64 merge maps
            forward_with_decisions records for them (kept tokens in position order).
        return_decisions: also return the decisions made, in the same format.

    Returns:
        logits, or (logits, decisions) when return_decisions.

    Raises:
        ragvit.UnsupportedModelError: a model ragvit.patch refuses (the message names why).
        TypeError: policy is not a PruningPolicy.
        ValueError: the policy's layers do not fit the model (PruningPolicy.check), or
            decisions do not match the pruning points.
    """
    from .pruning import PruningPolicy
    from .timm_patch import _check_supported

    _check_supported(model, "ragvit.reference.vit_forward_reference")
    if policy is not None:
        if not isinstance(policy, PruningPolicy):
            raise TypeError(f"ragvit.reference.vit_forward_reference: policy must be a "
                            f"ragvit.pruning.PruningPolicy or None, got {type(policy).__name__}")
        policy.check(len(model.blocks))
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    B, N, C = h.shape
    P = int(model.num_prefix_tokens)
    points = tuple(policy.layers) if policy is not None else ()
    if decisions is not None and len(decisions) != len(points):
        raise ValueError(f"decisions must hold one mask per pruning point ({len(points)}), "
                         f"got {len(decisions)}")
    mid = policy is not None and policy.prune_mid_block
    mask = None
    uniform = True
    origin = torch.arange(N, device=h.device).expand(B, N)
    made = []
    cls = value_norm = keys = sizes = None
    stage = num_fused = 0

    def prune(h, mask, origin, uniform, i, stage, cls, value_norm, keys, sizes, num_fused):
        decision = decisions[stage] if decisions is not None else None
        h, mask, origin, uniform, num_fused, sizes, merged = _reference_prune(
            policy, h, mask, origin, uniform, i, stage, P, cls, value_norm, keys, sizes,
            decision, N, num_fused)
        if return_decisions and merged is not None:
            made.append(merged)
        elif return_decisions:
            width = N + num_fused
            valid = origin if mask is None else torch.where(mask, origin, width)
            made_mask = torch.zeros(B, width + 1, dtype=torch.bool, device=h.device)
            made.append(made_mask.scatter_(1, valid, True)[:, :width])
        return h, mask, origin, uniform, num_fused, sizes

    for i, blk in enumerate(model.blocks):
        if not mid and stage < len(points) and points[stage] == i:
            h, mask, origin, uniform, num_fused, sizes = prune(
                h, mask, origin, uniform, i, stage, cls, value_norm, keys, sizes, num_fused)
            stage += 1
        feeds = stage < len(points) and points[stage] == (i if mid else i + 1)
        h, cls, value_norm, keys = _reference_attention_half(
            blk, h, mask, feeds and policy.needs_cls_attn, feeds and policy.needs_value_norm,
            feeds and policy.needs_keys, sizes)
        if mid and feeds:
            h, mask, origin, uniform, num_fused, sizes = prune(
                h, mask, origin, uniform, i, stage, cls, value_norm, keys, sizes, num_fused)
            stage += 1
        h = _reference_mlp_half(blk, h)
    if model.global_pool == "avg":
        skip = 0 if getattr(model, "pool_include_prefix", False) else P
        hn = model.norm(h).float()
        valid = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if mask is None \
            else mask.clone()
        valid[:, :skip] = False
        pooled = (hn * valid[:, :, None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)
        logits = model.head(model.head_drop(model.fc_norm(pooled.to(h.dtype))))
    else:
        logits = model.forward_head(model.norm(h[:, :P]))
    return (logits, made) if return_decisions else logits


def selection_agreement(model, x: torch.Tensor, policy, logits: torch.Tensor, decisions,
                        dtype: torch.dtype = torch.float32) -> dict:
    """How a pruned forward's own decisions compare with an independent selection.

    The independent selection is vit_forward_reference deciding on its own, on a copy of
    the model in `dtype` (fp32: the scores come from its own fp32 activations) with the
    images in `dtype`. Near-tied scores make the kept sets differ on some images for any
    implementation that is not bit-identical to it, so this is a rate to report; where
    the decisions are the same the logits must agree to the forward's precision.

    Args:
        model: the timm model the forward ran (patched or not: only its modules are used).
        x: (B, 3, H, W) the images it ran on.
        policy: its ragvit.pruning policy, or None (no decisions: every image agrees).
        logits: (B, classes) its logits.
        decisions: its decisions, as ragvit.timm_patch.forward_with_decisions returns them.
        dtype: the independent selection's dtype.

    Returns:
        {"images": B, "images_differ": images whose decisions differ at some pruning
        point (the kept set; for merging policies the merge map), "fraction_differ",
        "max_dlogit_same": max |logits - the independent forward's logits| over the other
        images, float64 (NaN when every image differs)}.
    """
    import copy

    with torch.no_grad():
        independent = copy.deepcopy(model).to(dtype)
        if policy is None:
            theirs, made = vit_forward_reference(independent, x.to(dtype)), []
        else:
            theirs, made = vit_forward_reference(independent, x.to(dtype), policy,
                                                 return_decisions=True)
        del independent
    if len(made) != len(decisions):
        raise ValueError(f"selection_agreement: decisions must hold one entry per pruning "
                         f"point ({len(made)}), got {len(decisions)}")
    differ = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for ours, own in zip(decisions, made, strict=True):
        differ |= (ours.to(logits.device) != own.to(logits.device)).any(1)
    same = ~differ
    max_dlogit = float((logits[same].double() - theirs[same].to(logits.device).double())
                       .abs().max()) if bool(same.any()) else math.nan
    count = int(differ.sum())
    return {"images": int(logits.shape[0]), "images_differ": count,
            "fraction_differ": count / logits.shape[0], "max_dlogit_same": max_dlogit}
