"""tools.probe: pair accuracy with ties at 0.5, the batched ITM scoring path, the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from PIL import Image
from torch import nn

from models.pretrain import ALBEF_Base
from models.tokenization import tokenizer_from_vocab
from tools.probe import (
    ProbeFileError,
    default_probe_file,
    load_probe_file,
    main,
    probe_accuracy,
    score_probe,
)
from training.cli import run_main
from training.config_resolve import resolve_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPO = Path(__file__).parents[1]
TINY_BERT = str(REPO / "configs" / "tiny" / "config_bert.json")
TINY_PRETRAIN = str(REPO / "configs" / "tiny" / "Pretrain.yaml")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["a", "an", "small", "large", "red", "blue", "green", "circle", "square", "triangle", "left",
         "right", "of", "above", "below", "two", "one", "and"]
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}

# Three images; not every image has every kind, and image 2 has two negatives of one kind.
PROBE = [
    {"image": "images/0.png", "caption": "a small red circle left of a large blue square",
     "negatives": [{"kind": "colour", "caption": "a small green circle left of a large blue square"},
                   {"kind": "shape", "caption": "a small red triangle left of a large blue square"},
                   {"kind": "size", "caption": "a large red circle left of a large blue square"},
                   {"kind": "count", "caption": "two small red circles left of a large blue square"},
                   {"kind": "relation", "caption": "a small red circle right of a large blue square"}]},
    {"image": "images/1.png", "caption": "a green square",
     "negatives": [{"kind": "colour", "caption": "a red square"},
                   {"kind": "shape", "caption": "a green circle"}]},
    {"image": "images/2.png", "caption": "a blue triangle above a red circle",
     "negatives": [{"kind": "relation", "caption": "a blue triangle below a red circle"},
                   {"kind": "colour", "caption": "a green triangle above a red circle"},
                   {"kind": "colour", "caption": "a blue triangle above a blue circle"}]},
]
KIND_PAIRS = {"colour": 4, "shape": 2, "size": 1, "count": 1, "relation": 2}


@pytest.fixture(scope="module")
def probe_root(tmp_path_factory) -> Path:
    """A folder with vocab.txt, three PNGs under images/, probe.json and a tiny config.yaml (the tiny
    pre-training config, smaller still, with no synthetic_root)."""
    root = tmp_path_factory.mktemp("probe")
    (root / "vocab.txt").write_text("\n".join(SPECIALS + WORDS) + "\n")
    (root / "images").mkdir()
    for i, colour in enumerate(COLOURS.values()):
        image = Image.new("RGB", (40, 40), (128, 128, 128))
        image.paste(colour, (5 + 5 * i, 5, 25 + 5 * i, 25))
        image.save(root / "images" / f"{i}.png")
    (root / "probe.json").write_text(json.dumps(PROBE))
    (root / "config.yaml").write_text(
        f"base: '{TINY_PRETRAIN}'\nsynthetic_root: null\n"
        f"image_root: '{root}'\nvocab_file: '{root / 'vocab.txt'}'\nbert_config: '{TINY_BERT}'\n"
        "text_encoder: null\nimage_res: 32\npatch_size: 8\nvision_width: 64\nvision_depth: 1\n"
        "vision_heads: 4\nvision_init: null\nembed_dim: 32\ntemp: 0.07\nmax_words: 30\nmax_tokens: 40\n"
        "seed: 42\n"
    )
    return root


@pytest.fixture(scope="module")
def tokenizer(probe_root):
    return tokenizer_from_vocab(str(probe_root / "vocab.txt"))


def tiny_model(probe_root: Path, tokenizer, seed: int = 0) -> ALBEF_Base:
    torch.manual_seed(seed)
    config = resolve_config("pretrain", str(probe_root / "config.yaml"), check_paths=False)
    return ALBEF_Base(config, tokenizer).eval()


def flat(scores: list) -> list[float]:
    return [s for true, negatives in scores for s in (true, *(v for _, v in negatives))]


def run_score(model, probe_root, tokenizer, batch_size=256):
    return score_probe(model, PROBE, tokenizer, image_root=str(probe_root), image_res=32,
                       batch_size=batch_size)


# ----------------------------------------------------------------------------------------------
# probe_accuracy on hand-made scores
# ----------------------------------------------------------------------------------------------


def hand_scores(score_of) -> list:
    """PROBE scored by score_of(caption) -> [(true, [(kind, negative), ...]), ...]."""
    return [(score_of(e["caption"]), [(n["kind"], score_of(n["caption"])) for n in e["negatives"]])
            for e in PROBE]


def test_accuracy_of_a_scorer_that_prefers_the_true_caption_is_one():
    true_captions = {e["caption"] for e in PROBE}
    result = probe_accuracy(hand_scores(lambda c: 0.9 if c in true_captions else 0.1))
    assert result["overall"] == 1.0 and result["image_all"] == 1.0
    assert result["pairs"] == 10 and result["images"] == 3
    assert {k: v["pairs"] for k, v in result["per_kind"].items()} == KIND_PAIRS
    assert all(v["accuracy"] == 1.0 for v in result["per_kind"].values())
    assert list(result["per_kind"]) == ["colour", "shape", "size", "count", "relation"]  # first appearance


def test_accuracy_of_a_constant_scorer_is_exactly_chance():
    result = probe_accuracy(hand_scores(lambda c: 0.37))
    assert result["overall"] == 0.5
    assert all(v["accuracy"] == 0.5 for v in result["per_kind"].values())
    assert result["image_all"] == 0.0  # a tie never "beats" a negative


def test_accuracy_mixed_case_by_hand():
    scores = [
        (0.8, [("colour", 0.9), ("shape", 0.8), ("size", 0.1)]),  # lose, tie, win
        (0.6, [("colour", 0.2), ("count", 0.7)]),                  # win, lose
        (0.5, [("colour", 0.4), ("size", 0.3)]),                   # win, win
    ]
    result = probe_accuracy(scores)
    assert result["per_kind"] == {
        "colour": {"pairs": 3, "accuracy": pytest.approx(2 / 3)},
        "shape": {"pairs": 1, "accuracy": 0.5},
        "size": {"pairs": 2, "accuracy": 1.0},
        "count": {"pairs": 1, "accuracy": 0.0},
    }
    assert result["overall"] == pytest.approx(4.5 / 7)
    assert result["image_all"] == pytest.approx(1 / 3)
    assert result["pairs"] == 7 and result["images"] == 3


def test_accuracy_rejects_no_images_and_images_without_negatives():
    with pytest.raises(ValueError, match="no images"):
        probe_accuracy([])
    with pytest.raises(ValueError, match="image 1 has no negatives"):
        probe_accuracy([(0.5, [("colour", 0.1)]), (0.5, [])])


# ----------------------------------------------------------------------------------------------
# The probe file
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry, message", [
    ({"image": "images/0.png", "caption": "a red square"}, r"entry 1 is missing key\(s\) \['negatives'\]"),
    ({"image": "images/0.png", "caption": "a red square", "negatives": []}, "entry 1: 'negatives' must be"),
    ({"image": "images/0.png", "caption": "a red square", "negatives": [{"caption": "a blue square"}]},
     "entry 1: negative 0 must be an object with keys 'kind' and 'caption'"),
    ({"image": "images/0.png", "caption": "a red square",
      "negatives": [{"kind": "colour", "caption": "A red square."}]}, "entry 1: negative 0 .* is the true"),
    ({"image": "images/9.png", "caption": "a red square",
      "negatives": [{"kind": "c", "caption": "a square"}]}, "entry 1: image not found"),
])
def test_bad_probe_file_names_the_file_and_entry(probe_root, tmp_path, entry, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([PROBE[0], entry]))
    with pytest.raises(ProbeFileError, match=message) as err:
        load_probe_file(str(path), image_root=str(probe_root))
    assert str(err.value).startswith(f"{path}: ")


def test_default_probe_file_needs_a_synthetic_root():
    config = tiny_config("pretrain")
    assert config.synthetic_root == "data/synthetic"
    assert default_probe_file(config) == "data/synthetic/probe_test.json"
    with pytest.raises(ValueError, match="--probe_file is required: my.yaml names no synthetic_root"):
        default_probe_file(dataclasses.replace(config, synthetic_root=None), "my.yaml")


# ----------------------------------------------------------------------------------------------
# score_probe through a real tiny ALBEF_Base
# ----------------------------------------------------------------------------------------------


def test_batched_scores_match_one_pair_at_a_time(probe_root, tokenizer):
    """Chunking, padding and the repeated image tokens do not change any pair's score."""
    model = tiny_model(probe_root, tokenizer)
    batched = run_score(model, probe_root, tokenizer)
    chunked = run_score(model, probe_root, tokenizer, batch_size=4)
    assert flat(chunked) == pytest.approx(flat(batched), abs=1e-5)
    # Reference: each (image, caption) pair alone (no padding, no repeat) through the model's own parts.
    from dataset.transforms import test_transform

    def alone(image_path: str, caption: str) -> float:
        image = test_transform(32)(Image.open(probe_root / image_path).convert("RGB"))[None]
        text = tokenizer([caption], return_tensors="pt")
        fused = model.text_encoder(mode="fusion", attention_mask=text.attention_mask,
                                   hidden_states=model.encode_text(text.input_ids, text.attention_mask),
                                   encoder_hidden_states=model.encode_image(image))
        return model.itm_head(fused[:, 0]).softmax(-1)[0, 1].item()

    with torch.no_grad():
        reference = [(alone(e["image"], e["caption"]),
                      [(n["kind"], alone(e["image"], n["caption"])) for n in e["negatives"]]) for e in PROBE]
    assert flat(batched) == pytest.approx(flat(reference), abs=1e-5)
    assert [[k for k, _ in negatives] for _, negatives in batched] == [
        [n["kind"] for n in e["negatives"]] for e in PROBE]
    assert not any(m.training for m in model.modules())


class TrueCaptionTagger(nn.Module):
    """Wraps the real text encoder; tags the CLS state of the true captions' text and carries the tag
    through the real fusion pass, so that an ITM head reading the tag prefers exactly those captions."""

    def __init__(self, encoder: nn.Module, tokenizer, true_captions: set[str]):
        super().__init__()
        self.encoder, self.tokenizer, self.true_captions = encoder, tokenizer, true_captions

    def forward(self, input_ids=None, attention_mask=None, mode="multimodal", hidden_states=None, **kwargs):
        out = self.encoder(input_ids, attention_mask, mode=mode, hidden_states=hidden_states, **kwargs)
        if mode == "text":
            texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
            tag = torch.tensor([4.0 if t in self.true_captions else -4.0 for t in texts])
        else:
            tag = hidden_states[:, 0, 0]
        if isinstance(out, tuple):  # cls_rows (itm_cls_only): the rows' [CLS] states, then the others'
            head, rest = out[0].clone(), out[1].clone()
            head[:, 0] = tag[:head.shape[0]]
            rest[:, 0, 0] = tag[head.shape[0]:]
            return head, rest
        out = out.clone()
        out[:, 0, 0] = tag
        return out


def test_model_that_prefers_the_true_caption_scores_one(probe_root, tokenizer):
    model = tiny_model(probe_root, tokenizer)
    model.text_encoder = TrueCaptionTagger(model.text_encoder, tokenizer, {e["caption"] for e in PROBE})
    with torch.no_grad():
        model.itm_head.weight.zero_()
        model.itm_head.bias.zero_()
        model.itm_head.weight[1, 0] = 1.0  # match logit = the tag
    result = probe_accuracy(run_score(model, probe_root, tokenizer, batch_size=5))
    assert result["overall"] == 1.0 and result["image_all"] == 1.0
    assert {k: v["pairs"] for k, v in result["per_kind"].items()} == KIND_PAIRS


def test_constant_itm_head_is_exactly_at_chance(probe_root, tokenizer):
    model = tiny_model(probe_root, tokenizer)
    with torch.no_grad():
        model.itm_head.weight.zero_()
        model.itm_head.bias.zero_()
    scores = run_score(model, probe_root, tokenizer)
    assert set(flat(scores)) == {0.5}
    result = probe_accuracy(scores)
    assert result["overall"] == 0.5 and result["image_all"] == 0.0
    assert all(v["accuracy"] == 0.5 for v in result["per_kind"].values())


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(probe_root, tokenizer) -> str:
    path = probe_root / "checkpoint.pth"
    torch.save({"model": tiny_model(probe_root, tokenizer, seed=1).state_dict()}, path)
    return str(path)


def test_cli_prints_table_and_json(probe_root, checkpoint, capsys, tmp_path):
    out = tmp_path / "sub" / "probe.json"  # --output_dir is created when missing
    record = main(["--config", str(probe_root / "config.yaml"), "--checkpoint", checkpoint,
                   "--probe_file", str(probe_root / "probe.json"), "--device", "cpu", "--batch_size", "6",
                   "--output_dir", str(out.parent), "--set", "max_words=20"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"loaded {checkpoint}: missing: none; unexpected: none")
    assert lines[1].split() == ["kind", "pairs", "accuracy"]
    assert [line.split()[:2] for line in lines[2:7]] == [[k, str(n)] for k, n in KIND_PAIRS.items()]
    assert lines[7].split()[:2] == ["overall", "10"] and lines[8].split()[:2] == ["image_all", "3"]
    printed = json.loads(lines[-1])
    assert printed == record == json.loads(out.read_text())
    assert {k: v["pairs"] for k, v in printed["per_kind"].items()} == KIND_PAIRS
    assert printed["pairs"] == 10 and printed["checkpoint"] == checkpoint
    # overall is the mean over all pairs: the per-kind accuracies weighted by their pairs
    weighted = sum(v["accuracy"] * v["pairs"] for v in printed["per_kind"].values()) / printed["pairs"]
    assert printed["overall"] == pytest.approx(weighted)
    assert printed["images"] == 3 and printed["image_all"] in (0.0, 1 / 3, 2 / 3, 1.0)

    limited = main(["--config", str(probe_root / "config.yaml"), "--checkpoint", checkpoint,
                    "--probe_file", str(probe_root / "probe.json"), "--device", "cpu", "--limit", "2"])
    assert limited["pairs"] == 7 and limited["images"] == 2
    assert {k: v["pairs"] for k, v in limited["per_kind"].items()} == {
        "colour": 2, "shape": 2, "size": 1, "count": 1, "relation": 1}


def test_cli_bad_probe_file_is_a_one_line_error(probe_root, checkpoint, capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([PROBE[0], {"image": "images/1.png", "caption": "a green square"}]))
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, ["--config", str(probe_root / "config.yaml"), "--checkpoint", checkpoint,
                        "--probe_file", str(bad)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # fails before a model is built
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: {bad}: entry 1 is missing key(s) ['negatives']")


def test_cli_module_entry_point_errors_in_one_line(probe_root, checkpoint, capsys):
    """`python -m tools.probe`: without synthetic_root the probe file must be named; unknown --set keys."""
    config = str(probe_root / "config.yaml")
    base = [sys.executable, "-m", "tools.probe", "--config", config, "--checkpoint", checkpoint]
    proc = subprocess.run(base, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: --probe_file is required: {config} names no synthetic_root " \
                          "(whose probe_test.json would be the default)\n"
    with pytest.raises(SystemExit) as exit_info:
        run_main(main, [*base[3:], "--probe_file", str(probe_root / "probe.json"), "--set", "image_rez=48"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'image_rez' (did you mean 'image_res'?)")
    assert err.count("\n") == 1
