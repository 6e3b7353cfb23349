"""patch(model, policy) / unpatch(model): timm ViT/DeiT inference on packed, pruned tokens.

`patch` sets an instance `forward` on a timm VisionTransformer (the class, its modules
and its parameters are untouched; `unpatch` deletes the instance attribute, so the
original bound `forward` comes back and the state_dict never changed). The patched
forward runs every block on packed `(T, C)` rows: LayerNorm and the qkv/proj/MLP
linears in torch on 2-D rows, attention through `ragvit.attention` reading q/k/v as
strided views of the qkv output (no copies), `cu_seqlens` on the device and `max_seqlen`
known on the host. Before the first pruning point every image has N tokens, so the rows
are the embedded batch viewed as (B*N, C); at each pruning point the policy's selection
re-packs them. Decision that is not obvious: token moves between stages are isolated in
the `_gather_*`, `_pack_*`, `_repack_*` and `_segment_*` helpers below (ragvit's C ops,
plus a torch gather for fixed counts); none reads the device on the host, so a forward
with fixed-count policies is sync-free and capturable in a CUDA graph.
Each block runs as two halves (`_attention_half`, `_mlp_half`) so a policy can prune
between them (EViT, ATS, ToMe: `prune_mid_block`) with the scores of that block's own
attention call; merged tokens (ToMe) carry sizes, and attention then adds log(size) to
every key's logits through ragvit.attention's bias. On CPU rows the default forward
runs attention as torch's SDPA on views of the qkv rows (`_cpu_attention`) and the row ops
through torch's functions (`_TorchRowOps`): ragvit's C backend is single-threaded scalar
C, slower there than torch. Under torch.compile and torch.export the forward runs with a
traced copy of its state (`_traced_state`: capacity mode, no host reads) and ragvit's ops
trace as torch.ops.ragvit (ragvit.library); eager calls still go straight to C.

Only eval-mode inference without autograd is supported (ragvit.attention has no
backward; drop-path and dropout are identities in eval).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from . import library, ops
from .pruning import PruningPolicy, TokenBatch, _check_max_seqlen, _check_selection

__all__ = ["UnsupportedModelError", "forward_with_decisions", "graph_capture", "is_patched",
           "kept_mask", "patch", "unpatch"]

_STATE_ATTR = "_ragvit_patch_state"
_HEAD_DIMS = (32, 64, 80, 96, 128)


class UnsupportedModelError(ValueError, TypeError):
    """A model ragvit.patch cannot run on packed tokens; the message names why.

    Raised both for a model that is no timm VisionTransformer and for a VisionTransformer
    with a feature the packed path cannot run, so one ``except UnsupportedModelError``
    catches every "this model cannot be patched". It subclasses ValueError (what the
    feature refusals always were) and TypeError (what a non-ViT model always was), so
    callers catching either keep working.
    """


@dataclass
class _PatchState:
    """What patch() added to a model (kept out of nn.Module's registries)."""

    policy: PruningPolicy | None
    capacity: bool
    attention: Any  # patch's attention=; None: ragvit.attention, looked up at each call
    saved_forward: Any  # an instance-level forward that existed before patch, or None
    had_forward: bool
    num_prefix: int
    avg_pool: bool
    pool_skip: int
    dense_until_pruning: bool | None = None
    row_ops: bool | None = None  # None: on CUDA; True: on any device; False: never
    gemm_embed: bool = False  # the patch embedding is a plain strided conv (_embed_is_gemm)
    direct_pos_embed: bool = False  # timm's own _pos_embed, static size (_pos_embed_is_direct)
    cu_cache: dict | None = field(default_factory=dict)  # None: no cache (traced)
    traced: bool = False  # the state a traced forward runs with (_traced_state)

    def __getstate__(self) -> dict:
        # A copy or a pickle starts with an empty cu_seqlens cache: its tensors live on
        # the devices of this process's calls.
        fields = dict(vars(self))
        if fields["cu_cache"] is not None:
            fields["cu_cache"] = {}
        return fields


# ---- support checks ----


def _refuse(caller: str, feature: str, detail: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{caller}: {feature} is not supported ({detail})")


def _check_supported(model, caller: str = "ragvit.patch") -> None:
    """Raises UnsupportedModelError (its message starting with caller) unless model is a
    timm ViT/DeiT the packed path (and the padded reference) can run."""
    from timm.layers import Attention, Mlp
    from timm.models.vision_transformer import Block, VisionTransformer

    try:
        from timm.models.deit import VisionTransformerDistilled
    except ImportError:  # pragma: no cover - old timm
        VisionTransformerDistilled = None

    if not isinstance(model, torch.nn.Module) or not isinstance(model, VisionTransformer):
        wrapped = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        hint = ("; patch the model first, then compile it: torch.compile(ragvit.patch(model))"
                if isinstance(wrapped, VisionTransformer) else "")
        raise UnsupportedModelError(
            f"{caller}: model must be a timm VisionTransformer, got "
            f"{type(model).__name__}{hint}")
    if type(model) not in (VisionTransformer, VisionTransformerDistilled):
        raise _refuse(caller, f"model class {type(model).__name__}",
                      "only VisionTransformer and VisionTransformerDistilled")
    if getattr(model, "cls_token", None) is None:
        raise _refuse(caller, "a model without a class token", "class_token=False")
    if getattr(model, "dynamic_img_size", False):
        raise _refuse(caller, "dynamic_img_size", "the token count must be fixed by img_size")
    if getattr(model, "attn_pool", None) is not None:
        raise _refuse(caller, "an attention-pool head", f"global_pool={model.global_pool!r}")
    if model.global_pool not in ("token", "avg"):
        raise _refuse(caller, f"global_pool={model.global_pool!r}", "only 'token' and 'avg'")
    for i, blk in enumerate(model.blocks):
        if type(blk) is not Block:
            raise _refuse(caller, f"block type {type(blk).__name__}", f"block {i}; only timm Block")
        attn = blk.attn
        if type(attn) is not Attention:
            raise _refuse(caller, f"attention type {type(attn).__name__}",
                          f"block {i}; only timm Attention (no diff or parallel-block variants)")
        if not (isinstance(attn.q_norm, torch.nn.Identity)
                and isinstance(attn.k_norm, torch.nn.Identity)):
            raise _refuse(caller, "qk_norm", f"block {i}")
        if getattr(attn, "gate", None) is not None:
            raise _refuse(caller, "gated attention", f"block {i}")
        if not isinstance(getattr(attn, "norm", torch.nn.Identity()), torch.nn.Identity):
            raise _refuse(caller, "scale_attn_norm (norm before the attention projection)",
                          f"block {i}")
        if attn.head_dim not in _HEAD_DIMS:
            raise _refuse(caller, f"head_dim {attn.head_dim}",
                          f"block {i}; ragvit.attention takes "
                          f"{', '.join(map(str, _HEAD_DIMS))}")
        if isinstance(blk.mlp, Mlp) and isinstance(blk.mlp.fc1, torch.nn.Conv2d):
            raise _refuse(caller, "convolutional Mlp", f"block {i}")


def _blocks_allow_row_ops(model) -> bool:
    """Whether every block is LayerNorm -> Linear qkv -> attention -> Linear proj and
    LayerNorm -> Linear -> exact GELU -> Linear (timm's Block with its default Mlp), with
    LayerScale or Identity on each branch: the blocks ragvit's row ops can run."""
    from timm.layers import LayerScale, Mlp

    def is_norm(m):
        return isinstance(m, torch.nn.LayerNorm) and len(m.normalized_shape) == 1

    def is_branch_scale(m):
        return isinstance(m, torch.nn.Identity) or type(m) is LayerScale

    for blk in model.blocks:
        mlp = blk.mlp
        if not (is_norm(blk.norm1) and is_norm(blk.norm2) and type(mlp) is Mlp
                and type(blk.attn.qkv) is torch.nn.Linear
                and type(blk.attn.proj) is torch.nn.Linear
                and type(mlp.fc1) is torch.nn.Linear and type(mlp.fc2) is torch.nn.Linear
                and type(mlp.act) is torch.nn.GELU and mlp.act.approximate == "none"
                and isinstance(mlp.norm, torch.nn.Identity)
                and is_branch_scale(blk.ls1) and is_branch_scale(blk.ls2)):
            return False
    return True


def _embed_is_gemm(model) -> bool:
    """Whether the patch embedding is timm's PatchEmbed with a Conv2d whose kernel equals
    its stride (no padding, dilation, groups or norm) and tiles the image exactly (the conv
    drops a remainder), flattened to tokens: then it is one GEMM over the image's patches
    (im2col is a reshape), run by ragvit.linear."""
    from timm.layers import PatchEmbed

    pe = model.patch_embed
    if type(pe) is not PatchEmbed or not isinstance(pe.norm, torch.nn.Identity):
        return False
    conv = pe.proj
    return (type(conv) is torch.nn.Conv2d and conv.kernel_size == conv.stride
            and conv.padding == (0, 0) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and pe.flatten
            and not getattr(pe, "dynamic_img_pad", False)
            and all(size % k == 0
                    for size, k in zip(pe.img_size, conv.kernel_size, strict=True)))


def _embed_patches(pe, x: torch.Tensor, as_gemm: bool, linear=None,
                   traced: bool = False) -> torch.Tensor:
    """model.patch_embed(x), as one GEMM on the patches (`linear`, default ragvit.linear)
    when as_gemm and x has the size and channels the model was built for (the conv
    otherwise, which also raises timm's own error for a wrong input; cuDNN's
    default algorithm for this stride-p conv is slow at small batch); traced: see
    _patch_rows."""
    conv = pe.proj
    if (not as_gemm or x.ndim != 4 or tuple(x.shape[-2:]) != tuple(pe.img_size)
            or x.shape[1] != conv.in_channels):
        return pe(x)
    B, C, H, W = x.shape
    ph, pw = conv.kernel_size
    # (B, C, H/ph, ph, W/pw, pw) -> (B, H/ph, W/pw, C, ph, pw): rows in token order, columns
    # in the conv weight's (C, ph, pw) order.
    patches = _patch_rows(x, ph, pw, as_words=not traced)
    linear = ops.linear if linear is None else linear
    rows = linear(patches, conv.weight.reshape(conv.out_channels, -1), conv.bias)
    return rows.view(B, (H // ph) * (W // pw), conv.out_channels)


def _patch_rows(x: torch.Tensor, ph: int, pw: int, as_words: bool = True) -> torch.Tensor:
    """(B, C, H, W) images -> (B * H/ph * W/pw, C * ph * pw) patch rows, the conv weight's
    (C, ph, pw) order in each row. A permuted copy; for a contiguous x whose patch rows are
    whole 8-byte words (pw * itemsize % 8 == 0: fp16/bf16/fp32 at pw = 16) it moves int64
    words, 4x fewer elements for 16-bit types (torch's copy of the 6-d permute is
    index-bound: DeiT-B at batch 256 took 147 us); the bytes are the same either way.
    as_words=False (a traced forward: no data pointer to test, and the compiler generates its
    own copy) always permutes elements."""
    B, C, H, W = x.shape
    h, w = H // ph, W // pw
    words = pw * x.element_size() // 8
    if (as_words and x.is_contiguous() and pw * x.element_size() % 8 == 0
            and (H, W) == (h * ph, w * pw) and x.data_ptr() % 8 == 0 and x.numel() > 0):
        x64 = x.view(torch.int64).view(B, C, h, ph, w, words)
        return x64.permute(0, 2, 4, 1, 3, 5).contiguous().view(x.dtype).view(
            B * h * w, C * ph * pw)
    return x.reshape(B, C, h, ph, w, pw).permute(0, 2, 4, 1, 3, 5).reshape(-1, C * ph * pw)


def _pos_embed_is_direct(model) -> bool:
    """Whether model._pos_embed is VisionTransformer's own with a learned pos_embed of
    static size (not a subclass's, e.g. the distilled DeiT's, not dynamic_img_size)."""
    from timm.models.vision_transformer import VisionTransformer

    return (type(model)._pos_embed is VisionTransformer._pos_embed
            and getattr(model, "pos_embed", None) is not None
            and not getattr(model, "dynamic_img_size", False))


def _pos_embed(model, tokens: torch.Tensor) -> torch.Tensor:
    """VisionTransformer._pos_embed without the concatenation's extra pass: the prefix rows
    (class and register tokens) and the patch rows are written into one (B, P + n, C)
    buffer by two adds, the same sums rounded the same way as timm's cat + add (which
    copies every row once more: 0.3 ms at DeiT-B batch 256)."""
    B, n, C = tokens.shape
    pos = model.pos_embed
    parts = [t for t in (model.cls_token, getattr(model, "reg_token", None)) if t is not None]
    prefix = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) if parts else None
    P = prefix.shape[1] if prefix is not None else 0
    out = torch.empty(B, P + n, C, dtype=tokens.dtype, device=tokens.device)
    if model.no_embed_class:  # pos_embed covers the patch rows only
        torch.add(tokens, pos, out=out[:, P:])
        if P:
            out[:, :P] = prefix
    else:
        torch.add(tokens, pos[:, P:], out=out[:, P:])
        if P:
            torch.add(prefix.expand(B, P, C), pos[:, :P], out=out[:, :P])
    return model.pos_drop(out)


# ---- public entry points ----


def patch(model, policy: PruningPolicy | None = None, *, capacity: bool = False,
          attention=None, dense_until_pruning: bool | None = None,
          row_ops: bool | None = None, fused_ops: bool | None = None):
    """Makes a timm ViT/DeiT run on packed (optionally pruned) tokens, in place.

    Args:
        model: a timm VisionTransformer or VisionTransformerDistilled with a class token
            (DeiT, distilled DeiT, DeiT-III, ViT; register tokens allowed), pooling
            'token' or 'avg'.
        policy: a ragvit.pruning policy, or None for the lossless path (every token kept,
            every block through ragvit.attention).
        capacity: for data-dependent policies, keep packed buffers at their worst-case
            size instead of reading the new total from the device after each pruning
            point (no host sync; garbage rows past cu_seqlens[B] cost compute). A forward
            traced by torch.compile or torch.export always runs in capacity mode (a total
            read on the host would break the graph), as ragvit.cuda_graph's captures do;
            fixed-count policies are unaffected, data-dependent ones (ThresholdL2
            threshold=, ATS) give the same logits either way. docs/compile.md.
        attention: a replacement for ragvit.attention with its signature (benchmarks
            use it to run the same pipeline on other attention ops). The default,
            ragvit.attention, runs on CPU rows as torch's SDPA on views of the qkv rows
            (faster there than ragvit's C backend; the same results up to rounding).
        dense_until_pruning: with a policy, how the blocks before its first pruning point
            (every image still holds all N tokens, nothing is ragged yet) run attention.
            True: as timm does, dense SDPA on (B, H, N, D) views of the qkv output; False or
            None (the default): through `attention` (on the H200 the whole pruned forward is
            1-5% faster that way as a CUDA graph and 2-17% eagerly, DeiT-S/B at 1 to 256
            images: benchmarks/results/dense_sdpa_h200.md).
            A block whose attention must also return CLS scores (EViT, ATS) always calls
            `attention`. No effect without a policy (the lossless path is all ragvit).
        row_ops: run each block's LayerNorms, its four linears (bias and residual add in
            the GEMM's epilogue) and GELU through ragvit.layer_norm /
            linear / gelu, launched from C (cuBLASLt GEMMs on CUDA), and a plain
            stride-p patch-embedding conv as one ragvit.linear over the image's patches
            (whenever the input has the model's img_size): about 8 calls a block
            instead of about 15 torch ops, which is what bounds small batches. None (the
            default): on CUDA rows whenever the model allows it, and on CPU rows the same
            structure through torch's functions (residual added by the GEMM, GELU in
            place); True: ragvit's row ops on any device (the CPU backend's GEMM is plain
            C, slow; for tests), and an error if the model does not allow it; False:
            torch's modules. Allowed when every block is timm's
            Block with nn.LayerNorm, its default Mlp with exact GELU and Identity or
            LayerScale branches; used for a forward when the rows' dtype equals the
            weights' and autocast is off. Same math as torch's modules; results differ by
            rounding only (the residual is added before the GEMM output is rounded).
        fused_ops: the former name of row_ops, still accepted (DeprecationWarning).

    Returns:
        model itself. Call it under torch.no_grad() or torch.inference_mode(), in eval
        (also to compile or export it: torch.compile(model, fullgraph=True) and
        torch.export.export(model, (x,)), strict or not, trace with no graph break).

    Raises:
        UnsupportedModelError (a ValueError and a TypeError): the model cannot be
            patched: it is not a timm VisionTransformer, or it has a feature the packed
            path cannot run (the message names it: qk_norm, gated attention,
            attention-pool head, dynamic_img_size, no class token, ...).
        TypeError: policy is not a PruningPolicy.
        ValueError: the model is already patched, the policy's layers do not fit, or
            row_ops=True on blocks the row ops cannot run.
        TypeError: capacity is not a bool, row_ops or dense_until_pruning not None, True
            or False, both row_ops and fused_ops are given, or attention is neither None
            nor callable.
    """
    if is_patched(model):
        raise ValueError("ragvit.patch: model is already patched; call ragvit.unpatch(model) "
                         "first")
    _check_supported(model)
    if policy is not None:
        if not isinstance(policy, PruningPolicy):
            raise TypeError(f"ragvit.patch: policy must be a ragvit.pruning.PruningPolicy or "
                            f"None, got {type(policy).__name__}")
        policy.check(len(model.blocks))
    if fused_ops is not None:
        if row_ops is not None:
            raise TypeError("ragvit.patch: pass row_ops only (fused_ops is its former name)")
        warnings.warn("ragvit.patch: fused_ops is now called row_ops", DeprecationWarning,
                      stacklevel=2)
        row_ops = fused_ops
    if not isinstance(capacity, bool):
        raise TypeError(f"ragvit.patch: capacity must be True or False, got {capacity!r}")
    if dense_until_pruning is not None and not isinstance(dense_until_pruning, bool):
        raise TypeError(f"ragvit.patch: dense_until_pruning must be None, True or False, got "
                        f"{dense_until_pruning!r}")
    if attention is not None and not callable(attention):
        raise TypeError(f"ragvit.patch: attention must be None or a callable with "
                        f"ragvit.attention's signature, got {type(attention).__name__}")
    if row_ops is not None and not isinstance(row_ops, bool):
        raise TypeError(f"ragvit.patch: row_ops must be None, True or False, got "
                        f"{type(row_ops).__name__}")
    allows_row_ops = row_ops is not False and _blocks_allow_row_ops(model)
    if row_ops and not allows_row_ops:
        raise ValueError("ragvit.patch: row_ops=True needs every block to be timm's Block "
                         "with nn.LayerNorm, the default Mlp with exact GELU and Identity or "
                         "LayerScale branches")
    had_forward = "forward" in vars(model)
    state = _PatchState(
        policy=policy,
        capacity=capacity,
        attention=None if attention is ops.attention else attention,
        saved_forward=vars(model).get("forward"),
        had_forward=had_forward,
        num_prefix=int(model.num_prefix_tokens),
        avg_pool=model.global_pool == "avg",
        pool_skip=0 if getattr(model, "pool_include_prefix", False) else int(
            model.num_prefix_tokens),
        dense_until_pruning=dense_until_pruning,
        # None (on CUDA) stays None where the blocks allow the row ops, else off
        row_ops=(None if row_ops is None else True) if allows_row_ops else False,
        gemm_embed=_embed_is_gemm(model),
        direct_pos_embed=_pos_embed_is_direct(model),
    )

    # object.__setattr__: the state must not become a submodule or buffer even if a policy
    # is an nn.Module. A partial of a module-level function rather than a closure, so that
    # copy.deepcopy of a patched model runs the copy's own weights (its memo maps the model
    # to the copy), pickle and torch.save can store it, and torch.export reads its code.
    object.__setattr__(model, _STATE_ATTR, state)
    object.__setattr__(model, "forward",
                       functools.partial(_patched_forward, model, state, _traced_state(state)))
    return model


def _patched_forward(model, state: _PatchState, traced: _PatchState,
                     x: torch.Tensor) -> torch.Tensor:
    """A patched model's forward(x): eager calls go straight to ragvit's C ops; traced ones
    (torch.compile, torch.export) run with the traced state (_traced_state)."""
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        if torch.jit.is_tracing():
            raise RuntimeError("ragvit.patch: torch.jit.trace cannot record a patched forward "
                               "(ragvit's C ops are invisible to it); use "
                               "torch.export.export(model, (x,)) or torch.compile(model)")
        return _forward(model, state, x)[0]
    if torch.compiler.is_dynamo_compiling():  # ragvit's C ops trace as torch.ops.ragvit
        return _forward(model, traced, x)[0]
    with library.routed_ops():  # tracing without Dynamo (non-strict torch.export)
        return _forward(model, traced, x)[0]


def _traced_state(state: _PatchState) -> _PatchState:
    """The state a traced forward (torch.compile, torch.export) runs with: capacity mode
    (a pruned total read on the host would break the graph), no cu_seqlens cache (a traced
    graph makes its own constants), timm's own position embedding (_pos_embed's adds into
    views of one buffer are what the compiler fuses anyway, and Dynamo cannot trace an out=
    view) and the traced variants of the other host-side shortcuts (state.traced)."""
    return dataclasses.replace(state, capacity=True, cu_cache=None, direct_pos_embed=False,
                               traced=True)


def unpatch(model):
    """Restores a patched model exactly (its original forward; parameters never changed).

    Returns:
        model itself.

    Raises:
        ValueError: the model is not patched.
    """
    state = getattr(model, "__dict__", {}).get(_STATE_ATTR)
    if state is None:
        raise ValueError("ragvit.unpatch: model is not patched")
    if state.had_forward:
        object.__setattr__(model, "forward", state.saved_forward)
    else:
        object.__delattr__(model, "forward")
    object.__delattr__(model, _STATE_ATTR)
    return model


def is_patched(model) -> bool:
    """Whether ragvit.patch has been applied to model (and not undone); False for any
    object that is no patched model."""
    return _STATE_ATTR in getattr(model, "__dict__", {})


@contextlib.contextmanager
def graph_capture(model):
    """For ragvit.cuda_graph: what a patched forward needs to be captured, for a with block.

    Inside, the model runs in capacity mode (no host read of the pruned totals, whatever
    `patch(..., capacity=)` said; index Selections are unaffected) with an empty
    cu_seqlens cache of its own. Yields that cache (a dict; None for an unpatched model):
    a captured graph reads its tensors, so the caller keeps it as long as the graph.
    Both are restored on exit, even after an exception.
    """
    state = vars(model).get(_STATE_ATTR)
    if state is None:
        yield None
        return
    saved = state.capacity, state.cu_cache
    state.capacity, state.cu_cache = True, {}
    try:
        yield state.cu_cache
    finally:
        state.capacity, state.cu_cache = saved


def forward_with_decisions(model, x: torch.Tensor):
    """Runs a patched model and also returns its pruning decisions (for tests and checks).

    Returns:
        (logits, decisions): decisions[s] describes pruning point s over the N embedded
        tokens (prefix first) and the F fused tokens made before it (columns N..N+F-1):
        a (B, N + F) bool mask of the tokens kept, or for a merging policy (ToMe) a
        (B, N + F) int64 map from every token alive before the point to the column of
        the token it merged into (its own column when kept; -1 for tokens already gone).
        The format ragvit.reference.vit_forward_reference(..., decisions=) replays;
        `kept_mask` turns either into the bool mask of kept tokens.
    """
    state = getattr(model, "__dict__", {}).get(_STATE_ATTR)
    if state is None:
        raise ValueError("ragvit.forward_with_decisions: model is not patched")
    return _forward(model, state, x, record=True)


def kept_mask(decision: torch.Tensor) -> torch.Tensor:
    """(B, N + F) bool mask of the tokens kept by one decision of forward_with_decisions
    (a bool mask is returned as is; a merge map keeps the tokens that map to themselves).

    Raises:
        TypeError: decision is not a 2-D bool or int64 tensor.
    """
    if not (isinstance(decision, torch.Tensor) and decision.ndim == 2
            and decision.dtype in (torch.bool, torch.int64)):
        got = (f"{decision.ndim}-D {decision.dtype}" if isinstance(decision, torch.Tensor)
               else type(decision).__name__)
        raise TypeError(f"ragvit.kept_mask: decision must be a 2-D bool or int64 tensor (a "
                        f"decision of forward_with_decisions), got {got}")
    if decision.dtype == torch.bool:
        return decision
    return decision == torch.arange(decision.shape[1], device=decision.device)


# ---- the packed pipeline ----


@dataclass
class _Rows:
    """Packed tokens between blocks; see TokenBatch for the fields."""

    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_len: int | None
    max_seqlen: int
    origin: torch.Tensor | None = None  # (T,) int64 embedded-token index, when recording
    num_tokens: int = 0  # N, embedded tokens per image (decision masks)
    num_fused: int = 0  # fused tokens made so far; fused token f has origin N + f
    sizes: torch.Tensor | None = None  # (T,) float32 tokens per row once merged (ToMe)
    merged: torch.Tensor | None = None  # merge decision of the pruning point that made it


def _uniform_cu(state: _PatchState, num_seqs: int, seq_len: int, device) -> torch.Tensor:
    """(B+1,) int32 cu_seqlens of B images of seq_len tokens, cached per shape/device (in
    state.cu_cache; a traced forward has none and computes them once per shape through
    library.uniform_cu_seqlens)."""
    if state.cu_cache is None:
        return library.uniform_cu_seqlens(num_seqs, seq_len, device)
    key = (num_seqs, seq_len, device)
    cu = state.cu_cache.get(key)
    if cu is None:
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * seq_len
        if len(state.cu_cache) > 64:
            state.cu_cache.clear()
        state.cu_cache[key] = cu
    return cu


def _check_mode(model) -> None:
    if model.training:
        raise RuntimeError("ragvit: the patched forward is inference-only; call model.eval()")
    if torch.is_grad_enabled():
        raise RuntimeError("ragvit: the patched forward has no backward; run it under "
                           "torch.no_grad() or torch.inference_mode()")


def _attention_half(blk, cur: _Rows, attention, cls_attn=None, want_value_norm=False,
                    want_keys=False, dense=False, row_ops=None, traced=False):
    """rows + ls1(attn(norm1(rows))) on packed rows (T, C); attention reads views of qkv,
    with bias log(size) per key once tokens have been merged (ToMe's proportional attention);
    dense: the rows are B whole images of seq_len tokens, attention is SDPA on (B, H, N, D)
    views instead (no cls_attn, no bias); row_ops (ragvit.ops or _TorchRowOps, or None for
    torch's modules): norm1, qkv and proj (with the residual add, in place on cur.rows)
    through those row ops. attention None is ragvit.attention: on CPU rows it runs through
    torch's SDPA (_cpu_attention), except for ragged rows in a traced forward (traced), where
    _cpu_attention's host read of cu_seqlens would break the graph.

    Returns:
        (rows, value_norm, keys): value_norm (T,) float32 head-mean L2 norm of the value
        vectors when want_value_norm, keys (T, D) float32 head-mean keys when want_keys,
        else None.
    """
    attn = blk.attn
    if row_ops:
        h = row_ops.layer_norm(cur.rows, blk.norm1.weight, blk.norm1.bias, eps=blk.norm1.eps)
        qkv = row_ops.linear(h, attn.qkv.weight, attn.qkv.bias)
    else:
        qkv = attn.qkv(blk.norm1(cur.rows))
    qkv = qkv.view(-1, 3, attn.num_heads, attn.head_dim)  # (T, 3, H, D)
    kwargs = {}
    if cls_attn is not None:
        kwargs["cls_attn"] = cls_attn
    if cur.sizes is not None:
        kwargs["bias"] = torch.log(cur.sizes)
    if dense:
        q, k, v = qkv.view(-1, cur.seq_len, 3, attn.num_heads, attn.head_dim).permute(
            2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) each, as timm's Attention
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=attn.scale)
        o = o.transpose(1, 2).reshape(-1, attn.num_heads, attn.head_dim)
    elif attention is None and not qkv.is_cuda and (cur.seq_len is not None or not traced):
        o = _cpu_attention(qkv, cur.cu_seqlens, cur.seq_len, attn.scale, **kwargs)
    else:
        q, k, v = qkv.unbind(1)  # one op for the three views (host time at small batch)
        o = (attention or ops.attention)(q, k, v, cur.cu_seqlens, cur.max_seqlen,
                                         scale=attn.scale, **kwargs)
    value_norm = keys = None
    if want_value_norm:
        value_norm = torch.linalg.vector_norm(qkv[:, 2].float(), dim=-1).mean(dim=1)
    if want_keys:
        keys = qkv[:, 1].float().mean(dim=1)
    o = o.reshape(o.shape[0], attn.attn_dim)
    if row_ops:
        return _linear_residual(row_ops, blk.ls1, attn.proj, o, cur.rows), value_norm, keys
    o = attn.proj_drop(attn.proj(o))
    return cur.rows + blk.drop_path1(blk.ls1(o)), value_norm, keys


def _cpu_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int | None,
                   scale: float, cls_attn: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """ragvit.attention on CPU rows through torch's scaled_dot_product_attention.

    Each run of consecutive sequences of one length L is one SDPA call on (n, H, L, D)
    views of the qkv rows (no copies in): fixed counts make the whole batch one run, ragged
    counts one run per change of length (a batch of B images costs at most B calls).
    Reading cu_seqlens is free here (host memory), so no device is ever read. The CLS row's
    probabilities (cls_attn) come from a separate q_cls K^T softmax per run; ToMe's
    per-key bias is an additive float mask. On a 2-core AMD EPYC (torch 2.14, fp32, one
    thread) this runs DeiT-S attention 4.8x faster than ragvit's C backend (18 vs 88 ms
    per pruned forward at batch 1), which is single-threaded scalar C.

    Args:
        qkv: (T, 3, H, D) the qkv projection's rows.
        cu_seqlens: (S+1,) int32 on the CPU; seq_len: every length when known, else None.
        scale: the logits' factor; cls_attn: (T,) float32 out, or None; bias: (T,)
            float32 added to every key's logit, or None.

    Returns:
        (T, H, D) attention output; rows past cu_seqlens[S] are left unwritten.
    """
    T, _, H, D = qkv.shape
    S = cu_seqlens.shape[0] - 1
    if seq_len is not None:
        runs = [(0, S, seq_len)] if S > 0 else []
    else:
        cu = cu_seqlens.tolist()
        runs = []  # (first row, sequences, length)
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if runs and runs[-1][2] == b - a:
                runs[-1][1] += 1
            else:
                runs.append([a, 1, b - a])
    out = None
    for start, n, L in runs:
        if L == 0:
            continue
        rows = qkv[start:start + n * L].view(n, L, 3, H, D)
        q, k, v = rows.permute(2, 0, 3, 1, 4).unbind(0)  # (n, H, L, D) views
        mask = None
        if bias is not None:
            mask = bias[start:start + n * L].view(n, 1, 1, L).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=scale)
        o = o.transpose(1, 2)  # (n, L, H, D), contiguous as SDPA lays it out on the CPU
        if n * L == T:  # one run over every row: the output as it is
            out = o.reshape(T, H, D)
        else:
            if out is None:
                out = qkv.new_empty(T, H, D)
            out[start:start + n * L].view(n, L, H, D).copy_(o)
        if cls_attn is not None:
            logits = torch.einsum("nhd,nhld->nhl", q[:, :, 0].float(), k.float()) * scale
            if bias is not None:
                logits = logits + bias[start:start + n * L].view(n, 1, L)
            cls_attn[start:start + n * L].view(n, L).copy_(logits.softmax(-1).mean(1))
    return out if out is not None else qkv.new_empty(T, H, D)


def _mlp_half(blk, rows, row_ops=None):
    if not row_ops:
        return rows + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(rows))))
    mlp = blk.mlp
    h = row_ops.layer_norm(rows, blk.norm2.weight, blk.norm2.bias, eps=blk.norm2.eps)
    h = row_ops.linear(h, mlp.fc1.weight, mlp.fc1.bias)
    row_ops.gelu(h, out=h)
    return _linear_residual(row_ops, blk.ls2, mlp.fc2, h, rows)


def _linear_residual(row_ops, scale, linear, h, rows):
    """rows + scale(linear(h)) written into rows (eval: dropout and drop-path are
    identities): the add is the GEMM's residual epilogue, or one addcmul_ for LayerScale."""
    if isinstance(scale, torch.nn.Identity):
        return row_ops.linear(h, linear.weight, linear.bias, residual=rows, out=rows)
    return rows.addcmul_(row_ops.linear(h, linear.weight, linear.bias), scale.gamma)


class _TorchRowOps:
    """The row ops' calls (ragvit.layer_norm / linear / gelu signatures) through torch's
    CPU functions, for CPU rows: the blocks keep the row ops' structure, the residual
    accumulated into rows by the GEMM (addmm_ with beta 1, then the bias) and GELU in
    place, so a block allocates two row buffers fewer and reads the rows twice less than
    with torch's modules; ragvit's own CPU GEMM is plain C, far slower than torch's."""

    @staticmethod
    def layer_norm(x, weight=None, bias=None, *, eps=1e-5):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def linear(x, weight, bias=None, *, residual=None, out=None):
        if residual is None:
            return torch.nn.functional.linear(x, weight, bias)
        out = residual.clone() if out is None else out if out is residual else \
            out.copy_(residual)
        out.addmm_(x, weight.t())
        return out if bias is None else out.add_(bias)

    @staticmethod
    def gelu(x, *, out=None):
        if out is None or out is x:
            return torch.ops.aten.gelu_(x)
        return out.copy_(torch.nn.functional.gelu(x))


class _CudaRowOpsTorchLinear:
    """ragvit's CUDA row ops with torch's linear, where CUDA linear cannot run (a build
    without cuBLASLt, or no libcublasLt to load). The ragvit ops are looked up at call time,
    as the patched forward's own calls are: non-strict torch.export swaps them
    (library.routed_ops)."""

    @staticmethod
    def layer_norm(x, weight=None, bias=None, *, eps=1e-5):
        return ops.layer_norm(x, weight, bias, eps=eps)

    @staticmethod
    def gelu(x, *, out=None):
        return ops.gelu(x, out=out)

    linear = staticmethod(_TorchRowOps.linear)


# device index -> whether ragvit.linear runs there (probed once per process and device)
_cuda_linear_runs: dict[int, bool] = {}


def _cuda_linear_probe(rows: torch.Tensor) -> bool:
    """Whether ragvit.linear runs on rows' CUDA device: one tiny GEMM the first time a
    device is seen; False (and a RuntimeWarning, once) when cuBLASLt is not built in or
    cannot be loaded, so a patched model runs its linears through torch instead."""
    index = rows.device.index if rows.device.index is not None else \
        torch.cuda.current_device()
    runs = _cuda_linear_runs.get(index)
    if runs is None:
        try:
            x = torch.zeros(1, 8, dtype=rows.dtype, device=rows.device)
            ops.linear(x, torch.zeros(8, 8, dtype=rows.dtype, device=rows.device))
            runs = True
        except RuntimeError as e:
            if "cuBLASLt" not in str(e):
                raise
            runs = False
            warnings.warn(f"ragvit: CUDA linear is unavailable ({e}); patched models run "
                          f"their linears through torch (ragvit.build_info() says what this "
                          f"build holds)", RuntimeWarning, stacklevel=4)
        _cuda_linear_runs[index] = runs
    return runs


def _use_row_ops(model, state: _PatchState, rows: torch.Tensor):
    """The row ops a forward runs, or None (torch's modules): where allowed, for rows of
    the blocks' weight dtype with autocast off, ragvit's (CUDA rows, or row_ops=True; with
    torch's linear where CUDA linear cannot run) or torch's functions in their structure
    (CPU rows by default, _TorchRowOps)."""
    if state.row_ops is False or not (rows.dtype == model.blocks[0].attn.qkv.weight.dtype
                                      and not torch.is_autocast_enabled(rows.device.type)):
        return None
    if not rows.is_cuda:
        return _TorchRowOps if state.row_ops is None else ops
    if state.traced:  # no probe GEMM in a traced graph: what an eager call found, if any
        return ops if all(_cuda_linear_runs.values()) else _CudaRowOpsTorchLinear
    return ops if _cuda_linear_probe(rows) else _CudaRowOpsTorchLinear


def _forward(model, state: _PatchState, x: torch.Tensor, record: bool = False):
    _check_mode(model)
    row_ops = _use_row_ops(model, state, x)
    tokens = _embed_patches(model.patch_embed, x, row_ops and state.gemm_embed,
                            row_ops and row_ops.linear, state.traced)
    h = _pos_embed(model, tokens) if row_ops and state.direct_pos_embed else \
        model._pos_embed(tokens)
    h = model.norm_pre(model.patch_drop(h))
    B, N, C = h.shape
    cur = _Rows(h.reshape(B * N, C), _uniform_cu(state, B, N, h.device), N, N, num_tokens=N)
    if record:
        cur.origin = torch.arange(B * N, device=h.device) % N
    policy = state.policy
    points = policy.layers if policy is not None else ()
    mid = policy is not None and policy.prune_mid_block
    decisions = []
    stage = 0
    cls_attn = value_norm = keys = None
    for i, blk in enumerate(model.blocks):
        if not mid and stage < len(points) and points[stage] == i:
            cur = _prune(state, cur, i, stage, cls_attn, value_norm, keys)
            if record:
                decisions.append(_decision(cur, B, N))
            stage += 1
        # The attention call that feeds the next pruning point: this block's (mid-block
        # points) or the one before the point (block-input points).
        feeds = stage < len(points) and points[stage] == (i if mid else i + 1)
        cls_attn = None
        if feeds and policy.needs_cls_attn:
            cls_attn = torch.empty(cur.rows.shape[0], dtype=torch.float32, device=h.device)
        dense = (policy is not None and stage == 0 and cls_attn is None and cur.sizes is None
                 and bool(state.dense_until_pruning))
        cur.rows, value_norm, keys = _attention_half(
            blk, cur, state.attention, cls_attn, feeds and policy.needs_value_norm,
            feeds and policy.needs_keys, dense, row_ops, state.traced)
        if mid and feeds:
            cur = _prune(state, cur, i, stage, cls_attn, value_norm, keys)
            if record:
                decisions.append(_decision(cur, B, N))
            stage += 1
        if i == len(model.blocks) - 1 and not state.avg_pool and not h.is_cuda:
            # The head reads the prefix rows alone, so the last MLP runs on those: the
            # rows it skips are about 4% of a DeiT-S forward's linear FLOPs at keep 50%
            # after block 4. CPU rows only, where compute bounds every batch size.
            P = state.num_prefix
            prefix = _gather_prefix(cur.rows, cur.cu_seqlens, P).view(B * P, C)
            cur = _Rows(prefix, _uniform_cu(state, B, P, h.device), P, P)
        cur.rows = _mlp_half(blk, cur.rows, row_ops)
    return _head(model, state, cur), decisions


def _head(model, state: _PatchState, cur: _Rows) -> torch.Tensor:
    if state.avg_pool:
        pooled = _segment_mean(model.norm(cur.rows), cur, state.pool_skip)
        return model.head(model.head_drop(model.fc_norm(pooled)))
    prefix = _gather_prefix(cur.rows, cur.cu_seqlens, state.num_prefix)  # (B, P, C)
    return model.forward_head(model.norm(prefix))


def _prune(state: _PatchState, cur: _Rows, layer: int, stage: int, cls_attn,
           value_norm, keys) -> _Rows:
    """Applies the policy at one pruning point and re-packs the kept rows."""
    batch = TokenBatch(rows=cur.rows, cu_seqlens=cur.cu_seqlens, num_prefix=state.num_prefix,
                       seq_len=cur.seq_len, max_seqlen=cur.max_seqlen, layer=layer, stage=stage,
                       cls_attn=cls_attn, value_norm=value_norm, keys=keys, sizes=cur.sizes,
                       num_tokens=cur.num_tokens)
    if state.traced:
        _fill_cached_properties(batch)
    sel = state.policy.select(batch)
    name = type(state.policy).__name__
    # Contents are checked where reading them costs no device sync (CPU rows) and in debug
    # mode; types and shapes always.
    values = not state.traced and (not cur.rows.is_cuda or ops.is_debug())
    _check_selection(sel, batch, name, values)
    fused_origin = cur.num_tokens + cur.num_fused  # decision-mask column of a new fused token
    if sel.index is not None:
        return _gather_uniform(state, cur, sel.index, sel.fuse_weights, fused_origin,
                               sel.assign)
    if cur.sizes is not None:
        raise ValueError(f"{type(state.policy).__name__}.select: merged tokens (sizes) need "
                         "index Selections")
    keep = (sel.keep | (batch.positions < state.num_prefix)) & (batch.seq_ids < batch.num_seqs)
    max_seqlen = cur.max_seqlen if sel.max_seqlen is None else min(sel.max_seqlen,
                                                                     cur.max_seqlen)
    if sel.fuse_weights is not None:
        new = _repack_rows(cur, keep, max_seqlen + 1, sel.fuse_weights, fused_origin)
    elif cur.seq_len is not None:
        new = _pack_first(cur, keep, max_seqlen)
    else:
        new = _repack_rows(cur, keep, max_seqlen)
    if values and sel.max_seqlen is not None:
        cu = new.cu_seqlens.tolist()
        fused = int(sel.fuse_weights is not None)
        _check_max_seqlen(sel, [b - a - fused for a, b in zip(cu[:-1], cu[1:], strict=True)],
                          name)
    if not state.capacity:
        new = _trim(new)
    return new


# TokenBatch's derived fields (seq_ids, positions, ...): functools.cached_property.
_TOKEN_BATCH_CACHED = tuple(name for name, value in vars(TokenBatch).items()
                            if isinstance(value, functools.cached_property))


def _fill_cached_properties(batch: TokenBatch) -> None:
    """Computes every cached property of batch up front, in a traced forward: on Python
    3.11 functools.cached_property's first access takes a lock, which Dynamo cannot trace;
    a value already in the instance dict is returned without one. Unused ones cost the
    compiled graph nothing (dead code)."""
    for name in _TOKEN_BATCH_CACHED:
        vars(batch)[name] = getattr(TokenBatch, name).func(batch)


def _decision(cur: _Rows, num_seqs: int, num_tokens: int) -> torch.Tensor:
    """The decision of the pruning point that made `cur` (forward_with_decisions' format):
    (B, N + F) bool, which embedded tokens (and which of the F fused tokens made so far,
    columns N..N+F-1) the packed rows hold, rows past the total ignored; after a merge,
    (B, N + F) int64, for every token alive before it the column of the token it merged
    into (its own when kept), -1 for tokens gone earlier."""
    if cur.merged is not None:
        return cur.merged
    batch = TokenBatch(rows=cur.rows, cu_seqlens=cur.cu_seqlens, num_prefix=0,
                       seq_len=cur.seq_len, max_seqlen=cur.max_seqlen, layer=0, stage=0)
    width = num_tokens + cur.num_fused
    seq = batch.seq_ids
    flat = torch.where(seq < num_seqs, seq * width + cur.origin, num_seqs * width)
    mask = torch.zeros(num_seqs * width + 1, dtype=torch.bool, device=seq.device)
    mask.scatter_(0, flat, True)  # not mask[flat] = True: CUDA index_put_ syncs the host
    return mask[:-1].view(num_seqs, width)


# ---- token movement ----


def _gather_uniform(state: _PatchState, cur: _Rows, index: torch.Tensor, fuse_weights=None,
                    fused_origin: int = 0, assign=None) -> _Rows:
    """Fixed counts: (B, L) rows -> the (B, k) positions of `index` (plus one fused row per
    image when fuse_weights is given; size-weighted merges when assign is); sync-free."""
    B, k = index.shape
    L, C = cur.seq_len, cur.rows.shape[1]
    x = cur.rows.view(B, L, C)
    sizes = None
    if assign is not None:
        rows, sizes = _merge(x, cur.sizes, assign, k)
        sizes = sizes.reshape(-1)
    else:
        rows = x.gather(1, index[:, :, None].expand(B, k, C))
        if cur.sizes is not None:
            sizes = cur.sizes.view(B, L).gather(1, index).reshape(-1)
    origin = merged = None
    if cur.origin is not None:
        old_origin = cur.origin.view(B, L)
        origin = old_origin.gather(1, index)
        if assign is not None:  # decision: the origin of the slot each token merges into
            merged = torch.full((B, cur.num_tokens + cur.num_fused), -1, dtype=torch.int64,
                                device=x.device).scatter_(1, old_origin,
                                                          origin.gather(1, assign))
    num_fused = cur.num_fused
    if fuse_weights is not None:
        if sizes is not None:
            raise ValueError("ragvit.patch: fusion of merged tokens (sizes) is not supported")
        dropped = torch.ones(B, L, dtype=torch.bool, device=x.device).scatter_(1, index, False)
        fused = _fuse(x, fuse_weights.view(B, L), dropped)
        rows = torch.cat([rows, fused[:, None]], dim=1)
        k, num_fused = k + 1, num_fused + 1
        if origin is not None:
            origin = torch.cat([origin, origin.new_full((B, 1), fused_origin)], dim=1)
    origin = origin.reshape(-1) if origin is not None else None
    return _Rows(rows.reshape(B * k, C), _uniform_cu(state, B, k, rows.device), k, k, origin,
                 cur.num_tokens, num_fused, sizes, merged)


def _merge(x: torch.Tensor, sizes, assign: torch.Tensor, k: int):
    """Size-weighted merge of padded x (B, L, C) into k slots per image (float32 sums).

    Returns:
        ((B, k, C) of x's dtype, (B, k) float32 sizes).
    """
    B, L, C = x.shape
    s = torch.ones(B, L, device=x.device) if sizes is None else sizes.view(B, L)
    total = torch.zeros(B, k, device=x.device).scatter_add_(1, assign, s)
    acc = torch.zeros(B, k, C, device=x.device).scatter_add_(
        1, assign[:, :, None].expand(B, L, C), x.float() * s[:, :, None])
    return (acc / total[:, :, None]).to(x.dtype), total


def _fuse(x: torch.Tensor, weights: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """(B, C) sum(w x) / sum(w) over the dropped tokens of padded x (B, L, C), in float32,
    zeros where sum(w) == 0 (ragvit.repack's fusion rule); x's dtype."""
    w = torch.where(dropped, weights.float(), torch.zeros((), device=x.device))
    total = w.sum(1, keepdim=True)
    nonzero = total != 0  # for weights of any sign
    fused = torch.einsum("bl,blc->bc", w, x.float()) / torch.where(nonzero, total, 1.0)
    return torch.where(nonzero, fused, 0.0).to(x.dtype)


def _pack_first(cur: _Rows, keep: torch.Tensor, max_seqlen: int) -> _Rows:
    """Mask over (B, L) rows -> packed capacity buffers, through ragvit.pack_into."""
    B = cur.cu_seqlens.shape[0] - 1
    L = cur.seq_len
    T, C = cur.rows.shape
    out = torch.empty_like(cur.rows)
    cu = torch.empty(B + 1, dtype=torch.int32, device=out.device)
    idx = torch.zeros(T, dtype=torch.int32, device=out.device)
    ops.pack_into(cur.rows.view(B, L, C), keep.view(B, L), out, cu, indices=idx)
    origin = None
    if cur.origin is not None:
        new = TokenBatch(rows=out, cu_seqlens=cu, num_prefix=0, seq_len=None,
                         max_seqlen=max_seqlen, layer=0, stage=0)
        src = new.seq_ids.clamp(max=B - 1) * L + idx.long().clamp(0, L - 1)
        origin = cur.origin[src]
    return _Rows(out, cu, None, max_seqlen, origin, cur.num_tokens, cur.num_fused)


def _repack_rows(cur: _Rows, keep: torch.Tensor, max_seqlen: int, fuse_weights=None,
                 fused_origin: int = 0) -> _Rows:
    """Mask over packed rows -> packed rows via ragvit.repack_into (capacity T, or T + B
    with fusion: one fused row appended per image)."""
    T, C = cur.rows.shape
    B = cur.cu_seqlens.shape[0] - 1
    capacity = T + (B if fuse_weights is not None else 0)
    out = torch.empty(capacity, C, dtype=cur.rows.dtype, device=cur.rows.device)
    cu = torch.empty(B + 1, dtype=torch.int32, device=out.device)
    src = torch.zeros(capacity, dtype=torch.int32, device=out.device)  # rows past the total: 0
    kwargs = {} if fuse_weights is None else {"fuse_weights": fuse_weights.float()}
    ops.repack_into(cur.rows, cur.cu_seqlens, keep, out, cu, src=src, **kwargs)
    origin = None
    if cur.origin is not None:
        s = src.long()
        origin = torch.where(s >= 0, cur.origin[s.clamp(min=0)], fused_origin)
    num_fused = cur.num_fused + (fuse_weights is not None)
    return _Rows(out, cu, None, max_seqlen, origin, cur.num_tokens, num_fused)


def _trim(cur: _Rows) -> _Rows:
    """Eager, data-dependent counts: one host read of cu_seqlens; rows cut to the total."""
    cu = cur.cu_seqlens.tolist()
    total = cu[-1]
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
    origin = cur.origin[:total] if cur.origin is not None else None
    return _Rows(cur.rows[:total], cur.cu_seqlens, None, max(longest, 1), origin,
                 cur.num_tokens, cur.num_fused, cur.sizes)


def _gather_prefix(rows: torch.Tensor, cu_seqlens: torch.Tensor, num_prefix: int):
    """(B, P, C) first P rows of every image (prefix rows are never pruned)."""
    return ops.gather_prefix(rows, cu_seqlens, num_prefix)


def _segment_mean(rows: torch.Tensor, cur: _Rows, skip: int) -> torch.Tensor:
    """(B, C) mean of each image's rows from position `skip` on (float32 sums)."""
    return ops.segment_mean(rows, cur.cu_seqlens, skip=skip)
