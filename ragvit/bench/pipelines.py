"""The pipelines a pruned-ViT benchmark compares, and the correctness check run before timing.

Each pipeline is one forward of a timm VisionTransformer on (B, 3, H, W) images: timm's own
(eager or one CUDA graph), ragvit.reference's padded-masked one, the paper's syncing packer
with FA2 varlen, ragvit's packed pipeline with FA2 varlen as attention, ragvit.patch (eager,
through ragvit.cuda_graph, or compiled by torch.compile). `check` compares each with the
reference replaying that pipeline's own pruning decisions, so rounding cannot flip a choice
between the two. torch and timm are imported inside the functions: importing ragvit.bench
needs neither.
"""

from __future__ import annotations

import contextlib
import math

__all__ = [
    "COMPILED", "COMPILE_REDUCE_OVERHEAD_MAX_BATCH", "DTYPES", "EXACT_FLOOR", "GPU_ONLY",
    "MODELS", "PIPELINES", "TOLERANCE", "UNPRUNED", "check", "compile_mode", "compile_options",
    "compiled",
    "dense_gather_forward", "dense_gather_unsupported", "fa2_attention", "fa2_attention_cls",
    "fa2_attention_for", "fa2_unsupported", "graphed", "kept_decisions", "load_model",
    "make_pipeline",
    "make_policy", "max_err", "model_problem", "own_decisions_err", "paper_forward", "patched",
    "timm_forward", "torch_dtype",
]

# Aliases for the timm names (any other timm VisionTransformer name works as well).
MODELS = {
    "deit_t": "deit_tiny_patch16_224",
    "deit_s": "deit_small_patch16_224",
    "deit_b": "deit_base_patch16_224",
    "deit_b384": "deit_base_patch16_384",
}
# timm_eager        the unpruned timm model (its own forward)
# timm_graph        the same, replayed as one CUDA graph (GPU only)
# timm_compiled     the same under torch.compile (compile_mode: reduce-overhead at batch <= 16)
# reference         ragvit.reference.vit_forward_reference: the same pruning on padded tensors
#                   with key-padding masks and SDPA (what users write without ragvit)
# dense_gather      fixed keep counts only: timm's own blocks on the kept tokens gathered
#                   into a dense (B, P + k, C) batch (dense_gather_forward)
# dense_gather_compiled  the same under torch.compile: the strongest alternative for fixed
#                   counts (reduce-overhead at batch <= 16, default above)
# paper_fa2         the paper's FA2-varlen baseline pipeline (paper_forward), not the paper's
#                   Triton method: its syncing packer (three host syncs) and FA2 varlen on
#                   torch's modules (GPU only; ThresholdL2 with a fixed keep, one pruning point)
# fa2_packed        ragvit's packed pipeline with torch's FA2 varlen as attention and torch's
#                   modules (GPU only)
# fa2_packed_graph  the same replayed as one CUDA graph (GPU only; fixed counts)
# ragvit            ragvit.patch(model, policy), eager
# ragvit_graph      the same through ragvit.cuda_graph, one CUDA graph per batch size (GPU
#                   only; data-dependent policies, e.g. a ThresholdL2 threshold, run in
#                   capacity mode)
# ragvit_compiled   torch.compile(patched model, fullgraph=True), in compile_mode(batch):
#                   capacity mode as ragvit_graph
PIPELINES = ("timm_eager", "timm_graph", "timm_compiled", "reference", "dense_gather",
             "dense_gather_compiled", "paper_fa2", "fa2_packed", "fa2_packed_graph", "ragvit",
             "ragvit_graph", "ragvit_compiled")
GPU_ONLY = ("timm_graph", "paper_fa2", "fa2_packed", "fa2_packed_graph", "ragvit_graph")
UNPRUNED = ("timm_eager", "timm_graph", "timm_compiled")
# compiled once per model and batch before timing (tens of seconds each): on the CPU, run
# only when named
COMPILED = ("timm_compiled", "dense_gather_compiled", "ragvit_compiled")
# torch.compile's mode: reduce-overhead (CUDA graphs) up to this batch on CUDA (compile_mode)
COMPILE_REDUCE_OVERHEAD_MAX_BATCH = 16
DTYPES = ("fp32", "fp16", "bf16")
# max |dlogit| allowed against the reference (fp16: a patched DeiT on the GPU).
TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}
# The additive floor of check()'s fp32-relative rule (tests/support/tolerances.py ERROR_FLOOR).
EXACT_FLOOR = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 8e-3}


def make_policy(keep: float | None = 0.5, threshold: float | None = None,
                layers=(4,)):
    """ThresholdL2 with a fixed keep ratio (threshold None) or a per-image threshold."""
    from ..pruning import ThresholdL2

    if threshold is not None:
        return ThresholdL2(threshold=threshold, layers=tuple(layers))
    return ThresholdL2(keep, layers=tuple(layers))


def model_problem(name: str, img_size: int | None = None) -> str | None:
    """Why ragvit.bench cannot run timm model `name` (one line), or None when it can.

    The model must be a timm VisionTransformer or VisionTransformerDistilled (the
    vision_transformer and deit modules) that ragvit.patch accepts; the second check
    builds the model on torch's meta device, so it costs neither memory nor init time.
    """
    import timm
    import torch
    from timm.models import is_model_in_modules

    from ..timm_patch import UnsupportedModelError, _check_supported

    if not timm.is_model(name):
        return f"unknown timm model {name!r}"
    if not is_model_in_modules(name, ("vision_transformer", "deit")):
        return (f"{name} is not a ViT/DeiT; ragvit.bench runs timm VisionTransformer and "
                f"VisionTransformerDistilled models: the aliases {', '.join(MODELS)} or a name "
                "from timm.list_models(module=['vision_transformer', 'deit']), e.g. "
                "vit_small_patch16_224, deit_small_distilled_patch16_224")
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False,
                                      **({"img_size": img_size} if img_size else {}))
        _check_supported(model)
    except UnsupportedModelError as e:
        return f"{name}: {e}"
    return None


def load_model(name: str, img_size: int, dtype: str = "fp32", device: str = "cpu",
               seed: int = 0):
    """A random-init timm model (pretrained=False) in eval, cast to dtype on device."""
    import timm
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, img_size=img_size)
    return model.eval().to(device=device, dtype=torch_dtype(dtype))


def torch_dtype(name: str):
    """The torch dtype of a DTYPES name."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def fa2_attention(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, out=None, cls_attn=None):
    """ragvit.attention's signature on torch's FA2 varlen kernel (no cls_attn)."""
    import torch

    if cls_attn is not None:
        raise ValueError("fa2_attention: FA2 varlen gives no cls_attn")
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale)[0]


def fa2_attention_cls(q, k, v, cu_seqlens, max_seqlen=None, *, scale=None, out=None,
                      cls_attn=None, bias=None):
    """fa2_attention plus, when asked, the head-mean CLS attention row.

    FA2 varlen returns no probabilities, so a user of it computes what EViT/ATS score with
    in torch: each sequence's first query against its keys, a segment softmax, the mean
    over heads (about ten small ops per attention call; counted in fa2_packed's time).

    Args:
        q, k, v: (T, H, D) views; cu_seqlens: (S+1,) int32; cls_attn: (T,) float32 out.

    Raises:
        ValueError: bias given (FA2 varlen has no per-key bias: ToMe cannot run on it).
    """
    import torch

    if bias is not None:
        raise ValueError("fa2_attention_cls: FA2 varlen takes no per-key bias "
                         "(ToMe's proportional attention)")
    o = fa2_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale)
    if cls_attn is not None:
        T, H, D = q.shape
        S = cu_seqlens.numel() - 1
        scale = scale if scale is not None else D ** -0.5
        seq = torch.repeat_interleave(torch.arange(S, device=q.device), cu_seqlens.diff(),
                                      output_size=T)
        first = q[cu_seqlens[:-1].long()].float()  # (S, H, D)
        logits = (first[seq] * k.float()).sum(-1) * scale  # (T, H)
        idx = seq[:, None].expand(-1, H)
        peak = torch.full((S, H), -math.inf, device=q.device).scatter_reduce(
            0, idx, logits, reduce="amax")
        e = torch.exp(logits - peak[seq])
        total = torch.zeros(S, H, device=q.device).index_add_(0, seq, e)
        cls_attn.copy_((e / total[seq]).mean(1))
    if out is not None:
        out.copy_(o)
        return out
    return o


def fa2_unsupported(policy) -> str | None:
    """Why the FA2 pipelines cannot run `policy`, or None when they can."""
    return ("FA2 varlen takes no per-key bias (ToMe's proportional attention)"
            if policy is not None and policy.needs_keys else None)


def fa2_attention_for(policy):
    """The FA2 attention for `policy`: fa2_attention_cls where it reads the CLS attention
    row (EViT, ATS), fa2_attention otherwise."""
    return fa2_attention_cls if policy is not None and policy.needs_cls_attn else fa2_attention

def paper_forward(model, x, policy, attention=None, *, return_decisions: bool = False):
    """The paper's pruned pipeline, as its code runs it: timm's blocks on the padded batch up
    to the pruning point, then the paper's packer (counts, cumsum, ``.item()`` for the total
    and for max_seqlen, ``nonzero``, ``index_select``: three host syncs, data-dependent
    shapes, so no CUDA graph) and the remaining blocks on packed rows with torch's modules
    and FA2 varlen attention: the paper's FA2-varlen baseline, not its Triton method (which
    the paper measures at the same throughput). Its decisions equal ThresholdL2's (ties
    keep the earlier token); the paper's own code scores all N tokens, CLS included, keeps
    int(N * r) and then forces CLS in, which can keep one token more or fewer.

    Args:
        model: a timm VisionTransformer with a class token, in eval.
        x: (B, 3, H, W) images.
        policy: ThresholdL2 with a fixed keep ratio and one pruning point.
        attention: ragvit.attention's signature (default fa2_attention; tests pass a CPU one).
        return_decisions: also return its decision, [keep] with keep the (B, N) bool mask of
            kept tokens (forward_with_decisions' format, for vit_forward_reference).

    Returns:
        (B, num_classes) logits, or (logits, [keep]) with return_decisions.

    Raises:
        ValueError: another policy, or more than one pruning point.
    """
    import torch

    from ..pruning import ThresholdL2, kept_count

    if not isinstance(policy, ThresholdL2) or policy.keep is None or len(policy.layers) != 1:
        raise ValueError(f"paper_forward: the paper's pipeline prunes once with a fixed keep "
                         f"ratio (ThresholdL2(keep=r, layers=(i,))), got {policy!r}")
    attention = fa2_attention if attention is None else attention
    layer, P = policy.layers[0], int(model.num_prefix_tokens)
    h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    for blk in model.blocks[:layer]:
        h = blk(h)
    B, N, C = h.shape
    scores = torch.linalg.vector_norm(h[:, P:], dim=-1, dtype=torch.float32)
    # stable descending sort: equal scores keep the earlier token, as topk_selection does
    top = torch.sort(scores, dim=1, descending=True, stable=True).indices
    top = top[:, :kept_count(policy.keep[0], N - P)] + P
    keep = torch.zeros(B, N, dtype=torch.bool, device=h.device)
    keep[:, :P] = True
    keep.scatter_(1, top, True)
    counts = keep.sum(1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    total = int(cu_seqlens[-1].item())  # host sync 1
    max_seqlen = int(counts.max().item())  # host sync 2
    # host sync 3: nonzero sizes its output from the device
    rows = h.reshape(B * N, C).index_select(0, keep.reshape(-1).nonzero().squeeze(1))
    for blk in model.blocks[layer:]:
        attn = blk.attn
        qkv = attn.qkv(blk.norm1(rows)).view(total, 3, attn.num_heads, attn.head_dim)
        q, k, v = qkv.unbind(1)
        o = attention(q, k, v, cu_seqlens, max_seqlen, scale=attn.scale)
        o = attn.proj_drop(attn.proj(o.reshape(total, attn.attn_dim)))
        rows = rows + blk.drop_path1(blk.ls1(o))
        rows = rows + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(rows))))
    first = cu_seqlens[:-1].long()[:, None] + torch.arange(P, device=rows.device)
    logits = model.forward_head(model.norm(rows[first]))
    return (logits, [keep]) if return_decisions else logits


def dense_gather_unsupported(policy) -> str | None:
    """Why dense_gather cannot run `policy`, or None: it needs the same kept count in every
    image (ThresholdL2 with a keep ratio, pruning at block inputs)."""
    from ..pruning import ThresholdL2

    if isinstance(policy, ThresholdL2) and policy.keep is not None:
        return None
    return (f"dense_gather runs fixed keep counts (ThresholdL2(keep=...)), not "
            f"{type(policy).__name__}" + (" with a threshold" if isinstance(
                policy, ThresholdL2) else ""))


def dense_gather_forward(model, x, policy, *, return_decisions: bool = False,
                         return_kept: bool = False):
    """The strongest pruned forward a torch user writes for fixed keep counts: timm's own
    blocks (SDPA, cuDNN) on a dense (B, P + k, C) batch, the kept tokens gathered at each
    pruning point by ThresholdL2's rule (the L2 norm of the block input, top-k, ties to the
    earlier token, kept tokens in position order). Nothing is ragged, nothing syncs the
    host: CUDA graphs and torch.compile take it whole.

    Args:
        model: a timm VisionTransformer with a class token, in eval.
        x: (B, 3, H, W) images.
        policy: ThresholdL2 with a keep ratio (dense_gather_unsupported says why not).
        return_decisions: also return the decisions in forward_with_decisions' format (per
            pruning point, (B, N) bool over the embedded tokens still held).
        return_kept: also return, per pruning point, the (B, P + k) int64 positions of the
            tokens kept there among the N embedded ones (kept_decisions turns them into
            decisions): one (B, P + k) int64 tensor per pruning point, which eager computes
            anyway and a compiled forward writes only when it returns them.

    Returns:
        (B, num_classes) logits, or (logits, decisions) with return_decisions, or
        (logits, kept) with return_kept.
    """
    import torch

    from ..pruning import kept_count

    why = dense_gather_unsupported(policy)
    if why is not None:
        raise ValueError(f"dense_gather_forward: {why}")
    P = int(model.num_prefix_tokens)
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    B, N, C = h.shape
    origin = torch.arange(N, device=h.device).expand(B, N)
    kept, stage = [], 0
    for i, blk in enumerate(model.blocks):
        if stage < len(policy.layers) and policy.layers[stage] == i:
            scores = torch.linalg.vector_norm(h[:, P:], dim=-1, dtype=torch.float32)
            k = kept_count(policy.keep[stage], h.shape[1] - P)
            top = torch.sort(torch.topk(scores, k, dim=1, sorted=False).indices, dim=1).values
            index = torch.cat([torch.arange(P, device=h.device).expand(B, P), top + P], 1)
            h = torch.gather(h, 1, index[:, :, None].expand(-1, -1, C))
            origin = torch.gather(origin, 1, index)
            kept.append(origin)
            stage += 1
        h = blk(h)
    logits = model.forward_head(model.norm(h))
    if return_decisions:
        return logits, kept_decisions(kept, N)
    return (logits, tuple(kept)) if return_kept else logits


def kept_decisions(kept, num_tokens: int) -> list:
    """dense_gather_forward's kept positions (per pruning point, (B, P + k)) as decisions in
    forward_with_decisions' format: per pruning point, (B, num_tokens) bool."""
    import torch

    return [torch.zeros(k.shape[0], num_tokens, dtype=torch.bool, device=k.device)
            .scatter_(1, k, True) for k in kept]


@contextlib.contextmanager
def patched(model, policy, attention=None):
    """ragvit.patch for the duration of a with block. With a replacement attention (the
    FA2 pipelines) the blocks keep torch's LayerNorm / Linear / GELU modules, as a user
    writing that pipeline would (row_ops=False); ragvit itself runs with patch's default
    (ragvit's row ops on CUDA; on the CPU, attention through torch's SDPA and the row ops
    through torch's functions)."""
    from .. import timm_patch

    timm_patch.patch(model, policy, attention=attention,
                     row_ops=None if attention is None else False)
    try:
        yield model
    finally:
        timm_patch.unpatch(model)


def timm_forward(model, x):
    """The unpatched timm forward, whatever instance attribute patch() set."""
    return type(model).forward(model, x)


def graphed(fn, x):
    """fn(static_x) captured as one CUDA graph; returns run(inp=x) that copies in, replays."""
    import torch

    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)

    def run(inp=x):
        static_x.copy_(inp)
        graph.replay()
        return out

    run.graph = graph  # keep the graph alive as long as the callable
    return run


def compile_options(variant: str) -> dict:
    """torch.compile's options for a variant "MODE" or "MODE+freezing": the mode's own
    Inductor options (torch._inductor.list_mode_options), plus Inductor freezing where named
    (docs/compile.md).

    Raises:
        ValueError: an unknown mode or suffix.
    """
    import torch

    mode, _, extra = variant.partition("+")
    if extra not in ("", "freezing"):
        raise ValueError(f"unknown variant {variant!r}: MODE or MODE+freezing")
    try:
        options = torch._inductor.list_mode_options(mode)
    except RuntimeError as exc:  # an unknown mode
        raise ValueError(f"unknown variant {variant!r}: {exc}") from None
    return {**options, **({"freezing": True} if extra else {})}


def compile_mode(batch: int, device: str) -> str:
    """The compiled pipelines' torch.compile mode: "reduce-overhead" (CUDA graphs: the
    forward is host-bound) on CUDA up to COMPILE_REDUCE_OVERHEAD_MAX_BATCH images, else
    "default" (max-autotune would autotune every GEMM shape of the model, minutes per model
    and batch on an H200, beyond what one benchmark run spends on a baseline's compile)."""
    small = batch <= COMPILE_REDUCE_OVERHEAD_MAX_BATCH
    return "reduce-overhead" if device == "cuda" and small else "default"


def compiled(fn, x):
    """torch.compile(fn, fullgraph=True, dynamic=False) in compile_mode, compiled on x now
    and called twice more (reduce-overhead records its CUDA graph on the second call and
    replays it from the third), so no timed call includes compilation. Dynamo's caches are
    reset first: every patched model shares its forward's code, and past the recompile
    limit Dynamo refuses to compile it (fullgraph=True); compiled artifacts of an earlier
    identical graph come back from Inductor's cache in seconds. The reset also drops what
    pipelines set up before compiled: they compile again on their next call, a warm-up call
    where several are timed side by side (timing.interleaved_ms warms every one up after all
    are set up)."""
    import torch

    torch._dynamo.reset()
    run = torch.compile(fn, fullgraph=True, dynamic=False,
                        mode=compile_mode(x.shape[0], x.device.type))
    for _ in range(3):
        run(x)
    return run


@contextlib.contextmanager
def make_pipeline(name: str, model, policy, x):
    """Yields a no-argument callable running pipeline `name` on x (patching inside the block)."""
    from .. import reference

    if name == "timm_eager":
        yield lambda: timm_forward(model, x)
    elif name == "timm_graph":
        yield graphed(lambda inp: timm_forward(model, inp), x)
    elif name == "timm_compiled":
        run = compiled(lambda inp: timm_forward(model, inp), x)
        yield lambda: run(x)
    elif name == "dense_gather":
        yield lambda: dense_gather_forward(model, x, policy)
    elif name == "dense_gather_compiled":
        # The compiled forward also returns its kept positions: check() replays the decisions
        # it made itself (its fp32 norms, reduced in Inductor's order, may rank a near-tie
        # the other way than eager's); the cost is one small index tensor per pruning point.
        run = compiled(lambda inp: dense_gather_forward(model, inp, policy, return_kept=True),
                       x)

        def call():
            return run(x)[0]

        def with_decisions():
            logits, kept = run(x)
            return logits.clone(), kept_decisions(kept, model.patch_embed.num_patches
                                                  + int(model.num_prefix_tokens))

        call.with_decisions = with_decisions
        yield call
    elif name == "reference":
        yield lambda: reference.vit_forward_reference(model, x, policy)
    elif name == "fa2_packed":
        with patched(model, policy, attention=fa2_attention_for(policy)):
            yield lambda: model(x)
    elif name == "fa2_packed_graph":
        with patched(model, policy, attention=fa2_attention_for(policy)):
            yield graphed(model, x)
    elif name == "paper_fa2":
        yield lambda: paper_forward(model, x, policy)
    elif name == "ragvit":
        with patched(model, policy):
            yield lambda: model(x)
    elif name == "ragvit_graph":
        from ..graph import cuda_graph

        with patched(model, policy):
            # clone_output=False: the static output, like timm_graph (`graphed`) returns.
            run = cuda_graph(model, clone_output=False)
            run(x)  # capture now, as `graphed` does, so no timed call includes it
            yield lambda: run(x)
    elif name == "ragvit_compiled":
        with patched(model, policy):
            run = compiled(model, x)
            yield lambda: run(x)
    else:
        raise ValueError(f"unknown pipeline {name!r}; choose from {', '.join(PIPELINES)}")


def max_err(a, b) -> float:
    """max |a - b| over all elements, computed in float64 (a and b: tensors of one shape)."""
    return float((a.double() - b.double()).abs().max())


def _replay_err(model, x, policy, logits, decided) -> float:
    """max |dlogit| of a pipeline's logits against the reference replaying its decisions."""
    from .. import reference

    return max_err(logits, reference.vit_forward_reference(model, x, policy, decisions=decided))


def own_decisions(model, x, policy, attention):
    """(logits, decisions) of ragvit's packed pipeline with a replacement attention (an FA2
    pipeline)."""
    from .. import timm_patch

    with patched(model, policy, attention=attention):
        return timm_patch.forward_with_decisions(model, x)


def own_decisions_err(model, x, policy, attention) -> float:
    """max |dlogit| of ragvit's packed pipeline with a replacement attention (an FA2
    pipeline) against the reference replaying that pipeline's own decisions."""
    return _replay_err(model, x, policy, *own_decisions(model, x, policy, attention))


def check(model, x, policy, pipelines, dtype: str = "fp32") -> dict:
    """Every pipeline's max |dlogit| against the padded-masked reference, before timing.

    Pruned pipelines compare with the reference replaying their decisions (so numerical
    noise cannot flip a choice): ragvit's for ragvit, ragvit_graph and ragvit_compiled,
    their own for paper_fa2, fa2_packed, dense_gather and dense_gather_compiled (torch's
    modules and Inductor's reductions may rank a near-tie the other way in fp16), their eager
    form's for the other graphed and compiled forms; unpruned ones with the unpruned reference.

    Returns:
        {"err": {pipeline: float or None}, "unavailable": {pipeline: reason},
         "err_exact" and "err_reference_exact": {pipeline: float} (fp16/bf16, for the
         pruned pipelines past TOLERANCE), "decisions_agree", "top1_agree" (ragvit vs
         reference), "kept_fraction", "ok"}.
        ok: every pipeline that ran (in fp16/bf16 the reference on its own decisions
        excepted: near-ties may flip them) is within TOLERANCE[dtype] of the reference, or, in
        fp16/bf16, a pruned pipeline that is not is at least as close to the truth as the
        reference itself by flash-attention's rule: against the same forward in fp32 (an
        fp32 copy of the model, on that pipeline's decisions), err_exact <= 2 *
        err_reference_exact + EXACT_FLOOR[dtype], err_reference_exact being the fp16/bf16
        reference's own error on those decisions (ragvit's row ops add the residual in the
        GEMM, before rounding, and Inductor and cuDNN order their sums their own way, so at
        large widths and batches a pipeline can sit just past TOLERANCE from the fp16
        reference while being closer to fp32 than that reference is); and ragvit ran.
        top1_agree is reported only: the error bound already limits a top-1 flip to images
        whose top-2 margin is within twice it (near-ties). A baseline that
        cannot run here (e.g. FA2 in fp32) is listed in "unavailable", not failed.
    """
    import copy

    from .. import reference, timm_patch

    with patched(model, policy):
        ours, decided = timm_patch.forward_with_decisions(model, x)
    replayed = reference.vit_forward_reference(model, x, policy, decisions=decided)
    ref, ref_decided = reference.vit_forward_reference(model, x, policy, return_decisions=True)
    dense = None
    # judged_on[name]: (logits, decisions, the fp16/bf16 reference on those decisions) of a
    # pruned pipeline, for the fp32-relative rule below
    err, unavailable, judged_on = {}, {}, {}

    def replay(name, logits, own):
        judged_on[name] = (logits.clone(), own,  # a graph's static output gets reused
                           reference.vit_forward_reference(model, x, policy, decisions=own))
        return max_err(logits, judged_on[name][2])

    for name in pipelines:
        try:
            # the baselines against the reference replaying their own decisions
            if name == "fa2_packed":
                err[name] = replay(name, *own_decisions(model, x, policy,
                                                        fa2_attention_for(policy)))
                continue
            if name == "paper_fa2":
                err[name] = replay(name, *paper_forward(model, x, policy, return_decisions=True))
                continue
            # the graphed and compiled forms against the reference replaying the decisions
            # of their eager form (the same computation)
            if name == "fa2_packed_graph":
                _, own = own_decisions(model, x, policy, fa2_attention_for(policy))
            elif name == "dense_gather":
                _, own = dense_gather_forward(model, x, policy, return_decisions=True)
            elif name == "dense_gather_compiled":
                with make_pipeline(name, model, policy, x) as fn:
                    err[name] = replay(name, *fn.with_decisions())
                continue
            if name in ("fa2_packed_graph", "dense_gather"):
                with make_pipeline(name, model, policy, x) as fn:
                    err[name] = replay(name, fn(), own)
                continue
            with make_pipeline(name, model, policy, x) as fn:
                logits = fn()
            if name in UNPRUNED:
                if dense is None:
                    dense = reference.vit_forward_reference(model, x, None)
                err[name] = max_err(logits, dense)
            elif name == "reference":
                err[name] = max_err(ref, replayed)
            else:
                judged_on[name] = (logits.clone(), decided, replayed)
                err[name] = max_err(logits, replayed)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            unavailable[name] = f"{type(e).__name__}: {e}"
            err[name] = None
    agree = ours.argmax(1) == replayed.argmax(1)
    tol = TOLERANCE[dtype]
    # The fp32-relative rule, for each pruned pipeline past tol: the same forward in fp32 on
    # that pipeline's own decisions (one fp32 copy of the model; decisions shared by several
    # pipelines are run once), and the fp16/bf16 reference's own error against it.
    err_exact, err_reference_exact = {}, {}
    past = [n for n, e in err.items() if e is not None and e > tol and n in judged_on]
    if dtype != "fp32" and past:
        model32 = copy.deepcopy(model).float()
        exact_of = {}
        for name in past:
            logits, own, replayed_own = judged_on[name]
            key = id(own)
            if key not in exact_of:
                exact_of[key] = reference.vit_forward_reference(model32, x.float(), policy,
                                                                decisions=own)
            err_exact[name] = max_err(logits, exact_of[key])
            err_reference_exact[name] = max_err(replayed_own, exact_of[key])
        del model32

    def within(name, e):
        if e is None or e <= tol:
            return True
        return (name in err_exact
                and err_exact[name] <= 2 * err_reference_exact[name] + EXACT_FLOOR[dtype])

    # "reference" is the reference on its own decisions against it replaying ragvit's: in
    # fp16/bf16 a near-tie in the scores may flip a decision (reported: decisions_agree).
    # Top-1 agreement is reported, not judged: with every logit within the error a row is
    # accepted with, e, a flip can only happen where the top-2 margin is within 2e.
    judged = {n: e for n, e in err.items() if dtype == "fp32" or n != "reference"}
    ok = all(within(name, e) for name, e in judged.items()) and err.get("ragvit", 0.0) is not None
    return {
        "err": err,
        "unavailable": unavailable,
        "err_exact": err_exact,
        "err_reference_exact": err_reference_exact,
        "err_ragvit_vs_reference": max_err(ours, replayed),
        "decisions_agree": all(bool((a == b).all())
                               for a, b in zip(decided, ref_decided, strict=True)),
        "top1_agree": float(agree.float().mean()),
        "kept_fraction": float(timm_patch.kept_mask(decided[-1]).float().mean()),
        "tolerance": tol,
        "ok": ok,
    }
