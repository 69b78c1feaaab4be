"""FLIP's image-token dropout (config key image_token_drop, models.pretrain): a seeded subset of fixed size
of each image's patches, [CLS] kept, the same kept tokens for ITC, ITM and MLM, none dropped in evaluation
or in the unmasked epochs (where the step is the paper's, bit for bit), one compiled graph, and executed
FLOPs that fall by a closed form in the kept count."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import word_tokenizer
from test_step_equality import IMAGE_KEYS, batch, pretrain_config, step, twin_models
from torch import nn

from models.losses import WithObjectives
from models.pretrain import ALBEF_Base
from models.vit import VisionEncoder, VisionTransformer, build_vision_encoder, patch_dropout
from tools.step_measure import count_flops
from training.config_files import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WORDS = ["a", "dog", "cat", "red", "blue", "ball", "on", "the", "grass", "left", "right", "big", "small"]
PATCHES = 16  # 32 px images in 8 px patches (pretrain_config)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


def vision_tokens(model: ALBEF_Base, image: torch.Tensor, text: dict, seed: int = 3) -> list[tuple]:
    """One seeded forward of the whole model -> for every call of the ViT's blocks, every patch's embedded
    token (B,1+P,D) and the tokens the blocks received (B,1+K,D); the image tokens every call of the fusion
    layers received."""
    seen: list = []
    vit = model.visual_encoder
    with torch.no_grad():  # every patch's token as timm embeds it, before any is dropped
        every = vit._pos_embed(vit.patch_embed(image))
    handles = [vit.blocks.register_forward_pre_hook(lambda m, args: seen.append(("drop", every, args[0])))]
    fuse = model.fuse

    def spy(text_embeds, text_mask, image_embeds, image_index=None, **kwargs):
        seen.append(("fuse", image_embeds))
        return fuse(text_embeds, text_mask, image_embeds, image_index, **kwargs)

    model.fuse = spy
    try:
        torch.manual_seed(seed)
        WithObjectives(model)(image, text, image_key=IMAGE_KEYS)
    finally:
        del model.fuse
        for h in handles:
            h.remove()
    return seen


def test_kept_tokens_are_a_seeded_fixed_size_subset_per_image_shared_by_every_objective(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(image_token_drop=0.5), tokenizer).double().train()
    image, text = batch(tokenizer)
    seen = vision_tokens(model, image.double(), text)
    drops = [s for s in seen if s[0] == "drop"]
    assert len(drops) == 1  # the image is encoded once per step
    _, before, after = drops[0]
    assert before.shape[1] == 1 + PATCHES and after.shape == (8, 1 + PATCHES // 2, before.shape[2])
    assert torch.equal(after[:, 0], before[:, 0])  # [CLS] kept
    # Each kept token is one of its own image's patches, none twice; the subsets differ between images.
    # (B, K, P); the kept patches alone are projected (models.vit), so equal up to rounding
    match = (after[:, 1:, None, :] - before[:, None, 1:, :]).abs().amax(-1) < 1e-12
    assert (match.sum(-1) == 1).all()
    kept = match.float().argmax(-1).sort(-1).values
    assert (kept[:, 1:] != kept[:, :-1]).all()
    assert len({tuple(k.tolist()) for k in kept}) > 1
    # ITM's and MLM's fusion pass attends to exactly these tokens (after the ViT's blocks).
    fused = [s[1] for s in seen if s[0] == "fuse"]
    assert len(fused) == 1 and fused[0].shape[1] == 1 + PATCHES // 2
    # Seeded: the same seed keeps the same tokens, another seed others.
    again = [s for s in vision_tokens(model, image.double(), text) if s[0] == "drop"][0][2]
    other = [s for s in vision_tokens(model, image.double(), text, seed=4) if s[0] == "drop"][0][2]
    assert torch.equal(again, after) and not torch.equal(other, after)


@pytest.mark.parametrize("ordered", [False, True])
def test_projecting_the_kept_patches_alone_equals_timms_project_then_drop(ordered):
    """models.vit.VisionEncoder projects only the kept patches: its tokens and gradients equal timm's
    forward (every patch projected, then PatchDropout) from the same draw."""
    config = pretrain_config(image_token_drop=0.5)
    torch.manual_seed(0)
    vit = build_vision_encoder(config).double().train()
    vit.patch_drop = patch_dropout(vit, 0.5)
    vit.patch_drop.ordered = ordered
    image = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    assert vit._projects_kept_only(vit.patch_drop)  # the kept-patch path is the one under test
    results, generator_after = [], []
    for forward in (VisionTransformer.forward_features, VisionEncoder.forward_features):
        vit.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = forward(vit, image)
        generator_after.append(torch.get_rng_state())  # the same draws: a resumed run stays exact
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in vit.named_parameters()
                                       if p.grad is not None}))
    (timm_out, timm_grads), (out, grads) = results
    assert torch.equal(*generator_after)
    assert out.shape == (3, 1 + PATCHES // 2, vit.embed_dim)
    torch.testing.assert_close(out, timm_out, rtol=0, atol=1e-12)
    assert grads.keys() == timm_grads.keys()
    for name, grad in timm_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-11, msg=name)
    vit.eval()  # evaluation: every token, timm's path
    assert vit.forward_features(image).shape[1] == 1 + PATCHES


def test_the_unmasked_epochs_and_a_zero_rate_are_the_papers_step_bit_for_bit(tokenizer):
    paper, dropping = twin_models(tokenizer, {}, {"image_token_drop": 0.75, "unmasked_epochs": 2,
                                                  "max_epoch": 5})
    assert isinstance(paper.visual_encoder.patch_drop, nn.Identity)  # 0: timm's identity, no draw
    image, text = batch(tokenizer)
    image = image.double()
    dropping.start_epoch(2)  # still masked: a different step
    masked = step(dropping, image, text)
    reference = step(paper, image, text)
    assert not torch.equal(masked[0]["loss_itc"], reference[0]["loss_itc"])
    dropping.start_epoch(3)  # the last two epochs: every token
    unmasked = step(dropping, image, text)
    for key, value in reference[0].items():
        assert torch.equal(unmasked[0][key], value), key
    assert reference[1].keys() == unmasked[1].keys()
    for name, grad in reference[1].items():
        assert torch.equal(unmasked[1][name], grad), name


def test_evaluation_never_drops_and_checkpoints_load_without_the_switch(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(image_token_drop=0.5), tokenizer).eval()
    image, text = batch(tokenizer)
    assert model.encode_image(image).shape[1] == 1 + PATCHES
    feats = model.unimodal_features(image, SimpleNamespace(**text))  # GRIT's naive pass, the warm start
    model.train()
    with torch.no_grad():
        assert model.encode_image(image).shape[1] == 1 + PATCHES // 2
    plain = ALBEF_Base(pretrain_config(), tokenizer)
    assert plain.load_state_dict(model.state_dict()) is not None  # strict: the same keys
    plain.eval()
    torch.testing.assert_close(plain.unimodal_features(image, SimpleNamespace(**text)), feats, rtol=0, atol=0)


def test_the_step_with_dropping_compiles_as_one_graph(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(image_token_drop=0.5), tokenizer).train()
    image, text = batch(tokenizer, static=True)
    eager = step(model, image, text)
    compiled = torch.compile(WithObjectives(model), fullgraph=True, backend="aot_eager")
    got = step(compiled, image, text)
    for key, value in eager[0].items():  # the same draws: the same kept tokens and MLM masks
        torch.testing.assert_close(got[0][key], value, rtol=1e-5, atol=1e-6, msg=key)
    torch._dynamo.reset()


def step_flops(tokenizer, drop: float, **overrides) -> tuple[int, ALBEF_Base, tuple]:
    torch.manual_seed(0)
    config = pretrain_config(image_token_drop=drop, **overrides)
    model = ALBEF_Base(config, tokenizer).train()
    image, text = batch(tokenizer, static=True)
    return count_flops(model, (image, text, IMAGE_KEYS), torch.device("cpu"), None)[0], model, text


@pytest.mark.parametrize("share_image_kv", [True, False])
def test_the_steps_flops_fall_by_a_closed_form_in_the_kept_tokens(tokenizer, share_image_kv):
    """Forward + backward: every product that touches image tokens costs 3x its forward (the backward
    computes the input's and the weight's gradients), attention 3.5x (torch's formula for the fused
    kernels' backward, 2.5x, recomputes the scores), the patch projection 2x (the image needs no
    gradient), and only of the kept patches (models.vit). The last fusion layer's cross-attention has one
    query, [CLS], for each of ITM's 3B pairs (itm_cls_only) and L for each of MLM's B captions."""
    full, model, text = step_flops(tokenizer, 0.0, share_image_kv=share_image_kv)
    vit, bert = model.visual_encoder, model.text_encoder.config
    D, H, depth = vit.embed_dim, bert.hidden_size, len(vit.blocks)
    fusion_layers = bert.num_hidden_layers - bert.fusion_layer
    B, L = IMAGE_KEYS.numel(), text["input_ids"].shape[1]
    rows = 4 * B  # ITM's 3B pairs and MLM's B captions attend to the image tokens
    pixels = 3 * vit.patch_embed.proj.kernel_size[0] ** 2  # one patch's inputs to the linear stem
    queries = (fusion_layers - 1) * rows * L + 3 * B + B * L  # text queries of the image tokens, all layers

    def image_token_flops(T: int) -> int:
        """FLOPs of one step that scale with the T image tokens ([CLS] and T - 1 patches)."""
        images = B if share_image_kv else rows  # whose keys and values are computed
        # ViT blocks: q, k, v and the output projection 8TD^2, the MLP 16TD^2; fusion layers: keys, values.
        products = B * depth * 24 * T * D * D + fusion_layers * images * 4 * T * D * H
        # Scores and their weighted sum: ViT self-attention, and the cross-attention of the text queries.
        attention = B * depth * 4 * T * T * D + queries * 4 * T * H
        return 3 * products + 7 * attention // 2 + 2 * B * 2 * (T - 1) * pixels * D

    for drop in (0.5, 0.75):
        got, _, _ = step_flops(tokenizer, drop, share_image_kv=share_image_kv)
        kept = 1 + int(PATCHES * (1 - drop))
        assert full - got == image_token_flops(1 + PATCHES) - image_token_flops(kept), drop


def test_settings_that_cannot_act_are_refused():
    with pytest.raises(ConfigError, match="unmasked_epochs is 2 but image_token_drop is 0"):
        pretrain_config(unmasked_epochs=2)
    with pytest.raises(ConfigError, match=r"unmasked_epochs \(5\) is not below max_epoch \(5\)"):
        pretrain_config(image_token_drop=0.5, unmasked_epochs=5, max_epoch=5)
    with pytest.raises(ConfigError, match="image_token_drop"):
        pretrain_config(image_token_drop=1.0)


def test_dropping_works_with_gradient_checkpointing_and_bf16(tokenizer):
    """The kept tokens are drawn before the checkpointed blocks: checkpointing recomputes the same step
    (equal losses and gradients); under bf16 autocast the step runs and its losses are finite."""
    plain, checkpointed = twin_models(tokenizer, {}, {"grad_checkpointing": True}, image_token_drop=0.5)
    image, text = batch(tokenizer)
    reference, got = step(plain, image.double(), text), step(checkpointed, image.double(), text)
    for key, value in reference[0].items():
        torch.testing.assert_close(got[0][key], value, rtol=0, atol=1e-12, msg=key)
    for name, grad in reference[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=1e-10, msg=name)
    bf16 = step(plain.float(), image, text, autocast=torch.bfloat16)
    assert all(torch.isfinite(v) for v in bf16[0].values())
