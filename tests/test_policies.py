"""The pruning policies (EViT, ATS, ToMe, DynamicViT): the packed pipeline equals the
padded-masked reference with identical decisions, the scoring rules equal float64
re-implementations on small hand-made inputs, and bad arguments are refused.

CPU tests use support.models' random-init DeiTs (weights perturbed from the test's seed) at
small img_size, one torch thread; GPU tests run fp16 DeiT-S/B 224 at batch 1 and 32.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings

import pytest
import torch
from support.devices import requires_cuda
from support.inputs import seed_note

timm = pytest.importorskip("timm")

from support.models import (  # noqa: E402
    CPU_ATOL,
    assert_fp16_close,
    check_against_reference,
    images,
    make_model,
    max_diff,
    top1_agrees,
)

import ragvit  # noqa: E402
from ragvit import pruning, reference, timm_patch  # noqa: E402
from ragvit.pruning import (  # noqa: E402
    ATS,
    DynamicViT,
    DynamicViTPredictor,
    EViT,
    PruningPolicy,
    Selection,
    ThresholdL2,
    TokenBatch,
    ToMe,
    ats_sample,
    kept_count,
)
from ragvit.timm_patch import patch, unpatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

POLICIES = {
    "evit_fuse": lambda: EViT(0.7, layers=(3, 6, 9)),
    "evit_drop": lambda: EViT(0.5, layers=(4,), fuse=False),
    "evit_layer0": lambda: EViT((0.6, 0.8), layers=(0, 5)),
    "ats": lambda: ATS(36, layers=(3,)),
    "ats_3stage": lambda: ATS((30, 24, 16), layers=(2, 5, 8)),
    "dynamicvit": lambda: DynamicViT(predictor=random_predictors(3)),
}


def random_predictors(stages, embed_dim=None):
    """DynamicViT predictors with random weights as a state dict, or (embed_dim None) lazily
    created by the policy from the first batch (which warns)."""
    if embed_dim is None:
        return None
    modules = torch.nn.ModuleList(DynamicViTPredictor(embed_dim) for _ in range(stages))
    return {f"score_predictor.{k}": v for k, v in modules.state_dict().items()}

MODELS = {
    "deit_tiny": ("deit_tiny_patch16_224", 96, {}),
    "deit_small_distilled": ("deit_small_distilled_patch16_224", 64, {}),
    "vit_tiny_reg4_avg": ("vit_tiny_patch16_224", 64, {"reg_tokens": 4, "global_pool": "avg"}),
}

CASES = [pytest.param("deit_tiny", p, id=f"deit_tiny-{p}") for p in POLICIES] + [
    pytest.param(m, p, id=f"{m}-{p}")
    for m in ("deit_small_distilled", "vit_tiny_reg4_avg") for p in ("evit_fuse", "ats",
                                                                      "dynamicvit")
]


def run_case(model_name, policy_name, gen, seed, capacity=False, batch=3):
    name, img_size, kwargs = MODELS[model_name]
    model = make_model(name, gen, img_size, **kwargs)
    x = images(gen, batch, img_size)
    policy = POLICIES[policy_name]()
    decided = check_against_reference(model, x, policy, seed, capacity=capacity)
    return model, policy, decided


@pytest.mark.parametrize("model_name,policy_name", CASES)
def test_policy_matches_reference(model_name, policy_name, gen, seed):
    """max |dlogit| <= 1e-4 and identical decisions (prefix kept: check_against_reference)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicViT: prediction modules are randomly")
        model, policy, decided = run_case(model_name, policy_name, gen, seed)
    N = model.patch_embed.num_patches + model.num_prefix_tokens
    P = model.num_prefix_tokens
    if isinstance(policy, EViT):
        n = N - P
        for s, (d, rate) in enumerate(zip(decided, policy.keep_rate, strict=True)):
            fused = s + 1 if policy.fuse else 0
            assert d.shape == (3, N + fused)
            n = kept_count(rate, n)
            # kept patch tokens + prefix, + this stage's fused token
            assert d.sum(1).tolist() == [n + P + (1 if policy.fuse else 0)] * 3
            n += 1 if policy.fuse else 0
            if policy.fuse:
                assert d[:, N + s].all(), "this stage's fused token must be present"
    elif isinstance(policy, DynamicViT):
        for d, rate in zip(decided, policy.keep_rates, strict=True):
            assert d.sum(1).tolist() == [P + int((N - P) * rate)] * 3
    else:
        for d, k in zip(decided, policy.num_samples, strict=True):
            assert d.shape == (3, N)
            assert (d.sum(1) <= P + k).all()


@pytest.mark.parametrize("policy_name", ["ats_3stage", "evit_fuse"])
def test_capacity_mode_matches_reference(policy_name, gen, seed):
    run_case("deit_tiny", policy_name, gen, seed, capacity=True)


class RaggedFusion(PruningPolicy):
    """Test policy: ThresholdL2's ragged choice, dropped rows fused by token norm (exercises
    ragvit.repack_into's fusion and the reference's keep-mask fusion)."""

    is_fixed = False

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.inner = ThresholdL2(threshold=1.0, layers=layers)

    def select(self, batch):
        sel = self.inner.select(batch)
        sel.fuse_weights = torch.linalg.vector_norm(batch.rows.float(), dim=-1)
        return sel


@pytest.mark.parametrize("capacity", [False, True], ids=["trimmed", "capacity"])
def test_ragged_fusion_matches_reference(capacity, gen, seed):
    model = make_model("deit_small_distilled_patch16_224", gen, 64)
    x = images(gen, 3, 64)
    decided = check_against_reference(model, x, RaggedFusion((3, 7)), seed, capacity=capacity)
    N = model.patch_embed.num_patches + model.num_prefix_tokens
    assert [tuple(d.shape) for d in decided] == [(3, N + 1), (3, N + 2)]
    assert decided[0][:, N].all() and decided[1][:, N + 1].all()


@pytest.mark.parametrize("policy_name", ["ats", "threshold"])
def test_data_dependent_policies_are_ragged(policy_name, gen, seed):
    model = make_model("deit_tiny_patch16_224", gen, 96)
    x = images(gen, 8, 96)
    policy = ATS(36, layers=(3,)) if policy_name == "ats" else \
        ThresholdL2(threshold=1.0, layers=(4,))
    assert not policy.is_fixed
    with torch.no_grad():
        patch(model, policy)
        _, decided = timm_patch.forward_with_decisions(model, x)
    counts = decided[0].sum(1).tolist()
    assert len(set(counts)) > 1, f"{policy_name} must give ragged counts, got {counts}" + \
        seed_note(seed)


def test_fixed_flags():
    assert EViT().is_fixed and EViT(fuse=False).is_fixed and ToMe().is_fixed
    assert DynamicViT(predictor=random_predictors(3, 8)).is_fixed
    assert not ATS().is_fixed
    assert EViT().prune_mid_block and ATS().prune_mid_block
    assert ATS().needs_value_norm and ATS().needs_cls_attn and EViT().needs_cls_attn


# ---- the row ops (row_ops=True: ragvit.layer_norm / linear / gelu on the CPU) ----

ROW_OPS_POLICIES = {
    "evit_fuse": lambda: EViT(0.7, layers=(3, 6, 9)),  # mid-block, cls_attn, fused token
    "ats_3stage": lambda: ATS((30, 24, 16), layers=(2, 5, 8)),  # value norms, ragged
    "tome_three_stages": lambda: ToMe((4, 3, 2), layers=(1, 5, 8)),  # keys, log(size) bias
}


@pytest.mark.parametrize("policy_name", list(ROW_OPS_POLICIES))
def test_row_ops_policies_match_reference(policy_name, gen, seed):
    """Every policy hook (cls_attn, value norms, keys, bias, fusion, mid-block pruning) on
    the row ops: row_ops=True equals timm's modules (row_ops=False) and the padded
    reference replaying the same decisions, fp32 on the CPU, within 1e-4."""
    name, img_size, kwargs = MODELS["deit_tiny"]
    model = make_model(name, gen, img_size, **kwargs)
    x = images(gen, 2, img_size)
    got = {}
    with torch.no_grad():
        for row_ops in (False, True):
            patch(model, ROW_OPS_POLICIES[policy_name](), row_ops=row_ops)
            got[row_ops] = timm_patch.forward_with_decisions(model, x)
            unpatch(model)
        replayed = reference.vit_forward_reference(model, x, ROW_OPS_POLICIES[policy_name](),
                                                   decisions=got[True][1])
    for ours, theirs in zip(got[True][1], got[False][1], strict=True):
        assert torch.equal(ours, theirs), (
            "the row ops and timm's modules made different decisions" + seed_note(seed))
    assert max_diff(got[True][0], got[False][0]) <= CPU_ATOL, seed_note(seed)
    assert max_diff(got[True][0], replayed) <= CPU_ATOL, seed_note(seed)


# ---- ToMe (merging: decisions are int64 merge maps, replayed like masks) ----

TOME_CASES = {
    "every_block_r2": lambda: ToMe(2),
    "three_stages": lambda: ToMe((4, 3, 2), layers=(1, 5, 8)),
}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("case", list(TOME_CASES))
def test_tome_matches_reference(case, model_name, gen, seed):
    name, img_size, kwargs = MODELS[model_name]
    model = make_model(name, gen, img_size, **kwargs)
    x = images(gen, 3, img_size)
    policy = TOME_CASES[case]()
    decided = check_against_reference(model, x, policy, seed)
    with torch.no_grad():
        merged = timm_patch.forward_with_decisions(model, x)[0]
        unpruned = reference.vit_forward_reference(model, x)
    assert max_diff(merged, unpruned) > 0.01, "merging must change the logits"
    P = model.num_prefix_tokens
    L = model.patch_embed.num_patches + P
    for d, r in zip(decided, policy.r, strict=True):
        L -= min(r, (L - P) // 2)
        assert d.dtype == torch.int64
        assert timm_patch.kept_mask(d).sum(1).tolist() == [L] * 3


def test_kept_mask_of_masks_and_merge_maps():
    mask = torch.tensor([[True, False, True]])
    assert ragvit.kept_mask is timm_patch.kept_mask and "kept_mask" in ragvit.__all__
    assert timm_patch.kept_mask(mask) is mask
    merged = torch.tensor([[0, 0, 2, -1], [0, 2, 2, 2]])  # token 1 into 0; 3 gone / into 2
    assert timm_patch.kept_mask(merged).tolist() == [[True, False, True, False],
                                                      [True, False, True, False]]


def _tome_at_block_2(gen, batch, r):
    """A DeiT-T (img_size 64) patched with ToMe(r) at block 2 and run on batch images:
    (model, images, policy, logits, decisions), the model unpatched again."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, batch, 64)
    policy = ToMe(r, layers=(2,))
    with torch.no_grad():
        patch(model, policy)
        got, decided = timm_patch.forward_with_decisions(model, x)
    unpatch(model)
    return model, x, policy, got, decided


def test_tome_replays_merge_decisions(gen, seed):
    """A merge map other than the reference's own is replayed, not re-decided: merging
    token 3 into token 1 instead (both alive, 1 kept) changes the replayed logits, and the
    recorded map of the replay is the one given."""
    model, x, policy, got, decided = _tome_at_block_2(gen, 2, 2)
    with torch.no_grad():
        same = reference.vit_forward_reference(model, x, policy, decisions=decided)
        other = [d.clone() for d in decided]
        kept = timm_patch.kept_mask(other[0])[0]
        dst = int(kept[1:].nonzero()[0]) + 1  # a kept patch token
        src = int(kept.logical_not().nonzero()[0])  # a merged one
        other[0][0, src] = dst
        changed, made = reference.vit_forward_reference(model, x, policy, decisions=other,
                                                        return_decisions=True)
    assert max_diff(got, same) <= 1e-4, seed_note(seed)
    assert torch.equal(made[0], other[0])
    assert max_diff(changed[1:], same[1:]) == 0.0
    assert max_diff(changed[:1], same[:1]) > 0.0, seed_note(seed)


@pytest.mark.parametrize("edit, message", [
    ("bool", "must be the \\(B, N \\+ F\\) int64 merge map"),
    ("gone", "does not fit the tokens alive before it"),
    ("into_dropped", "merges a token into one that is not kept"),
])
def test_tome_reference_refuses_bad_merge_decisions(edit, message, gen):
    model, x, policy, _, decided = _tome_at_block_2(gen, 1, 1)
    d = decided[0]
    kept = timm_patch.kept_mask(d)[0]
    if edit == "bool":
        d = kept[None]
    elif edit == "gone":
        d = d.clone()
        d[0, 1] = -1
    else:  # a kept token now merges into a merged (dropped) token
        d = d.clone()
        d[0, int(kept[1:].nonzero()[0]) + 1] = int(kept.logical_not().nonzero()[0])
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        reference.vit_forward_reference(model, x, policy, decisions=[d])


def test_selecting_policy_refuses_merge_map(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 1, 64)
    policy = ThresholdL2(0.5, layers=(2,))
    with torch.no_grad(), pytest.raises(ValueError, match="must be a bool mask"):
        N = model.patch_embed.num_patches + model.num_prefix_tokens
        reference.vit_forward_reference(model, x, policy,
                                        decisions=[torch.zeros(1, N, dtype=torch.int64)])


def tome_float64(keys, sizes, x, L, P, r):
    """Loop re-implementation of ToMe's matching and size-weighted merge for one image."""
    k = keys.double()
    k = k / k.norm(dim=-1, keepdim=True)
    a_pos = [i for i in range(L) if i % 2 == 0]
    b_pos = [i for i in range(L) if i % 2 == 1]
    best = {}
    for i in a_pos:
        if i < P:
            continue
        cands = [(float(k[i] @ k[j]), j) for j in b_pos if j >= P]
        score, j = max(cands, key=lambda t: (t[0], -t[1]))
        best[i] = (score, j)
    ranked = sorted(best, key=lambda i: (-best[i][0], i))
    r = min(r, (L - P) // 2)
    merged = {i: best[i][1] for i in ranked[:r]}
    groups = {j: [j] for j in range(L) if j not in merged}
    for i, j in merged.items():
        groups[j].append(i)
    out = {}
    for j, members in groups.items():
        s = sum(float(sizes[m]) for m in members)
        out[j] = (sum(float(sizes[m]) * x[m].double() for m in members) / s, s)
    return out


@pytest.mark.parametrize("P,r", [(1, 3), (2, 4), (5, 2), (1, 100)])
def test_tome_merges_float64(P, r, gen):
    B, L, C, D = 2, 15, 6, 4
    batch = hand_batch(gen, [L] * B, P, C, seq_len=L)
    batch.keys = torch.randn(B * L, D, generator=gen)
    batch.sizes = torch.randint(1, 4, (B * L,), generator=gen).float()
    sel = ToMe(r, layers=(3,)).select(batch)
    assert sel.index.shape[1] == L - min(r, (L - P) // 2)
    assert sel.index[:, :P].tolist() == [list(range(P))] * B
    merged, sizes = timm_patch._merge(batch.rows.view(B, L, C), batch.sizes,
                                      sel.assign, sel.index.shape[1])
    for b in range(B):
        rows = slice(b * L, (b + 1) * L)
        expected = tome_float64(batch.keys[rows], batch.sizes[rows], batch.rows[rows], L, P, r)
        reps = sel.index[b].tolist()
        assert sorted(reps) == sorted(expected), (reps, sorted(expected))
        for slot, j in enumerate(reps):
            value, size = expected[j]
            assert float(sizes[b, slot]) == size
            torch.testing.assert_close(merged[b, slot].double(), value, atol=1e-6, rtol=1e-6)


def test_tome_every_block_resolves_layers():
    policy = ToMe(3)
    assert policy.is_fixed and policy.needs_keys and policy.prune_mid_block
    policy.check(12)
    assert policy.layers == tuple(range(12)) and policy.r == (3,) * 12
    with pytest.raises(ValueError, match="ToMe: r must be an int >= 0, got -1"):
        ToMe(-1)
    with pytest.raises(ValueError, match="ToMe: one value per layer needed"):
        ToMe((1, 2), layers=(3,))
    with pytest.raises(ValueError, match=r"ToMe.select: batch.keys must be given"):
        ToMe(1).select(TokenBatch(rows=torch.zeros(4, 2), cu_seqlens=torch.tensor(
            [0, 4], dtype=torch.int32), num_prefix=1, seq_len=4, max_seqlen=4, layer=0,
            stage=0))


def test_tome_every_block_takes_one_r_per_block():
    policy = ToMe([1, 2, 3])
    assert policy.layers == () and policy.r == ()
    policy.check(3)
    assert policy.layers == (0, 1, 2) and policy.r == (1, 2, 3)
    with pytest.raises(ValueError, match="ToMe: one value per layer needed, got 3 r values "
                       "for the 12 blocks of layers=None"):
        ToMe([1, 2, 3]).check(12)


def test_tome_every_block_is_resolved_for_one_depth(gen):
    """layers=None resolves to the blocks of the first model that checks the policy; a model
    of another depth is refused (it would change the first model's pruning points), one of
    the same depth shares it."""
    policy = ToMe(2)
    policy.check(12)
    policy.check(12)
    with pytest.raises(ValueError, match="ToMe: layers=None is resolved to every block of a "
                       "12-block model; a 6-block model needs its own ToMe"):
        policy.check(6)
    assert policy.layers == tuple(range(12))
    shallow = make_model("deit_tiny_patch16_224", gen, 64, depth=6)
    with pytest.raises(ValueError, match="6-block model needs its own ToMe"):
        patch(shallow, policy)
    assert not timm_patch.is_patched(shallow)


def test_tome_every_block_in_the_reference_before_patch(gen, seed):
    """The reference resolves layers=None itself: run before any patch, it merges at every
    block, as the same policy with the blocks listed does."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    with torch.no_grad():
        got, made = reference.vit_forward_reference(model, x, ToMe(2), return_decisions=True)
        expected = reference.vit_forward_reference(model, x, ToMe(2, layers=range(12)))
    assert len(made) == 12
    assert torch.equal(got, expected), seed_note(seed)


# ---- DynamicViT ----


def dynamicvit_float64(module, x):
    """PredictorLG's forward in float64 on one image's patch tokens x (n, C): keep log-prob."""
    ln, fc1 = module.in_conv[0], module.in_conv[1]
    x = x.double()
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    x = (x - mu) / torch.sqrt(var + ln.eps) * ln.weight.double() + ln.bias.double()
    x = torch.nn.functional.gelu(x @ fc1.weight.double().T + fc1.bias.double())
    half = x.shape[1] // 2
    x = torch.cat([x[:, :half], x[:, half:].mean(0, keepdim=True).expand(len(x), -1)], dim=1)
    for i, layer in enumerate(m for m in module.out_conv if isinstance(m, torch.nn.Linear)):
        x = x @ layer.weight.double().T + layer.bias.double()
        if i < 2:
            x = torch.nn.functional.gelu(x)
    return torch.log_softmax(x, dim=-1)[:, 0]


def test_dynamicvit_scores_float64(gen):
    B, L, P, C = 2, 11, 2, 16
    batch = hand_batch(gen, [L] * B, P, C, seq_len=L, num_tokens=L)
    policy = DynamicViT((0.5,), layers=(3,), predictor=random_predictors(1, C))
    module = policy.predictors[0]
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
        scores = module.score(batch)
        sel = policy.select(batch)
        ragged = policy.select(dataclasses.replace(batch, seq_len=None))
    k = int((L - P) * 0.5)
    for b in range(B):
        expected = dynamicvit_float64(module, batch.rows[b * L + P:(b + 1) * L])
        torch.testing.assert_close(scores[b * L + P:(b + 1) * L].double(), expected,
                                   atol=1e-5, rtol=1e-5)
        top = sorted((torch.argsort(expected, descending=True)[:k] + P).tolist())
        assert sel.index[b].tolist() == list(range(P)) + top
        assert ragged.keep[b * L:(b + 1) * L].nonzero().view(-1).tolist() == \
            list(range(P)) + top


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "ragged"])
def test_dynamicvit_score_gradient_float64(uniform, gen):
    """Training the predictors: the gradient of the patch rows' scores reaches every row
    through both the local and the per-image global features (the mean a float64 autograd
    re-implementation differentiates), and no prefix row."""
    lengths, P, C = ([12, 12] if uniform else [9, 12]), 2, 16
    batch = hand_batch(gen, lengths, P, C, seq_len=12 if uniform else None, num_tokens=12)
    policy = DynamicViT((0.5,), layers=(3,), predictor=random_predictors(1, C))
    module = policy.predictors[0]
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
    rows = batch.rows.clone().requires_grad_(True)
    scores = module.score(dataclasses.replace(batch, rows=rows))
    starts = [0, lengths[0]]
    patch_rows = torch.cat([torch.arange(a + P, a + n) for a, n in zip(starts, lengths,
                                                                        strict=True)])
    scores[patch_rows].sum().backward()
    rows64 = batch.rows.double().requires_grad_(True)
    total = sum(dynamicvit_float64(module, rows64[a + P:a + n]).sum()
                for a, n in zip(starts, lengths, strict=True))
    total.backward()
    torch.testing.assert_close(rows.grad.double(), rows64.grad, atol=1e-5, rtol=1e-4)
    prefix = torch.cat([torch.arange(a, a + P) for a in starts])
    assert (rows.grad[prefix] == 0).all()


def test_dynamicvit_predictor_loading():
    with pytest.warns(UserWarning, match="DynamicViT: prediction modules are randomly"):
        batch = TokenBatch(rows=torch.randn(10, 8), cu_seqlens=torch.tensor([0, 5, 10],
                           dtype=torch.int32), num_prefix=1, seq_len=5, max_seqlen=5, layer=3,
                           stage=0, num_tokens=5)
        DynamicViT((0.5,), layers=(3,)).select(batch)
    state = random_predictors(2, 8)
    policy = DynamicViT((0.7, 0.5), layers=(2, 4), predictor=state)
    plain = {k.removeprefix("score_predictor."): v for k, v in state.items()}
    again = DynamicViT((0.7, 0.5), layers=(2, 4), predictor=plain)
    for a, b in zip(policy.predictors.parameters(), again.predictors.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="one module per layer"):
        DynamicViT((0.7,), layers=(2,), predictor=state)
    with pytest.raises(ValueError, match="must hold '\\[score_predictor.\\]0.in_conv"):
        DynamicViT((0.7,), layers=(2,), predictor={"x": torch.zeros(1)})
    with pytest.raises(TypeError, match="predictor must be a state dict, a ModuleList or None"):
        DynamicViT(predictor=3)
    with pytest.raises(ValueError, match=r"DynamicViT: keep_rates must be in \(0, 1\]"):
        DynamicViT((0.7, 0.0, 0.3))


@pytest.mark.parametrize("predictor", ["lazy", "state_dict"])
def test_dynamicvit_made_under_inference_mode_trains_later(predictor, gen):
    """Constructed and first run under torch.inference_mode() (which also moves the
    predictors to bfloat16 here), then run in grad mode: the predictors' parameters are
    ordinary tensors that backward reaches."""
    C = 8
    batch = hand_batch(gen, [6, 6], 1, C, seq_len=6, num_tokens=6)
    batch = dataclasses.replace(batch, rows=batch.rows.bfloat16())
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DynamicViT: prediction modules are randomly")
        state = random_predictors(1, C) if predictor == "state_dict" else None
        policy = DynamicViT((0.5,), layers=(3,), predictor=state)
        policy.select(batch)
    assert not any(p.is_inference() for p in policy.predictors.parameters())
    module = policy.predictors[0]
    rows = batch.rows.clone().requires_grad_(True)
    scores = module.score(dataclasses.replace(batch, rows=rows))
    scores.sum().backward()
    assert rows.grad is not None and torch.isfinite(rows.grad).all()
    assert all(p.grad is not None for p in module.parameters())


def test_dynamicvit_first_calls_of_threads_share_one_set(gen):
    """Eight threads making their first select at once on a policy without predictors get
    one set of modules (made once: one warning), so every thread scores alike."""
    import threading

    batch = hand_batch(gen, [6, 6], 1, 8, seq_len=6, num_tokens=6)
    policy = DynamicViT((0.5,), layers=(3,))
    start = threading.Barrier(8)
    made, selections = [], []

    def first_call():
        start.wait()
        selections.append(policy.select(batch))
        made.append(policy.predictors)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=first_call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(made) == 8 and all(m is made[0] for m in made)
    assert sum("randomly initialised" in str(w.message) for w in caught) == 1
    assert all(torch.equal(s.index, selections[0].index) for s in selections)


# ---- scoring rules vs float64 re-implementations ----


def hand_batch(gen, lengths, P, C=4, seq_len=None, garbage=0, **extra):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1]) + garbage
    rows = torch.randn(T, C, generator=gen)
    return TokenBatch(rows=rows, cu_seqlens=cu, num_prefix=P, seq_len=seq_len,
                      max_seqlen=max(lengths), layer=3, stage=0, **extra)


def softmaxish(gen, T):
    """Positive scores with distinct values (no ties to break)."""
    return torch.rand(T, generator=gen) * 0.9 + 0.05 + torch.arange(T) * 1e-4


@pytest.mark.parametrize("L", [197, ragvit.ops.TOPK_INDEX_MAX_COLS + 1])
def test_topk_selection_uniform_both_paths(gen, L):
    """Uniform batches: ragvit.topk_index up to its column limit, torch's topk + sort past
    it; both keep the prefix and the top k (distinct scores), ascending; the limit is the
    op's own (one more column raises there)."""
    B, P = 2, 1
    batch = hand_batch(gen, [L] * B, P, 2, seq_len=L)
    scores = torch.randperm(B * L, generator=gen).float()  # distinct (floats tie past 8192)
    sel = pruning.topk_selection(batch, scores, 0.25)
    k = pruning.kept_count(0.25, L - P)
    for b in range(B):
        top = sorted((torch.argsort(scores.view(B, L)[b, P:], descending=True)[:k] + P).tolist())
        assert sel.index[b].tolist() == list(range(P)) + top
    with pytest.raises(ValueError, match="8192"):
        ragvit.topk_index(torch.zeros(1, ragvit.ops.TOPK_INDEX_MAX_COLS + 1), 1)


def test_segment_mean_scores_float64(gen):
    """Per-image mean of the patch-row scores (prefix rows and rows past cu_seqlens[B] left
    out; slot B and an image without patch rows: 0) against float64."""
    lengths, P = [5, 1, 9], 1
    batch = hand_batch(gen, lengths, P, garbage=3)
    scores = torch.randn(batch.total_tokens, generator=gen)
    got = pruning.segment_mean_scores(batch, scores)
    cu = [0, 5, 6, 15]
    expected = [scores[cu[b] + P:cu[b + 1]].double().mean().item() if lengths[b] > P else 0.0
                for b in range(3)] + [0.0]
    assert got.dtype == torch.float32 and got.shape == (4,)
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-6, rtol=1e-6)


def test_evit_topk_and_fusion_weights_float64(gen):
    B, L, P, C = 3, 9, 1, 5
    batch = hand_batch(gen, [L] * B, P, C, seq_len=L)
    batch.cls_attn = softmaxish(gen, B * L)
    sel = EViT(0.5, layers=(3,)).select(batch)
    k = math.ceil(0.5 * (L - P))
    assert sel.index.shape == (B, P + k)
    x = batch.rows.double().view(B, L, C)
    a = batch.cls_attn.double().view(B, L)
    fused_got = timm_patch._fuse(batch.rows.view(B, L, C), sel.fuse_weights.view(B, L),
                                 torch.ones(B, L, dtype=torch.bool).scatter_(1, sel.index,
                                                                              False))
    for b in range(B):
        top = sorted((torch.argsort(a[b, P:], descending=True)[:k] + P).tolist())
        assert sel.index[b].tolist() == list(range(P)) + top
        dropped = [j for j in range(P, L) if j not in top]
        w = a[b, dropped]
        expected = (w[:, None] * x[b, dropped]).sum(0) / w.sum()
        torch.testing.assert_close(fused_got[b].double(), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(sel.fuse_weights.view(B, L)[:, P:], batch.cls_attn.view(B, L)[:, P:])
    assert (sel.fuse_weights.view(B, L)[:, :P] == 0).all()
    # The ragged form picks the same rows, and ragvit.repack fuses them identically.
    ragged = EViT(0.5, layers=(3,)).select(dataclasses.replace(batch, seq_len=None))
    mask = torch.zeros(B, L, dtype=torch.bool).scatter_(1, sel.index, True)
    assert torch.equal(ragged.keep.view(B, L)[:, P:], mask[:, P:])
    out, cu, src = ragvit.repack(batch.rows, batch.cu_seqlens, mask.view(-1),
                                 fuse_weights=ragged.fuse_weights)
    assert cu.tolist() == [b * (P + k + 1) for b in range(B + 1)]
    torch.testing.assert_close(out.view(B, P + k + 1, C)[:, -1], fused_got, atol=1e-6,
                               rtol=1e-6)


def test_evit_no_fusion_at_keep_one(gen):
    batch = hand_batch(gen, [6, 6], 1, seq_len=6)
    batch.cls_attn = softmaxish(gen, 12)
    sel = EViT(1.0, layers=(3,)).select(batch)
    assert sel.fuse_weights is None and sel.index.shape == (2, 6)


def ats_float64(p_sig, lengths, P, K):
    """Loop re-implementation of ATS sampling on per-image significance lists."""
    kept = []
    start = 0
    for n in lengths:
        s = p_sig[start + P:start + n].double()
        if s.sum() > 0:
            s = s / s.sum()
        else:
            s = torch.full_like(s, 1.0 / max(len(s), 1))
        order = sorted(range(len(s)), key=lambda j: (float(s[j]), j))
        cdf, acc = [], 0.0
        for j in order:
            acc += float(s[j])
            cdf.append(acc)
        picks = set()
        for i in range(K):
            q = (i + 0.5) / K
            pos = next((t for t, c in enumerate(cdf) if c > q), len(cdf) - 1)
            if len(cdf):
                picks.add(order[pos] + P)
        kept.append(sorted(picks))
        start += n
    return kept


@pytest.mark.parametrize("K", [1, 5, 12])
def test_ats_sampling_float64(K, gen):
    lengths, P = [9, 1, 14, 6], 2
    lengths[1] = P  # an image with no patch token keeps only its prefix
    batch = hand_batch(gen, lengths, P, garbage=3)  # ragged, with capacity rows
    T = batch.total_tokens
    attn = softmaxish(gen, T) ** 4  # peaked: duplicates happen
    vnorm = torch.rand(T, generator=gen) + 0.5
    batch.cls_attn, batch.value_norm = attn, vnorm
    keep = ats_sample(batch, K)
    expected = ats_float64(attn.double() * vnorm.double(), lengths, P, K)
    start = 0
    for b, n in enumerate(lengths):
        got = [j for j in range(n) if keep[start + j]]
        assert got == expected[b], (b, got, expected[b])
        start += n
    assert not keep[start:].any(), "garbage rows must not be kept"
    sel = ATS(K, layers=(3,)).select(batch)
    assert torch.equal(sel.keep, keep) and sel.max_seqlen == min(14, P + K)


def test_ats_zero_significance_is_uniform(gen):
    batch = hand_batch(gen, [7], 1)
    batch.cls_attn = torch.zeros(7)
    batch.value_norm = torch.ones(7)
    keep = ats_sample(batch, 6)
    assert keep.tolist() == [False] + [True] * 6


# ---- errors ----


@pytest.mark.parametrize("make,exc,message", [
    (lambda: EViT(0.0), ValueError, r"EViT: keep_rate must be in \(0, 1\], got 0.0"),
    (lambda: EViT(1.5), ValueError, r"EViT: keep_rate must be in \(0, 1\], got 1.5"),
    (lambda: EViT((0.5, 0.7), layers=(3,)), ValueError, "EViT: one value per layer needed"),
    (lambda: EViT(layers=3), TypeError, "EViT: layers must be a sequence of ints, got 3"),
    (lambda: ATS(0), ValueError, "ATS: num_samples must be an int >= 1, got 0"),
    (lambda: ATS(2.5), ValueError, "ATS: num_samples must be an int >= 1, got 2.5"),
    (lambda: ATS((4, 4), layers=(3,)), ValueError, "ATS: one value per layer needed"),
    (lambda: ATS(math.nan), ValueError, "ATS: num_samples must be an int >= 1, got nan"),
    (lambda: ATS("8"), TypeError, "ATS: num_samples must be an int or one int per layer, "
     "got '8'"),
    (lambda: ATS(True), TypeError, "ATS: num_samples must be an int or one int per layer, "
     "got True"),
    (lambda: ToMe(math.nan), ValueError, "ToMe: r must be an int >= 0, got nan"),
    (lambda: ToMe(math.inf, layers=(3,)), ValueError, "ToMe: r must be an int >= 0, got inf"),
    (lambda: ToMe([1, 2.5]), ValueError, "ToMe: r must be an int >= 0, got 2.5"),
    (lambda: ToMe(layers=4), TypeError, "ToMe: layers must be a sequence of ints, got 4"),
    (lambda: ThresholdL2(0.5, layers=4), TypeError,
     "ThresholdL2: layers must be a sequence of ints, got 4"),
    (lambda: ThresholdL2(0.5, layers="4"), TypeError,
     "ThresholdL2: layers must be a sequence of ints, got '4'"),
    (lambda: EViT(layers=(4.5,)), TypeError,
     r"EViT: layers must be a sequence of ints, got \(4.5,\)"),
    (lambda: EViT(layers=(True,)), TypeError,
     r"EViT: layers must be a sequence of ints, got \(True,\)"),
    (lambda: ThresholdL2("0.5"), TypeError,
     "ThresholdL2: keep must be a number or one number per layer, got '0.5'"),
    (lambda: ThresholdL2(True), TypeError,
     "ThresholdL2: keep must be a number or one number per layer, got True"),
    (lambda: ThresholdL2(math.nan), ValueError, r"ThresholdL2: keep must be in \(0, 1\], got nan"),
    (lambda: ThresholdL2(threshold=math.inf), ValueError,
     "ThresholdL2: threshold must be finite and > 0, got inf"),
    (lambda: EViT("a"), TypeError, "EViT: keep_rate must be a number or one number per layer, "
     "got 'a'"),
    (lambda: EViT(fuse="no"), TypeError, "EViT: fuse must be True or False, got 'no'"),
    (lambda: DynamicViT(None), TypeError,
     "DynamicViT: keep_rates must be a number or one number per layer, got None"),
], ids=["keep0", "keep1.5", "keep_len", "layers_int", "samples0", "samples_float",
        "samples_len", "samples_nan", "samples_str", "samples_bool", "tome_r_nan", "tome_r_inf",
        "tome_r_list_float", "tome_layers_int", "l2_layers_int", "l2_layers_str",
        "evit_layers_float", "evit_layers_bool", "l2_keep_str", "l2_keep_bool", "l2_keep_nan",
        "l2_threshold_inf", "evit_keep_str", "evit_fuse_str", "dynamicvit_none"])
def test_bad_arguments(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


@pytest.mark.parametrize("call, exc, message", [
    (lambda b, s: pruning.topk_selection(b, s, 0.0), ValueError,
     r"topk_selection: keep_ratio must be in \(0, 1\], got 0.0"),
    (lambda b, s: pruning.topk_selection(b, s, 1.5), ValueError,
     r"topk_selection: keep_ratio must be in \(0, 1\], got 1.5"),
    (lambda b, s: pruning.topk_selection(b, s, math.nan), ValueError,
     r"topk_selection: keep_ratio must be in \(0, 1\], got nan"),
    (lambda b, s: pruning.topk_selection(b, s, "0.5"), TypeError,
     r"topk_selection: keep_ratio must be a number in \(0, 1\], got '0.5'"),
    (lambda b, s: pruning.topk_selection(b, s[:-1], 0.5), ValueError,
     r"topk_selection: scores must be a \(12,\) tensor on cpu, got \(11,\) on cpu"),
    (lambda b, s: pruning.kept_count(2.0, 10), ValueError,
     r"kept_count: keep_ratio must be in \(0, 1\], got 2.0"),
], ids=["ratio0", "ratio1.5", "ratio_nan", "ratio_str", "scores_short", "kept_count_2"])
@pytest.mark.parametrize("uniform", [False, True], ids=["ragged", "uniform"])
def test_helpers_refuse_bad_arguments(call, exc, message, uniform, gen):
    batch = hand_batch(gen, [6, 6] if uniform else [5, 7], 1, seq_len=6 if uniform else None)
    with pytest.raises(exc, match=message):
        call(batch, torch.rand(12, generator=gen))


@pytest.mark.parametrize("layers, message", [
    ((4.5,), r"Custom: layers must be a sequence of ints, got \(4.5,\)"),
    ("4", "Custom: layers must be a sequence of ints, got '4'"),
    ((True,), r"Custom: layers must be a sequence of ints, got \(True,\)"),
    (4, "Custom: layers must be a sequence of ints, got 4")], ids=["float", "str", "bool", "int"])
def test_custom_policy_layers_must_be_ints(layers, message, gen):
    class Custom(PruningPolicy):
        pass

    policy = Custom()
    policy.layers = layers
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(TypeError, match=message):
        patch(model, policy)
    assert not timm_patch.is_patched(model)


@pytest.mark.parametrize("policy", [EViT(layers=(3, 12)), ATS(layers=(5, 4)), EViT(layers=())],
                         ids=["evit_out_of_range", "ats_descending", "empty"])
def test_bad_layers_refused_by_patch(policy, gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(ValueError, match="layers must"):
        patch(model, policy)
    assert not timm_patch.is_patched(model)


def test_selection_needs_one_form():
    with pytest.raises(ValueError, match="Selection: exactly one of index and keep must be "
                       "given"):
        Selection()
    with pytest.raises(ValueError, match="Selection: exactly one of index and keep must be "
                       "given"):
        Selection(index=torch.zeros(1, 1, dtype=torch.int64), keep=torch.ones(1, dtype=bool))
    with pytest.raises(ValueError, match="Selection: assign needs an index Selection"):
        Selection(keep=torch.ones(1, dtype=bool), assign=torch.zeros(1, 1, dtype=torch.int64))


def test_tome_needs_a_uniform_batch(gen):
    batch = hand_batch(gen, [5, 7], 1, keys=torch.randn(12, 4, generator=gen))
    with pytest.raises(ValueError, match=r"ToMe.select: batch must be uniform \(seq_len "
                       r"known\); ToMe's counts are fixed"):
        ToMe(1, layers=(3,)).select(batch)


def test_select_without_inputs_raises(gen):
    batch = hand_batch(gen, [5], 1, seq_len=5)
    with pytest.raises(ValueError, match=r"EViT.select: batch.cls_attn must be given"):
        EViT().select(batch)
    batch.cls_attn = torch.rand(5)
    with pytest.raises(ValueError, match=r"ATS.select: batch.value_norm must be given"):
        ATS().select(batch)
    assert isinstance(EViT().select(batch), Selection)


# ---- policies' own Selections ----


class Returns(PruningPolicy):
    """Test policy: whatever make(batch) returns, at the input of block 4."""

    is_fixed = False

    def __init__(self, make):
        self.make, self.layers = make, (4,)

    def select(self, batch):
        return self.make(batch)


def _index(batch, positions):
    return torch.tensor(positions, dtype=torch.int64).expand(batch.num_seqs, -1)


def _all_kept(batch, **kwargs):
    return Selection(keep=torch.ones(batch.total_tokens, dtype=torch.bool), **kwargs)


# deit_tiny at 64 px: L = 17 tokens per image, P = 1, B = 2, T = 34.
BAD_SELECTIONS = {
    "not_selection": (lambda b: {"keep": None}, TypeError,
                      "Returns.select must return a Selection, got dict"),
    "no_prefix": (lambda b: Selection(index=_index(b, range(1, 9))), ValueError,
                  r"Returns.select: index must start with the prefix positions 0..0 in every"),
    "duplicate": (lambda b: Selection(index=_index(b, [0, 1, 1, 2])), ValueError,
                  "Returns.select: index positions must be strictly ascending in every image"),
    "descending": (lambda b: Selection(index=_index(b, [0, 5, 3])), ValueError,
                   "index positions must be strictly ascending"),
    "past_image": (lambda b: Selection(index=_index(b, [0, 3, 17])), ValueError,
                   r"Returns.select: index positions must lie in \[0, 17\)"),
    "negative": (lambda b: Selection(index=_index(b, [0, -1])), ValueError,
                 r"index positions must lie in \[0, 17\)"),
    "index_int32": (lambda b: Selection(index=_index(b, [0, 1]).int()), ValueError,
                    r"Returns.select: index must be an int64 tensor of shape \(B, k\) on cpu "
                    r"with B = 2 and 1 <= k <= 17, got \(2, 2\) torch.int32 on cpu"),
    "index_batch": (lambda b: Selection(index=torch.zeros(3, 2, dtype=torch.int64)), ValueError,
                    r"with B = 2 and 1 <= k <= 17, got \(3, 2\) torch.int64"),
    "index_too_long": (lambda b: Selection(index=torch.zeros(2, 18, dtype=torch.int64)),
                       ValueError, r"1 <= k <= 17, got \(2, 18\)"),
    "index_list": (lambda b: Selection(index=[[0, 1], [0, 1]]), ValueError,
                   "1 <= k <= 17, got list"),
    "assign_shape": (lambda b: Selection(index=_index(b, [0, 1]), assign=torch.zeros(
        2, 16, dtype=torch.int64)), ValueError,
        r"Returns.select: assign must be an int64 tensor of shape \(2, 17\) on cpu, got "
        r"\(2, 16\)"),
    "assign_slots": (lambda b: Selection(index=_index(b, [0, 1]), assign=torch.zeros(
        2, 17, dtype=torch.int64)), ValueError,
        r"Returns.select: assign must map every token to a slot in \[0, 2\), the token "
        r"index\[:, j\] to slot j"),
    "keep_int8": (lambda b: Selection(keep=torch.ones(b.total_tokens, dtype=torch.int8)),
                  ValueError, r"Returns.select: keep must be a bool tensor of shape \(34,\) "
                  r"on cpu, got \(34,\) torch.int8 on cpu"),
    "keep_padded": (lambda b: Selection(keep=torch.ones(2, 17, dtype=torch.bool)), ValueError,
                    r"keep must be a bool tensor of shape \(34,\)"),
    "fuse_int": (lambda b: _all_kept(b, fuse_weights=torch.ones(34, dtype=torch.int64)),
                 ValueError, r"fuse_weights must be a floating tensor of shape \(34,\)"),
    "fuse_short": (lambda b: _all_kept(b, fuse_weights=torch.ones(33)), ValueError,
                   r"fuse_weights must be a floating tensor of shape \(34,\)"),
    "max_seqlen_bool": (lambda b: _all_kept(b, max_seqlen=True), ValueError,
                        r"Returns.select: max_seqlen must be None or an int >= num_prefix "
                        r"\(1\), got True"),
    "max_seqlen_str": (lambda b: _all_kept(b, max_seqlen="17"), ValueError,
                       "max_seqlen must be None or an int >= num_prefix"),
    "max_seqlen_zero": (lambda b: _all_kept(b, max_seqlen=0), ValueError,
                        r"max_seqlen must be None or an int >= num_prefix \(1\), got 0"),
    "max_seqlen_short": (lambda b: _all_kept(b, max_seqlen=16), ValueError,
                         "Returns.select: max_seqlen=16 is below the 17 tokens image 0 keeps"),
    "max_seqlen_short_fused": (lambda b: _all_kept(b, max_seqlen=16,
                                                   fuse_weights=torch.ones(34)), ValueError,
                               "max_seqlen=16 is below the 17 tokens image 0 keeps"),
}


@pytest.mark.parametrize("capacity", [False, True], ids=["trimmed", "capacity"])
@pytest.mark.parametrize("case", list(BAD_SELECTIONS))
def test_bad_selection_refused(case, capacity, gen):
    """A policy's Selection that breaks the contract is refused by name, patched and in the
    reference, on CPU rows (where its contents cost no device sync to read)."""
    make, exc, message = BAD_SELECTIONS[case]
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    policy = Returns(make)
    with torch.no_grad():
        with pytest.raises(exc, match=message):
            reference.vit_forward_reference(model, x, policy)
        patch(model, policy, capacity=capacity)
        with pytest.raises(exc, match=message):
            model(x)


class TwoStages(PruningPolicy):
    """Test policy: first(batch) at block 3, then second(batch) at block 5, mid-block."""

    needs_keys = True
    prune_mid_block = True
    is_fixed = False

    def __init__(self, first, second):
        self.first, self.second, self.layers = first, second, (3, 5)

    def select(self, batch):
        return (self.first if batch.stage == 0 else self.second)(batch)


@pytest.mark.parametrize("case", ["index_after_ragged", "keep_after_merge"])
def test_selection_that_does_not_fit_the_batch_refused(case, gen):
    """An index Selection once the batch is ragged, or a keep mask once tokens were merged,
    is refused by name (patched and reference; the reference also wants merges after a
    merge)."""
    def keep_all(batch):
        return _all_kept(batch)

    if case == "index_after_ragged":
        policy = TwoStages(keep_all, lambda b: Selection(index=torch.zeros(
            b.num_seqs, 1, dtype=torch.int64)))
        patched = reference_message = ("TwoStages.select: an index Selection needs a batch "
                                       "with seq_len known")
    else:
        policy = TwoStages(lambda b: pruning.tome_match(b, 2), keep_all)
        patched = r"TwoStages.select: merged tokens \(sizes\) need index Selections"
        reference_message = (r"TwoStages.select: merged tokens \(sizes\) need merging "
                             "Selections in the reference")
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    with torch.no_grad():
        with pytest.raises(ValueError, match=reference_message):
            reference.vit_forward_reference(model, x, policy)
        patch(model, policy)
        with pytest.raises(ValueError, match=patched):
            model(x)


def test_exact_max_seqlen_accepted(gen, seed):
    """The bound may equal the longest kept image (the fused token not counted)."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    for extra in ({}, {"fuse_weights": None}):
        policy = Returns(lambda b, extra=extra: _all_kept(b, max_seqlen=17, **extra))
        check_against_reference(model, x, policy, seed, capacity=True)
        unpatch(model)


class SignedFusion(PruningPolicy):
    """Test policy: keep the 8 highest-norm patch tokens per image, fuse the rest with weights
    of both signs (positions alternate +w / -w), as an index or a keep Selection."""

    def __init__(self, form, weights):
        self.form, self.weights, self.layers = form, weights, (4,)
        self.is_fixed = form == "index"

    def select(self, batch):
        scores = torch.linalg.vector_norm(batch.rows, dim=-1, dtype=torch.float32)
        sel = pruning.topk_selection(batch, scores, 8 / 16)
        if self.form == "keep":
            keep = torch.zeros(batch.num_seqs, batch.seq_len, dtype=torch.bool)
            sel = Selection(keep=keep.scatter_(1, sel.index, True).view(-1))
        sel.fuse_weights = self.weights(batch)
        return sel


def signed_weights(positions, magnitude):
    """float32 weights in [1, 2], and in [-0.1, -0.05] at positions 2 mod 4 (magnitude: one
    value in [0, 1) per position): at most a quarter negative, so the sum over any 8 dropped
    of 16 tokens stays >= 3.6, far from 0."""
    m = magnitude[positions]
    return torch.where(positions % 4 == 2, -0.05 - 0.05 * m, 1.0 + m)


@pytest.mark.parametrize("form", ["index", "keep"])
def test_fusion_weights_of_both_signs(form, gen, seed):
    """Weights of both signs fuse the same way in the index form's torch code and in
    ragvit.repack_into (keep form) as in the reference."""
    magnitude = torch.rand(17, generator=gen)  # the same weights in every forward

    def make(batch):
        return signed_weights(batch.positions, magnitude)

    model = make_model("deit_tiny_patch16_224", gen, 64)
    decided = check_against_reference(model, images(gen, 2, 64), SignedFusion(form, make), seed)
    assert decided[0].shape == (2, 18) and decided[0][:, 17].all()


@pytest.mark.parametrize("weights", ["signed", "cancelling", "zero"])
def test_fusion_rule_float64(weights, gen):
    """The three fusion paths (the index form's torch code, ragvit.repack in C, the
    reference) against float64: sum(w x) / sum(w) over the dropped rows, zeros where
    sum(w) == 0, whatever the signs (here +1/-1 weights that cancel, and all-zero ones)."""
    B, L, C = 3, 9, 5
    x = torch.randn(B, L, C, generator=gen)
    kept = torch.rand(B, L, generator=gen) < 0.5
    kept[:, 0] = True
    kept[:, 1:5] = False  # four dropped rows at positions 1..4 in every image
    positions = torch.arange(L).expand(B, L)
    if weights == "signed":
        w = signed_weights(positions, torch.rand(L, generator=gen)).double()
    elif weights == "cancelling":  # positions 1..4 weigh -1, +1, -1, +1; the rest 0
        w = torch.where(positions < 5, 1.0 - 2.0 * (positions % 2), 0).double()
    else:
        w = torch.zeros(B, L, dtype=torch.float64)
    dropped = ~kept
    wd = torch.where(dropped, w, 0.0)
    total = wd.sum(1, keepdim=True)
    expected = torch.einsum("bl,blc->bc", wd, x.double()) / torch.where(total != 0, total, 1)
    expected[total[:, 0] == 0] = 0.0
    torch_path = timm_patch._fuse(x, w.float(), dropped)
    ref_path = reference._fuse_reference(x, w.float(), dropped)
    cu = torch.arange(B + 1, dtype=torch.int32) * L
    packed, cu_out, _ = ragvit.repack(x.reshape(B * L, C), cu, kept.reshape(-1),
                                      fuse_weights=w.float().reshape(-1))
    c_path = packed[cu_out[1:].long() - 1]  # the fused row closes every image
    if weights != "signed":
        assert (expected == 0).all()
    for got in (torch_path, ref_path, c_path):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


# ---- GPU ----


# Paper defaults run on the GPU only (CPU cases above use smaller settings).
GPU_POLICIES = {
    "tome_r8": lambda: ToMe(8),
    "ats_k108_b3": lambda: ATS(108, layers=(3,)),
    "l2_keep50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
    "l2_thr1_b4": lambda: ThresholdL2(threshold=1.0, layers=(4,)),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("policy_name", ["evit_fuse", "evit_drop", "ats_3stage", "ats_k108_b3",
                                         "tome_r8", "dynamicvit", "l2_keep50_b4", "l2_thr1_b4"])
@pytest.mark.parametrize("name", ["deit_small_patch16_224", "deit_base_patch16_224"],
                         ids=["deit_small", "deit_base"])
def test_gpu_fp16_matches_reference(name, policy_name, batch, gen, seed):
    """fp16 logits vs the fp16 padded reference replaying ragvit's decisions (ToMe's merge maps
    included: rounding may flip a near-tie), within bars derived from that reference's own
    error against fp32 (assert_fp16_close); top-1 identical where the reference's top-2 gap is
    clear; and ragvit's own decisions no further from an independent fp32 selection than an
    independent fp16 implementation's (own_decisions_bar)."""
    dtype = torch.float16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False).eval().to("cuda", dtype)
    x = images(gen, batch, 224, dtype=dtype, device="cuda")
    policy = GPU_POLICIES[policy_name]() if policy_name in GPU_POLICIES else \
        POLICIES[policy_name]()
    if isinstance(policy, DynamicViT):  # trained-like scale is irrelevant; fixed weights
        policy = DynamicViT(predictor=random_predictors(3, model.embed_dim))
    with torch.inference_mode():
        patch(model, policy)
        got, decided = timm_patch.forward_with_decisions(model, x)
        unpatch(model)
        _, own16 = reference.vit_forward_reference(model, x, policy, return_decisions=True)
        _, own32 = reference.vit_forward_reference(copy.deepcopy(model).float(), x.float(),
                                                   policy, return_decisions=True)
    expected, bar = assert_fp16_close(model, x, policy, got, decided, seed)
    same, counted = top1_agrees(got, expected, 2 * bar)
    assert same, f"top-1 differs on one of {counted} clear images" + seed_note(seed)
    points = list(zip(decided, own16, own32, strict=True))[:OWN_DECISIONS_POINTS.get(policy_name)]
    for stage, (ours, ref16, ref32) in enumerate(points):
        off_ours = (ours != ref32).float().mean().item()
        off_ref = (ref16 != ref32).float().mean().item()
        least = own_decisions_bar(off_ref, ours.shape[1])
        assert off_ours <= least, (
            f"point {stage}: ragvit's decisions differ from fp32's on {off_ours:.4f} of tokens, "
            f"the fp16 reference's on {off_ref:.4f} (bar {least:.4f}; ragvit vs fp16 reference "
            f"{(ours != ref16).float().mean().item():.4f})" + seed_note(seed))


def own_decisions_bar(off_ref, width) -> float:
    """The largest fraction of tokens on which ragvit's own fp16 decisions may differ from an
    fp32 selection (the reference deciding on its own fp32 activations): twice the fraction
    on which an independent fp16 implementation (the padded fp16 reference deciding on its
    own) differs from it on the same images, measured in the same test, plus one swapped
    pair per image (2 of `width` columns: a single near-tie may flip in any implementation
    that is not bit-identical, even where the fp16 reference happens not to flip it).
    Flash-attention's rule, err <= 2 * err(baseline) + floor, over decisions."""
    return 2 * off_ref + 2 / width


# Pruning points compared per policy (all when absent): ToMe merges at every block and one
# flipped near-tie match changes every later merge of that image, so after its first point
# an image agrees entirely or not at all and a batch-1 rate says nothing; its first point
# only.
OWN_DECISIONS_POINTS = {"tome_r8": 1}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("policy_name", ["l2_thr1_b4", "ats_k108_b3", "dynamicvit",
                                         "evit_fuse"])
def test_gpu_forward_is_deterministic(policy_name, gen, seed):
    """Two forwards of the same images give bit-identical logits and decisions: every
    score a policy ranks or thresholds is summed in a fixed order (an atomic index_add_
    mean flipped ThresholdL2 threshold decisions between two forwards, DeiT-B batch 256)."""
    model = make_model("deit_base_patch16_224", gen, 224, dtype=torch.float16, device="cuda")
    x = images(gen, 128, 224, dtype=torch.float16, device="cuda")
    policy = GPU_POLICIES[policy_name]() if policy_name in GPU_POLICIES else \
        POLICIES[policy_name]()
    if isinstance(policy, DynamicViT):
        policy = DynamicViT(predictor=random_predictors(3, model.embed_dim))
    patch(model, policy)
    with torch.inference_mode():
        first, first_decided = timm_patch.forward_with_decisions(model, x)
        second, second_decided = timm_patch.forward_with_decisions(model, x)
    for a, b in zip(first_decided, second_decided, strict=True):
        assert torch.equal(a, b), "decisions differ between two forwards" + seed_note(seed)
    assert torch.equal(first, second), "logits differ between two forwards" + seed_note(seed)


@contextlib.contextmanager
def host_syncs_raise():
    """Any host sync inside the block raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


SYNC_FREE = {  # policy, capacity mode
    "evit": (lambda: EViT(), False),
    "tome": (lambda: ToMe(8), False),
    "ats_capacity": (lambda: POLICIES["ats_3stage"](), True),
    "dynamicvit": (lambda: DynamicViT(predictor=random_predictors(3, 384)), False),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", list(SYNC_FREE))
def test_gpu_forward_is_sync_free(case, gen, seed):
    """Fixed-count policies, and ATS in capacity mode, never sync the host."""
    make_policy, capacity = SYNC_FREE[case]
    model = make_model("deit_small_patch16_224", gen, 224, dtype=torch.float16, device="cuda")
    x = images(gen, 8, 224, dtype=torch.float16, device="cuda")
    policy = make_policy()
    patch(model, policy, capacity=capacity)
    with torch.inference_mode():
        model(x)  # warm-up: caches, cuBLAS handles
        with host_syncs_raise():
            got, decided = timm_patch.forward_with_decisions(model, x)
    assert_fp16_close(model, x, policy, got, decided, seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("case", ["no_prefix", "duplicate", "max_seqlen_short", "keep_int8"])
def test_gpu_bad_selection_refused(case, gen):
    """On CUDA rows a Selection's types and shapes are always checked and its contents in
    debug mode (reading them syncs the host); the errors are the CPU's, device names
    aside."""
    make, exc, message = BAD_SELECTIONS[case]

    def on_gpu(batch):
        sel = make(batch)
        return dataclasses.replace(sel, **{f.name: getattr(sel, f.name).cuda()
                                           for f in dataclasses.fields(sel)
                                           if isinstance(getattr(sel, f.name), torch.Tensor)})

    model = make_model("deit_tiny_patch16_224", gen, 64, device="cuda")
    x = images(gen, 2, 64, device="cuda")
    patch(model, Returns(on_gpu), capacity=True)
    ragvit.set_debug(True)  # conftest restores it
    with torch.no_grad(), pytest.raises(exc, match=message.replace("on cpu", "on cuda:0")):
        model(x)
