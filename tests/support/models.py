"""timm models for the patch, policy and graph tests, and the checks of a patched forward.

Models are random-init (pretrained=False: nothing downloads) with weights perturbed from the
test's generator, so LayerScale and the zero-ish heads of a fresh init do not hide
mistakes. A patched forward is checked against ragvit.reference.vit_forward_reference, the
padded-masked float64-capable reference, on the same decisions. GPU bars are derived in the
test from the same-dtype reference's own error against an fp32 reference (reference_error,
derived_atol), never fixed from a past failure. Import after pytest.importorskip("timm").
"""

from __future__ import annotations

import copy

import timm
import torch

from ragvit import reference, timm_patch
from ragvit.timm_patch import patch
from support.inputs import seed_note
from support.tolerances import ERROR_FLOOR

CPU_ATOL = 1e-4


def make_model(name, gen, img_size=64, dtype=torch.float32, device="cpu", **kwargs):
    """A random-init timm model in eval, weights perturbed from gen (init seeded from gen)."""
    with torch.random.fork_rng(devices=[]):  # timm initialises from the global RNG
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        model = timm.create_model(name, pretrained=False, img_size=img_size, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval().to(device=device, dtype=dtype)


def images(gen, batch, img_size, dtype=torch.float32, device="cpu"):
    return torch.randn(batch, 3, img_size, img_size, generator=gen).to(device=device, dtype=dtype)


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def check_against_reference(model, x, policy, seed, capacity=False):
    """Patches model with policy; its logits and decisions must equal the reference's (its
    own decisions, and replaying the patched ones) within CPU_ATOL. Returns the decisions."""
    with torch.no_grad():
        patch(model, policy, capacity=capacity)
        got, decided = timm_patch.forward_with_decisions(model, x)
        plain = model(x)
        expected, ref_decided = reference.vit_forward_reference(model, x, policy,
                                                                return_decisions=True)
        replayed = reference.vit_forward_reference(model, x, policy, decisions=decided)
    assert torch.equal(got, plain), "forward_with_decisions must not change the result"
    assert len(decided) == len(policy.layers)
    for ours, theirs in zip(decided, ref_decided, strict=True):
        assert torch.equal(ours, theirs), "patched and reference made different decisions" + \
            seed_note(seed)
        kept = timm_patch.kept_mask(ours)
        assert kept[:, : model.num_prefix_tokens].all(), "prefix tokens must be kept"
    assert max_diff(got, expected) <= CPU_ATOL, seed_note(seed)
    assert max_diff(got, replayed) <= CPU_ATOL, seed_note(seed)
    return decided


def reference_error(model, x, policy, decided, model32=None):
    """(expected, exact, err_ref): the padded reference in model's dtype replaying `decided`,
    the same reference in fp32 (model32, by default an fp32 copy of model's weights; the
    images in fp32; the same decisions), and max |expected - exact|: how far that dtype's
    rounding alone moves the logits."""
    model32 = copy.deepcopy(model).float() if model32 is None else model32
    with torch.inference_mode():
        expected = reference.vit_forward_reference(model, x, policy, decisions=decided)
        exact = reference.vit_forward_reference(model32, x.float(), policy, decisions=decided)
    return expected, exact, max_diff(expected, exact)


def derived_atol(err_ref, dtype=torch.float16) -> float:
    """The bar for two forwards in `dtype` (or one against the fp32 truth): each is an
    implementation whose rounding error is the reference's own (err_ref, measured in the same
    test), so they differ by at most twice that, plus ERROR_FLOOR[dtype] for the last
    rounding (flash-attention's rule err <= 2 * err(baseline) + floor)."""
    return 2 * err_ref + ERROR_FLOOR[dtype]


def assert_fp16_close(model, x, policy, got, decided, seed):
    """Patched fp16 logits vs the fp16 padded reference replaying the same decisions, both
    bars derived from that reference's own error against an fp32 reference of the same
    weights and decisions (err_ref): flash-attention's rule against the fp32 reference,
    err(ours vs fp32) <= 2 * err_ref + floor, and against the fp16 reference, which is itself
    err_ref from the truth, err(ours vs fp16 ref) <= 2 * err_ref + floor. Returns
    (expected, bar): the fp16 reference's logits and that bar (for near-tie margins)."""
    expected, exact, err_ref = reference_error(model, x, policy, decided)
    err, err_ours = max_diff(got, expected), max_diff(got, exact)
    bar = derived_atol(err_ref)
    note = f" err vs fp16 ref {err}, vs fp32 ref {err_ours} (fp16 ref's own {err_ref}, bar {bar})"
    assert err_ours <= bar, note + seed_note(seed)
    assert err <= bar, note + seed_note(seed)
    return expected, bar


def top1_agrees(got, expected, margin):
    """Top-1 equal on every image whose reference top-2 gap exceeds margin (random weights
    leave near-ties that any rounding may flip)."""
    top2 = expected.float().topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > margin
    return bool((got.argmax(1) == expected.argmax(1))[decided].all()), int(decided.sum())
