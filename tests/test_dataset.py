"""dataset/: synthetic generator, json loading, transforms and the per-task datasets (CPU, 32 px)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image
from torch.utils.data import DataLoader, default_collate
from torchvision import transforms as T

from dataset import (
    Batch,
    ImageBatch,
    ImageCollate,
    ImagePairBatch,
    ImageReadError,
    ImageTextBatch,
    ImageTextCollate,
    NLVRCollate,
    NLVRDataset,
    PretrainCorpus,
    PretrainDataset,
    QABatch,
    QACollate,
    QuestionBatch,
    QuestionCollate,
    RetrievalEvalDataset,
    RetrievalTrainDataset,
    SkipBadCollate,
    SkipBadSamples,
    VQADataset,
    create_dataset,
    ensure_synthetic,
    load_json_list,
    pre_caption,
    pre_question,
    read_image,
    synthetic,
    synthetic_tasks,
    synthetic_world,
    train_transform,
)
from dataset import transforms as dtf
from dataset.transforms import ALBEF_RANDAUG_OPS, AlbefRandAugment
from grit_io import InputFileError
from models.tokenization import tokenizer_from_vocab
from tools import make_synthetic
from training.config import PretrainConfig, RetrievalConfig

N = 24
RES = 32
JSON_FILES = ["answer_list.json", "nlvr_dev.json", "nlvr_test.json", "nlvr_train.json", "pretrain.json",
              "pretrain_extra.json", "probe_test.json", "retrieval_test.json", "retrieval_train.json",
              "retrieval_val.json", "scenes.json", "vqa_test.json", "vqa_train.json"]


def _hashes(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _load(root: str, name: str):
    with open(os.path.join(root, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("syn") / "synthetic")
    synthetic.generate(root, n=N, seed=0)
    return root


@pytest.fixture(scope="module")
def train_tf():
    return train_transform(RES, hflip=False)


@pytest.fixture(scope="module")
def test_tf():
    return dtf.test_transform(RES)


@pytest.fixture(scope="module")
def tokenizer(data_root):
    return tokenizer_from_vocab(os.path.join(data_root, "vocab.txt"))


# ----------------------------------------------------------------------------- generator
def test_generator_is_deterministic_and_seed_dependent(tmp_path, data_root):
    make_synthetic.main(["--output_dir", str(tmp_path / "a"), "--n", str(N), "--seed", "0"])
    synthetic.generate(str(tmp_path / "b"), n=N, seed=1)
    same, other = _hashes(str(tmp_path / "a")), _hashes(str(tmp_path / "b"))
    assert same == _hashes(data_root)
    assert set(same) == set(other)
    assert same["pretrain.json"] != other["pretrain.json"]
    assert same["images/train/00000.png"] != other["images/train/00000.png"]


def _check_pretrain_entries(entries: list[dict], n_images: int, prefix: str) -> dict[str, list[str]]:
    """``n_images`` distinct images, some listed under two entries whose captions are disjoint; 3-5 captions
    per image in all. Returns each image's captions."""
    lists: dict[str, list[list[str]]] = {}
    for e in entries:
        assert e["caption"] and all(isinstance(c, str) for c in e["caption"]), e
        lists.setdefault(e["image"], []).append(e["caption"])
    assert len(lists) == n_images < len(entries)
    assert all(p.startswith(prefix) for p in lists)
    union = {p: [c for caps in ls for c in caps] for p, ls in lists.items()}
    for p, ls in lists.items():
        assert len(ls) <= 2 and 3 <= len(union[p]) == len(set(union[p])) <= 5, (p, ls)
    return union


def test_generator_files_and_split_sizes(data_root):
    sizes = synthetic.split_sizes(N)
    assert (sizes["val_images"], sizes["test_images"], sizes["pretrain_extra_images"]) == (12, 40, 72)
    for name in JSON_FILES + ["vocab.txt", synthetic.MARKER]:
        assert os.path.isfile(os.path.join(data_root, name)), name
    meta = _load(data_root, synthetic.MARKER)
    assert (meta["n"], meta["seed"], meta["format_version"]) == (N, 0, synthetic.FORMAT_VERSION)
    assert sorted(meta["files"]) == sorted(JSON_FILES + ["vocab.txt"])
    assert not [p for p in os.listdir(os.path.dirname(data_root)) if ".tmp-" in p]

    pretrain = _load(data_root, "pretrain.json")
    captions = _check_pretrain_entries(pretrain, N, "images/train/")
    with Image.open(os.path.join(data_root, pretrain[0]["image"])) as im:
        assert im.size == (48, 48) and im.mode == "RGB"
    extra = _load(data_root, "pretrain_extra.json")
    _check_pretrain_entries(extra, sizes["pretrain_extra_images"], "images/pretrain/")
    assert all(os.path.isfile(os.path.join(data_root, e["image"])) for e in extra)
    # retrieval_train.json: one entry per caption of each pre-training (train) image, one id per image
    ret_train = _load(data_root, "retrieval_train.json")
    ids: dict[str, set[int]] = {}
    by_image: dict[str, list[str]] = {}
    for e in ret_train:
        assert isinstance(e["image_id"], int) and isinstance(e["caption"], str)
        ids.setdefault(e["image"], set()).add(e["image_id"])
        by_image.setdefault(e["image"], []).append(e["caption"])
    assert all(len(v) == 1 for v in ids.values()) and len({i for v in ids.values() for i in v}) == N
    assert {p: sorted(c) for p, c in by_image.items()} == {p: sorted(c) for p, c in captions.items()}
    for split in ("val", "test"):
        ev = _load(data_root, f"retrieval_{split}.json")
        assert len(ev) == len({e["image"] for e in ev}) == sizes[f"{split}_images"]
        assert all(3 <= len(e["caption"]) <= 5 and e["image"].startswith(f"images/{split}/") for e in ev)
        texts = [c for e in ev for c in e["caption"]]
        assert len(texts) == len(set(texts)), "an eval caption must identify one image"
    probe = _load(data_root, "probe_test.json")
    assert [e["image"] for e in probe] == [e["image"] for e in _load(data_root, "retrieval_test.json")]
    scenes = _load(data_root, "scenes.json")
    assert len(scenes) == N + sizes["val_images"] + sizes["test_images"] + sizes["pretrain_extra_images"]
    assert all(os.path.isfile(os.path.join(data_root, p)) for p in scenes)
    for split in ("train", "dev", "test"):
        nlvr = _load(data_root, f"nlvr_{split}.json")
        assert len(nlvr) == sizes[f"nlvr_{split}"]
        labels = Counter(e["label"] for e in nlvr)
        assert abs(labels[True] - labels[False]) <= 1
        image_split = {"dev": "val"}.get(split, split)
        assert all(len(e["images"]) == 2 and e["images"][0] != e["images"][1]
                   and all(p.startswith(f"images/{image_split}/") for p in e["images"]) for e in nlvr)
    answers = set(_load(data_root, "answer_list.json"))
    qids = []
    for split in ("train", "test"):
        vqa = _load(data_root, f"vqa_{split}.json")
        assert len(vqa) == sizes[f"vqa_{split}"]
        for e in vqa:
            assert len(e["answer"]) == 10 and e["dataset"] == "vqa"
            assert Counter(e["answer"]).most_common(1)[0][1] >= 7
            assert set(e["answer"]) <= answers
            qids.append(e["question_id"])
    assert len(qids) == len(set(qids))


def test_generation_of_default_size_is_fast(tmp_path):
    root = str(tmp_path / "big")
    start = time.process_time()  # this process's CPU seconds, whatever else the machine runs
    synthetic.generate(root, n=600, seed=0)
    assert time.process_time() - start < 60  # about 6 s here: it runs once before the demo
    pretrain = _load(root, "pretrain.json")
    assert len({e["image"] for e in pretrain}) == 600
    split = len(pretrain) / 600 - 1
    assert 0.15 < split < 0.25, split  # about a fifth of the images have a second entry

    # The corpus properties at full size (the module fixture has only 24 training images): GRIT finds
    # one-thing-off neighbours in its search space, yet no scene repeats.
    stats = _load(root, synthetic.MARKER)["pretrain_statistics"]
    assert stats["images"] == 600 + 1800 and stats["entries"] > stats["images"]
    assert stats["neighbour_rate"]["768"] >= 1.0, stats
    assert stats["neighbour_rate"]["64"] < stats["neighbour_rate"]["256"] < stats["neighbour_rate"]["1024"]
    assert stats["duplicate_scene_share"] < 0.02, stats
    corpus = _Corpus(root)
    corpus.check_captions_are_true_of_their_images_only()
    corpus.check_probe_negatives()
    corpus.check_pretraining_scenes()
    corpus.check_eval_splits()
    _assert_leak_free(root)


TRAINING_FILES = ("pretrain.json", "pretrain_extra.json", "retrieval_train.json", "nlvr_train.json",
                  "vqa_train.json")
EVAL_FILES = ("retrieval_val.json", "retrieval_test.json", "probe_test.json", "nlvr_dev.json",
              "nlvr_test.json", "vqa_test.json")


def _split_images(root: str, name: str) -> set[str]:
    entries = _load(root, name)
    return {p for e in entries for p in (e["images"] if "images" in e else [e["image"]])}


def _assert_leak_free(root: str) -> None:
    """Format 6: no image of an evaluation file shows a scene of a training file; val and test share no
    scene; no evaluation caption occurs in a training file."""
    scenes = _load(root, "scenes.json")
    train_scenes = {scenes[p] for name in TRAINING_FILES for p in _split_images(root, name)}
    for name in EVAL_FILES:
        images = _split_images(root, name)
        assert images and not {scenes[p] for p in images} & train_scenes, name
    val = {scenes[p] for p in _split_images(root, "retrieval_val.json")}
    assert not val & {scenes[p] for p in _split_images(root, "retrieval_test.json")}
    train_captions = {c for name in ("pretrain.json", "pretrain_extra.json") for e in _load(root, name)
                      for c in e["caption"]}
    for name in ("retrieval_val.json", "retrieval_test.json"):
        assert not {c for e in _load(root, name) for c in e["caption"]} & train_captions, name


def test_evaluation_splits_are_leak_free(data_root):
    _assert_leak_free(data_root)


def test_vocab_tokenises_every_text_without_unk(data_root):
    tok = tokenizer_from_vocab(os.path.join(data_root, "vocab.txt"))
    assert tok.pad_token_id == 0 and tok.unk_token_id == 1 and tok.mask_token_id == 4
    texts = [c for name in ("pretrain.json", "pretrain_extra.json") for e in _load(data_root, name)
             for c in e["caption"]]
    for split in ("val", "test"):
        texts += [c for e in _load(data_root, f"retrieval_{split}.json") for c in e["caption"]]
    for split in ("train", "dev", "test"):
        texts += [e["sentence"] for e in _load(data_root, f"nlvr_{split}.json")]
    for split in ("train", "test"):
        vqa = _load(data_root, f"vqa_{split}.json")
        texts += [e["question"] for e in vqa] + [a for e in vqa for a in e["answer"]]
    texts += [pre_caption(t) for t in texts]
    ids = tok(texts).input_ids
    assert all(tok.unk_token_id not in row for row in ids)


def test_ensure_synthetic_creates_once(tmp_path, monkeypatch):
    root = str(tmp_path / "data" / "synthetic")
    calls = []
    build = synthetic._build
    monkeypatch.setattr(synthetic, "_build", lambda *a, **k: calls.append(a) or build(*a, **k))
    assert ensure_synthetic(root, n=6, seed=0) == root
    before = _hashes(root)
    assert ensure_synthetic(root, n=6, seed=0) == root
    assert len(calls) == 1 and _hashes(root) == before
    with pytest.warns(UserWarning, match="n=6"):
        ensure_synthetic(root, n=7, seed=0)
    assert len(calls) == 1


def test_ensure_synthetic_concurrent_callers(tmp_path):
    root = str(tmp_path / "synthetic")
    errors = []

    def run():
        try:
            ensure_synthetic(root, n=6, seed=3)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert os.listdir(tmp_path) == ["synthetic"], "losers must remove their temp dirs"
    assert _load(root, synthetic.MARKER)["seed"] == 3


def test_ensure_synthetic_refuses_foreign_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="x"):
        ensure_synthetic(str(tmp_path / "x"), n=6)


# ----------------------------------------------------------------------------- utils
def test_pre_caption_and_question():
    assert pre_caption("  A Red-circle,  left of\tTHE square!\n", 30) == "a red circle left of the square"
    assert pre_caption("one two three four", 2) == "one two"
    assert pre_caption("it's a/the (dog)", 30) == "its a the dog"
    assert pre_question("What colour is the circle?", 30) == "what colour is the circle"
    with pytest.raises(ValueError, match=r"'\?!\.'"):
        pre_caption("?!.", 30)
    with pytest.raises(ValueError, match="question"):
        pre_question("  ", 30)


def test_load_json_list_errors_name_the_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"image": "a.png", "caption": "x"}]))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"image": "a.png",]')
    obj = tmp_path / "obj.json"
    obj.write_text('{"image": "a.png"}')
    nokey = tmp_path / "nokey.json"
    nokey.write_text(json.dumps([{"image": "a.png", "caption": "x"}, {"image": "b.png"}]))

    assert len(load_json_list([str(good), str(good)], required=("image", "caption"))) == 2
    # Every fault of a file is an InputFileError (a ValueError) naming the file: the scripts print it as
    # one error line.
    with pytest.raises(InputFileError, match="json file not found: .*missing.json"):
        load_json_list([str(good), str(tmp_path / "missing.json")])
    with pytest.raises(InputFileError, match="bad.json.*line 1"):
        load_json_list(str(bad))
    with pytest.raises(InputFileError, match="obj.json.*list"):
        load_json_list(str(obj))
    with pytest.raises(InputFileError, match=r"nokey.json: entry 1 .*caption"):
        load_json_list(str(nokey), required=("image", "caption"))
    with pytest.raises(InputFileError, match="nokey.json.*caption"):
        PretrainDataset(str(nokey), dtf.test_transform(RES))
    with pytest.raises(InputFileError, match="good.json.*image_id"):
        RetrievalTrainDataset(str(good), dtf.test_transform(RES))
    assert issubclass(InputFileError, ValueError)


@pytest.mark.parametrize("entries, match", [
    ([{"image": "a.png", "caption": "x"}, {"image": "b.png", "caption": 7}], r"entry 1: 'caption' must be"),
    ([{"image": "a.png", "caption": ["a cat", None]}], r"entry 0: 'caption' must be"),
    ([{"image": "a.png", "caption": []}], r"entry 0: 'caption' must be"),
    ([{"image": "a.png", "caption": "x"}, "a.png"], r"entry 1 is a str"),
    ({"image": "a.png", "caption": "x"}, "expected a JSON list"),
])
def test_malformed_caption_lists_raise_input_file_error(tmp_path, entries, match):
    path = tmp_path / "captions.json"
    path.write_text(json.dumps(entries))
    for make in (PretrainDataset, RetrievalEvalDataset):
        with pytest.raises(InputFileError, match=f"captions.json.*{match}"):
            make(str(path), dtf.test_transform(RES))


def test_bad_samples_are_no_input_file_errors(tmp_path):
    # A missing image or a caption empty after cleaning is the entry's fault, found when it is read:
    # the json list loads, and the entry is skipped at train time (dataset.bad_samples).
    Image.new("RGB", (8, 8)).save(tmp_path / "ok.png")
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"image": "nope.png", "caption": "a cat"},
                                {"image": "ok.png", "caption": "?!"}]))
    ds = SkipBadSamples(PretrainDataset(str(path), dtf.test_transform(RES), image_root=str(tmp_path)))
    (_, missing), (_, empty) = ds[0], ds[1]
    assert missing.startswith("entry 0: cannot read image") and "nope.png" in missing
    assert empty.startswith("entry 1: caption '?!' is empty")
    ev = RetrievalEvalDataset(str(path), dtf.test_transform(RES), image_root=str(tmp_path))
    assert ev.text == ["a cat"] and ev.bad_texts == ["entry 1: caption '?!' is empty after cleaning"]


def test_read_image_errors(tmp_path):
    missing = str(tmp_path / "nope.png")
    with pytest.raises(ImageReadError, match="nope.png"):
        read_image(missing)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ImageReadError, match="broken.png") as info:
        read_image(str(broken))
    assert isinstance(info.value, OSError) and info.value.path == str(broken)
    Image.new("L", (5, 4)).save(tmp_path / "grey.png")
    img = read_image(str(tmp_path / "grey.png"))
    assert img.mode == "RGB" and img.size == (5, 4)

    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps([{"image": "nope.png", "caption": "a cat"}]))
    ds = PretrainDataset(str(ann), dtf.test_transform(RES), image_root=str(tmp_path))
    with pytest.raises(ImageReadError, match="nope.png"):
        ds[0]


# ----------------------------------------------------------------------------- transforms
def test_randaugment_op_set_and_transforms():
    ops = AlbefRandAugment()._augmentation_space(11, (RES, RES))
    assert list(ops) == list(ALBEF_RANDAUG_OPS)
    assert set(ops) == {"Identity", "AutoContrast", "Equalize", "Brightness", "Sharpness", "ShearX", "ShearY",
                        "TranslateX", "TranslateY", "Rotate"}
    assert ops["Rotate"][0][7].item() == pytest.approx(21.0)  # ALBEF: level 7 of 10 -> 0.7 * 30 degrees

    tf = train_transform(RES)
    kinds = [type(t) for t in tf.transforms]
    assert T.RandomHorizontalFlip in kinds and AlbefRandAugment in kinds
    assert T.RandomHorizontalFlip not in [type(t) for t in train_transform(RES, hflip=False).transforms]
    crop = tf.transforms[0]
    assert crop.scale == (0.2, 1.0) and crop.interpolation == T.InterpolationMode.BICUBIC
    assert train_transform(RES, scale=(0.5, 1.0)).transforms[0].scale == (0.5, 1.0)

    torch.manual_seed(0)
    img = Image.new("RGB", (64, 48), (255, 0, 0))
    for t in (tf, dtf.test_transform(RES)):
        x = t(img)
        assert x.shape == (3, RES, RES) and x.dtype == torch.float32
    red = dtf.test_transform(RES)(img)
    assert red[0].mean().item() == pytest.approx((1 - 0.48145466) / 0.26862954, abs=1e-4)


# ----------------------------------------------------------------------------- datasets
def test_pretrain_dataset(data_root, train_tf):
    ds = PretrainDataset(os.path.join(data_root, "pretrain.json"), train_tf, image_root=data_root)
    assert len(ds) == len(_load(data_root, "pretrain.json")) > N  # some images have two entries
    random.seed(0)
    i = next(i for i, e in enumerate(ds.ann) if len(e["caption"]) >= 3)
    image, caption, index = ds[i]
    assert image.shape == (3, RES, RES) and index == i
    assert caption in [pre_caption(c) for c in ds.ann[i]["caption"]]
    seen = {ds[i][1] for _ in range(30)}
    assert len(seen) > 1, "list captions are sampled per visit"
    images, captions, idx = next(iter(DataLoader(ds, batch_size=4)))
    assert images.shape == (4, 3, RES, RES) and len(captions) == 4 and idx.tolist() == [0, 1, 2, 3]


def test_pretrain_dataset_string_caption_and_max_words(tmp_path, data_root, test_tf):
    ann = tmp_path / "p.json"
    path = os.path.join(data_root, "images/train/00000.png")  # absolute path, empty root
    ann.write_text(json.dumps([{"image": path, "caption": "One Two, three four"}]))
    _, caption, _ = PretrainDataset(str(ann), test_tf, max_words=3)[0]
    assert caption == "one two three"


def test_pretrain_dataset_image_keys(tmp_path, test_tf):
    # Keys come from the paths alone (no image is read): one per resolved, normalised path.
    root = str(tmp_path)
    entries = [
        {"image": "images/a.png", "caption": "a cat"},
        {"image": "images/b.png", "caption": ["a dog", "the dog"]},
        {"image": "images/./a.png", "caption": "a sleeping cat"},  # ALBEF: one entry per caption
        {"image": os.path.join(root, "images", "a.png"), "caption": "a cat"},  # absolute, same file
        {"image": "images/c.png", "caption": "a cat"},
    ]
    ann = tmp_path / "p.json"
    ann.write_text(json.dumps(entries))
    ds = PretrainDataset(str(ann), test_tf, image_root=root)
    assert ds.image_keys == [0, 1, 0, 0, 2]
    assert PretrainDataset([str(ann), str(ann)], test_tf, image_root=root).image_keys == [0, 1, 0, 0, 2] * 2


def test_retrieval_datasets(data_root, train_tf, test_tf):
    train = RetrievalTrainDataset(os.path.join(data_root, "retrieval_train.json"), train_tf, data_root)
    ids = [train[i][2] for i in range(len(train))]
    assert sorted(set(ids)) == list(range(N)) and ids == sorted(ids)
    image, caption, img_id = train[0]
    assert image.shape == (3, RES, RES) and isinstance(caption, str) and isinstance(img_id, int)

    ev = RetrievalEvalDataset(os.path.join(data_root, "retrieval_test.json"), test_tf, data_root)
    raw = _load(data_root, "retrieval_test.json")
    assert len(ev) == len(raw) == len(ev.image) == len(ev.img2txt)
    assert len(ev.text) == len(ev.txt2img) == sum(len(e["caption"]) for e in raw)
    for i, txts in ev.img2txt.items():
        assert all(ev.txt2img[t] == i for t in txts)
        assert [ev.text[t] for t in txts] == [pre_caption(c) for c in raw[i]["caption"]]
    image, index = ev[2]
    assert image.shape == (3, RES, RES) and index == 2


def test_nlvr_dataset(tmp_path, data_root, test_tf):
    ds = NLVRDataset(os.path.join(data_root, "nlvr_dev.json"), test_tf, data_root)
    image0, image1, sentence, label = ds[0]
    assert image0.shape == image1.shape == (3, RES, RES)
    assert isinstance(sentence, str) and label in (0, 1) and isinstance(label, int)
    assert sum(ds[i][3] for i in range(len(ds))) in (len(ds) // 2, (len(ds) + 1) // 2)

    entry = dict(_load(data_root, "nlvr_dev.json")[0], label="False")
    ann = tmp_path / "n.json"
    ann.write_text(json.dumps([entry]))
    assert NLVRDataset(str(ann), test_tf, data_root)[0][3] == 0
    ann.write_text(json.dumps([dict(entry, label="maybe")]))
    with pytest.raises(InputFileError, match="n.json: entry 0.*label"):
        NLVRDataset(str(ann), test_tf, data_root)
    ann.write_text(json.dumps([dict(entry, images=entry["images"][:1])]))
    with pytest.raises(InputFileError, match="n.json.*two"):
        NLVRDataset(str(ann), test_tf, data_root)


def test_vqa_datasets(tmp_path, data_root, train_tf, test_tf, tokenizer):
    train = VQADataset(os.path.join(data_root, "vqa_train.json"), train_tf, data_root, split="train")
    image, question, answers, weights = train[0]
    raw = train.ann[0]
    assert image.shape == (3, RES, RES) and question == pre_question(raw["question"])
    counts = Counter(raw["answer"])
    assert dict(zip(answers, weights)) == {a: c / 10 for a, c in counts.items()}
    assert sum(weights) == pytest.approx(1.0)

    items = [train[i] for i in range(3)]
    batch = QACollate(tokenizer, 40)(items)
    assert batch.image.shape == (3, 3, RES, RES) and batch.question.input_ids.shape[0] == 3
    n = [len(item[2]) for item in items]
    assert batch.counts.tolist() == n and batch.answer.input_ids.shape[0] == sum(n)
    assert batch.weights.shape == (sum(n),) and batch.weights.dtype == torch.float32
    assert batch.weights.tolist() == pytest.approx([w for item in items for w in item[3]])

    test = VQADataset(os.path.join(data_root, "vqa_test.json"), test_tf, data_root, split="test",
                      answer_list=os.path.join(data_root, "answer_list.json"))
    image, question, qid = test[0]
    assert qid == test.ann[0]["question_id"] and "yes" in test.answer_list

    ann = tmp_path / "vg.json"
    ann.write_text(json.dumps([{"image": raw["image"], "question": "what is it?", "answer": "circle",
                                "dataset": "vg"}]))
    _, _, answers, weights = VQADataset(str(ann), test_tf, data_root)[0]
    assert answers == ["circle"] and weights == [0.5]
    with pytest.raises(InputFileError, match="vg.json.*question_id"):
        VQADataset(str(ann), test_tf, data_root, split="test")
    with pytest.raises(InputFileError, match="answer list not found: .*nope.json"):
        VQADataset(str(ann), test_tf, data_root, split="train", answer_list=str(tmp_path / "nope.json"))
    for content, match in (("[", "answer list .*answers.json: invalid JSON at line 1"),
                           ('{"yes": 1}', "answers.json: expected a non-empty JSON list"),
                           ('["yes", 2]', "answers.json: expected a non-empty JSON list")):
        (tmp_path / "answers.json").write_text(content)
        with pytest.raises(InputFileError, match=match):
            VQADataset(str(ann), test_tf, data_root, answer_list=str(tmp_path / "answers.json"))


def _task_config(task: str, data_root: str, **values):
    """The tiny config of `task` on the module's synthetic set (RES px, no flip)."""
    return tiny_config(task, image_root=data_root, image_res=RES, hflip=False, **values)


def test_create_dataset_from_config(data_root):
    config = _task_config("retrieval", data_root, crop_scale=[0.5, 1.0],
                          train_file=[os.path.join(data_root, "retrieval_train.json")],
                          val_file=os.path.join(data_root, "retrieval_val.json"),
                          test_file=os.path.join(data_root, "retrieval_test.json"))
    train, val, test = create_dataset("retrieval", config)
    assert isinstance(train, RetrievalTrainDataset) and isinstance(val, RetrievalEvalDataset)
    assert train.transform.transforms[0].scale == (0.5, 1.0)
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in train.transform.transforms)
    assert isinstance(val.transform.transforms[0], T.Resize)  # evaluation: the test transform
    sizes = synthetic.split_sizes(N)
    assert (len(val), len(test)) == (sizes["val_images"], sizes["test_images"])
    # The crop scale is the config's; its per-task default (fine-tuning 0.5-1, pre-training 0.2-1) lives in
    # training.config alone.
    defaults = {c: {f.name: f for f in dataclasses.fields(c)}["crop_scale"].default_factory()
                for c in (RetrievalConfig, PretrainConfig)}
    assert defaults == {RetrievalConfig: [0.5, 1.0], PretrainConfig: [0.2, 1.0]}
    train, _, _ = create_dataset("retrieval", dataclasses.replace(config, crop_scale=[0.3, 0.9]))
    assert train.transform.transforms[0].scale == (0.3, 0.9)
    # image_root null: the json paths as they are (here relative to a folder that does not hold them)
    train, _, _ = create_dataset("retrieval", dataclasses.replace(config, image_root=None))
    with pytest.raises(ImageReadError):
        train[0]
    with pytest.raises(ValueError, match="answer_list"):  # VQA needs an answer list: the config says so
        _task_config("vqa", data_root, answer_list=None)
    with pytest.raises(ValueError, match="unknown task"):
        create_dataset("captioning", config)


def test_create_dataset_pretrain_and_nlvr(data_root):
    pretrain = create_dataset("pretrain", _task_config("pretrain", data_root, crop_scale=[0.2, 1.0],
                                                       train_file=[os.path.join(data_root, "pretrain.json")]))
    # one json list, no repeat: the corpus is that list under its own indices
    assert isinstance(pretrain, PretrainCorpus) and [type(d) for d in pretrain.datasets] == [PretrainDataset]
    assert pretrain.datasets[0].transform.transforms[0].scale == (0.2, 1.0)
    assert len(pretrain) == len(_load(data_root, "pretrain.json"))
    assert pretrain[3][1:] == pretrain.datasets[0][3][1:]

    files = {k: os.path.join(data_root, f"nlvr_{s}.json")
             for k, s in (("train_file", "train"), ("val_file", "dev"), ("test_file", "test"))}
    config = _task_config("nlvr", data_root, **files)
    sets = create_dataset("nlvr", config)
    assert [type(s) for s in sets] == [NLVRDataset] * 3
    assert [len(s) for s in sets] == [len(_load(data_root, f"nlvr_{s}.json"))
                                      for s in ("train", "dev", "test")]
    # Stage 1 (text assignment) trains on pre-training captions: an image-caption set, no evaluation split.
    stage1, val, test = create_dataset("nlvr", dataclasses.replace(
        config, text_assignment=True, train_file=[os.path.join(data_root, "pretrain.json")]))
    assert isinstance(stage1, PretrainDataset) and len(stage1) == len(pretrain) and val is test is None
    assert stage1.transform.transforms[0].scale == (1.0, 1.0)  # the NLVR config's crop, hflip off
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in stage1.transform.transforms)
    image, caption, index = stage1[0]
    assert image.shape == (3, RES, RES) and isinstance(caption, str) and index == 0


def test_create_dataset_vqa_splits(data_root):
    config = _task_config("vqa", data_root, train_file=[os.path.join(data_root, "vqa_train.json")],
                          test_file=[os.path.join(data_root, "vqa_test.json")],
                          answer_list=os.path.join(data_root, "answer_list.json"), val_file=None)
    train, val, test = create_dataset("vqa", config)
    assert val is None
    assert (train.split, test.split) == ("train", "test") and test.answer_list == _load(data_root,
                                                                                         "answer_list.json")
    # val_file set: its questions are answered as the test split's (the test transform, the answer list)
    _, val, _ = create_dataset("vqa", dataclasses.replace(config, val_file=os.path.join(data_root,
                                                                                        "vqa_test.json")))
    assert isinstance(val, VQADataset) and val.split == "test" and len(val) == len(test)
    assert val.answer_list == test.answer_list
    assert isinstance(val.transform.transforms[0], T.Resize)
    image, question, qid = val[0]
    assert image.shape == (3, RES, RES) and qid == val.ann[0]["question_id"]


# ----------------------------------------------------------------------------- named batches
def _tokens(tokenizer, texts, max_tokens: int = 40):
    """What every collate's texts were tokenized as before the batches were named."""
    return tokenizer(list(texts), padding="longest", truncation=True, max_length=max_tokens,
                     return_tensors="pt")


def _assert_same_tokens(got, want) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype == torch.long and torch.equal(got[key], want[key]), key


def _assert_all_good(batch: Batch, n: int) -> None:
    assert len(batch) == n and batch.reasons == []
    assert batch.valid.dtype == torch.bool and batch.valid.tolist() == [True] * n
    assert batch.valid_on("cpu") is None


def test_image_text_and_image_collates(data_root, train_tf, test_tf, tokenizer):
    ds = PretrainDataset(os.path.join(data_root, "pretrain.json"), test_tf, image_root=data_root)
    items = [ds[i] for i in range(3)]
    batch = ImageTextCollate(tokenizer, 40)(items)
    assert type(batch) is ImageTextBatch and isinstance(batch, Batch)
    assert batch.image.dtype == torch.float32
    assert torch.equal(batch.image, torch.stack([it[0] for it in items]))
    _assert_same_tokens(batch.text, _tokens(tokenizer, [it[1] for it in items]))
    assert batch.ids.dtype == torch.long and batch.ids.tolist() == [0, 1, 2]
    _assert_all_good(batch, 3)
    short = ImageTextCollate(tokenizer, 5)(items)
    assert short.text.input_ids.shape == (3, 5)  # cut at max_tokens, [SEP] kept
    assert (short.text.input_ids[:, -1] == tokenizer.sep_token_id).all()

    train = RetrievalTrainDataset(os.path.join(data_root, "retrieval_train.json"), train_tf, data_root)
    batch = ImageTextCollate(tokenizer, 40)([train[i] for i in (0, 5, 9)])
    assert batch.ids.tolist() == [train[i][2] for i in (0, 5, 9)]  # retrieval: the image ids

    ev = RetrievalEvalDataset(os.path.join(data_root, "retrieval_test.json"), test_tf, data_root)
    items = [ev[i] for i in range(4)]
    batch = ImageCollate()(items)
    image, index = default_collate(items)  # what the retrieval evaluation batched with before
    assert type(batch) is ImageBatch and torch.equal(batch.image, image)
    assert batch.index.dtype == index.dtype == torch.long and torch.equal(batch.index, index)
    _assert_all_good(batch, 4)


def test_nlvr_and_vqa_collates(data_root, test_tf, tokenizer):
    nlvr = NLVRDataset(os.path.join(data_root, "nlvr_dev.json"), test_tf, data_root)
    items = [nlvr[i] for i in range(4)]
    batch = NLVRCollate(tokenizer, 40)(items)
    assert type(batch) is ImagePairBatch
    assert torch.equal(batch.image0, torch.stack([it[0] for it in items]))
    assert torch.equal(batch.image1, torch.stack([it[1] for it in items]))
    _assert_same_tokens(batch.text, _tokens(tokenizer, [it[2] for it in items]))
    assert batch.label.dtype == torch.long and batch.label.tolist() == [it[3] for it in items]
    _assert_all_good(batch, 4)

    train = VQADataset(os.path.join(data_root, "vqa_train.json"), test_tf, data_root, split="train")
    items = [train[i] for i in range(3)]
    batch = QACollate(tokenizer, 40)(items)
    assert type(batch) is QABatch and torch.equal(batch.image, torch.stack([it[0] for it in items]))
    _assert_same_tokens(batch.question, _tokens(tokenizer, [it[1] for it in items]))
    answers = [a for it in items for a in it[2]]  # grouped by question, in order, never cut
    _assert_same_tokens(batch.answer, tokenizer(answers, padding="longest", return_tensors="pt"))
    assert (batch.answer.input_ids[:, 0] == tokenizer.cls_token_id).all()
    assert batch.weights.dtype == torch.float32 and batch.counts.dtype == torch.long
    assert batch.counts.tolist() == [len(it[2]) for it in items]
    _assert_all_good(batch, 3)

    test = VQADataset(os.path.join(data_root, "vqa_test.json"), test_tf, data_root, split="test")
    items = [test[i] for i in range(3)]
    batch = QuestionCollate(tokenizer, 40)(items)
    assert type(batch) is QuestionBatch and torch.equal(batch.image, torch.stack([it[0] for it in items]))
    _assert_same_tokens(batch.question, _tokens(tokenizer, [it[1] for it in items]))
    assert batch.question_ids == [it[2] for it in items]
    _assert_all_good(batch, 3)


def test_skip_bad_collate_sets_valid_and_reasons(tmp_path, data_root, test_tf, tokenizer):
    good = _load(data_root, "pretrain.json")[:3]
    entries = [good[0], dict(good[1], image="images/missing.png"), good[2], dict(good[0], caption="?!")]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(entries))
    ds = SkipBadSamples(PretrainDataset(str(path), test_tf, image_root=data_root))
    batch = SkipBadCollate(ImageTextCollate(tokenizer, 40))([ds[i] for i in range(4)])
    assert type(batch) is ImageTextBatch and len(batch) == 4
    assert batch.valid.dtype == torch.bool and batch.valid.tolist() == [True, False, True, False]
    assert [r.split(":")[0] for r in batch.reasons] == ["entry 1", "entry 3"]
    assert "missing.png" in batch.reasons[0] and "empty after cleaning" in batch.reasons[1]
    assert batch.ids.tolist() == [0, 1, 2, 3]  # a placeholder keeps its index: GRIT collects it as invalid
    assert torch.equal(batch.valid_on("cpu"), batch.valid)
    # All good: the plain collate's batch, valid all True.
    batch = SkipBadCollate(ImageTextCollate(tokenizer, 40))([ds[0], ds[2]])
    _assert_all_good(batch, 2)

    ev = SkipBadSamples(RetrievalEvalDataset(str(path), test_tf, image_root=data_root))
    batch = SkipBadCollate(ImageCollate())([ev[i] for i in range(4)])
    assert type(batch) is ImageBatch and batch.valid.tolist() == [True, False, True, True]
    assert batch.index.tolist() == [0, 1, 2, 3]

    vqa = _load(data_root, "vqa_train.json")[:2]
    path = tmp_path / "q.json"
    path.write_text(json.dumps([vqa[0], dict(vqa[1], image="images/missing.png")]))
    qa = SkipBadSamples(VQADataset(str(path), test_tf, data_root, split="train"))
    batch = SkipBadCollate(QACollate(tokenizer, 40))([qa[0], qa[1]])
    assert type(batch) is QABatch and batch.valid.tolist() == [True, False]
    assert batch.counts.tolist() == [len(qa[0][0][2]), 1]  # the placeholder: one answer

    with pytest.raises(TypeError, match="not a dataset.collate.Batch"):
        SkipBadCollate(default_collate)([ev[0], ev[2]])


def test_batch_pin_memory(data_root, test_tf, tokenizer, monkeypatch):
    test = VQADataset(os.path.join(data_root, "vqa_test.json"), test_tf, data_root, split="test")
    batch = QuestionCollate(tokenizer, 40)([test[i] for i in range(3)])
    pinned = batch.pin_memory()  # callable without CUDA too
    assert type(pinned) is QuestionBatch and pinned is not batch
    assert type(pinned.question) is type(batch.question)  # the BatchEncoding, with its .to()
    assert torch.equal(pinned.image, batch.image) and pinned.question_ids == batch.question_ids
    _assert_same_tokens(pinned.question, batch.question)
    assert torch.equal(pinned.valid, batch.valid) and pinned.reasons == batch.reasons

    # Every tensor goes through Tensor.pin_memory, the BatchEncoding's too, into a copy (seen here
    # without CUDA through a stand-in that clones).
    seen: list[torch.Tensor] = []
    with monkeypatch.context() as m:
        m.setattr(torch.accelerator, "is_available", lambda: True)
        m.setattr(torch.Tensor, "pin_memory", lambda t: seen.append(t) or t.clone())
        copied = batch.pin_memory()
    tensors = [batch.image, batch.valid, *batch.question.values()]
    assert len(seen) == len(tensors) and all(any(t is s for s in seen) for t in tensors)
    assert type(copied.question) is type(batch.question) and copied.question is not batch.question
    assert copied.image is not batch.image and copied.question["input_ids"] is not batch.question["input_ids"]
    assert batch.question["input_ids"] is tensors[2]  # the original batch is left as it was
    _assert_same_tokens(copied.question, batch.question)
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    assert pinned.image.is_pinned() and pinned.valid.is_pinned()
    assert all(t.is_pinned() for t in pinned.question.values())
    # The DataLoader pins a custom batch through its pin_memory().
    loader = DataLoader(test, batch_size=2, collate_fn=QuestionCollate(tokenizer, 40), pin_memory=True)
    batch = next(iter(loader))
    assert type(batch) is QuestionBatch and batch.image.is_pinned() and batch.question.input_ids.is_pinned()


def test_batches_cross_worker_processes(data_root, test_tf, tokenizer):
    # Named batches are built in the loader's worker processes and sent back to the main one.
    ds = SkipBadSamples(NLVRDataset(os.path.join(data_root, "nlvr_dev.json"), test_tf, data_root))
    collate = SkipBadCollate(NLVRCollate(tokenizer, 40))
    loader = DataLoader(ds, batch_size=3, num_workers=1, collate_fn=collate)
    batch = next(iter(loader))
    assert type(batch) is ImagePairBatch and batch.image0.shape == (3, 3, RES, RES)
    want = NLVRCollate(tokenizer, 40)([ds.dataset[i] for i in range(3)])
    assert torch.equal(batch.image0, want.image0) and torch.equal(batch.label, want.label)
    _assert_all_good(batch, 3)


def test_generator_cli_does_not_import_torch():
    code = "import sys, dataset.synthetic, dataset.utils; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_ensure_synthetic_regenerates_an_older_format(tmp_path):
    root = str(tmp_path / "old")
    synthetic.ensure_synthetic(root, n=12, seed=0)
    marker = os.path.join(root, synthetic.MARKER)
    meta = _load(root, synthetic.MARKER)
    meta["format_version"] = synthetic.FORMAT_VERSION - 1
    with open(marker, "w") as f:
        json.dump(meta, f)
    os.remove(os.path.join(root, "vocab.txt"))
    synthetic.ensure_synthetic(root, n=12, seed=0)
    assert _load(root, synthetic.MARKER)["format_version"] == synthetic.FORMAT_VERSION
    assert os.path.isfile(os.path.join(root, "vocab.txt"))


# ----------------------------------------------------------------------------- the corpus, read independently
# The test's own reading of the synthetic English, from what the words mean rather than from the
# generator's tables (only the colour and shape names are shared). A scene is (objects, layout), objects
# ((colour, shape, size), ...). Canonical: a two-object relation written as left or above, three objects
# listed left to right ('row') or top to bottom ('column'), one object 'alone'.
_SIZE_WORD = {"small": "small", "little": "small", "large": "large", "big": "large"}
_REL_WORD = {"left of": "left", "to the left of": "left", "on the left of": "left",
             "right of": "right", "to the right of": "right", "on the right of": "right",
             "above": "above", "on top of": "above", "over": "above",
             "below": "below", "under": "below", "beneath": "below"}
_ORDER_WORD = {"from left to right": ("row", False), "from right to left": ("row", True),
               "from top to bottom": ("column", False), "from bottom to top": ("column", True)}
_COLOUR = "|".join(synthetic_world.COLOURS)
_SHAPE = "|".join(synthetic_world.SHAPES)
_NOUN = rf"({'|'.join(_SIZE_WORD)}) ({_COLOUR}) ({_SHAPE})"
_NOUN_RE = re.compile(rf"\b(an? )?{_NOUN}\b")
_REL = "|".join(sorted(_REL_WORD, key=len, reverse=True))  # longest first: 'to the left of' before 'left of'
_REL_RE = re.compile(rf"\b({_REL})\b")
_ORDER_RE = re.compile(rf"\b({'|'.join(_ORDER_WORD)})\b")
_THE_SHAPE_RE = re.compile(rf"\bthe ({_SHAPE})\b")
# Sentences after replacing each noun phrase by X (with its article) or Y (without), the relation phrase
# by R, the order phrase by O and 'the <shape>' by S.
_ONE = {"a single Y", "X alone", "there is only X", "one Y on its own", "the image shows only X"}
_TWO = {"X R X", "there is X R X", "the image shows X R X", "an image with X R X"}
_TWO_NAMED = {"X and X S R S"}  # 'a red circle and a blue square, the circle left of the square'
_THREE = {"O X X and X", "X X and X O", "the image shows X X and X O", "three shapes O X X and X"}
_INVERSE = {"right": "left", "below": "above"}
_LAYOUTS = {(1, "alone"), (2, "left"), (2, "above"), (3, "row"), (3, "column")}  # canonical (objects, layout)


def _canonical(objects, layout: str) -> tuple:
    objects = tuple(objects)
    if layout in _INVERSE:  # 'B right of A' is 'A left of B'
        return objects[::-1], _INVERSE[layout]
    return objects, layout


def _scene_of_key(key: str) -> tuple:
    """scenes.json's 'size colour shape; ... | layout'."""
    objects, layout = key.split(" | ")
    return tuple((c, s, z) for z, c, s in (o.split(" ") for o in objects.split("; "))), layout


def _read_caption(caption: str) -> tuple:
    """The canonical scene a caption describes, read from the cleaned text the model gets (30 words at
    most); AssertionError unless it names every object with its size, colour and shape, and the relation
    or order."""
    text = pre_caption(caption)
    objects = [(m[3], m[4], _SIZE_WORD[m[2]]) for m in _NOUN_RE.finditer(text)]
    skeleton = _NOUN_RE.sub(lambda m: "X" if m[1] else "Y", text)
    rels = [_REL_WORD[m] for m in _REL_RE.findall(skeleton)]
    orders = [_ORDER_WORD[m] for m in _ORDER_RE.findall(skeleton)]
    named = _THE_SHAPE_RE.findall(skeleton)
    skeleton = _THE_SHAPE_RE.sub("S", _ORDER_RE.sub("O", _REL_RE.sub("R", skeleton)))
    if skeleton in _ONE:
        return _canonical(objects, "alone")
    if skeleton in _TWO:
        return _canonical(objects, rels[0])
    if skeleton in _TWO_NAMED:
        by_shape = {o[1]: o for o in objects}
        assert len(by_shape) == 2 and sorted(named) == sorted(by_shape), caption
        return _canonical((by_shape[named[0]], by_shape[named[1]]), rels[0])
    if skeleton in _THREE:
        layout, reverse = orders[0]
        return _canonical(objects[::-1] if reverse else objects, layout)
    raise AssertionError(f"not a complete scene description: {caption!r} (read as {skeleton!r})")


def test_caption_reader_reads_hand_written_captions():
    circle, square = ("red", "circle", "small"), ("blue", "square", "large")
    cross = ("green", "cross", "small")
    read = _read_caption
    assert read("a little red circle beneath a big blue square") == ((square, circle), "above")
    assert read("There is a big blue square on the left of a small red circle.") == ((square, circle), "left")
    assert read("a small red circle and a large blue square, the square to the right of the circle") \
        == ((circle, square), "left")
    assert read("from bottom to top: a small green cross, a big blue square and a little red circle") \
        == ((circle, square, cross), "column")
    assert read("a small green cross, a big blue square and a little red circle from left to right") \
        == ((cross, square, circle), "row")
    assert read("one big blue square on its own") == ((square,), "alone")
    for bad in ("a red circle left of a large blue square",  # no size
                "a small red circle and a large blue square",  # no relation
                "a small red circle, a large blue square and a small green cross",  # no order
                "a small red circle left of a large blue square and a small green cross",
                "a small red circle and a large blue square, the circle left of the cross",
                "a big blue square on its own"):
        with pytest.raises(AssertionError):
            _read_caption(bad)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def _difference(truth: tuple, other: tuple) -> str | None:
    """What changed from one canonical scene to another, if it is one thing."""
    (a, layout_a), (b, layout_b) = truth, other
    if len(a) != len(b):
        return "count"
    if layout_a == layout_b:
        changed = [(x, y) for x, y in zip(a, b) if x != y]
        if len(changed) == 1:
            attributes = [k for k, u, v in zip(("colour", "shape", "size"), *changed[0]) if u != v]
            if len(attributes) == 1:
                return attributes[0]
    if sorted(a) == sorted(b) and truth != other:
        return "relation"  # the same objects, arranged otherwise
    return None


class _Corpus:
    """A generated dataset's captions and scenes, read back with the test's own caption reader."""

    def __init__(self, root: str):
        self.scenes = {p: _scene_of_key(k) for p, k in _load(root, "scenes.json").items()}
        self.meta = _load(root, synthetic.MARKER)
        self.pretrain = _load(root, "pretrain.json") + _load(root, "pretrain_extra.json")
        self.probe = _load(root, "probe_test.json")
        self.eval = {split: _load(root, f"retrieval_{split}.json") for split in ("val", "test")}
        self.captions = [(e["image"], c) for e in self.pretrain for c in e["caption"]]
        self.captions += [(e["image"], e["caption"]) for e in _load(root, "retrieval_train.json")]
        self.captions += [(e["image"], c) for ev in self.eval.values() for e in ev for c in e["caption"]]
        self.captions += [(e["image"], e["caption"]) for e in self.probe]

    def check_captions_are_true_of_their_images_only(self) -> None:
        for p, (objects, layout) in self.scenes.items():
            assert _canonical(objects, layout) == (objects, layout), p
            assert (len(objects), layout) in _LAYOUTS, p
            assert len({s for _, s, _ in objects}) == len(objects), f"{p}: shapes must be distinct"
        assert {p for p, _ in self.captions} == set(self.scenes)
        wrong = [(p, c, self.scenes[p]) for p, c in self.captions if _read_caption(c) != self.scenes[p]]
        assert not wrong, wrong[:5]
        # The reading is a function of the text alone, so a text shared by images of different scenes
        # would be false of one of them: a caption is true of one scene, its own.
        scenes_of_text: dict[str, set] = {}
        for p, c in self.captions:
            scenes_of_text.setdefault(pre_caption(c), set()).add(self.scenes[p])
        assert all(len(s) == 1 for s in scenes_of_text.values())

    def check_probe_negatives(self) -> None:
        """Each negative is false of the image and changes exactly its declared thing, in the true caption's
        wording. (A three-object scene's count negative names two of its objects, in their order: false
        only as the corpus's captions always name every object.)"""
        assert [e["image"] for e in self.probe] == [e["image"] for e in self.eval["test"]]
        word_kind = {"colour": set(synthetic_world.COLOURS), "shape": set(synthetic_world.SHAPES),
                     "size": set(_SIZE_WORD)}
        for e in self.probe:
            truth = self.scenes[e["image"]]
            n_objects = len(truth[0])
            assert [x["kind"] for x in e["negatives"]] == \
                [k for k in synthetic_world.PROBE_KINDS if n_objects > 1 or k != "relation"], e
            words = _words(e["caption"])
            for x in e["negatives"]:
                kind, negative = x["kind"], _read_caption(x["caption"])
                assert negative != truth and _difference(truth, negative) == kind, (e, x)
                if kind in word_kind:
                    changed = [(u, v) for u, v in zip(words, _words(x["caption"])) if u != v]
                    assert len(words) == len(_words(x["caption"])) and len(changed) == 1, (e, x)
                    assert set(changed[0]) <= word_kind[kind], (e, x)
                elif kind == "relation" and n_objects == 2:  # only the relation phrase differs
                    assert _REL_RE.sub("R", e["caption"]) == _REL_RE.sub("R", x["caption"]), (e, x)
                elif kind == "relation":  # two neighbours swapped
                    assert sorted(words) == sorted(_words(x["caption"])), (e, x)
                    assert any(negative[0] == truth[0][:i] + truth[0][i:i + 2][::-1] + truth[0][i + 2:]
                               for i in range(2)), (e, x)
                else:  # count: an object more or one fewer, the others kept
                    fewer, more = sorted((truth, negative), key=lambda s: len(s[0]))
                    assert len(more[0]) == len(fewer[0]) + 1 and set(fewer[0]) < set(more[0]), (e, x)
                    if len(more[0]) == 3:  # the two kept in their order, the order as their relation
                        kept = [more[0].index(o) for o in fewer[0]]
                        assert kept == sorted(kept), (e, x)
                        assert fewer[1] == {"row": "left", "column": "above"}[more[1]], (e, x)

    def check_pretraining_scenes(self) -> None:
        """No scene repeats among the pre-training images (train + extra), some of which have two entries;
        synthetic.json's statistics say so too."""
        images = sorted({e["image"] for e in self.pretrain})
        counts = Counter(self.scenes[p] for p in images)
        share = sum(counts[self.scenes[p]] > 1 for p in images) / len(images)
        stats = self.meta["pretrain_statistics"]
        assert share < 0.02 and stats["duplicate_scene_share"] == round(share, 4)
        assert stats["images"] == len(images) < stats["entries"] == len(self.pretrain)
        assert stats["distinct_scenes"] == len(counts)

    def check_eval_splits(self) -> None:
        """Within val and within test, a caption belongs to one image and scenes do not repeat."""
        for split, ev in self.eval.items():
            images_of_text: dict[str, set[str]] = {}
            for e in ev:
                for c in e["caption"]:
                    images_of_text.setdefault(pre_caption(c), set()).add(e["image"])
            assert all(len(v) == 1 for v in images_of_text.values()), split
            scenes = [self.scenes[e["image"]] for e in ev]
            assert len(set(scenes)) == len(scenes), split


@pytest.fixture(scope="module")
def corpus(data_root) -> _Corpus:
    return _Corpus(data_root)


def test_every_caption_is_true_of_its_image_and_of_no_other_scene(corpus):
    corpus.check_captions_are_true_of_their_images_only()


def test_probe_negatives_change_exactly_the_declared_thing(corpus):
    corpus.check_probe_negatives()
    assert {x["kind"] for e in corpus.probe for x in e["negatives"]} == set(synthetic_world.PROBE_KINDS)


def test_pretraining_images_repeat_no_scene(corpus):
    corpus.check_pretraining_scenes()


def test_eval_captions_identify_one_image(corpus):
    corpus.check_eval_splits()


def _components(mask: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """4-connected components of a boolean mask, as (ys, xs)."""
    h, w = mask.shape
    label = np.where(mask, np.arange(h * w).reshape(h, w), h * w)
    while True:  # every pixel takes the smallest label among itself and its masked neighbours
        new = label.copy()
        new[1:] = np.minimum(new[1:], label[:-1])
        new[:-1] = np.minimum(new[:-1], label[1:])
        new[:, 1:] = np.minimum(new[:, 1:], label[:, :-1])
        new[:, :-1] = np.minimum(new[:, :-1], label[:, 1:])
        new = np.where(mask, new, h * w)
        if (new == label).all():
            return [np.nonzero(label == v) for v in np.unique(label[mask])]
        label = new


def _shape_and_size(ys: np.ndarray, xs: np.ndarray) -> tuple[str, str]:
    """An object's shape and size from its pixels, in its bounding box (u, v in [-1, 1])."""
    box = np.zeros((ys.max() - ys.min() + 1, xs.max() - xs.min() + 1), bool)
    box[ys - ys.min(), xs - xs.min()] = True
    h, w = box.shape

    def filled(points) -> float:
        return float(np.mean([box[round((v + 1) / 2 * (h - 1)), round((u + 1) / 2 * (w - 1))]
                              for u, v in points]))

    quarter = max(1, h // 4)
    if filled([(u, v) for u in (-0.9, 0.9) for v in (-0.9, 0.9)]) == 1:
        shape = "square"
    elif box[-quarter:].sum() > 3 * box[:quarter].sum():  # wide base, narrow top
        shape = "triangle"
    elif filled([(u, v) for u in (-0.7, 0.7) for v in (-0.7, 0.7)]) == 1:  # outside a diamond or cross
        shape = "circle"
    else:  # diamond: half its box; cross: about 0.6
        shape = "diamond" if box.mean() < 0.54 else "cross"
    radius = max(h, w) / (1.7 if shape == "square" else 2.0)  # a square's half side is 0.85 of its radius
    return shape, "large" if radius > 5.5 else "small"  # radii 4 and 6.7 px in a 48 px image


def test_scenes_json_is_true_of_the_images(corpus, data_root):
    # Objects are flat colour on grey: each one is a component of its colour's pixels, whose shape, size
    # and place must be those scenes.json names.
    merged = []
    for path, (objects, layout) in corpus.scenes.items():
        with Image.open(os.path.join(data_root, path)) as im:
            pixels = np.asarray(im.convert("RGB"))
        axis = 0 if layout in ("column", "above") else 1  # the axis objects are listed along: y or x
        found: dict[tuple, tuple[float, float]] = {}
        for colour, rgb in synthetic_world.COLOURS.items():
            parts = sorted(_components((pixels == rgb).all(-1)), key=lambda c: c[axis].mean())
            named = [o for o in objects if o[0] == colour]
            if len(parts) < len(named) and len(parts) >= 1 and len(named) >= 2:
                merged.append((path, colour))  # two same-coloured neighbours touch: one blob
                continue
            assert len(parts) == len(named), (path, colour)
            for obj, (ys, xs) in zip(named, parts):  # same-coloured objects in the listed order
                assert (colour, *_shape_and_size(ys, xs)) == obj, (path, obj)
                found[obj] = (ys.mean(), xs.mean())
        centres = np.array([found[o] for o in objects if o in found]).reshape(-1, 2)
        steps = np.diff(centres, axis=0)
        assert (steps[:, axis] > 0).all(), path  # left to right, or top to bottom
        assert (steps[:, axis] > np.abs(steps[:, 1 - axis])).all(), path  # and plainly so
    # Neighbours in a row or column never touch (cell centres 16 px apart, large radii 6.7 px), so two
    # same-coloured shapes are never one blob.
    assert not merged, merged


def _one_thing_off(a: tuple, b: tuple) -> bool:
    """Neighbours in synthetic.json's neighbour_rate: one attribute of one object, or a two-object scene's
    relation (left <-> above, or the two objects' sides swapped); row <-> column counts as the layout."""
    (objects_a, layout_a), (objects_b, layout_b) = a, b
    if a == b or len(objects_a) != len(objects_b):
        return False
    if layout_a != layout_b:
        return objects_a == objects_b
    if len(objects_a) == 2 and objects_a == objects_b[::-1]:
        return True
    changed = [(x, y) for x, y in zip(objects_a, objects_b) if x != y]
    return len(changed) == 1 and sum(u != v for u, v in zip(*changed[0])) == 1


def test_neighbour_statistic_counts_one_thing_off_scenes(corpus):
    # The statistic's pairwise test against the test's own, on the fixture's scenes and their probe
    # negatives (one thing off by construction).
    scenes = sorted(set(corpus.scenes.values()))
    negatives = {_read_caption(x["caption"]) for e in corpus.probe for x in e["negatives"]}
    scenes += sorted(negatives - set(scenes))
    codes = synthetic._attribute_codes([synthetic_world.Scene(o, None if lay == "alone" else lay)
                                        for o, lay in scenes])
    got = synthetic._neighbours(codes)
    want = np.array([[_one_thing_off(a, b) for b in scenes] for a in scenes])
    assert want.sum() > len(corpus.probe)
    mismatch = [(scenes[i], scenes[j]) for i, j in zip(*np.nonzero(got != want))]
    assert not mismatch, mismatch[:3]


# ----------------------------------------------------------------------------- NLVR sentences
def _nlvr_truth(sentence: str, scenes) -> bool:
    """An independent reading of a synthetic NLVR sentence against its two canonical scenes."""
    side = {"left": 0, "right": 1}
    shapes = "|".join(synthetic_world.SHAPES)

    def obj(m, i: int) -> tuple:
        return m[i + 1], m[i + 2], _SIZE_WORD[m[i]]

    if m := re.fullmatch(rf"the (left|right) image (?:has|contains|shows) an? {_NOUN}", sentence):
        return obj(m, 2) in scenes[side[m[1]]][0]
    if m := re.fullmatch(rf"the (left|right) image has something ({_COLOUR})", sentence):
        return any(c == m[2] for c, _, _ in scenes[side[m[1]]][0])
    if m := re.fullmatch(rf"the (left|right) image shows an? {_NOUN} ({_REL}) an? {_NOUN}", sentence):
        return _canonical((obj(m, 2), obj(m, 6)), _REL_WORD[m[5]]) == scenes[side[m[1]]]
    if m := re.fullmatch(rf"both images contain an? ({shapes})", sentence):
        return all(m[1] in {s for _, s, _ in sc[0]} for sc in scenes)
    if m := re.fullmatch(rf"neither image contains an? ({shapes})", sentence):
        return not any(m[1] in {s for _, s, _ in sc[0]} for sc in scenes)
    if m := re.fullmatch(r"the (left|right) image has exactly (one shape|two shapes|three shapes)", sentence):
        return len(scenes[side[m[1]]][0]) == {"one": 1, "two": 2, "three": 3}[m[2].split()[0]]
    raise AssertionError(f"unknown NLVR sentence form: {sentence!r}")


def test_nlvr_sentences_are_true_of_their_images_and_text_alone_predicts_nothing():
    # Scenes without rendering: the sentence generator only needs them and a name per image.
    rng = np.random.default_rng(0)
    pools = {split: [(f"{split}/{i}", sc) for i, sc in enumerate(synthetic_world.sample_scenes(rng, count))]
             for split, count in (("train", 600), ("dev", 100))}
    train = synthetic_tasks.nlvr_split(rng, pools["train"], 4000)
    dev = synthetic_tasks.nlvr_split(rng, pools["dev"], 1000)
    for split, pairs in (("train", train), ("dev", dev)):
        scene = {p: _scene_of_key(sc.key()) for p, sc in pools[split]}
        wrong = [e for e in pairs
                 if _nlvr_truth(e["sentence"], [scene[p] for p in e["images"]]) != e["label"]]
        assert not wrong, wrong[:3]

    # Every sentence form is balanced, and a text-only guess (the majority label of that very sentence
    # in train) is at chance on dev: only the images decide.
    words = {"left", "right", "a", "an", *synthetic_world.COLOURS, *synthetic_world.SHAPES, *_SIZE_WORD}
    form = [" ".join("_" if w in words else w for w in _REL_RE.sub("REL", e["sentence"]).split())
            for e in train]
    by_form = Counter(zip(form, (e["label"] for e in train)))
    assert len(set(form)) >= 9
    for f in set(form):
        assert 0.4 < by_form[f, True] / (by_form[f, True] + by_form[f, False]) < 0.6, f
    votes: dict[str, Counter] = {}
    for e in train:
        votes.setdefault(e["sentence"], Counter())[e["label"]] += 1
    guess = [votes[e["sentence"]].most_common(1)[0][0] if e["sentence"] in votes else True for e in dev]
    text_only = sum(g == e["label"] for g, e in zip(guess, dev)) / len(dev)
    assert 0.45 < text_only < 0.55, text_only
