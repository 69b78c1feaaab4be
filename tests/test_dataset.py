"""dataset/: synthetic generator, json loading, transforms and the per-task datasets (CPU, 32 px)."""

from __future__ import annotations

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
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T

from dataset import (
    ImageReadError,
    NLVRDataset,
    PretrainDataset,
    RetrievalEvalDataset,
    RetrievalTrainDataset,
    VQADataset,
    create_dataset,
    ensure_synthetic,
    load_json_list,
    pre_caption,
    pre_question,
    read_image,
    synthetic,
    train_transform,
    vqa_collate,
)
from dataset import transforms as dtf
from dataset.transforms import ALBEF_RANDAUG_OPS, AlbefRandAugment
from models.tokenization import tokenizer_from_vocab

N = 24
RES = 32
JSON_FILES = ["answer_list.json", "nlvr_dev.json", "nlvr_test.json", "nlvr_train.json", "pretrain.json",
              "pretrain_extra.json",
              "retrieval_test.json", "retrieval_train.json", "retrieval_val.json", "vqa_test.json",
              "vqa_train.json"]


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


# ----------------------------------------------------------------------------- generator
def test_generator_is_deterministic_and_seed_dependent(tmp_path, data_root):
    synthetic.main(["--out", str(tmp_path / "a"), "--n", str(N), "--seed", "0"])
    synthetic.generate(str(tmp_path / "b"), n=N, seed=1)
    same, other = _hashes(str(tmp_path / "a")), _hashes(str(tmp_path / "b"))
    assert same == _hashes(data_root)
    assert set(same) == set(other)
    assert same["pretrain.json"] != other["pretrain.json"]
    assert same["images/train/00000.png"] != other["images/train/00000.png"]


def test_generator_files_and_split_sizes(data_root):
    sizes = synthetic.split_sizes(N)
    for name in JSON_FILES + ["vocab.txt", synthetic.MARKER]:
        assert os.path.isfile(os.path.join(data_root, name)), name
    meta = _load(data_root, synthetic.MARKER)
    assert (meta["n"], meta["seed"]) == (N, 0)
    assert not [p for p in os.listdir(os.path.dirname(data_root)) if ".tmp-" in p]

    pretrain = _load(data_root, "pretrain.json")
    assert len(pretrain) == N
    assert all(3 <= len(e["caption"]) <= 5 for e in pretrain)
    with Image.open(os.path.join(data_root, pretrain[0]["image"])) as im:
        assert im.size == (64, 64) and im.mode == "RGB"
    extra = _load(data_root, "pretrain_extra.json")
    assert len(extra) == sizes["pretrain_extra_images"] == 3 * N
    assert all(3 <= len(e["caption"]) <= 5 and e["image"].startswith("images/pretrain/") for e in extra)
    assert len({e["image"] for e in extra}) == len(extra)
    assert all(os.path.isfile(os.path.join(data_root, e["image"])) for e in extra)
    ret_train = _load(data_root, "retrieval_train.json")
    assert len(ret_train) == sum(len(e["caption"]) for e in pretrain)
    assert all(isinstance(e["image_id"], int) for e in ret_train)
    for split in ("val", "test"):
        ev = _load(data_root, f"retrieval_{split}.json")
        assert len(ev) == sizes[f"{split}_images"]
        texts = [c for e in ev for c in e["caption"]]
        assert len(texts) == len(set(texts)), "an eval caption must identify one image"
    for split in ("train", "dev", "test"):
        nlvr = _load(data_root, f"nlvr_{split}.json")
        assert len(nlvr) == sizes[f"nlvr_{split}"]
        labels = Counter(e["label"] for e in nlvr)
        assert abs(labels[True] - labels[False]) <= 1
        assert all(len(e["images"]) == 2 for e in nlvr)
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
    start = time.time()
    synthetic.generate(str(tmp_path / "big"), n=600, seed=0)
    assert time.time() - start < 60  # about 8 s here: it runs once before the demo
    assert len(_load(str(tmp_path / "big"), "pretrain.json")) == 600


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
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_json_list([str(good), str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="bad.json.*line 1"):
        load_json_list(str(bad))
    with pytest.raises(ValueError, match="obj.json.*list"):
        load_json_list(str(obj))
    with pytest.raises(ValueError, match=r"nokey.json: entry 1 .*caption"):
        load_json_list(str(nokey), required=("image", "caption"))
    with pytest.raises(ValueError, match="nokey.json.*caption"):
        PretrainDataset(str(nokey), dtf.test_transform(RES))
    with pytest.raises(ValueError, match="good.json.*image_id"):
        RetrievalTrainDataset(str(good), dtf.test_transform(RES))


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
    assert len(ds) == N
    random.seed(0)
    image, caption, index = ds[3]
    assert image.shape == (3, RES, RES) and index == 3
    assert caption in [pre_caption(c) for c in ds.ann[3]["caption"]]
    seen = {ds[3][1] for _ in range(30)}
    assert len(seen) > 1, "list captions are sampled per visit"
    images, captions, idx = next(iter(DataLoader(ds, batch_size=4)))
    assert images.shape == (4, 3, RES, RES) and len(captions) == 4 and idx.tolist() == [0, 1, 2, 3]


def test_pretrain_dataset_string_caption_and_max_words(tmp_path, data_root, test_tf):
    ann = tmp_path / "p.json"
    path = os.path.join(data_root, "images/train/00000.png")  # absolute path, empty root
    ann.write_text(json.dumps([{"image": path, "caption": "One Two, three four"}]))
    _, caption, _ = PretrainDataset(str(ann), test_tf, max_words=3)[0]
    assert caption == "one two three"


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
    with pytest.raises(ValueError, match="n.json: entry 0.*label"):
        NLVRDataset(str(ann), test_tf, data_root)
    ann.write_text(json.dumps([dict(entry, images=entry["images"][:1])]))
    with pytest.raises(ValueError, match="n.json.*two"):
        NLVRDataset(str(ann), test_tf, data_root)


def test_vqa_datasets(tmp_path, data_root, train_tf, test_tf):
    train = VQADataset(os.path.join(data_root, "vqa_train.json"), train_tf, data_root, split="train")
    image, question, answers, weights = train[0]
    raw = train.ann[0]
    assert image.shape == (3, RES, RES) and question == pre_question(raw["question"])
    counts = Counter(raw["answer"])
    assert dict(zip(answers, weights)) == {a: c / 10 for a, c in counts.items()}
    assert sum(weights) == pytest.approx(1.0)

    batch = [train[i] for i in range(3)]
    images, questions, flat, w, n = vqa_collate(batch)
    assert images.shape == (3, 3, RES, RES) and len(questions) == 3
    assert n == [len(b[2]) for b in batch] and len(flat) == sum(n) and w.shape == (sum(n),)
    assert w.dtype == torch.float32

    test = VQADataset(os.path.join(data_root, "vqa_test.json"), test_tf, data_root, split="test",
                      answer_list=os.path.join(data_root, "answer_list.json"))
    image, question, qid = test[0]
    assert qid == test.ann[0]["question_id"] and "yes" in test.answer_list

    ann = tmp_path / "vg.json"
    ann.write_text(json.dumps([{"image": raw["image"], "question": "what is it?", "answer": "circle",
                                "dataset": "vg"}]))
    _, _, answers, weights = VQADataset(str(ann), test_tf, data_root)[0]
    assert answers == ["circle"] and weights == [0.5]
    with pytest.raises(ValueError, match="vg.json.*question_id"):
        VQADataset(str(ann), test_tf, data_root, split="test")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        VQADataset(str(ann), test_tf, data_root, split="train", answer_list=str(tmp_path / "nope.json"))


def test_create_dataset_from_config(data_root):
    config = {"image_res": RES, "image_root": data_root, "hflip": False,
              "train_file": [os.path.join(data_root, "retrieval_train.json")],
              "val_file": os.path.join(data_root, "retrieval_val.json"),
              "test_file": os.path.join(data_root, "retrieval_test.json")}
    train, val, test = create_dataset("retrieval", config)
    assert train.transform.transforms[0].scale == (0.5, 1.0)
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in train.transform.transforms)
    assert len(val) == len(test) == synthetic.split_sizes(N)["val_images"]
    with pytest.raises(ValueError, match="answer_list"):
        create_dataset("vqa", dict(config, train_file=os.path.join(data_root, "vqa_train.json")))


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


# Relation phrase -> relation, and a regex of the phrases, longest first ("to the left of" before "left of").
_PHRASE_REL = {p: rel for rel, phrases in synthetic.REL_PHRASES.items() for p in phrases}
_PHRASES = "|".join(sorted(_PHRASE_REL, key=len, reverse=True))


def _nlvr_truth(sentence: str, scenes) -> bool:
    """An independent reading of a synthetic NLVR sentence against its two scenes."""
    colours, shapes = "|".join(synthetic.COLOURS), "|".join(synthetic.SHAPES)
    obj = rf"an? ({colours}) ({shapes})"
    side = {"left": 0, "right": 1}
    if m := re.fullmatch(rf"the (left|right) image (?:has|contains|shows) {obj}", sentence):
        return (m[2], m[3]) in scenes[side[m[1]]].objects
    if m := re.fullmatch(rf"the (left|right) image has something ({colours})", sentence):
        return any(c == m[2] for c, _ in scenes[side[m[1]]].objects)
    if m := re.fullmatch(rf"the (left|right) image shows {obj} ({_PHRASES}) {obj}", sentence):
        return scenes[side[m[1]]].relation_holds((m[2], m[3]), _PHRASE_REL[m[4]], (m[5], m[6]))
    if m := re.fullmatch(rf"both images contain an? ({shapes})", sentence):
        return all(m[1] in sc.shapes() for sc in scenes)
    if m := re.fullmatch(rf"neither image contains an? ({shapes})", sentence):
        return not any(m[1] in sc.shapes() for sc in scenes)
    if m := re.fullmatch(r"the (left|right) image has exactly (one|two) shapes?", sentence):
        return len(scenes[side[m[1]]].objects) == {"one": 1, "two": 2}[m[2]]
    raise AssertionError(f"unknown NLVR sentence form: {sentence!r}")


def test_nlvr_sentences_are_true_of_their_images_and_text_alone_predicts_nothing():
    # Scenes without rendering: the sentence generator only needs them and a name per image.
    rng = np.random.default_rng(0)
    pools = {split: [(f"{split}/{i}", sc) for i, sc in
                     enumerate(synthetic._sample_scenes(rng, count, eval_split=split == "dev"))]
             for split, count in (("train", 600), ("dev", 100))}
    train = synthetic._nlvr_split(rng, pools["train"], 4000)
    dev = synthetic._nlvr_split(rng, pools["dev"], 1000)
    for split, pairs in (("train", train), ("dev", dev)):
        scene = dict(pools[split])
        assert all(_nlvr_truth(e["sentence"], [scene[p] for p in e["images"]]) == e["label"] for e in pairs)

    # Every sentence form is balanced, and a text-only guess (the majority label of that very sentence
    # in train) is at chance on dev: only the images decide.
    rel = re.compile(_PHRASES)
    words = {"left", "right", "a", "an", *synthetic.COLOURS, *synthetic.SHAPES}
    form = [" ".join("_" if w in words else w for w in rel.sub("REL", e["sentence"]).split()) for e in train]
    by_form = Counter(zip(form, (e["label"] for e in train)))
    assert len(set(form)) >= 6
    for f in set(form):
        assert 0.4 < by_form[f, True] / (by_form[f, True] + by_form[f, False]) < 0.6, f
    votes: dict[str, Counter] = {}
    for e in train:
        votes.setdefault(e["sentence"], Counter())[e["label"]] += 1
    guess = [votes[e["sentence"]].most_common(1)[0][0] if e["sentence"] in votes else True for e in dev]
    text_only = sum(g == e["label"] for g, e in zip(guess, dev)) / len(dev)
    assert 0.45 < text_only < 0.55, text_only
