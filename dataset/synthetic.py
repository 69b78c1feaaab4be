"""Built-in synthetic image-text data, in ALBEF's json formats, for CPU demos and tests: this module
writes the corpus (splits, files, statistics); the scenes, images and captions are in
dataset/synthetic_world.py, the NLVR2 sentences and VQA questions in dataset/synthetic_tasks.py.

Images are 48x48 PNGs of one to three coloured shapes of two sizes on a lightly noisy grey
background: one shape alone, two shapes in a spatial relation (left of, right of, above, below), or
three in a row (left to right) or a column (top to bottom). Every caption names every object with its
size, colour and shape, and the relation or order, in several paraphrases ("a small red circle to the
left of a big blue square", "from top to bottom: ..."), so

* a caption is true of exactly one scene (its own): no caption in the corpus is true of another scene,
  and GRIT's hardest negatives are hard but true negatives;
* a caption with one attribute or the relation changed is false of the image;
* the world has about 200,000 distinct scenes, the pre-training images are drawn without repeating a
  scene, and yet one-attribute-off neighbours are frequent (two-shape scenes come from 5,760), so GRIT
  finds near-duplicates inside its search space (``neighbour_rate`` in synthetic.json);
* no val or test scene is a scene of a training split (pre-training, retrieval, NLVR2 and VQA train),
  and val and test share none, so zero-shot retrieval, the probe and every downstream test score unseen
  scenes (and, as a caption is true of one scene only, unseen captions).

Like ALBEF's COCO and VG files, some pre-training images are listed under several entries, each with
its own captions (the false negatives the pre-training guard is for). The vocabulary is tiny, and
``vocab.txt`` is a word-level BERT vocabulary that tokenises every text without [UNK].

    python -m tools.make_synthetic --output_dir data/synthetic [--n 600] [--seed 0]

Files written under the output directory (image paths inside the json files are relative to it,
so configs use ``image_root: data/synthetic``):

    images/{train,val,test,pretrain}/NNNNN.png
    pretrain.json                          [{"image", "caption": [str, ...]}]  (n images; a fifth of
                                           them split into two entries with disjoint captions)
    pretrain_extra.json                    same, 3n further pre-training-only images (as a real
                                           pre-training corpus holds far more than the downstream
                                           train split; tiny pre-training reads both files)
    retrieval_train.json                   [{"image", "caption", "image_id": int}]     (train images)
    retrieval_val.json, retrieval_test.json [{"image", "caption": [str, ...]}]  (n/2 and 5n/3 images)
    probe_test.json                        [{"image", "caption", "negatives": [{"kind", "caption"}]}]
                                           one per test image: its caption and the same caption with
                                           the colour, shape, size, count or relation changed
    scenes.json                            {image path: scene}, the ground truth of every image
    nlvr_train.json, nlvr_dev.json, nlvr_test.json [{"images": [p0, p1], "sentence", "label": bool}]
    vqa_train.json, vqa_test.json          [{"question_id", "image", "question", "answer": [10 x str],
                                             "dataset": "vqa"}]
    answer_list.json                       [str, ...]
    vocab.txt                              [PAD] [UNK] [CLS] [SEP] [MASK] + sorted words
    synthetic.json                         metadata (n, seed, counts, corpus statistics); written last =
                                           completion marker

The same (n, seed) gives byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings

import numpy as np

from grit_io import read_json

from .synthetic_tasks import nlvr_split, vqa_split
from .synthetic_world import (
    COLOURS,
    SHAPES,
    SIZES,
    Scene,
    probe_entries,
    render,
    sample_scenes,
    scene_captions,
)

__all__ = ["MARKER", "SPECIAL_TOKENS", "ensure_synthetic", "generate"]

logger = logging.getLogger(__name__)


# 2: pretrain_extra.json; 3: NLVR sentences (colour form, any-object negatives), 8n pairs;
# 4: sizes, three-object rows/columns, fully specifying captions, split entries, probe_test.json,
#    scenes.json, 5n/3 test images; 5: objects drawn at the cells of a 3 x 3 grid, 48 px images;
# 6: leak-free evaluation: no val or test scene (so no probe image, no NLVR2 dev/test or VQA test image) is
#    a scene of any training split, val and test share no scene, n/2 val images (n/6 were at R@1 ~99 %,
#    too easy to select a learning rate on)
FORMAT_VERSION = 6
MARKER = "synthetic.json"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# ----------------------------------------------------------------------------- corpus statistics
def _attribute_codes(scenes: list[Scene]) -> np.ndarray:
    """(S, 11) int codes: [objects, layout, 3 x (colour, shape, size)] of each canonical scene, -1 padded."""
    colour_id = {c: i for i, c in enumerate(COLOURS)}
    layouts = {None: 0, "left": 1, "above": 2, "row": 3, "column": 4}
    codes = np.full((len(scenes), 11), -1, dtype=np.int64)
    for r, sc in enumerate(scenes):
        sc = sc.canonical()
        codes[r, 0], codes[r, 1] = len(sc.objects), layouts[sc.layout]
        for j, (c, s, z) in enumerate(sc.objects):
            codes[r, 2 + 3 * j: 5 + 3 * j] = (colour_id[c], SHAPES.index(s), SIZES.index(z))
    return codes


def _neighbours(codes: np.ndarray) -> np.ndarray:
    """(S, S) bool: scenes that differ in one attribute of one object, or in the relation of two objects
    (left/above, or the two objects' sides swapped)."""
    diff = (codes[:, None, :] != codes[None, :, :]).sum(-1)
    one_off = diff == 1
    two = codes[:, 0] == 2
    swapped = codes.copy()
    swapped[:, 2:5], swapped[:, 5:8] = codes[:, 5:8], codes[:, 2:5]
    same_when_swapped = (codes[:, None, :] == swapped[None, :, :]).all(-1) & (diff > 0)
    return one_off | (same_when_swapped & two[:, None] & two[None, :])


def corpus_statistics(entries: list[dict], scenes: dict[str, Scene], rng: np.random.Generator,
                      search_spaces=(64, 256, 512, 768, 1024), draws: int = 4) -> dict:
    """Duplicate-scene share of the images and mean one-attribute-off neighbours per example in random
    sub-queues of each search space (the entries are shuffled and cut into sub-queues, as GRIT does)."""
    images = sorted({e["image"] for e in entries})
    keys = [scenes[p].key() for p in images]
    counts: dict[str, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    codes = _attribute_codes([scenes[e["image"]] for e in entries])
    rates = {}
    for m in search_spaces:
        per_example = []
        for _ in range(draws):
            order = rng.permutation(len(entries))
            for start in range(0, len(order) - m + 1, m):
                block = codes[order[start:start + m]]
                per_example.append(_neighbours(block).sum(1))
        if per_example:  # a corpus smaller than the search space has no full sub-queue
            rates[str(m)] = round(float(np.concatenate(per_example).mean()), 3)
    return {"images": len(images), "entries": len(entries), "distinct_scenes": len(counts),
            "duplicate_scene_share": round(sum(1 for k in keys if counts[k] > 1) / len(keys), 4),
            "neighbour_rate": rates}


# ----------------------------------------------------------------------------- generation
_WORD = re.compile(r"\w+|[^\w\s]")


def _vocab(texts) -> list[str]:
    words = {w for t in texts for w in _WORD.findall(t.lower())}
    words |= {".", ",", "?", ":"}  # un-cleaned text keeps punctuation; BERT splits it into tokens
    return list(SPECIAL_TOKENS) + sorted(words - set(SPECIAL_TOKENS))


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def split_sizes(n: int) -> dict[str, int]:
    """Number of images / pairs / questions per split for n pre-training images."""
    n_dev = max(4, n // 6)
    return {"train_images": n, "val_images": max(4, n // 2),
            # 1,000 test images at the default n=600: R@1 then has a standard error of about 1.4 points
            # (text retrieval, 1,000 queries) and 0.6 (image retrieval, ~4,000 captions).
            "test_images": max(4, 5 * n // 3), "pretrain_extra_images": 3 * n,
            # NLVR pairs reuse the split's images: many pairs, as NLVR2 (86k train pairs) has, so the tiny
            # model sees each sentence form often; dev/test hold n pairs each, so that accuracy is known to
            # about +-0.02.
            "nlvr_train": 8 * n, "nlvr_dev": 6 * n_dev, "nlvr_test": 6 * n_dev,
            "vqa_train": 2 * n, "vqa_test": max(8, n // 3)}


SPLIT_SHARE = 0.2  # share of pre-training images listed under two entries (ALBEF's COCO/VG: one per caption)


def _pretrain_entries(items: list[tuple[str, list[str]]], rng: np.random.Generator) -> list[dict]:
    """One entry per image with all its captions, or, for SPLIT_SHARE of them, two entries with disjoint
    captions, the second inserted at a random position (entries of one image are rarely adjacent)."""
    out: list[dict] = []
    later: list[tuple[int, dict]] = []
    for path, caps in items:
        if rng.random() < SPLIT_SHARE:
            cut = int(rng.integers(1, len(caps)))
            out.append({"image": path, "caption": caps[:cut]})
            later.append((int(rng.integers(len(items))), {"image": path, "caption": caps[cut:]}))
        else:
            out.append({"image": path, "caption": caps})
    for pos, entry in sorted(later, key=lambda x: x[0], reverse=True):
        out.insert(max(pos, 0), entry)
    return out


def _render_pool(out: str, split: str, scenes: list[Scene], rng: np.random.Generator,
                 image_size: int) -> list[tuple[str, Scene]]:
    os.makedirs(os.path.join(out, "images", split))
    pool = []
    for i, sc in enumerate(scenes):
        rel_path = f"images/{split}/{i:05d}.png"
        render(sc, rng, image_size).save(os.path.join(out, rel_path), optimize=False)
        pool.append((rel_path, sc))
    return pool


def _build(out: str, n: int, seed: int, image_size: int = 48) -> dict:
    """Write the whole dataset into the (existing, empty) directory ``out``; returns the metadata."""
    if n < 4:
        raise ValueError(f"synthetic dataset needs n >= 4 images, got {n}")
    sizes = split_sizes(n)
    rng = np.random.default_rng(seed)
    pretrain_taken: set = set()  # pre-training images (train + extra) never repeat a scene
    pools: dict[str, list[tuple[str, Scene]]] = {}
    train = sample_scenes(rng, sizes["train_images"], pretrain_taken)
    pools["train"] = _render_pool(out, "train", train, rng, image_size)
    # Evaluation scenes are new to every training split, as COCO's test images are to ALBEF's corpus: they
    # are drawn excluding the train scenes (and each other's), and the pre-training-only images below
    # exclude them. The 60 one-object scenes are then mostly training scenes (at n=600, 18 of the 1,000
    # test images have one object).
    eval_taken = set(pretrain_taken)
    for split in ("val", "test"):
        drawn = sample_scenes(rng, sizes[f"{split}_images"], eval_taken, strict=True)
        pools[split] = _render_pool(out, split, drawn, rng, image_size)
    eval_taken -= pretrain_taken

    captions = {split: [scene_captions(sc, rng) for _, sc in pools[split]] for split in pools}
    files: dict[str, list | dict] = {}
    train = list(zip(pools["train"], captions["train"]))
    files["pretrain.json"] = _pretrain_entries([(p, caps) for (p, _), caps in train], rng)
    files["retrieval_train.json"] = [{"image": p, "caption": c, "image_id": i}
                                     for i, ((p, _), caps) in enumerate(train) for c in caps]
    for split in ("val", "test"):
        files[f"retrieval_{split}.json"] = [{"image": p, "caption": caps}
                                            for (p, _), caps in zip(pools[split], captions[split])]
    files["probe_test.json"] = probe_entries(pools["test"], np.random.default_rng([seed, 4]))
    nlvr_rng = np.random.default_rng([seed, 2])  # own stream: NLVR changes leave the other files as they are
    files["nlvr_train.json"] = nlvr_split(nlvr_rng, pools["train"], sizes["nlvr_train"])
    files["nlvr_dev.json"] = nlvr_split(nlvr_rng, pools["val"], sizes["nlvr_dev"])
    files["nlvr_test.json"] = nlvr_split(nlvr_rng, pools["test"], sizes["nlvr_test"])
    files["vqa_train.json"] = vqa_split(rng, pools["train"], sizes["vqa_train"], first_qid=0)
    files["vqa_test.json"] = vqa_split(rng, pools["test"], sizes["vqa_test"], first_qid=sizes["vqa_train"])
    answers = sorted({a for f in ("vqa_train.json", "vqa_test.json") for e in files[f] for a in e["answer"]})
    files["answer_list.json"] = answers

    # Pre-training-only images come from a separate random stream, so the other files do not depend on it.
    extra_rng = np.random.default_rng([seed, 1])
    extra_scenes = sample_scenes(extra_rng, sizes["pretrain_extra_images"], pretrain_taken | eval_taken,
                                 strict=True)
    pools["pretrain"] = _render_pool(out, "pretrain", extra_scenes, extra_rng, image_size)
    extra_caps = [(p, scene_captions(sc, extra_rng)) for p, sc in pools["pretrain"]]
    files["pretrain_extra.json"] = _pretrain_entries(extra_caps, extra_rng)
    scenes = {p: sc for pool in pools.values() for p, sc in pool}
    files["scenes.json"] = {p: sc.key() for p, sc in scenes.items()}

    texts = [c for split_caps in captions.values() for caps in split_caps for c in caps]
    texts += [c for _, caps in extra_caps for c in caps]
    for e in files["probe_test.json"]:
        texts += [e["caption"]] + [x["caption"] for x in e["negatives"]]
    texts += [e["sentence"] for f in ("nlvr_train.json", "nlvr_dev.json", "nlvr_test.json") for e in files[f]]
    texts += [e["question"] for f in ("vqa_train.json", "vqa_test.json") for e in files[f]]
    texts += answers
    for name, obj in files.items():
        _dump(os.path.join(out, name), obj)
    with open(os.path.join(out, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(_vocab(texts)) + "\n")
    stats = corpus_statistics(files["pretrain.json"] + files["pretrain_extra.json"], scenes,
                              np.random.default_rng([seed, 3]))
    meta = {"format_version": FORMAT_VERSION, "n": n, "seed": seed, "image_size": image_size,
            "sizes": sizes, "pretrain_statistics": stats, "files": sorted(files) + ["vocab.txt"]}
    _dump(os.path.join(out, MARKER), meta)  # last: its presence means the dataset is complete
    return meta


def _temp_dir_beside(target: str) -> str:
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    # Same parent -> same filesystem, so the final os.rename is atomic.
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.tmp-", dir=parent)


def generate(out: str, n: int = 600, seed: int = 0, image_size: int = 48) -> dict:
    """Generate the dataset into ``out`` (replacing an earlier synthetic dataset there); returns metadata."""
    if os.path.exists(out) and not os.path.isfile(os.path.join(out, MARKER)) and os.listdir(out):
        raise FileExistsError(f"{out} exists, is not empty and is not a synthetic dataset; "
                              "refusing to overwrite it")
    tmp = _temp_dir_beside(out)
    try:
        meta = _build(tmp, n, seed, image_size)
        if os.path.exists(out):
            old = _temp_dir_beside(out)
            os.rename(out, os.path.join(old, "old"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def ensure_synthetic(root: str = "data/synthetic", n: int = 600, seed: int = 0) -> str:
    """Generate the synthetic dataset at ``root`` unless it is already complete; returns root.

    Safe for concurrent callers (e.g. every rank): each builds in its own temp dir and renames it
    into place atomically; a loser finds root taken and deletes its copy (the content is identical).
    """
    marker = os.path.join(root, MARKER)
    if os.path.isfile(marker):
        meta = read_json(marker, "synthetic dataset marker")
        if meta.get("format_version") != FORMAT_VERSION:
            # written by an older generator: its files may differ from what the configs expect
            logger.info("synthetic dataset at %s has format %s, regenerating as format %s", root,
                        meta.get("format_version"), FORMAT_VERSION)
            generate(root, n, seed)
            return root
        if (meta.get("n"), meta.get("seed")) != (n, seed):
            warnings.warn(f"{root} holds a synthetic dataset with n={meta.get('n')}, "
                          f"seed={meta.get('seed')}; requested n={n}, seed={seed} (delete it to regenerate)",
                          stacklevel=2)
        return root
    if os.path.exists(root) and os.listdir(root):
        raise FileExistsError(f"{root} exists but has no {MARKER}, so it is not a complete synthetic "
                              "dataset; delete it")
    start = time.time()
    tmp = _temp_dir_beside(root)
    try:
        _build(tmp, n, seed)
        try:
            os.rename(tmp, root)  # atomic; replaces only a missing or empty root
        except OSError:
            if not os.path.isfile(marker):
                raise
            logger.info("synthetic dataset at %s was created concurrently; discarding own copy", root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("synthetic dataset ready at %s (n=%d, seed=%d, %.1fs)", root, n, seed, time.time() - start)
    return root
