"""ALBEF_Base: ALBEF parameter names, losses and training signal, config checks, pretrained text weights."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, word_tokenizer
from transformers import BertConfig, BertForMaskedLM, BertModel

from grit_io import InputFileError
from models.loading import load_weights
from models.losses import WithObjectives
from models.pretrain import ALBEF_Base
from training.config_files import ConfigError
from training.optimizer import build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPO = Path(__file__).parents[1]
TINY_BERT = str(REPO / "configs" / "tiny" / "config_bert.json")
WORDS = [
    "a",
    "dog",
    "cat",
    "red",
    "blue",
    "ball",
    "on",
    "the",
    "grass",
    "left",
    "right",
    "of",
    "big",
    "small",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("vocab"), WORDS)


def config(**overrides):
    """The typed pre-training config (configs/tiny/Pretrain.yaml) of a 32 px, 2-block model with these
    tests' objectives; resolved by config_from_mapping, so a refused value raises ConfigError here."""
    values = dict(
        bert_config=TINY_BERT,
        image_res=32,
        patch_size=8,
        vision_width=64,
        vision_depth=2,
        vision_heads=4,
        vision_init=None,
        embed_dim=32,
        temp=0.07,
        mlm_probability=0.5,
        itc=True,
        lambda_cons=0.2,
        itm_negatives="hard",
        hard_sampling="argmax",
        itc_gather=False,
        guard_false_negatives=False,
        text_encoder=None,
    )
    values.update(overrides)
    return tiny_config("pretrain", **values)


def synthetic_batch(tokenizer, n=6):
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 32, 32, generator=gen) * 0.5 + 2 * torch.randn(n, 3, 1, 1, generator=gen)
    captions = [
        " ".join(WORDS[j] for j in torch.randint(len(WORDS), (int(k),), generator=gen))
        for k in torch.randint(3, 9, (n,), generator=gen)
    ]
    return images, tokenizer(captions, padding="longest", return_tensors="pt")


def run(model, *args, **kwargs) -> dict[str, torch.Tensor]:
    """The model's forward and its objectives (models.losses.WithObjectives): outputs, losses, 'loss'."""
    return WithObjectives(model)(*args, **kwargs)


def albef_reference_shapes(vocab: int) -> dict[str, tuple]:
    """ALBEF / GRIT-VLP checkpoint names for this tiny config (D=64, 2 ViT blocks, 4 BERT layers)."""
    d, p, h, inter = 64, 16, 64, 256
    shapes = {
        "temp": (),
        "visual_encoder.cls_token": (1, 1, d),
        "visual_encoder.pos_embed": (1, 1 + p, d),
        "visual_encoder.patch_embed.proj.weight": (d, 3, 8, 8),
        "visual_encoder.patch_embed.proj.bias": (d,),
        "visual_encoder.norm.weight": (d,),
        "visual_encoder.norm.bias": (d,),
        "vision_proj.weight": (32, d),
        "vision_proj.bias": (32,),
        "text_proj.weight": (32, h),
        "text_proj.bias": (32,),
        "itm_head.weight": (2, h),
        "itm_head.bias": (2,),
        "text_encoder.bert.embeddings.word_embeddings.weight": (vocab, h),
        "text_encoder.bert.embeddings.position_embeddings.weight": (128, h),
        "text_encoder.bert.embeddings.token_type_embeddings.weight": (2, h),
        "text_encoder.bert.embeddings.LayerNorm.weight": (h,),
        "text_encoder.bert.embeddings.LayerNorm.bias": (h,),
        "text_encoder.cls.predictions.bias": (vocab,),
        "text_encoder.cls.predictions.transform.dense.weight": (h, h),
        "text_encoder.cls.predictions.transform.dense.bias": (h,),
        "text_encoder.cls.predictions.transform.LayerNorm.weight": (h,),
        "text_encoder.cls.predictions.transform.LayerNorm.bias": (h,),
        "text_encoder.cls.predictions.decoder.weight": (vocab, h),
        "text_encoder.cls.predictions.decoder.bias": (vocab,),
    }
    for i in range(2):
        b = f"visual_encoder.blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[b + norm + ".weight"] = shapes[b + norm + ".bias"] = (d,)
        shapes.update(
            {
                b + "attn.qkv.weight": (3 * d, d),
                b + "attn.qkv.bias": (3 * d,),
                b + "attn.proj.weight": (d, d),
                b + "attn.proj.bias": (d,),
                b + "mlp.fc1.weight": (4 * d, d),
                b + "mlp.fc1.bias": (4 * d,),
                b + "mlp.fc2.weight": (d, 4 * d),
                b + "mlp.fc2.bias": (d,),
            }
        )
    for i in range(4):
        b = f"text_encoder.bert.encoder.layer.{i}."
        blocks = ["attention"] + (["crossattention"] if i >= 2 else [])
        for att in blocks:
            for name in ("query", "key", "value"):
                shapes[f"{b}{att}.self.{name}.weight"], shapes[f"{b}{att}.self.{name}.bias"] = (h, h), (h,)
            shapes[f"{b}{att}.output.dense.weight"], shapes[f"{b}{att}.output.dense.bias"] = (h, h), (h,)
            shapes[f"{b}{att}.output.LayerNorm.weight"] = shapes[f"{b}{att}.output.LayerNorm.bias"] = (h,)
        shapes.update(
            {
                b + "intermediate.dense.weight": (inter, h),
                b + "intermediate.dense.bias": (inter,),
                b + "output.dense.weight": (h, inter),
                b + "output.dense.bias": (h,),
                b + "output.LayerNorm.weight": (h,),
                b + "output.LayerNorm.bias": (h,),
            }
        )
    return shapes


def test_albef_checkpoint_names_load_strictly(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(config(), tokenizer)
    shapes = albef_reference_shapes(len(tokenizer))
    state = {k: torch.randn(s) for k, s in shapes.items()}
    state["text_encoder.cls.predictions.decoder.weight"] = state[
        "text_encoder.bert.embeddings.word_embeddings.weight"
    ]
    state["text_encoder.cls.predictions.decoder.bias"] = state["text_encoder.cls.predictions.bias"]
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes
    model.load_state_dict(state, strict=True)
    # Every tensor arrives unchanged (fused q/k/v and the LayerNorms keep transformers' and timm's keys),
    # and the model saves them back under the same names.
    saved = model.state_dict()
    assert saved.keys() == state.keys() and all(torch.equal(saved[k], v) for k, v in state.items())
    # Real ALBEF checkpoints also carry the position_ids buffer: load_weights drops it, nothing missing.
    state["text_encoder.bert.embeddings.position_ids"] = torch.arange(128)[None]
    report = load_weights(model, {"model": state}, strict=True)
    assert report.ignored == ["text_encoder.bert.embeddings.position_ids"]


def test_losses_outputs_and_training_signal(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(config(), tokenizer)
    images, text = synthetic_batch(tokenizer)
    out = run(model, images, text)
    for key in ("loss_itc", "loss_cons", "loss_itm", "loss_mlm", "hardness"):
        assert out[key].dim() == 0 and torch.isfinite(out[key]), key
    for key in ("image_feat", "text_feat"):
        # With their graph (the objectives' input); Pretrain.py detaches them for GRIT's queues.
        assert out[key].shape == (6, 32) and out[key].requires_grad
        assert torch.allclose(out[key].norm(dim=-1), torch.ones(6), atol=1e-5)
    assert not out["hardness"].requires_grad and -1 <= out["hardness"] <= 1
    assert out["loss_cons"] > 0 and out["loss_itc"] > 0

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    totals = []
    for _ in range(20):
        out = run(model, images, text)
        total = out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        totals.append(total.item())
    assert sum(totals[-3:]) / 3 < 0.75 * sum(totals[:3]) / 3, totals
    # ALBEF's clamp of the temperature runs after every optimiser step (build_optimizer's hook), so that
    # forward writes no parameter (CUDA graphs).
    optimizer = build_optimizer(model, config().optimizer)
    with torch.no_grad():
        model.temp.fill_(5.0)
        model(images, text)
    assert model.temp.item() == 5.0
    out = run(model, images, text)
    (out["loss_itc"] + out["loss_itm"]).backward()
    optimizer.step()
    assert model.temp.item() == pytest.approx(0.5)


def test_every_parameter_gets_a_gradient(tokenizer):
    torch.manual_seed(0)
    model = ALBEF_Base(config(hard_sampling="multinomial"), tokenizer)
    images, text = synthetic_batch(tokenizer)
    out = run(model, images, text)
    (out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert no_grad == []


def test_itc_off(tokenizer):
    # Hard ITM negatives are mined from ITC: the config refuses itc off with them (training.config).
    with pytest.raises(ConfigError, match="itc.*hard"):
        config(itc=False, itm_negatives="hard")
    torch.manual_seed(0)
    model = ALBEF_Base(config(itc=False, itm_negatives="random"), tokenizer)
    out = run(model, *synthetic_batch(tokenizer))
    assert out["loss_itc"] == 0 and out["loss_cons"] == 0
    assert torch.isfinite(out["loss_itm"]) and torch.isfinite(out["loss_mlm"])


def test_pretrained_text_encoder_matches_transformers(tmp_path, tokenizer, caplog):
    torch.manual_seed(0)
    hf_config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
    )
    BertForMaskedLM(hf_config).save_pretrained(tmp_path / "bert")
    model = ALBEF_Base(config(text_encoder=str(tmp_path / "bert")), tokenizer).eval()
    _, text = synthetic_batch(tokenizer)
    ref = BertModel.from_pretrained(tmp_path / "bert").eval()
    with torch.no_grad():
        got = model.encode_text(text.input_ids, text.attention_mask)
        expected = ref(**text, output_hidden_states=True).hidden_states[2]
    assert (got - expected).abs().max() <= 1e-5

    # Weights with another vocabulary than the tokenizer's: a clear error.
    hf_config.vocab_size = len(tokenizer) + 5
    BertForMaskedLM(hf_config).save_pretrained(tmp_path / "bert_big")
    with pytest.raises(InputFileError, match="bert_big.*vocab"):
        ALBEF_Base(config(text_encoder=str(tmp_path / "bert_big")), tokenizer)


def test_config_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="no_such_bert"):
        ALBEF_Base(config(text_encoder=str(tmp_path / "no_such_bert")), tokenizer)
    # Files the config names but cannot look into: InputFileError naming the file (and the key).
    with pytest.raises(InputFileError, match="missing_config.json"):
        ALBEF_Base(config(bert_config=str(tmp_path / "missing_config.json")), tokenizer)
    with pytest.raises(InputFileError, match="vision_width.*encoder_width.*config_bert.json"):
        ALBEF_Base(config(vision_width=32), tokenizer)
    with pytest.raises(TypeError, match="tokenizer"):
        ALBEF_Base(config())  # type: ignore[call-arg]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(InputFileError, match="partial.json.*fusion_layer"):
        ALBEF_Base(config(bert_config=str(partial)), tokenizer)


def test_random_init_takes_the_tokenizer_vocabulary(tokenizer):
    model = ALBEF_Base(config(), tokenizer)
    assert model.text_encoder.bert.embeddings.word_embeddings.weight.shape[0] == len(tokenizer)
    assert model.text_encoder.config.vocab_size == len(tokenizer)


# ----------------------------------------------------------------------------- false-negative guard


def guard_models(tokenizer, **overrides) -> tuple[ALBEF_Base, ALBEF_Base]:
    """The same weights with guard_false_negatives off and on."""
    torch.manual_seed(0)
    off = ALBEF_Base(config(guard_false_negatives=False, **overrides), tokenizer)
    on = ALBEF_Base(config(guard_false_negatives=True, **overrides), tokenizer)
    on.load_state_dict(off.state_dict())
    assert on.guard_false_negatives and not off.guard_false_negatives
    return off, on


def seeded_forward(model, images, text, image_key=None) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # the same MLM masks (and multinomial draws) in every call
    return run(model, images, text, image_key=image_key)


LOSS_KEYS = ("loss_itc", "loss_cons", "loss_itm", "loss_mlm", "hardness")
MINING_MODES = [("hard", "argmax"), ("hard", "multinomial"), ("random", "argmax")]


@pytest.mark.parametrize("negatives,sampling", MINING_MODES)
def test_guard_is_a_no_op_without_duplicates(tokenizer, negatives, sampling):
    off, on = guard_models(tokenizer, itm_negatives=negatives, hard_sampling=sampling)
    images, text = synthetic_batch(tokenizer)
    assert len(set(map(tuple, text.input_ids.tolist()))) == 6  # six distinct captions, six images
    keys = torch.arange(6)
    ref = seeded_forward(off, images, text)
    for model, key in ((off, keys), (on, keys)):
        out = seeded_forward(model, images, text, key)
        for name in LOSS_KEYS:
            assert torch.equal(out[name], ref[name]), name


def duplicate_batch(tokenizer):
    """Six pairs: 0 and 1 one image (two captions), 2 and 4 one caption on two images.

    Pair 1 holds another view of image 0 (flipped), as two entries of one image get different crops and
    flips in training: with bit-identical pixels (or captions) the multi-positive ITC target gives
    exactly the one-hot loss (the two positive columns have equal log-probabilities), so only the
    image key says they are one image.
    """
    images, _ = synthetic_batch(tokenizer)
    images[1] = images[0].flip(-1)
    captions = ["a red ball on the grass", "a big dog left of the cat", "the small cat",
                "blue ball right of a dog", "the small cat", "a big red dog"]
    text = tokenizer(captions, padding="longest", return_tensors="pt")
    return images, text, torch.tensor([7, 7, 3, 4, 5, 6])


def test_guard_changes_itc_on_duplicates(tokenizer):
    from models.objectives import itc_loss

    off, on = guard_models(tokenizer)
    images, text, keys = duplicate_batch(tokenizer)
    out_off = seeded_forward(off, images, text, keys)
    out_on = seeded_forward(on, images, text, keys)
    assert not torch.equal(out_on["loss_itc"], out_off["loss_itc"])
    torch.testing.assert_close(out_on["image_feat"], out_off["image_feat"], rtol=0, atol=0)
    # The guarded loss is the multi-positive ITC over the same-image / same-caption mask.
    positive = torch.eye(6, dtype=torch.bool)
    positive[0, 1] = positive[1, 0] = positive[2, 4] = positive[4, 2] = True
    itc_pos, mining_pos = on.false_negative_masks(keys, text.input_ids, text.attention_mask)
    assert torch.equal(itc_pos, positive) and torch.equal(mining_pos, positive)
    want = itc_loss(out_on["image_feat"], out_on["text_feat"], on.temp.detach(), on.lambda_cons,
                    positive=positive)
    torch.testing.assert_close(out_on["loss_itc"].detach(), want["loss_itc"])
    torch.testing.assert_close(out_on["loss_cons"].detach(), want["loss_cons"])
    for name in LOSS_KEYS:
        assert torch.isfinite(out_on[name]), name


def mined_negatives(monkeypatch, model, images, text, keys, seeds) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ITM negatives the model's forward mines, (neg_text_idx (B,), neg_image_idx (B,)) per seed: the
    real models.pretrain.mine_negatives, its results recorded."""
    import models.pretrain
    from models.negatives import mine_negatives

    drawn = []

    def spy(*args, **kwargs):
        drawn.append(mine_negatives(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(models.pretrain, "mine_negatives", spy)
    with torch.no_grad():
        for seed in seeds:
            torch.manual_seed(seed)  # other multinomial and uniform draws for every seed
            model(images, text, image_key=keys)
    monkeypatch.undo()
    return drawn


@pytest.mark.parametrize("negatives,sampling", MINING_MODES)
def test_guarded_itm_negatives_are_never_the_anchors_image_or_caption(tokenizer, monkeypatch, negatives,
                                                                      sampling):
    """Pairs 0 and 1 show one image, pairs 2 and 4 have one caption (duplicate_batch). With the guard, no
    mined ITM negative of an image is a caption of its image or its own caption, and no negative of a
    caption is its image or an image captioned alike; the hardest negative is the argmax over the rest.
    Without it (the authors' code), the hardest negative is the argmax over everything but the diagonal,
    and drawn negatives do take those pairs."""
    off, on = guard_models(tokenizer, itm_negatives=negatives, hard_sampling=sampling)
    images, text, keys = duplicate_batch(tokenizer)
    same = torch.eye(6, dtype=torch.bool)  # [image i, text j]: same image key, or the same caption
    same[0, 1] = same[1, 0] = same[2, 4] = same[4, 2] = True
    false_negatives = same & ~torch.eye(6, dtype=torch.bool)
    rows = torch.arange(6)
    seeds = range(1) if sampling == "argmax" and negatives == "hard" else range(12)
    hits = {}
    for name, model, excluded in (("on", on, same), ("off", off, torch.eye(6, dtype=torch.bool))):
        drawn = mined_negatives(monkeypatch, model, images, text, keys, seeds)
        assert len(drawn) == len(seeds)
        hits[name] = sum(int(false_negatives[rows, t].sum() + false_negatives[i, rows].sum())
                         for t, i in drawn)
        assert all(not excluded[rows, t].any() and not excluded[i, rows].any() for t, i in drawn), name
        if negatives == "hard" and sampling == "argmax":  # the hardest of the allowed, computed here
            with torch.no_grad():
                torch.manual_seed(0)
                out = model(images, text, image_key=keys)
            sim = (out["image_feat"] @ out["text_feat"].t()).masked_fill(excluded, float("-inf"))
            t, i = drawn[0]
            assert torch.equal(t, sim.argmax(1)) and torch.equal(i, sim.argmax(0)), name
    assert hits["on"] == 0
    if negatives != "hard" or sampling != "argmax":  # draws over 12 seeds do meet the duplicates
        assert hits["off"] > 0


@pytest.mark.parametrize("negatives,sampling", MINING_MODES)
def test_guard_on_a_batch_of_one_image(tokenizer, negatives, sampling):
    _, on = guard_models(tokenizer, itm_negatives=negatives, hard_sampling=sampling)
    images, text = synthetic_batch(tokenizer)
    images[:] = images[0]
    out = seeded_forward(on, images, text, torch.zeros(6, dtype=torch.long))
    for name in LOSS_KEYS:
        assert torch.isfinite(out[name]), name
    (out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]).backward()


def test_guard_fallback_keeps_a_negative_for_every_item(tokenizer):
    from models.negatives import mine_negatives

    _, on = guard_models(tokenizer)
    # Pair 0 shares its image with 1 and its caption with 2: positive with the whole batch.
    text = tokenizer(["a red ball", "a dog", "a red ball"], padding="longest", return_tensors="pt")
    ids, mask = text.input_ids, text.attention_mask
    itc_pos, mining_pos = on.false_negative_masks(torch.tensor([1, 1, 2]), ids, mask)
    assert itc_pos[0].all() and not itc_pos[1, 2]  # ITC keeps every true match as a target
    # Row and column 0 fall back to the diagonal only; 1 and 2 share nothing else.
    assert torch.equal(mining_pos, torch.diag(torch.tensor([False, True, True])))
    sim = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    mine_negatives(sim, sim.t(), mining_pos)  # every image and text keeps a negative
    all_one = on.false_negative_masks(torch.zeros(3, dtype=torch.long), ids, mask)
    assert all_one[0].all() and not all_one[1].any()


def test_guard_needs_image_key(tokenizer):
    off, on = guard_models(tokenizer)
    images, text = synthetic_batch(tokenizer)
    with pytest.raises(ValueError, match="guard_false_negatives"):
        on(images, text)
    with pytest.raises(ValueError, match="image_key"):
        on(images, text, image_key=torch.arange(5))
    assert torch.isfinite(run(off, images, text)["loss_itc"])  # without the guard no key is needed


def test_guard_with_itc_gather_single_process(tokenizer):
    off, on = guard_models(tokenizer, itc_gather=True)
    images, text, keys = duplicate_batch(tokenizer)
    out = seeded_forward(on, images, text, keys)
    assert not torch.equal(out["loss_itc"], seeded_forward(off, images, text, keys)["loss_itc"])
    for name in LOSS_KEYS:
        assert torch.isfinite(out[name]), name


def test_itc_only_dual_encoder(tokenizer):
    """itm/mlm false (Table 5): exact-zero ITM and MLM losses, no gradient into the fusion layers or
    heads, the same ITC loss as the full model, and a training signal for the uni-modal encoders."""
    torch.manual_seed(0)
    full = ALBEF_Base(config(), tokenizer)
    torch.manual_seed(0)
    dual = ALBEF_Base(config(itm=False, mlm=False), tokenizer)
    assert not dual.uses_every_parameter and full.uses_every_parameter
    images, text = synthetic_batch(tokenizer)
    out, ref = run(dual, images, text), run(full, images, text)
    assert out["loss_itm"].item() == 0.0 and out["loss_mlm"].item() == 0.0
    assert torch.equal(out["loss_itc"], ref["loss_itc"]) and torch.equal(out["hardness"], ref["hardness"])
    (out["loss_itc"] + out["loss_cons"] + out["loss_itm"] + out["loss_mlm"]).backward()
    grads = {n for n, p in dual.named_parameters() if p.grad is not None}
    assert "itm_head.weight" not in grads and not any("crossattention" in n for n in grads)
    assert not any(n.startswith("text_encoder.cls.") for n in grads)
    assert {"vision_proj.weight", "text_proj.weight", "visual_encoder.patch_embed.proj.weight"} <= grads
    with pytest.raises(ConfigError, match="nothing to train"):  # refused by the config (training.config)
        config(itc=False, itm=False, mlm=False)
    # Hard negatives come from ITC, but without ITM no negative is mined: itc off + hard is then fine.
    ALBEF_Base(config(itc=False, itm=False), tokenizer)
