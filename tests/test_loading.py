"""load_weights: path/dict input, pos_embed resampling, ALBEF naming, ignored/unexpected/missing, errors."""

import logging

import pytest
import torch
from conftest import tiny_config
from torch import nn
from transformers import BertConfig

from grit_io import InputFileError
from models.bert import BertEncoder
from models.loading import LoadReport, load_task_checkpoint, load_weights
from models.vit import build_vision_encoder


def bert_config() -> BertConfig:
    return BertConfig(
        vocab_size=50,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        fusion_layer=1,
        encoder_width=64,
    )


class TinyVLM(nn.Module):
    """The attribute names of the task models: visual_encoder, text_encoder (+ a projection)."""

    def __init__(self, image_res: int = 32, mlm_head: bool = True):
        super().__init__()
        self.visual_encoder = build_vision_encoder(
            tiny_config("pretrain", image_res=image_res, patch_size=8, vision_width=64, vision_depth=1,
                        vision_heads=4, vision_init=None)
        )
        self.text_encoder = BertEncoder(bert_config(), mlm_head=mlm_head)
        self.vision_proj = nn.Linear(64, 16)


def fresh(image_res=32, mlm_head=True, seed=0) -> TinyVLM:
    torch.manual_seed(seed)
    return TinyVLM(image_res, mlm_head)


def test_roundtrip_from_path_with_model_key_and_resampling(tmp_path, caplog):
    source = fresh(32, seed=1)
    path = tmp_path / "checkpoint_00.pth"
    torch.save({"model": source.state_dict(), "epoch": 3, "config": {"image_res": 32}}, path)
    target = fresh(64, seed=2)
    with caplog.at_level(logging.INFO, logger="models.loading"):
        report = load_weights(target, str(path))
    assert isinstance(report, LoadReport)
    assert report.missing == [] and report.unexpected == []
    assert report.resampled == ["visual_encoder.pos_embed"]
    assert target.state_dict()["visual_encoder.pos_embed"].shape == (1, 65, 64)
    for key, value in source.state_dict().items():
        if key != "visual_encoder.pos_embed":
            assert torch.equal(target.state_dict()[key], value), key
    assert len([r for r in caplog.records if r.name == "models.loading"]) == 1


def test_albef_finetune_naming_and_ignore():
    # ALBEF fine-tuned checkpoints name the text encoder without '.bert.', plus an obsolete
    # position_ids buffer; retrieval does not use the MLM head.
    source = fresh(seed=1).state_dict()
    state = {k.replace("text_encoder.bert.", "text_encoder."): v for k, v in source.items()}
    state["text_encoder.embeddings.position_ids"] = torch.arange(32)[None]
    state["itm_head.weight"] = torch.zeros(2, 64)
    target = fresh(mlm_head=False, seed=2)
    report = load_weights(target, state, ignore=["text_encoder.cls."])
    assert report.missing == []
    assert report.unexpected == ["itm_head.weight"]
    assert "text_encoder.embeddings.position_ids" in report.ignored
    assert any(k.startswith("text_encoder.cls.") for k in report.ignored)
    key = "text_encoder.bert.embeddings.word_embeddings.weight"
    assert torch.equal(target.state_dict()[key], source[key])
    with pytest.raises(ValueError, match="itm_head"):
        load_weights(fresh(mlm_head=False), state, ignore=["text_encoder.cls."], strict=True)


def test_missing_keys_reported_and_tied_decoder_counts_as_loaded():
    source = fresh(seed=1).state_dict()
    state = {
        k: v
        for k, v in source.items()
        if not k.startswith("vision_proj") and k != "text_encoder.cls.predictions.decoder.weight"
    }
    report = load_weights(fresh(seed=2), state)
    assert report.missing == ["vision_proj.weight", "vision_proj.bias"]
    assert "vision_proj" in report.summary()


def test_key_map_is_applied():
    source = fresh(seed=1).state_dict()
    # e.g. a task model that renames a module: the map sees the checkpoint and returns new names.
    state = {k.replace("vision_proj.", "old_proj."): v for k, v in source.items()}
    target = fresh(seed=2)
    report = load_weights(
        target, state, key_map=lambda sd: {k.replace("old_proj.", "vision_proj."): v for k, v in sd.items()}
    )
    assert report.missing == [] and report.unexpected == []
    assert torch.equal(target.vision_proj.weight, source["vision_proj.weight"])


def test_errors_name_the_file_or_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.pth"):
        load_weights(fresh(), str(tmp_path / "nothing.pth"))
    bad = fresh().state_dict()
    bad["vision_proj.weight"] = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="vision_proj.weight"):
        load_weights(fresh(), bad)
    with pytest.raises(ValueError, match="state dict"):
        load_weights(fresh(), {"model": {"a": 1}})


class TaskModel(TinyVLM):
    """A TinyVLM with the key_map / ignored_keys that load_task_checkpoint asks a task model for."""

    @staticmethod
    def key_map():
        return None

    @staticmethod
    def ignored_keys() -> tuple[str, ...]:
        return ()


def test_checkpoint_files_that_are_not_state_dicts_name_the_file(tmp_path, capsys):
    """--checkpoint pointing at a tensor, a list, a text file or a checkpoint of another model: one
    InputFileError (the scripts' one-line `error:`) that names the file."""
    torch.manual_seed(0)
    model = TaskModel()
    tensor = tmp_path / "tensor.pth"
    torch.save(torch.zeros(3), tensor)
    listed = tmp_path / "list.pth"
    torch.save([torch.zeros(3)], listed)
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint")
    with_strings = tmp_path / "strings.pth"
    torch.save({"model": {"a": torch.zeros(1), "note": "hello"}}, with_strings)
    for path, what in ((tensor, "a Tensor"), (listed, "a list"), (text, "could not be read"),
                       (with_strings, "note")):
        with pytest.raises(InputFileError, match=f"{path.name}.*{what}"):
            load_task_checkpoint(model, str(path))
    wrong = fresh().state_dict()
    wrong["vision_proj.weight"] = torch.zeros(8, 64)
    torch.save({"model": wrong}, tmp_path / "other_model.pth")
    with pytest.raises(InputFileError, match="other_model.pth.*vision_proj.weight"):
        load_task_checkpoint(model, str(tmp_path / "other_model.pth"))
    load_task_checkpoint(model, None)
    assert "random weights" in capsys.readouterr().out
