"""The pre-training step's speed switches compute ALBEF's step: image keys and values once per image
(share_image_kv), fused q/k/v products (fused_qkv), MLM logits at the masked positions only
(mlm_masked_only), ITM's last fusion layer at [CLS] only (itm_cls_only) and the first fusion layer's
self-attention once per caption (share_caption_attention) equal to the plain computation; LayerNorm in
bf16 (amp_layer_norm) within bf16's tolerance of fp32; text padded to a static length; the step compiled
as one graph."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, word_tokenizer

from dataset.collate import ImageTextCollate
from models.losses import WithObjectives
from models.mlm import mask_tokens, mlm_capacity, select_masked
from models.negatives import itm_pair_weights, mine_negatives
from models.objectives import itc_loss, masked_mean
from models.pretrain import ALBEF_Base

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WORDS = ["a", "dog", "cat", "red", "blue", "ball", "on", "the", "grass", "left", "right", "big", "small"]
CAPTIONS = ["a red dog on the grass", "the blue cat", "a big ball left of the cat", "small dog",
            "a red dog on the grass", "the cat right of a blue ball on the grass", "big red ball", "a cat"]
# Pairs 0 and 3 show one image and pairs 0 and 4 share a caption: the guard has something to exclude.
IMAGE_KEYS = torch.tensor([0, 1, 2, 0, 4, 5, 6, 7])
SWITCHES = ("share_image_kv", "fused_qkv", "mlm_masked_only", "itm_cls_only", "share_caption_attention")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


def pretrain_config(**overrides):
    """The tiny pre-training config at 32 px, two ViT blocks, random weights, the guard on."""
    values = dict(image_res=32, vision_depth=2, vision_init=None, text_encoder=None,
                  guard_false_negatives=True, mlm_probability=0.5)
    values.update(overrides)
    return tiny_config("pretrain", **values)


def batch(tokenizer, static: bool = False, dtype=torch.float32):
    """(image (8,3,32,32), text {input_ids, attention_mask} (8,L)), seeded; static: padded to 16 tokens."""
    g = torch.Generator().manual_seed(0)
    image = (torch.randn(8, 3, 32, 32, generator=g) + 2 * torch.randn(8, 3, 1, 1, generator=g)).to(dtype)
    tokens = ImageTextCollate(tokenizer, 16, static=static).tokenize(CAPTIONS)
    return image, {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


def twin_models(tokenizer, reference: dict, candidate: dict, dtype=torch.float64, **overrides):
    """Two ALBEF_Base with the same weights, in training mode and `dtype`; config keys of each on top."""
    torch.manual_seed(0)
    first = ALBEF_Base(pretrain_config(**overrides, **reference), tokenizer).to(dtype).train()
    second = ALBEF_Base(pretrain_config(**overrides, **candidate), tokenizer).to(dtype).train()
    second.load_state_dict(first.state_dict())
    return first, second


def step(model, image, text, valid=None, seed: int = 1, autocast: torch.dtype | None = None):
    """Forward and backward of the sum of the four losses -> ({loss: value}, {parameter: gradient}).

    An ALBEF_Base runs with its objectives (models.losses.WithObjectives, as the trainer runs it); a
    Reference or an already wrapped (possibly compiled) WithObjectives runs as it is."""
    net = WithObjectives(model) if isinstance(model, ALBEF_Base) else model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the MLM masks
    with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
        out = net(image, text, image_key=IMAGE_KEYS, valid=valid)
        loss = out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]
    loss.backward()
    losses = {k: out[k].detach().double() for k in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm")}
    module = getattr(model, "_orig_mod", model)  # a compiled model's parameters, by their own names
    if isinstance(module, WithObjectives):
        module = module.model
    grads = {n: p.grad.double() for n, p in module.named_parameters() if p.grad is not None}
    return losses, grads


def assert_same_step(first: tuple, second: tuple, atol: float) -> None:
    """Equal losses and, parameter by parameter, equal gradients (the same parameters receive one)."""
    (losses, grads), (other_losses, other_grads) = first, second
    for key in losses:
        torch.testing.assert_close(other_losses[key], losses[key], rtol=0, atol=atol, msg=key)
    assert set(grads) == set(other_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(other_grads[name], grad, rtol=0, atol=atol, msg=name)


# ------------------------------------------------------------------------- ALBEF's step, written out


def albef_reference(model: ALBEF_Base, image, text, valid=None) -> dict[str, torch.Tensor]:
    """ALBEF's pre-training losses written out from the model's parts, without the model's own ITM and MLM
    code: ITM's fusion pass over cat([image, image, image[neg]]) (keys and values once per row), MLM's
    multimodal pass after it, vocabulary logits at every position. Needs argmax mining (no random draw
    between ITM and MLM) and dropout 0 (the tiny BERT's)."""
    ids, mask = text["input_ids"], text["attention_mask"]
    b = ids.shape[0]
    image_embeds = model.visual_encoder.forward_features(image)
    text_embeds = model.text_encoder(ids, mask, mode="text")
    image_feat = F.normalize(model.vision_proj(image_embeds[:, 0]), dim=-1)
    text_feat = F.normalize(model.text_proj(text_embeds[:, 0]), dim=-1)
    positive_itc = positive_mining = None
    if model.guard_false_negatives:
        positive_itc, positive_mining = model.false_negative_masks(IMAGE_KEYS, ids, mask)
    itc = itc_loss(image_feat, text_feat, model.temp, model.lambda_cons, positive=positive_itc, valid=valid)
    zero = image_feat.new_zeros(())
    loss_itm = loss_mlm = zero
    if model.use_itm:
        with torch.no_grad():
            sim = image_feat @ text_feat.t() / model.temp
            neg_text, neg_image = mine_negatives(sim, sim.t(), positive_mining, mode=model.itm_negatives,
                                                 sampling=model.hard_sampling, valid=valid)
        fused = model.text_encoder(
            mode="fusion", hidden_states=torch.cat([text_embeds, text_embeds[neg_text], text_embeds]),
            attention_mask=torch.cat([mask, mask[neg_text], mask]),
            encoder_hidden_states=torch.cat([image_embeds, image_embeds, image_embeds[neg_image]]))
        labels = torch.tensor([1] * b + [0] * 2 * b)
        itm = F.cross_entropy(model.itm_head(fused[:, 0]), labels, reduction="none")
        loss_itm = (itm.mean() if valid is None
                    else masked_mean(itm, itm_pair_weights(valid, neg_text, neg_image)))
    if model.use_mlm:
        masked_ids, labels = mask_tokens(ids.clone(), model.vocab_size, model.mask_token_id,
                                         model.special_ids, model.mlm_probability)
        if valid is not None:
            labels = labels.masked_fill(~valid[:, None], -100)
        hidden = model.text_encoder(masked_ids, mask, mode="multimodal", encoder_hidden_states=image_embeds)
        logits = model.text_encoder.mlm_logits(hidden)
        loss_mlm = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                    / (labels != -100).sum())
    return {"loss_itc": itc["loss_itc"], "loss_cons": itc["loss_cons"], "loss_itm": loss_itm,
            "loss_mlm": loss_mlm}


class Reference(torch.nn.Module):
    """A module whose forward is albef_reference of `model` (so that step() runs it)."""

    def __init__(self, model: ALBEF_Base) -> None:
        super().__init__()
        self.model = model

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def forward(self, image, text, image_key=None, valid=None):
        return albef_reference(self.model, image, text, valid)


ALL_OFF = {k: False for k in SWITCHES}
# share_caption_attention acts only in share_image_kv's one fusion pass: alone it would test nothing.
SETTINGS = {"all on": {k: True for k in SWITCHES}, "all off": ALL_OFF,
            **{f"{k} alone": {**ALL_OFF, k: True} for k in SWITCHES if k != "share_caption_attention"},
            **{f"share_image_kv + {k}": {**ALL_OFF, "share_image_kv": True, k: True}
               for k in ("itm_cls_only", "share_caption_attention")}}
CASES = {"guard": {}, "bad sample": {}, "no guard": {"guard_false_negatives": False},
         "itm only": {"mlm": False}, "mlm only": {"itm": False, "itm_negatives": "random"},
         "no consistency": {"lambda_cons": 0.0}}


# Every case with all switches on; each other setting on the two richest cases.
COMBINATIONS = [("all on", case) for case in CASES] + [
    (setting, case) for setting in SETTINGS if setting != "all on" for case in ("guard", "bad sample")]


@pytest.mark.parametrize(("setting", "case"), COMBINATIONS)
def test_the_step_equals_albefs_in_float64(tokenizer, setting, case):
    """Every switch setting gives ALBEF's four losses and every parameter's gradient (within 1e-10 in
    float64): one fusion pass with each cross-attention layer's keys and values computed on the B images
    and gathered, fused q/k/v products, MLM logits at the masked positions only."""
    reference, model = twin_models(tokenizer, ALL_OFF, SETTINGS[setting], **CASES[case])
    image, text = batch(tokenizer)
    image = image.double()
    valid = torch.tensor([True, True, False, True, True, True, True, True]) if case == "bad sample" else None
    expected = step(Reference(reference), image, text, valid)
    assert_same_step(expected, step(model, image, text, valid), atol=1e-10)
    if case != "mlm only":  # the mined negatives pair texts with other images: the gather is exercised
        assert expected[0]["loss_itm"] > 0


def test_context_index_gathers_keys_and_values_of_the_right_image(tokenizer):
    """BertEncoder's fusion pass with B images and an index equals the pass on the gathered images."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(), tokenizer).double().eval()
    states = torch.randn(6, 5, 64, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.long)
    mask[1, 3:] = 0
    images = torch.randn(3, 17, 64, dtype=torch.float64)
    index = torch.tensor([2, 0, 1, 1, 2, 0])
    encoder = model.text_encoder
    gathered = encoder(mode="fusion", hidden_states=states, attention_mask=mask,
                       encoder_hidden_states=images[index])
    shared = encoder(mode="fusion", hidden_states=states, attention_mask=mask, encoder_hidden_states=images,
                     context_index=index)
    torch.testing.assert_close(shared, gathered, rtol=0, atol=1e-12)
    wrong = encoder(mode="fusion", hidden_states=states, attention_mask=mask, encoder_hidden_states=images,
                    context_index=index.roll(1))
    assert (wrong - gathered).abs().max() > 1e-3
    with pytest.raises(ValueError, match="context_index"):
        encoder(mode="fusion", hidden_states=states, attention_mask=mask, encoder_hidden_states=images,
                encoder_attention_mask=torch.ones(3, 17), context_index=index)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("shared_images", [True, False])
def test_cls_rows_compute_the_full_passs_cls_and_leave_the_other_rows_whole(tokenizer, shared_images,
                                                                            checkpointed):
    """BertEncoder's fusion pass with cls_rows (itm_cls_only): the leading rows' [CLS] and the other rows'
    states equal the full pass's, values and gradients; the ITM logits with the switch equal those without."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(), tokenizer).double().train()
    encoder = model.text_encoder
    encoder.set_grad_checkpointing(checkpointed)
    states = torch.randn(6, 5, 64, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(6, 5, dtype=torch.long)
    mask[1, 3:] = 0
    mask[5, 2:] = 0
    images = torch.randn(3, 17, 64, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([2, 0, 1, 1, 2, 0])
    weights = torch.randn(6, 5, 64, dtype=torch.float64)

    def run(cls_rows):
        states.grad = images.grad = None
        context = dict(encoder_hidden_states=images, context_index=index) if shared_images else dict(
            encoder_hidden_states=images[index])
        out = encoder(mode="fusion", hidden_states=states, attention_mask=mask, cls_rows=cls_rows, **context)
        if cls_rows:  # the loss reads what ITM reads of the leading rows, and all of the others
            head, rest = out
            loss = (head * weights[:cls_rows, 0]).sum() + (rest * weights[cls_rows:]).sum()
        else:
            loss = (out[:4, 0] * weights[:4, 0]).sum() + (out[4:] * weights[4:]).sum()
        loss.backward()
        return out, states.grad.clone(), images.grad.clone()

    full, full_grad, full_image_grad = run(0)
    (head, rest), grad, image_grad = run(4)
    assert head.shape == (4, 64) and rest.shape == (2, 5, 64)
    torch.testing.assert_close(head, full[:4, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(rest, full[4:], rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(image_grad, full_image_grad, rtol=0, atol=1e-12)
    all_cls, _, _ = run(6)  # every row at [CLS] (ITM alone, retrieval's re-ranking)
    torch.testing.assert_close(all_cls[0], full[:, 0], rtol=0, atol=1e-12)
    assert all_cls[1].shape == (0, 5, 64)
    with pytest.raises(ValueError, match="cls_rows"):
        encoder(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), mode="text", cls_rows=1)
    with torch.no_grad():
        model.eval()
        text = encoder(torch.tensor([[2, 5, 6, 3, 0]] * 3), mask[:3], mode="text")
        plain = model.itm_logits(text, mask[:3], images, index[:3])
        model.itm_cls_only = False
        torch.testing.assert_close(model.itm_logits(text, mask[:3], images, index[:3]), plain, rtol=0,
                                   atol=1e-12)


def test_text_index_runs_the_first_fusion_self_attention_once_per_text(tokenizer):
    """A fusion pass over U distinct texts and each row's text index equals the pass over the gathered
    rows, values and gradients (share_caption_attention); refused where the first layer is not fusion."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(), tokenizer).double().train()
    encoder = model.text_encoder
    texts = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[2, 3:] = 0
    rows = torch.tensor([0, 2, 0, 1, 2, 2, 1])
    images = torch.randn(3, 17, 64, dtype=torch.float64)
    image_index = torch.tensor([0, 0, 1, 2, 2, 1, 0])
    weights = torch.randn(7, 5, 64, dtype=torch.float64)
    outs = []
    for gathered in (True, False):
        texts.grad = None
        hidden, hmask = (texts[rows], mask[rows]) if gathered else (texts, mask)
        out = encoder(mode="fusion", hidden_states=hidden, attention_mask=hmask, encoder_hidden_states=images,
                      context_index=image_index, text_index=None if gathered else rows)
        (out * weights).sum().backward()
        outs.append((out.detach(), texts.grad.clone()))
    (expected, expected_grad), (got, grad) = outs
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="text_index"):
        encoder(torch.zeros(3, 5, dtype=torch.long), mask, mode="multimodal", encoder_hidden_states=images,
                context_index=image_index[:3], text_index=rows[:3])
    with pytest.raises(ValueError, match=r"cls_rows must be in \[0, 7\]"):
        encoder(mode="fusion", hidden_states=texts, attention_mask=mask, encoder_hidden_states=images,
                context_index=image_index, text_index=rows, cls_rows=8)
    # One fusion layer, both [CLS]-only and first: the rows are gathered before it, the same numbers.
    encoder.fusion_layer = len(encoder.layers) - 1
    with torch.no_grad():
        full = encoder(mode="fusion", hidden_states=texts[rows], attention_mask=mask[rows],
                       encoder_hidden_states=images, context_index=image_index)
        head, rest = encoder(mode="fusion", hidden_states=texts, attention_mask=mask,
                             encoder_hidden_states=images, context_index=image_index, text_index=rows,
                             cls_rows=4)
    torch.testing.assert_close(head, full[:4, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(rest, full[4:], rtol=0, atol=1e-12)


def test_mlm_keeps_logits_for_the_capacity_of_the_maskable_positions(tokenizer):
    """mlm_masked_only: the vocabulary logits have mlm_capacity(B * (L - 1), p) rows, [CLS] never masked."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(), tokenizer).train()
    image, text = batch(tokenizer)
    torch.manual_seed(1)
    out = model(image, text, image_key=IMAGE_KEYS)
    b, length = text["input_ids"].shape
    assert out["mlm_logits"].shape[0] == mlm_capacity(b * (length - 1), 0.5) < b * length
    assert ((out["mlm_labels"] != -100).sum() > 0) and (out["mlm_labels"][-1] == -100)


# ------------------------------------------------------------------------- fused q/k/v, MLM selection


def test_mlm_at_masked_positions_equals_every_position_in_fp32(tokenizer):
    every, masked = twin_models(tokenizer, {"mlm_masked_only": False}, {"mlm_masked_only": True},
                                dtype=torch.float32)
    image, text = batch(tokenizer)
    reference, selected = step(every, image, text), step(masked, image, text)
    for key in reference[0]:
        torch.testing.assert_close(selected[0][key], reference[0][key], rtol=0, atol=1e-6, msg=key)
    for name, grad in reference[1].items():
        torch.testing.assert_close(selected[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_select_masked_keeps_every_masked_position_at_a_fixed_size():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(5, 50, (6, 11), generator=g)
    labels[torch.rand(6, 11, generator=g) > 0.4] = -100
    capacity = mlm_capacity(labels.numel(), 0.4)
    positions, picked = select_masked(labels, capacity)
    assert positions.shape == picked.shape == (capacity,)
    flat = labels.flatten()
    masked = (flat != -100).nonzero().squeeze(1)
    assert torch.equal(positions[:masked.numel()], masked)  # every masked position, in order
    assert torch.equal(picked, flat[positions]) and (picked[masked.numel():] == -100).all()
    with pytest.raises(ValueError, match="capacity"):
        select_masked(labels, masked.numel() - 1)


def test_mlm_capacity_is_the_binomial_mean_plus_eight_deviations():
    # The paper's batch 128 of 30 tokens at 50 % masking: 1,920 on average, room for 2,168.
    assert mlm_capacity(128 * 30, 0.5) == math.ceil(1920 + 8 * math.sqrt(960)) == 2168
    assert mlm_capacity(40, 0.5) == 40  # small batches keep every position
    assert mlm_capacity(1000, 1.0) == 1000
    assert mlm_capacity(1000, 0.15) == math.ceil(150 + 8 * math.sqrt(127.5))


# ------------------------------------------------------------------------- bf16 through the residual stream


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_bf16_layer_norm_stays_within_bf16_tolerance_of_fp32(tokenizer):
    """bf16 autocast with the LayerNorms in bf16 (amp_layer_norm: compute): the summed loss within 1 % of the
    fp32 step's, each loss within 2 % (the consistency loss is a KL of two near-equal distributions), and
    the gradient pointing the same way (cosine >= 0.99). torch's autocast with fp32 LayerNorms is no
    closer here (loss_itm 3 % off)."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(amp_layer_norm="compute"), tokenizer).train()
    image, text = batch(tokenizer)
    fp32 = step(model, image, text)
    bf16 = step(model, image, text, autocast=torch.bfloat16)
    total, total_bf16 = sum(fp32[0].values()), sum(bf16[0].values())
    assert abs(total_bf16 - total) <= 1e-2 * total
    for key, value in fp32[0].items():
        assert abs(float(bf16[0][key]) - float(value)) <= 2e-2 * abs(float(value)), key
    names = sorted(fp32[1])
    assert cosine(torch.cat([bf16[1][n].flatten() for n in names]),
                  torch.cat([fp32[1][n].flatten() for n in names])) >= 0.99


def test_amp_layer_norm_runs_in_the_compute_dtype_and_changes_nothing_in_fp32(tokenizer):
    torch.manual_seed(0)
    compute = ALBEF_Base(pretrain_config(amp_layer_norm="compute"), tokenizer).train()
    torch.manual_seed(0)
    float32 = ALBEF_Base(pretrain_config(amp_layer_norm="float32"), tokenizer).train()
    image, text = batch(tokenizer)
    assert_same_step(step(float32, image, text), step(compute, image, text), atol=0)
    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute.visual_encoder.norm(x).dtype == torch.bfloat16
        assert compute.text_encoder.layers[0].output.LayerNorm(x).dtype == torch.bfloat16
        assert float32.visual_encoder.norm(x).dtype == torch.float32
        assert float32.text_encoder.layers[0].output.LayerNorm(x).dtype == torch.float32


# ------------------------------------------------------------------------- static shapes, one graph


def test_static_text_pads_to_max_tokens_and_follows_compile(tokenizer):
    short = ImageTextCollate(tokenizer, 16).tokenize(CAPTIONS[:2])
    static = ImageTextCollate(tokenizer, 16, static=True).tokenize(CAPTIONS[:2])
    assert short["input_ids"].shape[1] < 16 == static["input_ids"].shape[1]
    length = short["input_ids"].shape[1]
    assert torch.equal(static["input_ids"][:, :length], short["input_ids"])
    assert static["attention_mask"][:, length:].sum() == 0
    config = pretrain_config()
    assert config.static_text is None and not config.static_text_on and config.compile_mode is None
    compiled = dataclasses.replace(config, compile="reduce-overhead")
    assert compiled.static_text_on and compiled.compile_mode == "reduce-overhead"
    assert dataclasses.replace(config, compile=True).compile_mode == "default"
    assert not dataclasses.replace(compiled, static_text=False).static_text_on


def test_padding_to_a_static_length_leaves_the_losses_unchanged(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(mlm=False), tokenizer).double().train()
    image, longest = batch(tokenizer)
    _, static = batch(tokenizer, static=True)
    assert_same_step(step(model, image.double(), longest), step(model, image.double(), static), atol=1e-10)


def test_the_pretraining_step_compiles_as_one_graph(tokenizer):
    """fullgraph=True: no graph break in forward or backward (guard on, static text), and the compiled
    step's losses and gradients are the eager step's."""
    torch.manual_seed(0)
    model = ALBEF_Base(pretrain_config(), tokenizer).train()
    image, text = batch(tokenizer, static=True)
    eager = step(model, image, text)
    # The trainer's unit: the model and its objectives in one forward, compiled together.
    compiled = torch.compile(WithObjectives(model), fullgraph=True, backend="aot_eager")
    got = step(compiled, image, text)
    for key, value in eager[0].items():
        torch.testing.assert_close(got[0][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for name, grad in eager[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    torch._dynamo.reset()


