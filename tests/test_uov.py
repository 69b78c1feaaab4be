"""tools.uov: shared masked positions, accuracies against a hand computation, edge cases, the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from models.pretrain import ALBEF_Base
from models.tokenization import tokenizer_from_vocab
from tools.uov import (
    CaptionFileError,
    blank_image,
    load_captions,
    main,
    masked_positions,
    usage_of_vision,
)
from training.cli import run_main
from training.config import PretrainConfig
from training.config_resolve import resolve_config

pytestmark = pytest.mark.usefixtures("in_repo")  # tests/conftest.py: repo root, one thread, synthetic data

CONFIG = "configs/tiny/Pretrain.yaml"
CAPTIONS = "data/synthetic/retrieval_test.json"
RESULT_KEYS = {"prob", "masked_tokens", "acc1", "acc1_no_image", "uov1", "acc5", "acc5_no_image", "uov5"}


@pytest.fixture(scope="module")
def tokenizer(in_repo):
    return tokenizer_from_vocab("data/synthetic/vocab.txt")


@pytest.fixture(scope="module")
def config(in_repo) -> PretrainConfig:
    # Random weights: the synthetic ViT (vision_init) is not needed to test the metric.
    return dataclasses.replace(resolve_config("pretrain", CONFIG, check_paths=False), vision_init=None)


def tiny_model(config: PretrainConfig, tokenizer, seed: int = 0) -> ALBEF_Base:
    torch.manual_seed(seed)
    return ALBEF_Base(config, tokenizer).eval()


@pytest.fixture(scope="module")
def examples(config, tokenizer):
    """The first 3 test images of the synthetic set, loaded, and their captions tokenized as the tool does."""
    images, captions, image_index = load_captions(CAPTIONS, config.image_root, config.image_res,
                                                  limit=3)
    text = tokenizer(captions, padding="longest", truncation=True, max_length=40, return_tensors="pt")
    return torch.stack([images[i] for i in range(len(images))]), text, image_index


# ----------------------------------------------------------------------------------------------
# The masking
# ----------------------------------------------------------------------------------------------


def test_masked_positions_are_a_function_of_the_seed_only(examples, tokenizer):
    _, text, _ = examples
    special = [tokenizer.pad_token_id, tokenizer.cls_token_id]

    def draw(p: float, seed: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return masked_positions(text.input_ids, text.attention_mask, p, special, generator)

    assert torch.equal(draw(0.5), draw(0.5))
    assert not torch.equal(draw(0.5), draw(0.5, seed=1))
    # One draw thresholded at every p: the masks are nested.
    assert bool((draw(0.15) <= draw(0.5)).all()) and bool((draw(0.5) <= draw(0.75)).all())
    assert draw(0.15).sum() < draw(0.5).sum() < draw(0.75).sum()


def test_both_passes_see_exactly_the_same_masked_tokens(examples, config, tokenizer):
    """Spy on the fusion encoder: each call's with-image half and blank-image half get identical ids."""
    images, text, image_index = examples
    model = tiny_model(config, tokenizer)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Recorder(nn.Module):
        def __init__(self, encoder: nn.Module):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask, mode="multimodal", **kwargs):
            calls.append((input_ids.clone(), kwargs["encoder_hidden_states"].clone()))
            return self.encoder(input_ids, attention_mask, mode=mode, **kwargs)

        def mlm_logits(self, hidden):
            return self.encoder.mlm_logits(hidden)

    model.text_encoder = Recorder(model.text_encoder)
    usage_of_vision(model, images, text.input_ids, text.attention_mask, [0.5], generator_seed=3,
                    batch_size=5, image_index=image_index)
    n = len(text.input_ids)
    assert len(calls) == -(-n // 5)
    selected = masked_positions(text.input_ids, text.attention_mask, 0.5, model.special_ids,
                                torch.Generator().manual_seed(3))
    start = 0
    for ids, context in calls:
        b = len(ids) // 2
        assert torch.equal(ids[:b], ids[b:])
        length = ids.shape[1]
        assert torch.equal(ids[:b] == tokenizer.mask_token_id, selected[start:start + b, :length])
        # The second half attends to the blank image: one constant set of tokens, unlike the real images.
        blank = model.encode_image(blank_image(config.image_res))
        assert torch.allclose(context[b:], blank.expand(b, -1, -1))
        assert not torch.allclose(context[:b], context[b:])
        start += b
    assert start == n


def test_pad_and_cls_never_masked_sep_is(examples, tokenizer):
    _, text, _ = examples
    special = [tokenizer.pad_token_id, tokenizer.cls_token_id]
    everything = masked_positions(text.input_ids, text.attention_mask, 1.0, special)
    ids = text.input_ids
    assert not bool(everything[ids == tokenizer.pad_token_id].any())
    assert not bool(everything[:, 0].any()) and bool((ids[:, 0] == tokenizer.cls_token_id).all())
    assert bool(everything[ids == tokenizer.sep_token_id].all())  # maskable, as in training
    # p = 1 selects every other real token.
    real = (text.attention_mask == 1) & (ids != tokenizer.cls_token_id)
    assert torch.equal(everything, real)


def test_probability_zero_is_rejected_and_an_empty_selection_reports_none(examples, config, tokenizer):
    images, text, image_index = examples
    for p in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"masking probability must be in \(0, 1\]"):
            masked_positions(text.input_ids, text.attention_mask, p, [0])
    model = tiny_model(config, tokenizer)
    result = usage_of_vision(model, images, text.input_ids, text.attention_mask, [1e-9, 0.5],
                             image_index=image_index)
    empty, half = result["results"]
    assert empty == {"prob": 1e-9, "masked_tokens": 0, "acc1": None, "acc1_no_image": None, "uov1": None,
                     "acc5": None, "acc5_no_image": None, "uov5": None}
    assert half["masked_tokens"] > 0 and half["uov1"] is not None


# ----------------------------------------------------------------------------------------------
# Accuracies against a hand computation
# ----------------------------------------------------------------------------------------------


def hand_hits(model: ALBEF_Base, image: torch.Tensor, ids: torch.Tensor,
              selected: torch.Tensor) -> tuple[int, int]:
    """One caption alone (no padding, no batch): (top-1 hits, top-5 hits) over its masked tokens."""
    masked = ids.clone()
    masked[selected] = model.mask_token_id
    hidden = model.text_encoder(masked[None], torch.ones_like(masked)[None], mode="multimodal",
                                encoder_hidden_states=model.encode_image(image[None]))
    logits = model.text_encoder.mlm_logits(hidden)[0]
    top1 = top5 = 0
    for pos in selected.nonzero().flatten().tolist():
        top1 += int(logits[pos].argmax() == ids[pos])
        top5 += int(ids[pos] in logits[pos].topk(5).indices)
    return top1, top5


def test_accuracies_equal_a_hand_computation(examples, config, tokenizer):
    images, text, image_index = examples
    model = tiny_model(config, tokenizer, seed=1)
    probs, seed = [0.3, 0.75], 7
    results = {bs: usage_of_vision(model, images, text.input_ids, text.attention_mask, probs,
                                   generator_seed=seed, batch_size=bs, image_index=image_index)
               for bs in (3, 256)}
    assert results[3] == results[256]  # batching and per-batch trimming change nothing
    result = results[3]
    assert result["pairs"] == len(text.input_ids) and result["seed"] == seed
    blank = blank_image(config.image_res)[0]
    with torch.no_grad():
        for p, entry in zip(probs, result["results"]):
            selected = masked_positions(text.input_ids, text.attention_mask, p, model.special_ids,
                                        torch.Generator().manual_seed(seed))
            with_hits, without_hits, total = [0, 0], [0, 0], 0
            for n in range(len(text.input_ids)):
                length = int(text.attention_mask[n].sum())
                ids, sel = text.input_ids[n, :length], selected[n, :length]
                total += int(sel.sum())
                for hits, image in ((with_hits, images[image_index[n]]), (without_hits, blank)):
                    h1, h5 = hand_hits(model, image, ids, sel)
                    hits[0] += h1
                    hits[1] += h5
            assert set(entry) == RESULT_KEYS and entry["prob"] == p and entry["masked_tokens"] == total
            assert entry["acc1"] == with_hits[0] / total and entry["acc5"] == with_hits[1] / total
            assert entry["acc1_no_image"] == without_hits[0] / total
            assert entry["acc5_no_image"] == without_hits[1] / total
            assert entry["uov1"] == entry["acc1"] - entry["acc1_no_image"]
            assert entry["uov5"] == entry["acc5"] - entry["acc5_no_image"]
            assert entry["acc1"] <= entry["acc5"]
    assert not any(m.training for m in model.modules())


def test_a_fusion_encoder_blind_to_the_image_has_zero_uov(examples, config, tokenizer):
    """Zeroed cross-attention output: the image cannot reach the text, so with == without exactly."""
    images, text, image_index = examples
    model = tiny_model(config, tokenizer)
    with torch.no_grad():
        for layer in model.text_encoder.layers:
            if hasattr(layer, "crossattention"):
                layer.crossattention.output.dense.weight.zero_()
                layer.crossattention.output.dense.bias.zero_()
    result = usage_of_vision(model, images, text.input_ids, text.attention_mask, [0.5, 1.0],
                             image_index=image_index)
    for entry in result["results"]:
        assert entry["uov1"] == 0.0 and entry["uov5"] == 0.0
        assert entry["acc1"] == entry["acc1_no_image"] and entry["masked_tokens"] > 0


# ----------------------------------------------------------------------------------------------
# The caption file and the command line
# ----------------------------------------------------------------------------------------------


def test_load_captions_limits_by_image_and_checks_images(config, tmp_path):
    images, captions, image_index = load_captions(CAPTIONS, config.image_root, config.image_res,
                                                  limit=2)
    with open(CAPTIONS, encoding="utf-8") as f:
        entries = json.load(f)[:2]
    assert len(images) == 2 and images[1].shape == (3, config.image_res, config.image_res)
    assert len(captions) == len(image_index) == sum(len(e["caption"]) for e in entries)
    assert image_index.tolist() == [i for i, e in enumerate(entries) for _ in e["caption"]]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([entries[0], {"image": "images/none.png", "caption": ["a red square"]}]))
    with pytest.raises(CaptionFileError, match=f"{bad}: entry 1: image not found"):
        load_captions(str(bad), config.image_root, config.image_res)
    with pytest.raises(FileNotFoundError, match="caption file not found"):
        load_captions(str(tmp_path / "missing.json"), config.image_root, config.image_res)


def test_cli_prints_table_and_json(pretrain_checkpoint, capsys, tmp_path):
    checkpoint, _ = pretrain_checkpoint
    out = tmp_path / "sub" / "uov.json"  # --output_dir (here its hyphenated alias) is created when missing
    record = main(["--config", CONFIG, "--checkpoint", checkpoint, "--probs", "0.15", "0.5", "--limit", "2",
                   "--device", "cpu", "--batch_size", "4", "--output-dir", str(out.parent),
                   "--set", "max_words=20"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"loaded {checkpoint}: missing: none; unexpected: none")
    assert lines[1].split() == ["prob", "acc@1", "acc@1", "w/o", "image", "UoV@1", "acc@5", "acc@5", "w/o",
                                "image", "UoV@5", "masked", "tokens"]
    assert [line.split()[0] for line in lines[2:4]] == ["0.15", "0.5"]
    printed = json.loads(lines[-1])
    assert printed == record == json.loads(out.read_text())
    assert set(record) == {"captions_file", "checkpoint", "images", "blank_image", "pairs", "seed", "results"}
    assert record["captions_file"] == CAPTIONS and record["images"] == 2 and record["seed"] == 0
    assert [e["prob"] for e in record["results"]] == [0.15, 0.5]
    for entry in record["results"]:  # what tools.ablate reads
        assert set(entry) == RESULT_KEYS and entry["masked_tokens"] > 0
        assert -1.0 <= entry["uov1"] <= 1.0 and -1.0 <= entry["uov5"] <= 1.0


def test_cli_probability_zero_is_a_one_line_error(pretrain_checkpoint, capsys):
    checkpoint, _ = pretrain_checkpoint
    base = [sys.executable, "-m", "tools.uov", "--config", CONFIG, "--checkpoint", checkpoint]
    proc = subprocess.run([*base, "--probs", "0.5", "0"], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: --probs must lie in (0, 1], got [0.0] "
                           "(0 masks nothing: no accuracy to compare)\n")
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, [*base[3:], "--captions", "data/synthetic/none.json"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "error: caption file not found: data/synthetic/none.json\n"
