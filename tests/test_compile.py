"""torch.compile and torch.export of patched models, and the torch custom ops they trace.

Every overload of torch.ops.ragvit passes torch.library.opcheck (schema, fake kernel,
functionalization) on CPU tensors with ragged lengths that include 1 and 197. A patched DeiT-Tiny
traces with no graph break (torch._dynamo.explain) for every policy of ragvit.pruning;
torch.compile(fullgraph=True) and torch.export.export (strict and not) of it equal eager to
rounding: err(traced) <= 2 * err(eager) + floor against the padded reference replaying
eager's decisions (fp32 on the CPU; on the GPU an fp32 reference of the fp16 model). The GPU
cases compile DeiT-S/B in fp16 (default and reduce-overhead). Compiling is slow on two cores
(tens of seconds a model), so the CPU cases are few.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from support.devices import requires_cuda
from support.inputs import make_cu_seqlens, random_lengths, seed_note
from support.tolerances import ERROR_FLOOR

timm = pytest.importorskip("timm")

from support.models import images, make_model, max_diff, top1_agrees  # noqa: E402

import ragvit  # noqa: E402
from ragvit import library, pruning, reference, timm_patch  # noqa: E402
from ragvit.bench import pipelines  # noqa: E402
from ragvit.pruning import ATS, DynamicViT, DynamicViTPredictor, EViT, ThresholdL2, ToMe  # noqa: E402
from ragvit.timm_patch import patch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "fresh_dynamo")

IMG = 64  # DeiT-Tiny at 64 px: 16 patch tokens; compile time does not depend on it


def random_predictors(embed_dim: int, stages: int = 3) -> torch.nn.ModuleList:
    return torch.nn.ModuleList(DynamicViTPredictor(embed_dim) for _ in range(stages))


# One entry per policy class of ragvit.pruning (test_every_policy_is_listed), ThresholdL2 in
# both modes; "none" is the lossless path.
POLICIES = {
    "none": lambda: None,
    "l2_keep": lambda: ThresholdL2(0.5, layers=(4,)),
    "l2_threshold": lambda: ThresholdL2(threshold=1.0, layers=(4,)),  # data-dependent counts
    "evit": lambda: EViT(0.7, layers=(3, 6, 9)),
    "ats": lambda: ATS(8, layers=(3,)),  # data-dependent counts
    "tome": lambda: ToMe(2, layers=(2, 5)),
    "dynamicvit": lambda: DynamicViT(predictor=random_predictors(192)),
}


def c_attention(*args, **kwargs):
    """ragvit.attention behind a wrapper: on the CPU the patched forward then calls ragvit's
    attention (and cls_attn) as on CUDA instead of torch's SDPA."""
    return ragvit.attention(*args, **kwargs)


# ---- torch.library.opcheck on every overload ----


def _opcheck_cases(gen):
    """{case: (overload, args, kwargs)} on ragged lengths with 1 and 197 among them."""
    lengths = random_lengths(gen, 4, 2, 40, include=(1, 197))
    cu = make_cu_seqlens(lengths)
    T, H, D, C = sum(lengths), 2, 64, 16
    q, k, v = torch.randn(T, 3, H, D, generator=gen).unbind(1)  # views of one qkv buffer
    rows = torch.randn(T, C, generator=gen)
    x = torch.randn(len(lengths), 197, C, generator=gen)
    keep = torch.rand(len(lengths), 197, generator=gen) < 0.5
    keep[0, 1:] = False  # one image keeps a single token
    keep_rows = torch.rand(T, generator=gen) < 0.6
    w, b = torch.randn(8, C, generator=gen), torch.randn(8, generator=gen)
    scores = torch.randn(len(lengths), 197, generator=gen)
    bias = torch.randn(T, generator=gen)
    S = len(lengths)
    op = torch.ops.ragvit
    att = (q, k, v, cu, 197)
    return {
        "attention": (op.attention.default, att, {"scale": 0.2, "bias": bias}),
        "attention.out": (op.attention.out, att, {"out": torch.empty(T, H, D)}),
        "attention.cls_attn": (op.attention.cls_attn, att, {"cls_attn": torch.empty(T)}),
        "attention.cls_attn_out": (op.attention.cls_attn_out, att, {
            "cls_attn": torch.empty(T), "out": torch.empty(T, H, D), "bias": bias}),
        "pack": (op.pack.default, (x, keep), {}),
        "pack_into": (op.pack_into.default, (x, keep, torch.zeros(S * 197, C),
                                             torch.zeros(S + 1, dtype=torch.int32)),
                      {"indices": torch.zeros(S * 197, dtype=torch.int32)}),
        "unpack": (op.unpack.default, (rows, cu, 197), {"fill": -1.0}),
        "unpack.out": (op.unpack.out, (rows, cu, 197), {"out": torch.empty(S, 197, C)}),
        "repack": (op.repack.default, (rows, cu, keep_rows), {}),
        "repack_into": (op.repack_into.default, (rows, cu, keep_rows, torch.zeros(T + S, C),
                                                 torch.zeros(S + 1, dtype=torch.int32)),
                        {"src": torch.zeros(T + S, dtype=torch.int32),
                         "fuse_weights": torch.rand(T, generator=gen)}),
        "gather_prefix": (op.gather_prefix.default, (rows, cu, 1), {}),
        "gather_prefix.out": (op.gather_prefix.out, (rows, cu, 1),
                              {"out": torch.empty(S, 1, C)}),
        "segment_mean": (op.segment_mean.default, (rows, cu), {"skip": 1}),
        "segment_mean.out": (op.segment_mean.out, (rows, cu), {"out": torch.empty(S, C)}),
        "linear": (op.linear.default, (rows, w, b), {"residual": torch.randn(T, 8,
                                                                             generator=gen)}),
        "linear.out": (op.linear.out, (rows, w), {"out": torch.empty(T, 8)}),
        "layer_norm": (op.layer_norm.default, (rows, torch.randn(C, generator=gen), None),
                       {"eps": 1e-6}),
        "layer_norm.out": (op.layer_norm.out, (rows,), {"out": torch.empty(T, C)}),
        "gelu": (op.gelu.default, (rows,), {}),
        "gelu.out": (op.gelu.out, (rows,), {"out": torch.empty(T, C)}),
        "topk_index": (op.topk_index.default, (scores, 50), {"prefix": 1}),
        "topk_index.out": (op.topk_index.out, (scores, 98), {
            "prefix": 1, "out": torch.empty(S, 99, dtype=torch.int32)}),
    }


OPCHECK_CASES = list(_opcheck_cases(torch.Generator().manual_seed(0)))


def test_every_overload_is_checked():
    """OPCHECK_CASES names every overload of every op in library.OPS."""
    overloads = {f"{name}.{o}" if o != "default" else name
                 for name in library.OPS for o in getattr(torch.ops.ragvit, name).overloads()}
    assert overloads == set(OPCHECK_CASES)
    # the runtime switches and the output type are not array ops
    runtime = {"cuda_is_compiled", "cuda_device_count", "set_debug", "is_debug", "Buffer"}
    c_ops = {n for n in ragvit.ops.__all__ if getattr(ragvit.ops, n) is getattr(ragvit._C, n, 0)}
    assert set(library.OPS) == c_ops - runtime


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, gen, seed):
    op, args, kwargs = _opcheck_cases(gen)[case]
    torch.library.opcheck(op, args, kwargs)


def test_library_functions_equal_the_c_ops(gen):
    """ragvit.library's functions give the C ops' results, out= forms included."""
    lengths = random_lengths(gen, 3, 2, 30, include=(1,))
    cu = make_cu_seqlens(lengths)
    T = sum(lengths)
    q, k, v = torch.randn(T, 3, 2, 32, generator=gen).unbind(1)
    cls_c, cls_l = torch.full((T,), torch.nan), torch.full((T,), torch.nan)
    out_l = torch.empty(T, 2, 32)
    expected = ragvit.attention(q, k, v, cu, cls_attn=cls_c)
    assert library.attention(q, k, v, cu, cls_attn=cls_l, out=out_l) is out_l
    assert torch.equal(out_l, expected) and torch.equal(cls_l, cls_c)
    rows = torch.randn(T, 8, generator=gen)
    w = torch.randn(8, 8, generator=gen)
    inplace = rows.clone()
    assert library.linear(rows, w, residual=inplace, out=inplace) is inplace
    assert torch.equal(inplace, ragvit.linear(rows, w, residual=rows))
    assert library.gelu(inplace, out=inplace) is inplace
    assert torch.equal(library.segment_mean(rows, cu, skip=1), ragvit.segment_mean(rows, cu,
                                                                                   skip=1))
    with pytest.raises(ValueError, match="stream must be None"):
        library.gelu(rows, stream=0)


@pytest.mark.parametrize("num_seqs,seq_len", [(1, 1), (3, 197), (2, 577)])
def test_uniform_cu_seqlens(num_seqs, seq_len):
    """cu_seqlens of equal lengths: 0, seq_len, ... num_seqs * seq_len, int32; opcheck."""
    op = torch.ops.ragvit.uniform_cu_seqlens.default
    got = library.uniform_cu_seqlens(num_seqs, seq_len, torch.device("cpu"))
    assert got.dtype == torch.int32
    assert torch.equal(got, make_cu_seqlens([seq_len] * num_seqs))
    torch.library.opcheck(op, (num_seqs, seq_len, torch.device("cpu")))


def test_compiled_ops_share_one_cu_seqlens(gen):
    """Inductor computes library.uniform_cu_seqlens once for every op that reads it (an
    arange it would compute afresh before each op: one more kernel per attention call)."""
    import re

    from torch._inductor.utils import run_and_get_code

    def three_attention_calls(q, k, v):
        cu = library.uniform_cu_seqlens(2, 5, q.device)
        for _ in range(3):
            q = ragvit.attention(q, k, v, cu, 5)
        return q

    q, k, v = torch.randn(10, 3, 2, 32, generator=gen).unbind(1)
    with torch.no_grad():
        got, codes = run_and_get_code(torch.compile(three_attention_calls, fullgraph=True),
                                      q, k, v)
    code = "\n".join(codes)
    assert code.count("ragvit.uniform_cu_seqlens.default(") == 1, code
    cu_args = re.findall(r"ragvit\.attention\.default\(.*?, (buf\d+), 5\b", code)
    assert len(cu_args) == 3 and len(set(cu_args)) == 1, cu_args
    assert torch.equal(got, three_attention_calls(q, k, v))


def test_routed_ops_swaps_and_restores():
    """routed_ops() points ragvit.<op> and ragvit.ops.<op> at the library functions for the
    block only, even when it raises; eager ragvit ops stay the C functions themselves."""
    assert ragvit.attention is ragvit._C.attention and ragvit.ops.gelu is ragvit._C.gelu
    with pytest.raises(RuntimeError, match="inside"):
        with library.routed_ops():
            assert ragvit.attention is library.attention and ragvit.ops.gelu is library.gelu
            raise RuntimeError("inside")
    assert ragvit.attention is ragvit._C.attention and ragvit.ops.gelu is ragvit._C.gelu


# ---- patched models ----


def test_every_policy_is_listed():
    classes = {obj for name in pruning.__all__ if isinstance(obj := getattr(pruning, name), type)
               and issubclass(obj, pruning.PruningPolicy) and obj is not pruning.PruningPolicy}
    listed = {type(make()) for make in POLICIES.values()} - {type(None)}
    assert listed == classes


def patched_tiny(gen, policy_name, **kwargs):
    model = make_model("deit_tiny_patch16_224", gen, IMG)
    patch(model, POLICIES[policy_name](), **kwargs)
    return model


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_no_graph_break(policy_name, gen):
    model = patched_tiny(gen, policy_name)
    x = images(gen, 2, IMG)
    with torch.no_grad():
        model(x)  # eager first, as a user would (DynamicViT moves its predictors here)
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def eager_and_reference(model, x):
    """(eager logits, the padded reference's logits replaying eager's decisions)."""
    policy = vars(model)[timm_patch._STATE_ATTR].policy
    with torch.no_grad():
        eager, decided = timm_patch.forward_with_decisions(model, x)
        expected = reference.vit_forward_reference(model, x, policy,
                                                   decisions=decided if policy else None)
    return eager, expected


def assert_equals_eager(traced, eager, expected, floor, seed):
    """Flash-attention's rule with eager as the baseline: err(traced) <= bar = 2 * err(eager)
    + floor against `expected` (a reference on eager's decisions), and eager's top-1 on every
    image whose top-2 gap exceeds twice the bar (near-ties may flip, in fp16 on the GPU)."""
    err, err_eager = max_diff(traced, expected), max_diff(eager, expected)
    bar = 2 * err_eager + floor
    note = f" err(traced) {err:.3g}, err(eager) {err_eager:.3g}" + seed_note(seed)
    assert err <= bar, note
    assert top1_agrees(traced, eager, 2 * bar)[0], note


COMPILE_CASES = [
    pytest.param("l2_keep", {}, {}, id="l2_keep"),
    pytest.param("evit", {}, {}, id="evit"),
    # the data-dependent policy on the path CUDA takes: every op through torch.ops.ragvit
    # (ragvit's row ops and attention with cls_attn; linear and GELU in place)
    pytest.param("ats", {"row_ops": True, "attention": c_attention}, {}, id="ats_c_ops"),
    # Inductor freezing (docs/compile.md): the parameters become constants of the graph
    pytest.param("ats", {"row_ops": True, "attention": c_attention}, {"freezing": True},
                 id="ats_c_ops-freezing"),
]


@pytest.mark.parametrize("policy_name,kwargs,options", COMPILE_CASES)
def test_compile_fullgraph_equals_eager(policy_name, kwargs, options, gen, seed):
    model = patched_tiny(gen, policy_name, **kwargs)
    x = images(gen, 3, IMG)
    eager, expected = eager_and_reference(model, x)
    compiled = torch.compile(model, fullgraph=True, options=options)
    with torch.no_grad():
        got = compiled(x)
    assert_equals_eager(got, eager, expected, ERROR_FLOOR[torch.float32], seed)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("policy_name", ["l2_keep", "evit", "l2_threshold"])
def test_export_equals_eager(policy_name, strict, gen, seed):
    model = patched_tiny(gen, policy_name)
    x = images(gen, 3, IMG)
    eager, expected = eager_and_reference(model, x)
    with torch.no_grad():
        program = torch.export.export(model, (x,), strict=strict)
        got = program.module()(x)
    assert ragvit.ops.attention is ragvit._C.attention  # routed_ops restored the C ops
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("ragvit.") for t in targets), targets
    assert "ragvit.uniform_cu_seqlens.default" in targets  # one op, not an arange per use
    assert_equals_eager(got, eager, expected, ERROR_FLOOR[torch.float32], seed)


def test_traced_threshold_runs_in_capacity_mode(gen, seed):
    """A data-dependent policy traces in capacity mode (no host read of the totals): the
    exported graph keeps the worst-case row count after the pruning point, while eager
    trims to the kept rows; both give the same logits (test_export_equals_eager)."""
    model = patched_tiny(gen, "l2_threshold")
    x = images(gen, 2, IMG)
    with torch.no_grad():
        program = torch.export.export(model, (x,), strict=False)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    assert any("ragvit.pack_into" in str(n.target) + str(n.args) for n in nodes)
    rows = [n.meta["val"].shape[0] for n in nodes if str(n.target).startswith("ragvit.attention")]
    N = model.patch_embed.num_patches + 1
    assert rows and all(r == 2 * N for r in rows), rows  # capacity: every row kept


# ---- GPU ----


GPU_COMPILE_CASES = [
    pytest.param(model, mode, policy, id=f"{alias}-{mode}-{policy}")
    for model, alias in (("deit_small_patch16_224", "deit_s"), ("deit_base_patch16_224", "deit_b"))
    for mode in ("default", "reduce-overhead") for policy in ("l2_keep",)
] + [
    pytest.param("deit_small_patch16_224", "reduce-overhead", "l2_threshold",
                 id="deit_s-reduce-overhead-l2_threshold"),
    pytest.param("deit_small_patch16_224", "default", "evit", id="deit_s-default-evit"),
    pytest.param("deit_small_patch16_224", "reduce-overhead+freezing", "l2_keep",
                 id="deit_s-reduce-overhead+freezing-l2_keep"),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name,mode,policy_name", GPU_COMPILE_CASES)
def test_gpu_compile_fp16_equals_eager(name, mode, policy_name, gen, seed):
    """fp16 DeiT-S/B, ragvit's CUDA ops and row ops: compiled logits vs an fp32 reference
    on eager's decisions, err(compiled) <= 2 * err(eager) + floor, at batch 8 (the second
    and third compiled calls replay a CUDA graph in reduce-overhead mode)."""
    model = make_model(name, gen, 224, dtype=torch.float16, device="cuda")
    x32 = images(gen, 8, 224, device="cuda")
    x = x32.half()
    policy = POLICIES[policy_name]()
    patch(model, policy)
    with torch.inference_mode():
        eager, decided = timm_patch.forward_with_decisions(model, x)
        exact = reference.vit_forward_reference(copy.deepcopy(model).float(), x32, policy,
                                                decisions=decided)
        compiled = torch.compile(model, fullgraph=True, options=pipelines.compile_options(mode))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # inductor's notes on cudagraph warm-up
            got = [compiled(x).clone() for _ in range(3)]
    torch.cuda.synchronize()
    for g in got:
        assert_equals_eager(g.float(), eager.float(), exact, ERROR_FLOOR[torch.float16], seed)
