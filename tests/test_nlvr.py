"""NLVR2: duplicated-fusion model, checkpoint loading, text assignment, tiny end-to-end fine-tune (CPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
from conftest import tiny_config

from models.loading import load_weights
from models.nlvr import ALBEF_NLVR, assign_texts, duplicate_fusion_layers
from models.tokenization import build_tokenizer
from training.config import NLVRConfig
from training.optimizer import build_optimizer

LAYER = re.compile(r"^text_encoder\.bert\.encoder\.layer\.(\d+)\.(.+)$")


pytestmark = pytest.mark.usefixtures("in_repo")


@pytest.fixture(scope="module")
def config() -> NLVRConfig:
    return tiny_config("nlvr")


def stage(config: NLVRConfig, text_assignment: bool) -> NLVRConfig:
    """The config of stage 1 (text_assignment true) or stage 2: ALBEF_NLVR builds the stage it names."""
    return dataclasses.replace(config, text_assignment=text_assignment)


@pytest.fixture(scope="module")
def tokenizer(config):
    return build_tokenizer(config)


def test_pretrain_checkpoint_loads_into_both_stages(config, tokenizer, pretrain_checkpoint):
    path, source = pretrain_checkpoint
    fusion = 2  # configs/tiny/config_bert.json: 4 layers, fusion_layer 2
    for text_assignment, head in ((False, "cls_head."), (True, "ta_head.")):
        torch.manual_seed(1)
        model = ALBEF_NLVR(stage(config, text_assignment), tokenizer)
        report = load_weights(model, path, key_map=model.key_map(), ignore=model.ignored_keys())
        assert report.unexpected == []
        assert report.missing and all(k.startswith(head) for k in report.missing), report.missing
        ignored = set(report.ignored)
        assert {"itm_head.weight", "text_proj.weight", "temp"} <= ignored
        assert any(k.startswith("text_encoder.cls.") for k in ignored)
        assert ("vision_proj.weight" in ignored) != text_assignment  # stage 1 keeps it to pick similar images

        state = model.state_dict()
        layers = model.text_encoder.layers
        assert len(layers) == fusion + 2 * (4 - fusion)
        for key, value in source.items():
            match = LAYER.match(key)
            if match is None:
                if key.startswith(("visual_encoder.", "text_encoder.bert.embeddings.")):
                    assert torch.equal(state[key], value), key
                continue
            i, rest = int(match[1]), match[2]
            targets = [i] if i < fusion else [fusion + 2 * (i - fusion), fusion + 2 * (i - fusion) + 1]
            for j in targets:
                assert torch.equal(state[f"text_encoder.bert.encoder.layer.{j}.{rest}"], value), (key, j)

        # Each pair shares its cross-attention key/value: one parameter, listed once to the optimizer.
        for j in range(fusion, len(layers), 2):
            first, second = layers[j].crossattention.self, layers[j + 1].crossattention.self
            assert second.key.weight is first.key.weight and second.value.bias is first.value.bias
            assert second.query.weight is not first.query.weight
        optimizer = build_optimizer(model, config.optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert len(params) == len({id(p) for p in params})
        if text_assignment:
            assert not model.vision_proj.weight.requires_grad
            assert all(p is not model.vision_proj.weight for p in params)


def test_stage1_checkpoint_loads_into_stage2_unchanged(config, tokenizer, pretrain_checkpoint):
    torch.manual_seed(2)
    stage1 = ALBEF_NLVR(stage(config, True), tokenizer)
    load_weights(stage1, pretrain_checkpoint[0], key_map=stage1.key_map(), ignore=stage1.ignored_keys())
    stage2 = ALBEF_NLVR(stage(config, False), tokenizer)
    report = load_weights(stage2, {"model": stage1.state_dict()}, key_map=stage2.key_map(),
                          ignore=stage2.ignored_keys())
    assert report.unexpected == []
    assert all(k.startswith("cls_head.") for k in report.missing)
    assert any(k.startswith("ta_head.") for k in report.ignored) and "vision_proj.weight" in report.ignored
    s1, s2 = stage1.state_dict(), stage2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s2 if k.startswith(("text_encoder.", "visual_encoder.")))


def test_duplicate_fusion_layers_rejects_other_depths():
    state = {f"text_encoder.bert.encoder.layer.{i}.output.dense.weight": torch.zeros(1) for i in range(5)}
    with pytest.raises(ValueError, match="5 text encoder layers"):
        duplicate_fusion_layers(state, fusion_layer=2, num_layers=4)


def test_assign_texts_pairs_and_labels():
    # Images 0/1 are near-duplicates, 2/3 are near-duplicates, 4 is alone.
    feat = torch.nn.functional.normalize(torch.tensor(
        [[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.0, 1.0, 0.0], [0.1, 0.9, 0.0], [0.5, 0.5, 0.7]]), dim=-1)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(20):
        first, second, labels = assign_texts(feat, generator=generator)
        own = torch.arange(5)
        most_similar = torch.tensor([1, 0, 3, 2, -1])
        for b in range(4):
            other = most_similar[b]
            expected = {0: (b, other), 1: (other, b)}.get(int(labels[b]))
            if expected is not None:
                assert (int(first[b]), int(second[b])) == (int(expected[0]), int(expected[1]))
        neither = labels == 2
        assert not ((first == own) | (second == own))[neither].any()
        assert (first != second).all()
        counts += torch.bincount(labels, minlength=3)
    assert (counts > 15).all()  # all three classes are drawn
    # Entries with the same image id never serve as each other's "other" image.
    first, second, labels = assign_texts(feat, image_ids=torch.tensor([0, 0, 1, 1, 2]), generator=generator)
    same = torch.tensor([0, 0, 1, 1, 2])
    own = torch.arange(5)
    other = torch.where(labels == 0, second, first)
    assert (same[other] != same[own]).all()


def _read_log(path: str) -> list[dict]:
    with open(os.path.join(path, "log.txt")) as f:
        return [json.loads(line) for line in f]


def test_tiny_text_assignment_then_finetune(tmp_path, pretrain_checkpoint):
    import NLVR

    # Stage 1 (3-way text assignment) on a small pre-training subset, from a pre-training checkpoint.
    with open("data/synthetic/pretrain.json") as f:
        pretrain_subset = tmp_path / "pretrain_subset.json"
        pretrain_subset.write_text(json.dumps(json.load(f)[:64]))
    stage1_dir = str(tmp_path / "stage1")
    record = NLVR.main(["--config", "configs/tiny/NLVR_pretrain.yaml", "--output_dir", stage1_dir,
                        "--checkpoint", pretrain_checkpoint[0], "--device", "cpu",
                        "--set", f"train_file=[{pretrain_subset}]", "max_epoch=1", "schedular.epochs=1"])
    assert record["epoch"] == 0 and 0.0 <= record["train_ta_acc"] <= 1.0
    stage1 = os.path.join(stage1_dir, "checkpoint_00.pth")
    assert os.path.isfile(stage1)

    # Stage 2 from the stage-1 checkpoint. Generalising to the held-out synthetic pairs takes a
    # pre-trained model and minutes of fine-tuning (the demo measures it; a model from scratch stays at
    # 0.5), so this checks that the whole path learns: 64 training pairs, fixed crops, fitted well above
    # chance, evaluated with the evaluation transform.
    with open("data/synthetic/nlvr_train.json") as f:
        pairs = tmp_path / "nlvr_subset.json"
        pairs.write_text(json.dumps(json.load(f)[:64]))
    out = str(tmp_path / "nlvr")
    NLVR.main(["--config", "configs/tiny/NLVR.yaml", "--output_dir", out, "--checkpoint", stage1,
               "--device", "cpu",
               "--set", f"train_file=[{pairs}]", f"val_file=[{pairs}]", f"test_file=[{pairs}]",
               "crop_scale=[1.0, 1.0]", "max_epoch=20", "schedular.epochs=20", "optimizer.lr=1e-3",
               "schedular.lr=1e-3"])
    log = _read_log(out)
    assert [r["epoch"] for r in log] == list(range(20))
    assert all({"val_acc", "test_acc", "train_acc", "best_epoch"} <= set(r) for r in log)
    best = max(log, key=lambda r: r["val_acc"])
    # The curve oscillates (0.53-0.88 after epoch 8): rounding-level changes to the step (issue 33's fused
    # q/k/v and additive masks) moved its best epoch from 0.875 to 0.766, so the bar is 3/4, chance 1/2.
    assert best["val_acc"] >= 0.75, [r["val_acc"] for r in log]
    assert log[-1]["best_epoch"] == best["epoch"]
    assert os.path.isfile(os.path.join(out, "checkpoint_best.pth"))

    # --evaluate on the best checkpoint reproduces its accuracies and logs one more line.
    record = NLVR.main(["--config", "configs/tiny/NLVR.yaml", "--output_dir", out, "--device", "cpu",
                        "--checkpoint", os.path.join(out, "checkpoint_best.pth"), "--evaluate",
                        "--set", f"val_file=[{pairs}]", f"test_file=[{pairs}]"])
    assert record["val_acc"] == pytest.approx(best["val_acc"])
    last = _read_log(out)[-1]
    assert last["mode"] == "evaluate" and last["val_acc"] == pytest.approx(best["val_acc"])


def test_finetune_resume_equals_uninterrupted_run(tmp_path):
    # training.trainer.Trainer (Retrieval, NLVR and VQA): resuming from the epoch-0 checkpoint gives
    # the same weights, log record and best-checkpoint bookkeeping as the run that never stopped.
    import NLVR

    subsets = []
    for split, count in (("train", 192), ("dev", 64), ("test", 64)):  # the full split is 4,800 pairs
        with open(f"data/synthetic/nlvr_{split}.json") as f:
            subsets.append(tmp_path / f"nlvr_{split}.json")
            subsets[-1].write_text(json.dumps(json.load(f)[:count]))
    common = ["--config", "configs/tiny/NLVR.yaml", "--device", "cpu", "--set", "max_epoch=2",
              f"train_file=[{subsets[0]}]", f"val_file=[{subsets[1]}]", f"test_file=[{subsets[2]}]"]
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    record = NLVR.main(["--output_dir", full, *common])
    again = NLVR.main(["--output_dir", resumed, "--resume", os.path.join(full, "checkpoint_00.pth"), *common])
    with open(os.path.join(resumed, "run_record.jsonl")) as f:
        (start,) = [json.loads(line) for line in f]
    epoch0 = torch.load(os.path.join(full, "checkpoint_00.pth"), map_location="cpu", weights_only=True)
    assert start["resumed_from"] == {"path": os.path.join(full, "checkpoint_00.pth"), "epoch": 1,
                                     "step": epoch0["step"]}
    drop = ("train_seconds", "samples_per_s", "epoch_seconds", "eval_seconds")  # timings
    assert ({k: v for k, v in again.items() if k not in drop}
            == {k: v for k, v in record.items() if k not in drop})
    a, b = (torch.load(os.path.join(d, "checkpoint_01.pth"), map_location="cpu", weights_only=True)
            for d in (full, resumed))
    assert a["best"] == b["best"] and a["step"] == b["step"]
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
