"""BertEncoder: equivalence with transformers' BERT, modes, NLVR lists, causal decoder, loading errors."""

import json
import logging

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertModel

from grit_io import InputFileError
from models.bert import BertEncoder, load_bert_config

VOCAB, HIDDEN, LAYERS, FUSION = 100, 64, 4, 2


def tiny_hf_config(**extra) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        **extra,
    )


def tiny_config(**overrides) -> BertConfig:
    config = tiny_hf_config(fusion_layer=FUSION, encoder_width=HIDDEN)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def batch():
    torch.manual_seed(1)
    ids = torch.randint(5, VOCAB, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert_mlm")
    BertForMaskedLM(tiny_hf_config()).save_pretrained(path)
    return path


def test_text_mode_matches_transformers(mlm_dir):
    ours = BertEncoder.from_pretrained(str(mlm_dir), tiny_config()).eval()
    ref = BertModel.from_pretrained(mlm_dir).eval()
    ids, mask = batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[FUSION]
        got = ours(ids, mask, mode="text")
    assert got.shape == (3, 10, HIDDEN)
    assert (got - expected).abs().max() <= 1e-5


def test_mlm_head_matches_transformers(mlm_dir):
    ours = BertEncoder.from_pretrained(str(mlm_dir), tiny_config()).eval()
    ref = BertForMaskedLM.from_pretrained(mlm_dir).eval()
    ids, mask = batch()
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = ours.mlm_logits(out.hidden_states[-1])
    assert (got - out.logits).abs().max() <= 1e-5
    # Tied like transformers, but the state dict still names the decoder weight and the bias.
    state = ours.state_dict()
    assert "cls.predictions.decoder.weight" in state and "cls.predictions.bias" in state
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight


def test_bertmodel_layout_loads_and_logs_fresh_groups(tmp_path, caplog):
    torch.manual_seed(0)
    BertModel(tiny_hf_config(), add_pooling_layer=True).save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="models.bert"):
        ours = BertEncoder.from_pretrained(str(tmp_path), tiny_config()).eval()
    lines = [r.getMessage() for r in caplog.records if r.name == "models.bert"]
    assert len(lines) == 1
    fresh = lines[0].split("freshly initialised:")[1].split(";")[0]
    assert "cls.predictions" in fresh and "crossattention" in fresh and "{2-3}" in fresh
    assert "embeddings" not in fresh and "attention.self" not in fresh
    ref = BertModel.from_pretrained(tmp_path).eval()
    ids, mask = batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[FUSION]
        assert (ours(ids, mask, mode="text") - expected).abs().max() <= 1e-5


def test_old_gamma_beta_names_load(tmp_path):
    torch.manual_seed(0)
    ref = BertModel(tiny_hf_config(), add_pooling_layer=False).eval()
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in ref.state_dict().items()
    }
    torch.save({"bert." + k: v for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    ours = BertEncoder.from_pretrained(str(tmp_path), tiny_config(), mlm_head=False).eval()
    ids, mask = batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[FUSION]
        assert (ours(ids, mask, mode="text") - expected).abs().max() <= 1e-5
    assert not hasattr(ours, "cls")


def test_multimodal_is_text_then_fusion():
    torch.manual_seed(0)
    model = BertEncoder(tiny_config()).eval()
    ids, mask = batch()
    image = torch.randn(3, 5, HIDDEN)
    with torch.no_grad():
        text = model(ids, mask, mode="text")
        fused = model(mode="fusion", hidden_states=text, attention_mask=mask, encoder_hidden_states=image)
        full = model(ids, mask, mode="multimodal", encoder_hidden_states=image)
        other = model(ids, mask, mode="multimodal", encoder_hidden_states=torch.randn(3, 5, HIDDEN))
    assert torch.allclose(fused, full, atol=1e-6)
    assert not torch.allclose(full, other, atol=1e-3)  # the image matters
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        model(ids, mask, mode="multimodal")


def test_image_mask_hides_tokens():
    torch.manual_seed(0)
    model = BertEncoder(tiny_config()).eval()
    ids, mask = batch()
    image = torch.randn(3, 5, HIDDEN)
    image_mask = torch.tensor([[1, 1, 1, 0, 0]] * 3)
    changed = image.clone()
    changed[:, 3:] = torch.randn(3, 2, HIDDEN)
    with torch.no_grad():
        a = model(ids, mask, encoder_hidden_states=image, encoder_attention_mask=image_mask)
        b = model(ids, mask, encoder_hidden_states=changed, encoder_attention_mask=image_mask)
    assert torch.allclose(a, b, atol=1e-6)


def test_list_of_images_alternates_per_fusion_layer():
    # NLVR: 6 fusion layers duplicated; layer j attends to images[(j - fusion_layer) % 2].
    torch.manual_seed(0)
    model = BertEncoder(tiny_config(num_hidden_layers=6)).eval()
    ids, mask = batch()
    images = [torch.randn(3, 5, HIDDEN), torch.randn(3, 7, HIDDEN)]
    with torch.no_grad():
        got = model(ids, mask, encoder_hidden_states=images)
        x = model(ids, mask, mode="text")
        self_mask = mask[:, None, None, :].bool()
        for j in range(FUSION, 6):
            x = model.layers[j](x, self_mask, images[(j - FUSION) % 2], None)
    assert torch.allclose(got, x, atol=1e-6)


def test_decoder_is_causal():
    torch.manual_seed(0)
    model = BertEncoder(tiny_config(fusion_layer=0), is_decoder=True).eval()
    assert all(hasattr(layer, "crossattention") for layer in model.layers)
    ids, _ = batch()
    mask = torch.ones_like(ids)
    question = torch.randn(3, 4, HIDDEN)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % VOCAB
    with torch.no_grad():
        a = model(ids, mask, encoder_hidden_states=question)
        b = model(changed, mask, encoder_hidden_states=question)
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:], atol=1e-3)


def test_parameter_names_follow_transformers():
    model = BertEncoder(tiny_config())
    names = set(model.state_dict())
    hf_names = {k for k in BertForMaskedLM(tiny_hf_config()).state_dict() if "position_ids" not in k}
    assert hf_names <= names
    extra = names - hf_names
    assert extra and all(".crossattention." in k for k in extra)
    assert all(int(k.split(".")[3]) >= FUSION for k in extra)
    xk = model.state_dict()["bert.encoder.layer.2.crossattention.self.key.weight"]
    assert xk.shape == (HIDDEN, HIDDEN)


def test_missing_dir_and_vocab_mismatch(tmp_path, mlm_dir):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        BertEncoder.from_pretrained(missing, tiny_config())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        BertEncoder.from_pretrained(str(tmp_path), tiny_config())  # a dir without weights
    with pytest.raises(ValueError, match="vocab"):
        BertEncoder.from_pretrained(str(mlm_dir), tiny_config(vocab_size=VOCAB + 7))
    with pytest.raises(ValueError, match="hidden"):
        BertEncoder.from_pretrained(
            str(mlm_dir), tiny_config(hidden_size=32, encoder_width=32, intermediate_size=64)
        )


def test_load_bert_config_errors(tmp_path):
    # A user's file that is missing or malformed: InputFileError naming it (the scripts print one line).
    with pytest.raises(InputFileError, match="missing.json"):
        load_bert_config(str(tmp_path / "missing.json"))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(tiny_hf_config().to_dict()))
    with pytest.raises(InputFileError, match="cfg.json.*fusion_layer"):
        load_bert_config(str(path))
    path.write_text('{"hidden_size": 64,')
    with pytest.raises(InputFileError, match="cfg.json.*line 1"):
        load_bert_config(str(path))
    path.write_text(json.dumps({**tiny_hf_config().to_dict(), "fusion_layer": 9, "encoder_width": 64}))
    with pytest.raises(InputFileError, match="cfg.json.*fusion_layer=9"):
        load_bert_config(str(path))
    path.write_text(json.dumps({**tiny_hf_config().to_dict(), "fusion_layer": 2, "encoder_width": 64}))
    config = load_bert_config(str(path))
    assert config.fusion_layer == 2 and config.encoder_width == 64


@pytest.mark.parametrize("name", ["config_bert.json", "tiny/config_bert.json"])
def test_repo_configs(name):
    from pathlib import Path

    config = load_bert_config(str(Path(__file__).parents[1] / "configs" / name))
    assert config.hidden_size % config.num_attention_heads == 0
    assert 0 < config.fusion_layer < config.num_hidden_layers
    assert config.encoder_width in (64, 768)
