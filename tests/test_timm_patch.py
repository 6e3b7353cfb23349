"""ragvit.patch on timm ViT/DeiT: lossless by default, equal to the padded-masked reference
with a pruning policy, reversible, and refusing what it cannot run.

CPU tests use support.models' random-init models (weights perturbed from the test's seed) at
small img_size, one torch thread; GPU tests run fp16/bf16 DeiT-T/S/B 224 and B 384 at batch
1 and 64, and check that fixed-count forwards never sync the host.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from support.devices import requires_cuda
from support.inputs import seed_note
from support.tolerances import ERROR_FLOOR

timm = pytest.importorskip("timm")

from support.models import (  # noqa: E402
    CPU_ATOL,
    assert_fp16_close,
    check_against_reference,
    derived_atol,
    images,
    make_model,
    max_diff,
    top1_agrees,
)

from ragvit import reference, timm_patch  # noqa: E402
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
    kept_count,
    topk_selection,
)
from ragvit.timm_patch import is_patched, patch, unpatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ---- lossless path ----

LOSSLESS = [
    pytest.param("deit_tiny_patch16_224", 224, {}, id="deit_tiny_224"),
    pytest.param("deit_small_patch16_224", 64, {}, id="deit_small"),
    pytest.param("deit_tiny_distilled_patch16_224", 64, {}, id="deit_tiny_distilled"),
    pytest.param("deit3_small_patch16_224", 64, {}, id="deit3_small"),
    pytest.param("deit_tiny_patch16_224", 64, {"global_pool": "avg"}, id="avg_pool"),
    pytest.param("vit_tiny_patch16_224", 64, {"reg_tokens": 4}, id="vit_tiny_reg4"),
]


@pytest.mark.parametrize("name,img_size,kwargs", LOSSLESS)
def test_lossless_matches_timm(name, img_size, kwargs, gen, seed):
    model = make_model(name, gen, img_size, **kwargs)
    x = images(gen, 2, img_size)
    with torch.inference_mode():
        expected = model(x)
        assert patch(model) is model
        got = model(x)
    assert got.shape == expected.shape
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)


# ---- pruning vs the padded-masked reference ----

POLICIES = {
    "fixed50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
    "threshold_b4": lambda: ThresholdL2(threshold=1.0, layers=(4,)),
    "fixed30_b4_7_10": lambda: ThresholdL2(0.3, layers=(4, 7, 10)),
    "threshold_b2_5_8": lambda: ThresholdL2(threshold=0.9, layers=(2, 5, 8)),
}

REF_MODELS = {
    "deit_tiny": ("deit_tiny_patch16_224", 96, {}),
    "deit_small": ("deit_small_patch16_224", 64, {}),
    "deit_small_distilled": ("deit_small_distilled_patch16_224", 64, {}),
    "deit3_small": ("deit3_small_patch16_224", 64, {}),
    "avg_pool": ("deit_tiny_patch16_224", 64, {"global_pool": "avg"}),
}

# Every policy on deit_tiny; the one-stage policies on every model (CPU time).
REF_CASES = [
    pytest.param(*REF_MODELS[m], p, id=f"{m}-{p}")
    for m in REF_MODELS for p in POLICIES
    if m == "deit_tiny" or p in ("fixed50_b4", "threshold_b4")
]


# ---- row ops (ragvit.layer_norm / linear / gelu instead of torch modules) ----

ROW_OPS_CASES = [
    pytest.param("deit_tiny_patch16_224", "fixed50_b4", id="deit_tiny-fixed50_b4"),
    pytest.param("deit_tiny_patch16_224", "none", id="deit_tiny-lossless"),
    pytest.param("deit3_small_patch16_224", "fixed50_b4", id="deit3_small-layerscale"),
    pytest.param("deit_tiny_distilled_patch16_224", "threshold_b4", id="distilled-threshold"),
]


@pytest.mark.parametrize("name,policy_name", ROW_OPS_CASES)
def test_row_ops_match_torch_modules(name, policy_name, gen, seed):
    """row_ops=True on the CPU (the C backend's row ops) equals torch's modules and the
    padded reference replaying the same decisions, fp32, within 1e-4."""
    model = make_model(name, gen, 64)
    x = images(gen, 2, 64)
    policy = None if policy_name == "none" else POLICIES[policy_name]()
    with torch.inference_mode():
        patch(model, policy, row_ops=False)
        expected = model(x)
        unpatch(model)
        patch(model, policy, row_ops=True)
        got, decided = timm_patch.forward_with_decisions(model, x)
        replayed = reference.vit_forward_reference(model, x, policy,
                                                   decisions=decided if policy else None)
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)
    assert max_diff(got, replayed) <= CPU_ATOL, seed_note(seed)


def test_gemm_patch_embedding_any_memory_format(gen, seed):
    """The patch embedding as one GEMM over the patches equals timm's conv, for contiguous
    and channels_last images (im2col is a reshape of whatever layout comes in)."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    with torch.inference_mode():
        expected = model.patch_embed(x)
        for img in (x, x.contiguous(memory_format=torch.channels_last)):
            got = timm_patch._embed_patches(model.patch_embed, img, True)
            assert got.shape == expected.shape
            assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)
    assert timm_patch._embed_is_gemm(model)
    model.patch_embed.proj.padding = (1, 1)  # not a plain stride-p conv any more
    assert not timm_patch._embed_is_gemm(model)


@pytest.mark.parametrize("img_size", [70, 24], ids=["70px", "24px"])
def test_image_size_not_a_multiple_of_the_patch_runs_timms_conv(img_size, gen, seed):
    """An image that the patches do not tile exactly (timm's conv drops the remainder) takes
    timm's own patch embedding, and the patched forward equals timm's."""
    model = make_model("deit_tiny_patch16_224", gen, img_size)
    x = images(gen, 2, img_size)
    assert not timm_patch._embed_is_gemm(model)
    with torch.inference_mode():
        expected = model(x)
        got = patch(model)(x)
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "offset", "narrow_patch"])
def test_patch_rows_are_the_permuted_patches(dtype, layout, gen, seed):
    """_patch_rows (int64 words where the layout allows) moves exactly the bytes of the
    plain 6-d permute, on every path: contiguous (words), channels_last and an x whose data
    starts one element into its storage (element copy), 2-pixel patches (4-byte patch rows
    of 16-bit types: element copy; fp32's 8 bytes: one word a row)."""
    p = 2 if layout == "narrow_patch" else 16
    full = torch.randn(3 * 3 * 32 * 32 + 1, generator=gen).to(dtype)
    x = full[:-1].view(3, 3, 32, 32)
    if layout == "offset":
        x = full[1:].view(3, 3, 32, 32)
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    h = w = 32 // p
    expected = x.reshape(3, 3, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * p * p)
    got = timm_patch._patch_rows(x, p, p)
    assert got.shape == (3 * h * w, 3 * p * p)
    assert torch.equal(got, expected), seed_note(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name, kwargs", [
    ("deit_tiny_patch16_224", {}),  # class token, pos_embed over every row
    ("deit3_small_patch16_224", {}),  # no_embed_class: pos_embed over the patch rows only
    ("vit_tiny_patch16_224", {"reg_tokens": 2}),  # class and register tokens
    ("vit_tiny_patch16_224", {"reg_tokens": 2, "no_embed_class": True}),
], ids=["deit", "deit3", "registers", "registers_no_embed_class"])
def test_direct_pos_embed_equals_timm(name, kwargs, dtype, gen, seed):
    """_pos_embed (prefix and patch rows written by two adds into one buffer) equals timm's
    cat + add bit for bit; subclasses with their own _pos_embed keep timm's."""
    model = make_model(name, gen, 64, **kwargs).to(dtype)
    tokens = torch.randn(3, 16, model.embed_dim, generator=gen).to(dtype)
    assert timm_patch._pos_embed_is_direct(model)
    with torch.inference_mode():
        assert torch.equal(timm_patch._pos_embed(model, tokens), model._pos_embed(tokens)), \
            seed_note(seed)
    distilled = make_model("deit_tiny_distilled_patch16_224", gen, 64)
    assert not timm_patch._pos_embed_is_direct(distilled)


def test_row_ops_need_timm_blocks(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    model.blocks[3].mlp.act = torch.nn.GELU(approximate="tanh")
    with pytest.raises(ValueError, match="row_ops=True needs every block to be timm's Block"):
        patch(model, row_ops=True)
    assert not is_patched(model)
    x = images(gen, 1, 64)
    with torch.inference_mode():
        expected = model(x)
        patch(model, row_ops=None)  # the default falls back to torch's modules
        assert not vars(model)[timm_patch._STATE_ATTR].row_ops
        assert max_diff(model(x), expected) <= CPU_ATOL


def test_fused_ops_is_the_deprecated_name_of_row_ops(gen):
    """fused_ops= still works as row_ops= with a DeprecationWarning; both at once, or a value
    other than None/True/False, is an error that leaves the model unpatched."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(TypeError, match="pass row_ops only"):
        patch(model, row_ops=True, fused_ops=True)
    assert not is_patched(model)
    for value in (0, "off"):  # truthy or falsy, neither is a choice
        with pytest.raises(TypeError, match="row_ops must be None, True or False, got"):
            patch(model, row_ops=value)
        assert not is_patched(model)
    with pytest.warns(DeprecationWarning, match="fused_ops is now called row_ops"):
        patch(model, fused_ops=False)
    assert vars(model)[timm_patch._STATE_ATTR].row_ops is False
    unpatch(model)


@pytest.mark.parametrize("name,img_size,kwargs,policy_name", REF_CASES)
def test_policy_matches_reference(name, img_size, kwargs, policy_name, gen, seed):
    model = make_model(name, gen, img_size, **kwargs)
    x = images(gen, 3, img_size)
    policy = POLICIES[policy_name]()
    decided = check_against_reference(model, x, policy, seed)
    counts = [d.sum(1).tolist() for d in decided]
    num_patches = model.patch_embed.num_patches
    if policy.is_fixed:
        n = num_patches
        for d, keep in zip(counts, policy.keep, strict=True):
            n = kept_count(keep, n)
            assert d == [n + model.num_prefix_tokens] * 3, counts


def test_threshold_mode_is_ragged(gen, seed):
    model = make_model("deit_tiny_patch16_224", gen, 96)
    x = images(gen, 8, 96)
    with torch.no_grad():
        patch(model, ThresholdL2(threshold=1.0, layers=(4,)))
        _, decided = timm_patch.forward_with_decisions(model, x)
    counts = decided[0].sum(1).tolist()
    assert len(set(counts)) > 1, f"threshold mode must give ragged counts, got {counts}" + \
        seed_note(seed)


@pytest.mark.parametrize("policy_name", ["threshold_b4", "threshold_b2_5_8", "fixed50_b4"])
def test_capacity_mode_matches_trimmed(policy_name, gen, seed):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 3, 64)
    policy = POLICIES[policy_name]()
    with torch.no_grad():
        patch(model, policy)
        trimmed = model(x)
        unpatch(model)
    check_against_reference(model, x, policy, seed, capacity=True)
    with torch.no_grad():
        assert max_diff(model(x), trimmed) <= 1e-5, seed_note(seed)


def test_inference_mode_and_batch_one(gen, seed):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 1, 64)
    policy = ThresholdL2(threshold=1.0, layers=(3, 6))
    patch(model, policy)
    with torch.inference_mode():
        got = model(x)
        expected = reference.vit_forward_reference(model, x, policy)
    assert got.shape == (1, model.num_classes)
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)


@pytest.mark.parametrize("mode", ["bf16_cast", "bf16_autocast"])
def test_low_precision_cpu_smoke(mode, gen, seed):
    dtype = torch.bfloat16
    cast = mode == "bf16_cast"
    model = make_model("deit_tiny_patch16_224", gen, 64, dtype=dtype if cast else torch.float32)
    x = images(gen, 2, 64, dtype=dtype if cast else torch.float32)
    policy = ThresholdL2(threshold=1.0, layers=(4,))
    patch(model, policy)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=not cast)
    with torch.inference_mode(), autocast:
        got, decided = timm_patch.forward_with_decisions(model, x)
        # Replay the decisions: bf16 noise may flip a near-tie in the reference's own choice.
        expected = reference.vit_forward_reference(model, x, policy, decisions=decided)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert max_diff(got, expected) <= 0.05 * float(expected.abs().max()) + 0.02, seed_note(seed)


class ClsAttnTopK(PruningPolicy):
    """Test policy: keep the patch tokens the CLS token attends to most (EViT's score)."""

    needs_cls_attn = True

    def __init__(self, keep, layers):
        self.keep, self.layers = keep, tuple(layers)

    def select(self, batch):
        assert batch.cls_attn is not None and batch.cls_attn.dtype == torch.float32
        return topk_selection(batch, batch.cls_attn, self.keep)


@pytest.mark.parametrize("layers", [(4,), (3, 6, 9)], ids=["one_stage", "three_stages"])
def test_cls_attn_policy_matches_reference(layers, gen, seed):
    """cls_attn from ragvit.attention equals the reference's explicit softmax of token 0."""
    model = make_model("deit_small_distilled_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    check_against_reference(model, x, ClsAttnTopK(0.6, layers), seed)


# ---- patch / unpatch contract ----


def test_unpatch_restores_bit_for_bit(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    forward_before = model.forward
    params_before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    keys_before = list(model.state_dict())
    modules_before = list(model.modules())
    with torch.no_grad():
        expected = model(x)
        patch(model, ThresholdL2(0.5, layers=(4,)))
        assert is_patched(model)
        assert list(model.state_dict()) == keys_before, "patch must not register anything"
        model(x)
        assert unpatch(model) is model
        got = model(x)
    assert not is_patched(model)
    assert "forward" not in vars(model)
    assert model.forward == forward_before
    assert model.forward.__func__ is type(model).forward
    assert list(model.modules()) == modules_before
    state = model.state_dict()
    assert list(state) == keys_before
    for k, (ptr, value) in params_before.items():
        assert state[k].data_ptr() == ptr, f"{k} was copied"
        assert torch.equal(state[k], value), f"{k} changed"
    assert torch.equal(got, expected)


def test_unpatch_restores_an_instance_forward(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    custom = model.forward
    model.forward = custom  # an instance attribute someone else set
    patch(model)
    unpatch(model)
    assert vars(model)["forward"] is custom


def test_double_patch_and_unpatch_unpatched_raise(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(ValueError, match="model is not patched"):
        unpatch(model)
    patch(model)
    with pytest.raises(ValueError, match="already patched"):
        patch(model, ThresholdL2(0.5))
    unpatch(model)
    patch(model, ThresholdL2(0.5))  # patchable again


def test_training_and_autograd_refused(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 1, 64)
    patch(model)
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        model(x)
    model.train()
    with torch.no_grad(), pytest.raises(RuntimeError, match="model.eval"):
        model(x)


@pytest.mark.parametrize("policy_name", ["none", "fixed50_b4", "dynamicvit"])
def test_deepcopy_runs_the_copys_weights(policy_name, gen, seed):
    """copy.deepcopy of a patched model is a patched model over the copy's own modules:
    changing the copy's weights changes its logits, not the original's."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    policy = {"none": lambda: None, "fixed50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
              "dynamicvit": lambda: DynamicViT(predictor=_dynamicvit_state(gen))}[policy_name]()
    x = images(gen, 2, 64)
    with torch.no_grad():
        patch(model, policy)
        before = model(x)
        twin = copy.deepcopy(model)
        assert is_patched(twin)
        for p in twin.parameters():
            p.mul_(1.5)
        expected = reference.vit_forward_reference(twin, x, _policy_of(twin))
        got = twin(x)
        again = model(x)
    assert torch.equal(again, before), "the original must keep its own weights"
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)
    assert max_diff(got, before) > 100 * CPU_ATOL, "the copy ran the original's weights"
    unpatch(twin)
    assert is_patched(model) and not is_patched(twin)


def _policy_of(model):
    return vars(model)[timm_patch._STATE_ATTR].policy


def _dynamicvit_state(gen):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        modules = torch.nn.ModuleList(DynamicViTPredictor(192) for _ in range(3))
    return modules.state_dict()


@pytest.mark.parametrize("how", ["pickle", "torch_save"])
def test_patched_model_pickles(how, gen, seed):
    """pickle and torch.save store a patched model whole: the loaded model is patched, gives
    the same logits, and starts with an empty cu_seqlens cache."""
    import io
    import pickle

    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    with torch.no_grad():
        patch(model, ThresholdL2(0.5, layers=(4,)))
        expected = model(x)  # fills the cache
        assert vars(model)[timm_patch._STATE_ATTR].cu_cache
        if how == "pickle":
            loaded = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
        assert is_patched(loaded)
        assert vars(loaded)[timm_patch._STATE_ATTR].cu_cache == {}
        got = loaded(x)
    assert torch.equal(got, expected), seed_note(seed)
    unpatch(loaded)
    with torch.no_grad():
        assert max_diff(loaded(x), expected) > 0, "unpatched: timm's own forward again"


@pytest.mark.parametrize("policy_name", ["none", "fixed50_b4", "threshold_b4", "evit", "ats",
                                         "tome", "dynamicvit"])
def test_empty_batch(policy_name, gen):
    """Batch 0 gives (0, num_classes) logits, patched and in the reference, as timm does."""
    policies = {"none": lambda: None, "fixed50_b4": lambda: ThresholdL2(0.5, layers=(4,)),
                "threshold_b4": lambda: ThresholdL2(threshold=1.0, layers=(4,)),
                "evit": lambda: EViT(0.7, layers=(3, 6)), "ats": lambda: ATS(8, layers=(3,)),
                "tome": lambda: ToMe(2),
                "dynamicvit": lambda: DynamicViT(predictor=_dynamicvit_state(gen))}
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 0, 64)
    policy = policies[policy_name]()
    with torch.no_grad():
        expected = model(x)
        ref = reference.vit_forward_reference(model, x, policy)
        patch(model, policy)
        got = model(x)
        _, decisions = timm_patch.forward_with_decisions(model, x)
    assert expected.shape == ref.shape == got.shape == (0, model.num_classes)
    assert len(decisions) == (len(policy.layers) if policy is not None else 0)
    assert all(d.shape[0] == 0 for d in decisions)


def test_attention_must_be_callable(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(TypeError, match="ragvit.patch: attention must be None or a callable "
                       "with ragvit.attention's signature, got int"):
        patch(model, attention=42)
    assert not is_patched(model)


def test_flags_must_be_bools(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(TypeError, match="ragvit.patch: capacity must be True or False, got "
                       "'yes'"):
        patch(model, ThresholdL2(threshold=1.0), capacity="yes")
    with pytest.raises(TypeError, match="ragvit.patch: dense_until_pruning must be None, True "
                       "or False, got 1"):
        patch(model, ThresholdL2(0.5), dense_until_pruning=1)
    assert not is_patched(model)


def test_non_models_are_not_patched():
    assert not is_patched(42) and not is_patched(torch.zeros(1))
    with pytest.raises(ValueError, match="ragvit.unpatch: model is not patched"):
        unpatch(42)
    with pytest.raises(ValueError, match="ragvit.forward_with_decisions: model is not patched"):
        timm_patch.forward_with_decisions(42, torch.zeros(1))


@pytest.mark.parametrize("decision, got", [
    (torch.zeros(2, 3), "2-D torch.float32"), (torch.zeros(3, dtype=torch.bool), "1-D torch.bool"),
    ([[True]], "list")], ids=["float", "1d", "list"])
def test_kept_mask_refuses_what_is_no_decision(decision, got):
    with pytest.raises(TypeError, match=f"ragvit.kept_mask: decision must be a 2-D bool or "
                       f"int64 tensor \\(a decision of forward_with_decisions\\), got {got}"):
        timm_patch.kept_mask(decision)


@pytest.mark.parametrize("shape", [(1, 4, 64, 64), (3, 64, 64), (1, 3, 32, 32)],
                         ids=["four_channels", "unbatched", "other_size"])
def test_wrong_images_raise_timms_error(shape, gen):
    """An input the model was not built for raises what timm's own forward raises."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = torch.randn(shape, generator=gen)
    with torch.no_grad():
        with pytest.raises(Exception) as timm_error:
            model(x)
        patch(model, ThresholdL2(0.5, layers=(4,)))
        with pytest.raises(type(timm_error.value)) as ours:
            model(x)
    assert str(ours.value) == str(timm_error.value)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
def test_jit_trace_refused(gen):
    """torch.jit.trace would fail inside torch (or keep a C op's output as a constant);
    the patched forward says what to use instead."""
    model = make_model("deit_tiny_patch16_224", gen, 64)
    patch(model, ThresholdL2(0.5, layers=(4,)))
    with torch.no_grad(), pytest.raises(RuntimeError, match="ragvit.patch: torch.jit.trace "
                                        "cannot record a patched forward .* torch.export"):
        torch.jit.trace(model, images(gen, 1, 64))


def _tiny_vit(**kwargs):
    from timm.models.vision_transformer import VisionTransformer

    args = dict(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=1, num_classes=4)
    args.update(kwargs)
    return VisionTransformer(**args).eval()


@pytest.mark.parametrize("kwargs,feature", [
    ({"qk_norm": True}, "qk_norm"),
    ({"class_token": False, "global_pool": "avg"}, "without a class token"),
    ({"global_pool": "map"}, "attention-pool head"),
    ({"dynamic_img_size": True}, "dynamic_img_size"),
    ({"global_pool": "max"}, "global_pool='max'"),
    ({"embed_dim": 48, "num_heads": 1}, "head_dim 48"),
    ({"scale_attn_norm": True}, "scale_attn_norm"),
    ({"attn_layer": "diff"}, "DiffAttention"),
], ids=["qk_norm", "no_class_token", "attn_pool", "dynamic_img_size", "max_pool", "head_dim",
        "scale_attn_norm", "diff_attention"])
def test_unsupported_models_refused(kwargs, feature):
    try:
        model = _tiny_vit(**kwargs)
    except TypeError as exc:  # this timm lacks the option
        pytest.skip(f"timm cannot build it: {exc}")
    with pytest.raises(timm_patch.UnsupportedModelError, match=feature) as info:
        patch(model)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    assert str(info.value).startswith("ragvit.patch: ")
    assert not is_patched(model)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.nn.Linear(2, 2), "timm VisionTransformer, got Linear"),
    (lambda: timm.create_model("resnet10t", pretrained=False, num_classes=4),
     "timm VisionTransformer, got ResNet"),
    (lambda: _tiny_vit(qk_norm=True), "qk_norm is not supported"),
], ids=["linear", "resnet", "vit_qk_norm"])
def test_every_unpatchable_model_raises_one_type(make, message):
    """A non-ViT model and a ViT with an unsupported feature raise the same
    ragvit.UnsupportedModelError, which `except TypeError` (the non-ViT error callers
    caught before) and `except ValueError` (the feature error) both still catch."""
    import ragvit

    model = make()
    with pytest.raises(ragvit.UnsupportedModelError, match=message):
        ragvit.patch(model)
    with pytest.raises(TypeError, match=message):
        ragvit.patch(model)
    with pytest.raises(ValueError, match=message):
        ragvit.patch(model)
    assert not is_patched(model)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.nn.Linear(2, 2), "model must be a timm VisionTransformer, got Linear"),
    (lambda: _tiny_vit(qk_norm=True), "qk_norm is not supported"),
    (lambda: _tiny_vit(global_pool="max"), "global_pool='max' is not supported"),
], ids=["linear", "vit_qk_norm", "max_pool"])
def test_reference_refuses_what_patch_refuses(make, message):
    """vit_forward_reference runs the models ragvit.patch runs; any other raises the same
    UnsupportedModelError, naming the reference (it would otherwise skip the feature)."""
    model = make()
    with torch.no_grad(), pytest.raises(timm_patch.UnsupportedModelError,
                                        match=message) as info:
        reference.vit_forward_reference(model, torch.zeros(1, 3, 32, 32))
    assert str(info.value).startswith("ragvit.reference.vit_forward_reference: ")


def test_reference_checks_the_policy(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 1, 64)
    with torch.no_grad():
        with pytest.raises(TypeError, match="vit_forward_reference: policy must be a "
                           "ragvit.pruning.PruningPolicy or None, got float"):
            reference.vit_forward_reference(model, x, 0.5)
        with pytest.raises(ValueError, match=r"layers must be ascending block indices in "
                           r"\[0, 12\), got \(12,\)"):
            reference.vit_forward_reference(model, x, ThresholdL2(0.5, layers=(12,)))


def test_compiled_model_refused_with_the_order_to_use(gen):
    model = make_model("deit_tiny_patch16_224", gen, 64)
    compiled = torch.compile(model)
    with pytest.raises(timm_patch.UnsupportedModelError, match="got OptimizedModule; patch the "
                       "model first, then compile it: torch.compile\\(ragvit.patch\\(model\\)\\)"):
        patch(compiled)
    assert not is_patched(model) and not is_patched(compiled)


def test_non_vit_and_bad_policy_refused(gen):
    with pytest.raises(TypeError, match="timm VisionTransformer, got Linear"):
        patch(torch.nn.Linear(2, 2))
    model = make_model("deit_tiny_patch16_224", gen, 64)
    with pytest.raises(TypeError, match="PruningPolicy"):
        patch(model, policy=0.5)
    with pytest.raises(ValueError, match="ascending block indices"):
        patch(model, ThresholdL2(0.5, layers=(12,)))
    assert not is_patched(model)


# ---- policy unit checks ----


def test_threshold_l2_arguments():
    with pytest.raises(ValueError, match="exactly one of keep and threshold"):
        ThresholdL2()
    with pytest.raises(ValueError, match="exactly one of keep and threshold"):
        ThresholdL2(0.5, threshold=1.0)
    with pytest.raises(ValueError, match=r"keep must be in \(0, 1\]"):
        ThresholdL2(1.5)
    with pytest.raises(ValueError, match="threshold must be finite and > 0"):
        ThresholdL2(threshold=0.0)
    with pytest.raises(ValueError, match="one value per layer"):
        ThresholdL2((0.5, 0.5), layers=(4,))
    assert ThresholdL2(0.5).is_fixed and not ThresholdL2(threshold=1.0).is_fixed


@pytest.mark.parametrize("policy_name, dense_blocks", [
    ("fixed50_b4", 4), ("threshold_b2_5_8", 2), ("evit", 3), ("none", 0)])
def test_dense_until_pruning(policy_name, dense_blocks, gen, seed):
    """Blocks before the first pruning point run dense SDPA (not `attention`) with
    dense_until_pruning=True, through `attention` with False and with None (the default);
    EViT's block 3 still needs the kernel's CLS scores; every setting gives the same
    logits; without a policy every block calls `attention`."""
    from ragvit import ops
    from ragvit.pruning import EViT

    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 2, 64)
    policy = {"evit": lambda: EViT(0.7, layers=(3, 6, 9)),
              "none": lambda: None}.get(policy_name, POLICIES.get(policy_name))()
    depth = len(model.blocks)
    results = {}
    for dense in (True, False, None):
        calls = []

        def counting(*args, calls=calls, **kwargs):
            calls.append(kwargs.get("cls_attn") is not None)
            return ops.attention(*args, **kwargs)

        with torch.no_grad():
            patch(model, policy, attention=counting, dense_until_pruning=dense)
            results[dense] = model(x)
            unpatch(model)
        assert len(calls) == depth - (dense_blocks if dense else 0), (dense, calls)
    assert max_diff(results[True], results[False]) <= CPU_ATOL, seed_note(seed)
    assert max_diff(results[None], results[False]) <= CPU_ATOL, seed_note(seed)


def test_topk_uniform_and_ragged_agree(gen):
    """Fixed-ratio selection: index form (uniform) and mask form (ragged) pick the same rows."""
    B, L, C, P = 3, 11, 8, 2
    rows = torch.randn(B * L, C, generator=gen)
    cu = torch.arange(B + 1, dtype=torch.int32) * L
    policy = ThresholdL2(0.4)
    common = dict(rows=rows, cu_seqlens=cu, num_prefix=P, max_seqlen=L, layer=4, stage=0)
    by_index = policy.select(TokenBatch(seq_len=L, **common))
    by_mask = policy.select(TokenBatch(seq_len=None, **common))
    assert isinstance(by_index, Selection) and by_index.index.shape == (B, P + 4)
    mask = torch.zeros(B, L, dtype=torch.bool).scatter_(1, by_index.index, True)
    assert torch.equal(mask.view(-1)[P:], (by_mask.keep | mask.view(-1))[P:])
    assert torch.equal(by_mask.keep.view(B, L)[:, P:], mask[:, P:])
    norms = rows.norm(dim=1).view(B, L)[:, P:]
    for b in range(B):
        kept = norms[b][mask[b, P:]]
        dropped = norms[b][~mask[b, P:]]
        assert kept.min() >= dropped.max()


# ---- GPU ----

GPU_MODELS = [
    pytest.param("deit_tiny_patch16_224", 224, id="deit_tiny_224"),
    pytest.param("deit_small_patch16_224", 224, id="deit_small_224"),
    pytest.param("deit_base_patch16_224", 224, id="deit_base_224"),
    pytest.param("deit_base_patch16_384", 384, id="deit_base_384"),
    pytest.param("deit_small_distilled_patch16_224", 224, id="deit_small_distilled_224"),
    pytest.param("deit3_small_patch16_224", 224, id="deit3_small_224"),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("policy_name", ["none", "fixed50_b4", "threshold_b4"])
@pytest.mark.parametrize("name,img_size", GPU_MODELS)
def test_gpu_matches_reference(name, img_size, policy_name, dtype, batch, gen, seed):
    """Both bars derived from the same-dtype padded reference's own error against an fp32
    reference of the same weights and decisions (err_ref, measured here): flash-attention's
    rule against the fp32 reference, err(ours vs fp32) <= 2 * err_ref + floor, and against
    the same-dtype reference (itself err_ref from the truth) err <= 2 * err_ref + floor; top-1
    identical wherever the reference's top-2 gap exceeds twice that bar."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model32 = timm.create_model(name, pretrained=False).eval().to("cuda")  # plain init
    model = copy.deepcopy(model32).to(dtype)
    x32 = images(gen, batch, img_size, device="cuda")
    x = x32.to(dtype)
    policy = None if policy_name == "none" else POLICIES[policy_name]()
    with torch.inference_mode():
        patch(model, policy)
        got, decided = timm_patch.forward_with_decisions(model, x)
        # Replay the patched decisions: rounding must not flip a threshold choice.
        replay = decided if policy else None
        expected = reference.vit_forward_reference(model, x, policy, decisions=replay)
        exact = reference.vit_forward_reference(model32, x32, policy, decisions=replay)
    torch.cuda.synchronize()
    err = max_diff(got, expected)
    err_ours, err_ref = max_diff(got, exact), max_diff(expected, exact)
    bar = derived_atol(err_ref, dtype)
    note = (f" err vs {dtype} ref {err}, vs fp32 ref {err_ours} (ref's own {err_ref}, "
            f"bar {bar})")
    assert err_ours <= bar, note + seed_note(seed)
    assert err <= bar, note + seed_note(seed)
    same, counted = top1_agrees(got, expected, 2 * bar)
    assert same, f"top-1 differs on one of {counted} clear images" + note + seed_note(seed)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("name", ["deit_small_patch16_224", "deit3_small_patch16_224"])
@pytest.mark.parametrize("policy_name", ["none", "fixed50_b4"])
def test_gpu_row_ops_match_torch_modules(name, policy_name, gen, seed):
    """The default CUDA path (the row ops, cuBLASLt, the patch embedding as a GEMM) vs
    torch's modules (row_ops=False), both fp16: each against an fp32 reference replaying
    its own decisions, err(row ops) <= 2 * err(torch modules) + floor."""
    model = make_model(name, gen, 224, dtype=torch.float16, device="cuda")
    model32 = copy.deepcopy(model).float()
    x = images(gen, 8, 224, dtype=torch.float16, device="cuda")
    policy = None if policy_name == "none" else POLICIES[policy_name]()
    errs = {}
    with torch.inference_mode():
        for row_ops in (False, None):
            patch(model, policy, row_ops=row_ops)
            assert vars(model)[timm_patch._STATE_ATTR].row_ops is row_ops
            got, decided = timm_patch.forward_with_decisions(model, x)
            unpatch(model)
            exact = reference.vit_forward_reference(model32, x.float(), policy,
                                                    decisions=decided if policy else None)
            errs[row_ops] = max_diff(got, exact)
    note = f" err vs fp32: row ops {errs[None]}, torch modules {errs[False]}"
    assert errs[None] <= 2 * errs[False] + ERROR_FLOOR[torch.float16], note + seed_note(seed)


@pytest.mark.gpu
@requires_cuda
def test_gpu_runs_torch_linear_when_cuda_linear_cannot_load(gen, seed, monkeypatch):
    """Where ragvit.linear cannot run on CUDA (no cuBLASLt built in or loadable; here its
    loader's error, raised by a stand-in), the patched model runs its linears through torch,
    says so once (RuntimeWarning) and stays within the row ops' own error of the fp32
    reference."""
    model = make_model("deit_small_patch16_224", gen, 224, dtype=torch.float16, device="cuda")
    model32 = copy.deepcopy(model).float()
    x = images(gen, 4, 224, dtype=torch.float16, device="cuda")
    policy = POLICIES["fixed50_b4"]()
    with torch.inference_mode():
        patch(model, policy)
        got, decided = timm_patch.forward_with_decisions(model, x)
        unpatch(model)
        exact = reference.vit_forward_reference(model32, x.float(), policy, decisions=decided)

    def no_cublaslt(*args, **kwargs):
        raise RuntimeError("linear: cuBLASLt must be loadable (libcublasLt.so.13), got: none")

    monkeypatch.setattr(timm_patch.ops, "linear", no_cublaslt)
    monkeypatch.setattr(timm_patch, "_cuda_linear_runs", {})
    with torch.inference_mode():
        patch(model, policy)
        with pytest.warns(RuntimeWarning, match="CUDA linear is unavailable .*cuBLASLt"):
            fallback, fallback_decided = timm_patch.forward_with_decisions(model, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(x)  # said once: no second warning
        exact_fallback = reference.vit_forward_reference(model32, x.float(), policy,
                                                         decisions=fallback_decided)
    assert timm_patch._cuda_linear_runs == {x.device.index: False}
    err_fallback = max_diff(fallback, exact_fallback)
    err_row_ops = max_diff(got, exact)
    note = f" err vs fp32: torch linear {err_fallback}, row ops {err_row_ops}"
    assert err_fallback <= 2 * err_row_ops + ERROR_FLOOR[torch.float16], note + seed_note(seed)


def test_torch_linear_fallback_looks_ops_up_at_call_time(gen, monkeypatch):
    """The torch-linear fallback's layer_norm and gelu call whatever ragvit.ops holds when
    they run, as the patched forward does: non-strict torch.export swaps in the torch ops
    (library.routed_ops), and a function bound at import would get fake tensors."""
    import ragvit
    from ragvit import library

    fallback = timm_patch._CudaRowOpsTorchLinear
    x, w, b = (torch.randn(3, 8, generator=gen), torch.randn(8, generator=gen),
               torch.randn(8, generator=gen))
    expected_ln = ragvit.layer_norm(x, w, b, eps=1e-6)
    expected_gelu = ragvit.gelu(x)
    seen = []
    with library.routed_ops():
        for name in ("layer_norm", "gelu"):
            routed = getattr(timm_patch.ops, name)
            assert routed is getattr(library, name)
            monkeypatch.setattr(timm_patch.ops, name,
                                lambda *a, _f=routed, _n=name, **k: seen.append(_n) or _f(*a, **k))
        got_ln = fallback.layer_norm(x, w, b, eps=1e-6)
        inplace = x.clone()
        got_gelu = fallback.gelu(inplace, out=inplace)
        monkeypatch.undo()
    assert seen == ["layer_norm", "gelu"]
    assert torch.equal(got_ln, expected_ln)
    assert got_gelu is inplace and torch.equal(got_gelu, expected_gelu)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_linear_probe_raises_other_errors(monkeypatch):
    """Only the loader's cuBLASLt error switches to torch's linear: any other error of the
    probe GEMM reaches the caller."""
    def broken(*args, **kwargs):
        raise RuntimeError("linear: CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(timm_patch.ops, "linear", broken)
    monkeypatch.setattr(timm_patch, "_cuda_linear_runs", {})
    rows = torch.zeros(2, 8, dtype=torch.float16, device="cuda")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        timm_patch._cuda_linear_probe(rows)
    assert timm_patch._cuda_linear_runs == {}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("policy_name", ["none", "fixed50_b4", "fixed30_b4_7_10"])
def test_gpu_fixed_counts_are_sync_free(policy_name, gen):
    model = make_model("deit_small_patch16_224", gen, 224, dtype=torch.float16, device="cuda")
    x = images(gen, 8, 224, dtype=torch.float16, device="cuda")
    policy = None if policy_name == "none" else POLICIES[policy_name]()
    patch(model, policy)
    with torch.inference_mode():
        model(x)  # warm-up: caches, cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@requires_cuda
def test_gpu_capacity_mode_is_sync_free(gen, seed):
    model = make_model("deit_small_patch16_224", gen, 224, dtype=torch.float16, device="cuda")
    x = images(gen, 8, 224, dtype=torch.float16, device="cuda")
    policy = POLICIES["threshold_b2_5_8"]()
    patch(model, policy, capacity=True)
    with torch.inference_mode():
        model(x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got, decided = timm_patch.forward_with_decisions(model, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert_fp16_close(model, x, policy, got, decided, seed)


# ---- the CPU path: torch's SDPA and functions in place of ragvit's C backend ----

# (lengths, whether the forward knows the common length, capacity rows past the total)
CPU_ATTENTION_CASES = [
    pytest.param([197, 197], True, 0, id="uniform_197_known"),
    pytest.param([99, 99, 99], False, 0, id="uniform_99_read"),
    pytest.param([1, 1, 1, 1], True, 0, id="uniform_1"),
    pytest.param([1, 197, 5, 5, 0, 33], False, 0, id="ragged_1_197"),
    pytest.param([99, 98, 99, 97], False, 7, id="ragged_capacity"),
    pytest.param([197], True, 0, id="one_seq_197"),
]


@pytest.mark.parametrize("lengths,known,spare", CPU_ATTENTION_CASES)
@pytest.mark.parametrize("with_cls", [False, True], ids=["no_cls", "cls_attn"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_cpu_attention_matches_ragvit_attention(lengths, known, spare, with_cls, with_bias,
                                                gen, seed):
    """_cpu_attention (the patched forward's attention on CPU rows) equals ragvit.attention
    (the C backend) on views of one qkv buffer: output, cls_attn and ToMe's key bias, for
    uniform lengths (known to the forward or read from cu_seqlens) and ragged ones
    (including 0, 1 and 197), with capacity rows past the total left alone."""
    from ragvit import ops
    H, D, scale = 6, 64, 0.125
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    T = total + spare
    qkv = torch.randn(T, 3, H, D, generator=gen)
    bias = torch.rand(T, generator=gen).add(0.5).log() if with_bias else None
    kwargs, expected_kwargs = {}, {}
    if with_cls:
        kwargs["cls_attn"] = torch.full((T,), float("nan"))
        expected_kwargs["cls_attn"] = torch.full((T,), float("nan"))
    if with_bias:
        kwargs["bias"] = expected_kwargs["bias"] = bias
    q, k, v = qkv.unbind(1)
    expected = torch.full((T, H, D), float("nan"))
    ops.attention(q, k, v, cu, max(lengths), scale=scale, out=expected, **expected_kwargs)
    got = timm_patch._cpu_attention(qkv, cu, lengths[0] if known else None, scale, **kwargs)
    assert got.shape == (T, H, D)
    torch.testing.assert_close(got[:total], expected[:total], atol=1e-5, rtol=1.3e-6,
                               msg=lambda m: f"{m}\n{seed_note(seed)}")
    if with_cls:
        torch.testing.assert_close(kwargs["cls_attn"][:total], expected_kwargs["cls_attn"][:total],
                                   atol=1e-6, rtol=1e-5, msg=lambda m: f"{m}\n{seed_note(seed)}")
        assert kwargs["cls_attn"][total:].isnan().all()  # rows past the total untouched


def _c_attention(*args, **kwargs):
    """ragvit.attention behind a wrapper: the patched forward's C-backend path on the CPU."""
    from ragvit import ops

    return ops.attention(*args, **kwargs)


@pytest.mark.parametrize("policy_name", ["fixed50_b4", "threshold_b4", "evit", "tome"])
def test_cpu_path_is_taken_and_matches_c_backend(policy_name, gen, seed, monkeypatch):
    """On CPU rows the default patch runs every block's attention through _cpu_attention
    (never ragvit.attention) and its row ops through _TorchRowOps; its logits and
    decisions equal the same forward on ragvit's C attention and torch's modules (fixed
    and ragged counts, EViT's cls_attn, ToMe's key bias)."""
    from ragvit.pruning import EViT, ToMe

    policy = {"evit": lambda: EViT(0.7, layers=(3, 6, 9)),
              "tome": lambda: ToMe(4, layers=(2, 5))}.get(policy_name,
                                                        POLICIES.get(policy_name))()
    model = make_model("deit_tiny_patch16_224", gen, 64)
    x = images(gen, 3, 64)
    calls = []
    original = timm_patch._cpu_attention

    def counting(*args, **kwargs):
        calls.append((kwargs.get("cls_attn") is not None, kwargs.get("bias") is not None))
        return original(*args, **kwargs)

    monkeypatch.setattr(timm_patch, "_cpu_attention", counting)
    with torch.inference_mode():
        patch(model, policy)
        state = vars(model)[timm_patch._STATE_ATTR]
        assert timm_patch._use_row_ops(model, state, x) is timm_patch._TorchRowOps
        got, decided = timm_patch.forward_with_decisions(model, x)
        unpatch(model)
        patch(model, policy, attention=_c_attention, row_ops=False)
        expected, expected_decided = timm_patch.forward_with_decisions(model, x)
        unpatch(model)
        replayed = reference.vit_forward_reference(model, x, policy, decisions=decided)
    assert len(calls) == len(model.blocks), calls
    assert any(c for c, _ in calls) == (policy_name == "evit")
    assert any(b for _, b in calls) == (policy_name == "tome")
    assert all(bool((a == b).all()) for a, b in zip(decided, expected_decided, strict=True))
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)
    assert max_diff(got, replayed) <= CPU_ATOL, seed_note(seed)


def test_cpu_row_ops_equal_ragvit_row_ops(gen, seed):
    """_TorchRowOps (the default on CPU rows) follows ragvit.layer_norm / linear (with the
    residual written into rows) / gelu (in place) to fp32 rounding, and row_ops=True
    still runs ragvit's own row ops on the CPU."""
    from ragvit import ops

    rows = torch.randn(37, 64, generator=gen)
    h = torch.randn(37, 96, generator=gen)
    w, b = torch.randn(64, 96, generator=gen) / 10, torch.randn(64, generator=gen)
    lw, lb = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    rops = timm_patch._TorchRowOps
    close = {"atol": 1e-5, "rtol": 1.3e-6, "msg": lambda m: f"{m}\n{seed_note(seed)}"}
    torch.testing.assert_close(rops.layer_norm(rows, lw, lb, eps=1e-6),
                               ops.layer_norm(rows, lw, lb, eps=1e-6), **close)
    torch.testing.assert_close(rops.linear(h, w, b), ops.linear(h, w, b), **close)
    mine, theirs = rows.clone(), rows.clone()
    assert rops.linear(h, w, b, residual=mine, out=mine) is mine
    ops.linear(h, w, b, residual=theirs, out=theirs)
    torch.testing.assert_close(mine, theirs, **close)
    mine, theirs = h.clone(), h.clone()
    assert rops.gelu(mine, out=mine) is mine
    torch.testing.assert_close(mine, ops.gelu(theirs), **close)
    model = make_model("deit_tiny_patch16_224", gen, 64)
    patch(model, None, row_ops=True)
    state = vars(model)[timm_patch._STATE_ATTR]
    assert timm_patch._use_row_ops(model, state, rows) is ops
    unpatch(model)
