"""Checkpoint fidelity (issue 16 items 2, 3): the authors' stage-1 ta_head layout, our older MLP head,
and ALBEF-layout checkpoints (momentum copies, queues) loading with every unused part ignored with
a reason."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from torch import nn

from models.loading import IGNORE_REASONS, load_task_checkpoint, load_weights
from models.nlvr import ALBEF_NLVR
from models.pretrain import ALBEF_Base
from models.retrieval import RETRIEVAL_IGNORED_PREFIXES
from models.tokenization import build_tokenizer
from models.vqa import ALBEF_VQA
from training.config_files import ConfigError

MOMENTUM = IGNORE_REASONS["*_m."]
QUEUE = IGNORE_REASONS["image_queue"]
TASKS = {"Pretrain.yaml": "pretrain", "Retrieval.yaml": "retrieval", "NLVR.yaml": "nlvr",
         "NLVR_pretrain.yaml": "nlvr", "VQA.yaml": "vqa"}

pytestmark = pytest.mark.usefixtures("in_repo")


def tiny(name: str, **overrides):
    """The typed config of configs/tiny/<name> with `overrides`; the ViT starts from random weights (these
    tests are about checkpoint keys, not the synthetic ViT's warm start)."""
    return tiny_config(TASKS[name], f"configs/tiny/{name}", **{"vision_init": None, **overrides})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tiny("NLVR_pretrain.yaml"))


@pytest.fixture(scope="module")
def albef_state(tokenizer) -> dict[str, torch.Tensor]:
    """Our ALBEF_Base state dict in ALBEF's pre-training layout: a momentum copy of every online module
    (*_m, text_encoder_m.cls included), the feature queues and an old position_ids buffer."""
    torch.manual_seed(0)
    base = ALBEF_Base(tiny("Pretrain.yaml"), tokenizer)
    state = dict(base.state_dict())
    for key, value in list(state.items()):
        head, _, rest = key.partition(".")
        if rest:  # modules only (ALBEF has no momentum temp)
            state[f"{head}_m.{rest}"] = value.clone()
    embed, size = base.text_proj.out_features, 16
    state.update(image_queue=torch.randn(embed, size), text_queue=torch.randn(embed, size),
                 idx_queue=torch.zeros(1, size, dtype=torch.long), queue_ptr=torch.zeros(1, dtype=torch.long))
    state["text_encoder.bert.embeddings.position_ids"] = torch.arange(30)[None]
    return state


def stage1(tokenizer, **overrides) -> ALBEF_NLVR:
    torch.manual_seed(1)
    return ALBEF_NLVR(tiny("NLVR_pretrain.yaml", **overrides), tokenizer)


def load(model: nn.Module, state: dict):
    return load_weights(model, {"model": state}, key_map=model.key_map(), ignore=model.ignored_keys())


def test_official_stage1_head_loads_completely(tokenizer):
    source = stage1(tokenizer)
    assert isinstance(source.ta_head, nn.Linear)
    state = source.state_dict()
    assert {"ta_head.weight", "ta_head.bias"} <= set(state)
    assert not any(k.startswith("ta_head.0") for k in state)
    # The authors' layout plus the parts an ALBEF-based stage-1 checkpoint also has.
    official = {**state, "cls_head.0.weight": torch.zeros(1), "visual_encoder_m.cls_token": torch.zeros(1)}
    target = stage1(tokenizer)
    report = load(target, official)
    assert report.missing == [] and report.unexpected == [] and report.notes == []
    assert report.reasons["cls_head.0.weight"] == IGNORE_REASONS["cls_head."]
    assert report.reasons["visual_encoder_m.cls_token"] == MOMENTUM
    assert torch.equal(target.ta_head.weight, state["ta_head.weight"])
    assert torch.equal(target.ta_head.bias, state["ta_head.bias"])


def test_old_mlp_stage1_checkpoint_still_loads_completely(tokenizer, capsys):
    old = stage1(tokenizer, ta_head="mlp")
    state = old.state_dict()
    assert {"ta_head.0.weight", "ta_head.0.bias", "ta_head.2.weight", "ta_head.2.bias"} <= set(state)
    target = stage1(tokenizer)
    assert isinstance(target.ta_head, nn.Linear)
    load_task_checkpoint(target, {"model": state})
    out = capsys.readouterr().out
    assert "missing: none; unexpected: none" in out and "rebuilt as 'mlp'" in out
    assert isinstance(target.ta_head, nn.Sequential)
    assert all(torch.equal(v, state[k]) for k, v in target.state_dict().items())
    # And back: an authors'-layout checkpoint into a model built with the MLP head.
    report = load(old, stage1(tokenizer).state_dict())
    assert report.missing == [] and report.unexpected == [] and isinstance(old.ta_head, nn.Linear)


def test_stage1_head_option_is_checked():
    # The allowed heads are the config's (training.config.NLVRConfig.ta_head): refused at resolution.
    with pytest.raises(ConfigError, match="ta_head.*linear.*mlp.*deep"):
        tiny("NLVR_pretrain.yaml", ta_head="deep")


def assert_momentum_and_queues_ignored(report, state) -> None:
    assert report.unexpected == [], report.unexpected
    momentum = [k for k in state if k.partition(".")[0].endswith("_m")]
    assert momentum and all(k in report.ignored and "momentum" in report.reasons[k] for k in momentum)
    for key in ("image_queue", "text_queue", "idx_queue", "queue_ptr"):
        assert key in report.ignored and "queue" in report.reasons[key], key
    assert any(k.startswith("text_encoder_m.cls.") for k in report.ignored)
    assert "momentum" in report.summary() and "feature queue" in report.summary()


def test_albef_pretrain_layout_into_pretrain_model(tokenizer, albef_state):
    torch.manual_seed(3)
    model = ALBEF_Base(tiny("Pretrain.yaml"), tokenizer)
    report = load_weights(model, albef_state)
    assert report.missing == []
    assert_momentum_and_queues_ignored(report, albef_state)
    assert report.reasons["text_encoder.bert.embeddings.position_ids"] == IGNORE_REASONS["*position_ids"]
    assert all(k.partition(".")[0].endswith("_m") for k in report.ignored
               if k not in ("image_queue", "text_queue", "idx_queue", "queue_ptr")
               and not k.endswith("position_ids"))


@pytest.mark.parametrize("text_assignment", [True, False])
def test_albef_pretrain_layout_into_nlvr(tokenizer, albef_state, text_assignment):
    torch.manual_seed(4)
    config = tiny("NLVR_pretrain.yaml" if text_assignment else "NLVR.yaml")
    assert config.text_assignment == text_assignment
    model = ALBEF_NLVR(config, tokenizer)
    report = load(model, albef_state)
    assert all(k.startswith(("ta_head.", "cls_head.")) for k in report.missing), report.missing
    assert_momentum_and_queues_ignored(report, albef_state)


def test_albef_pretrain_layout_into_vqa(tokenizer, albef_state):
    torch.manual_seed(5)
    model = ALBEF_VQA(tiny("VQA.yaml"), tokenizer)
    report = load(model, albef_state)
    assert report.missing == []
    assert_momentum_and_queues_ignored(report, albef_state)


def test_albef_distilled_task_checkpoints_report_nothing_unexpected(tokenizer):
    # ALBEF's distilled NLVR / VQA checkpoints carry cls_head_m, text_decoder_m, text_encoder_m.cls.
    torch.manual_seed(6)
    nlvr = ALBEF_NLVR(tiny("NLVR.yaml"), tokenizer)
    state = dict(nlvr.state_dict())
    state.update({f"cls_head_m.{k[len('cls_head.'):]}": v for k, v in state.items()
                  if k.startswith("cls_head.")})
    assert load(nlvr, state).unexpected == []
    vqa = ALBEF_VQA(tiny("VQA.yaml"), tokenizer)
    state = dict(vqa.state_dict())
    state.update({f"text_decoder_m.{k[len('text_decoder.'):]}": v for k, v in state.items()
                  if k.startswith("text_decoder.")})
    state["text_encoder_m.cls.predictions.bias"] = torch.zeros(1)
    report = load(vqa, state)
    assert report.unexpected == [] and report.missing == []
    assert {report.reasons[k] for k in report.ignored} == {MOMENTUM}


@pytest.mark.parametrize("momentum_init", ["initial", "checkpoint"])
def test_albef_pretrain_layout_into_retrieval(tokenizer, albef_state, momentum_init, tmp_path, capsys):
    import Retrieval

    path = str(tmp_path / "albef.pth")
    torch.save({"model": albef_state}, path)
    config = tiny("Retrieval.yaml", momentum_init=momentum_init)
    torch.manual_seed(7)
    model = Retrieval.build_model(config, tokenizer, path)
    out = capsys.readouterr().out
    assert "missing: none; unexpected: none" in out, out
    assert "feature queue" in out and "momentum" in out
    # The same load, its report: queues and (momentum_init initial) momentum copies skipped with a reason.
    own = model.state_dict()
    assert not torch.equal(own["image_queue"][:, :16], albef_state["image_queue"])
    loaded = albef_state["visual_encoder_m.cls_token"]
    assert torch.equal(own["visual_encoder_m.cls_token"], loaded) == (momentum_init == "checkpoint")
    queues = ("image_queue", "text_queue", "idx_queue", "queue_ptr")
    report = load_weights(model, albef_state, ignore=RETRIEVAL_IGNORED_PREFIXES,
                          skip=dict.fromkeys(queues, "queue"))
    assert report.unexpected == [] and report.reasons["image_queue"] == "queue"
    assert report.reasons["text_encoder_m.cls.predictions.bias"] == MOMENTUM


def test_unknown_key_is_still_unexpected(tokenizer, albef_state):
    torch.manual_seed(8)
    model = ALBEF_Base(tiny("Pretrain.yaml"), tokenizer)
    state = {**albef_state, "mystery_head.weight": torch.zeros(2), "text_encoder.bert.pooler.dense.weight":
             torch.zeros(2), "text_queue_extra": torch.zeros(1)}
    report = load_weights(model, state)
    assert sorted(report.unexpected) == ["mystery_head.weight", "text_encoder.bert.pooler.dense.weight",
                                         "text_queue_extra"]
    assert report.missing == []
