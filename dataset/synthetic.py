"""Built-in synthetic image-text data, in ALBEF's json formats, for CPU demos and tests.

Images are 64x64 PNGs of one or two coloured shapes, two shapes in a spatial relation, on a
lightly noisy grey background. Captions, NLVR sentences and VQA questions are compositional
("a red circle to the left of a blue square"), so items that differ in a single attribute exist
and hard negatives are meaningful. The vocabulary is tiny, and ``vocab.txt`` is a word-level BERT
vocabulary that tokenises every text without [UNK].

    python -m dataset.synthetic --out data/synthetic [--n 600] [--seed 0]

Files written under the output directory (image paths inside the json files are relative to it,
so configs use ``image_root: data/synthetic``):

    images/{train,val,test,pretrain}/NNNNN.png
    pretrain.json                          [{"image", "caption": [str, ...]}]          (n images)
    pretrain_extra.json                    same, 3n further pre-training-only images (as a real
                                           pre-training corpus holds far more than the downstream
                                           train split; tiny pre-training reads both files)
    retrieval_train.json                   [{"image", "caption", "image_id": int}]     (train images)
    retrieval_val.json, retrieval_test.json [{"image", "caption": [str, ...]}]         (val / test images)
    nlvr_train.json, nlvr_dev.json, nlvr_test.json [{"images": [p0, p1], "sentence", "label": bool}]
    vqa_train.json, vqa_test.json          [{"question_id", "image", "question", "answer": [10 x str],
                                             "dataset": "vqa"}]
    answer_list.json                       [str, ...]
    vocab.txt                              [PAD] [UNK] [CLS] [SEP] [MASK] + sorted words
    synthetic.json                         metadata (n, seed, counts); written last = completion marker

The same (n, seed) gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["MARKER", "SPECIAL_TOKENS", "ensure_synthetic", "generate", "main"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: pretrain_extra.json; 3: NLVR sentences (colour form, any-object negatives), 8n pairs
MARKER = "synthetic.json"
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

COLOURS = {
    "red": (215, 38, 38),
    "green": (34, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 55, 185),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
RELATIONS = ("left", "right", "above", "below")
INVERSE = {"left": "right", "right": "left", "above": "below", "below": "above"}
# Caption paraphrases of "A <rel> B"; the first one is also the short form used in questions.
REL_PHRASES = {
    "left": ("left of", "to the left of", "on the left of"),
    "right": ("right of", "to the right of", "on the right of"),
    "above": ("above", "on top of", "over"),
    "below": ("below", "under", "beneath"),
}
COUNT_WORDS = {1: "one", 2: "two"}

Obj = tuple[str, str]  # (colour, shape)


@dataclass(frozen=True)
class Scene:
    """One or two objects with distinct shapes; ``rel`` is objects[0]'s relation to objects[1]."""

    objects: tuple[Obj, ...]
    rel: str | None = None

    def has(self, obj: Obj) -> bool:
        return obj in self.objects

    def shapes(self) -> set[str]:
        return {s for _, s in self.objects}

    def relation_holds(self, a: Obj, rel: str, b: Obj) -> bool:
        if len(self.objects) != 2:
            return False
        o0, o1 = self.objects
        return (o0, o1, self.rel) == (a, b, rel) or (o0, o1, self.rel) == (b, a, INVERSE[rel])


def _a(colour_or_word: str) -> str:
    return "an" if colour_or_word[0] in "aeiou" else "a"


def _np(obj: Obj) -> str:
    """Noun phrase with article: 'a red circle', 'an orange square'."""
    return f"{_a(obj[0])} {obj[0]} {obj[1]}"


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


# ----------------------------------------------------------------------------- scenes and images
def _random_scene(rng: np.random.Generator) -> Scene:
    colours = list(COLOURS)
    if rng.random() < 0.2:
        return Scene(((_pick(rng, colours), _pick(rng, SHAPES)),))
    s0, s1 = rng.choice(len(SHAPES), size=2, replace=False)  # distinct shapes keep questions unambiguous
    objs = ((_pick(rng, colours), SHAPES[int(s0)]), (_pick(rng, colours), SHAPES[int(s1)]))
    return Scene(objs, _pick(rng, RELATIONS))


def _sample_scenes(rng: np.random.Generator, count: int, eval_split: bool) -> list[Scene]:
    """Distinct scenes; eval splits also keep object sets distinct so every caption has one image."""
    # Uniqueness keys from strict to loose; when one is exhausted (very large n) fall to the next,
    # and finally allow repeats.
    keys: list[Callable] = [lambda sc: sc]
    if eval_split:
        keys.insert(0, lambda sc: frozenset(sc.objects))
    seen: set = set()
    scenes: list[Scene] = []
    misses = 0
    while len(scenes) < count:
        sc = _random_scene(rng)
        if keys and keys[0](sc) in seen:
            misses += 1
            if misses > 2000:
                keys.pop(0)
                seen = {keys[0](x) for x in scenes} if keys else set()
                misses = 0
            continue
        misses = 0
        if keys:
            seen.add(keys[0](sc))
        scenes.append(sc)
    return scenes


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        h = 0.85 * r
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + 0.8 * r), (cx - r, cy + 0.8 * r)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _render(scene: Scene, rng: np.random.Generator, size: int) -> Image.Image:
    k = size / 64.0
    noise = rng.integers(-6, 7, size=(size, size, 1), dtype=np.int16)
    bg = np.clip(228 + noise, 0, 255).astype(np.uint8).repeat(3, axis=2)
    img = Image.fromarray(bg, "RGB")
    draw = ImageDraw.Draw(img)
    if len(scene.objects) == 1:
        cx, cy = rng.uniform(22, 42, size=2)
        places = [(cx, cy, rng.uniform(10, 14))]
    else:
        # objects[0] sits on the `rel` side of objects[1]; the off-axis jitter stays well below the
        # on-axis gap, so exactly one relation is visually true.
        near, far = rng.uniform(14, 20), rng.uniform(44, 50)
        a_main, b_main = {"left": (near, far), "right": (far, near), "above": (near, far),
                          "below": (far, near)}[scene.rel]
        a_off, b_off = rng.uniform(26, 38, size=2)
        if scene.rel in ("left", "right"):
            places = [(a_main, a_off), (b_main, b_off)]
        else:
            places = [(a_off, a_main), (b_off, b_main)]
        places = [(x, y, rng.uniform(9, 12)) for x, y in places]
    for (colour, shape), (cx, cy, r) in zip(scene.objects, places):
        _draw_shape(draw, shape, cx * k, cy * k, r * k, COLOURS[colour])
    return img


# ----------------------------------------------------------------------------- captions
def _captions(scene: Scene, rng: np.random.Generator) -> list[str]:
    """3-5 paraphrases; two-object scenes always get both relation orders."""
    if len(scene.objects) == 1:
        (c, s), = scene.objects
        pool = [f"a single {c} {s}", f"{_np((c, s))} alone", f"there is only {_np((c, s))}",
                f"{_np((c, s))} by itself", f"one {c} {s} on its own"]
        keep = [0] + sorted(int(i) + 1 for i in rng.choice(4, size=int(rng.integers(2, 5)), replace=False))
        return [pool[i] for i in keep]
    a, b = scene.objects
    rel, inv = scene.rel, INVERSE[scene.rel]
    must = [f"{_np(a)} {_pick(rng, REL_PHRASES[rel])} {_np(b)}",
            f"{_np(b)} {_pick(rng, REL_PHRASES[inv])} {_np(a)}"]
    first, second = (a, b) if rng.random() < 0.5 else (b, a)
    optional = [f"there is {_np(a)} {_pick(rng, REL_PHRASES[rel])} {_np(b)}",
                f"{_np(first)} and {_np(second)}",
                f"there is {_np(first)} and {_np(second)}",
                f"an image with {_np(first)} and {_np(second)}"]
    extra = rng.choice(len(optional), size=int(rng.integers(1, 4)), replace=False)
    return must + [optional[int(i)] for i in sorted(extra)]


# ----------------------------------------------------------------------------- NLVR sentences
def _other(rng: np.random.Generator, options, exclude) -> str:
    return _pick(rng, [o for o in options if o != exclude])


def _perturb(rng: np.random.Generator, obj: Obj) -> Obj:
    """Change colour or shape (a one-attribute hard negative)."""
    if rng.random() < 0.5:
        return (_other(rng, list(COLOURS), obj[0]), obj[1])
    return (obj[0], _other(rng, SHAPES, obj[1]))


# Each template maps (rng, scenes, want, **form) to (sentence, truth), or (None, None) when this
# pair cannot give a sentence of that form with that label. `form` (which side, which number) is
# drawn before the pair, independently of the label, so no wording predicts the answer.
def _nlvr_has(rng, scenes, want, side):
    sc = scenes[side]
    # A false sentence names any object that image lacks (it often shares a colour or a shape with
    # one it has). Always one attribute off, as in the captions' hard negatives, the tiny model did
    # not learn the split within minutes (README, "NLVR2 on the synthetic data").
    obj = _pick(rng, sc.objects) if want else (_pick(rng, list(COLOURS)), _pick(rng, SHAPES))
    verb = _pick(rng, ("has", "contains", "shows"))
    return f"the {('left', 'right')[side]} image {verb} {_np(obj)}", sc.has(obj)


def _nlvr_colour(rng, scenes, want, side):
    colour = _pick(rng, list(COLOURS))
    return (f"the {('left', 'right')[side]} image has something {colour}",
            any(c == colour for c, _ in scenes[side].objects))


def _nlvr_both(rng, scenes, want):
    options = sorted(scenes[0].shapes() & scenes[1].shapes()) if want else SHAPES
    if not options:
        return None, None
    shape = _pick(rng, options)
    return f"both images contain {_a(shape)} {shape}", all(shape in sc.shapes() for sc in scenes)


def _nlvr_neither(rng, scenes, want):
    present = scenes[0].shapes() | scenes[1].shapes()
    options = [s for s in SHAPES if (s not in present) == want]
    if not options:
        return None, None
    shape = _pick(rng, options)
    return f"neither image contains {_a(shape)} {shape}", shape not in present


def _nlvr_rel(rng, scenes, want, side):
    sc = scenes[side]
    if len(sc.objects) != 2:
        return None, None
    a, b = sc.objects
    rel = sc.rel
    if rng.random() < 0.5:
        a, b, rel = b, a, INVERSE[rel]
    if not want:
        kind = int(rng.integers(4))
        if kind == 0:
            a = _perturb(rng, a)
        elif kind == 1:
            b = _perturb(rng, b)
        elif kind == 2:
            rel = INVERSE[rel]
        else:
            rel = _other(rng, RELATIONS, rel)
    text = f"the {('left', 'right')[side]} image shows {_np(a)} {_pick(rng, REL_PHRASES[rel])} {_np(b)}"
    return text, sc.relation_holds(a, rel, b)


def _nlvr_count(rng, scenes, want, side, k):
    noun = "shape" if k == 1 else "shapes"
    return f"the {('left', 'right')[side]} image has exactly {COUNT_WORDS[k]} {noun}", \
        k == len(scenes[side].objects)


def _nlvr_form(rng: np.random.Generator) -> tuple[Callable, dict]:
    """Template and its label-independent parameters; object, colour and relation sentences dominate."""
    side = int(rng.integers(2))
    r = rng.random()
    if r < 0.3:
        return _nlvr_has, {"side": side}
    if r < 0.5:
        return _nlvr_colour, {"side": side}
    if r < 0.7:
        return _nlvr_rel, {"side": side}
    if r < 0.8:
        return _nlvr_both, {}
    if r < 0.9:
        return _nlvr_neither, {}
    return _nlvr_count, {"side": side, "k": int(rng.integers(1, 3))}


def _nlvr_split(rng: np.random.Generator, pool: list[tuple[str, Scene]], count: int) -> list[dict]:
    labels = rng.permutation(np.arange(count) % 2 == 0)  # exactly balanced
    out = []
    for want in labels:
        want, text = bool(want), None
        while text is None:
            template, form = _nlvr_form(rng)
            for _ in range(300):  # a rare form (e.g. "exactly one shape" = a single-object image)
                i0, i1 = (int(i) for i in rng.choice(len(pool), size=2, replace=False))
                text, truth = template(rng, (pool[i0][1], pool[i1][1]), want, **form)
                if text is not None and truth == want:
                    break
                text = None
        out.append({"images": [pool[i0][0], pool[i1][0]], "sentence": text, "label": want})
    return out


# ----------------------------------------------------------------------------- VQA questions
def _vqa_question(rng: np.random.Generator, sc: Scene) -> tuple[str, str, tuple[str, ...]]:
    """(question, answer, answers of the same type used as annotator noise)."""
    colours = tuple(COLOURS)
    counts = ("0", "1", "2")
    while True:
        kind = int(rng.integers(6))
        if kind == 0:
            c, s = _pick(rng, sc.objects)
            return f"what colour is the {s}?", c, colours
        if kind == 1:
            obj = _pick(rng, sc.objects)
            if rng.random() < 0.5:
                obj = _perturb(rng, obj)
            return f"is there {_np(obj)}?", ("yes" if sc.has(obj) else "no"), ("yes", "no")
        if kind == 2:
            return "how many shapes are there?", str(len(sc.objects)), counts
        if kind == 3:
            c = _pick(rng, sc.objects)[0] if rng.random() < 0.6 else _pick(rng, colours)
            n = sum(1 for oc, _ in sc.objects if oc == c)
            return f"how many {c} shapes are there?", str(n), counts
        if len(sc.objects) == 2:
            a, b = sc.objects
            rel = sc.rel
            if rng.random() < 0.5:
                a, b, rel = b, a, INVERSE[rel]
            where = REL_PHRASES[rel][0]
            if kind == 4:
                return f"what shape is {where} the {b[1]}?", a[1], SHAPES
            return f"what colour is the shape {where} the {b[1]}?", a[0], colours


def _vqa_split(rng: np.random.Generator, pool: list[tuple[str, Scene]], count: int,
               first_qid: int) -> list[dict]:
    out = []
    for q in range(count):
        path, sc = pool[int(rng.integers(len(pool)))]
        question, answer, domain = _vqa_question(rng, sc)
        n_right = int(rng.integers(7, 11))  # annotators mostly agree -> soft scores 0.7-1.0
        wrong = [o for o in domain if o != answer]
        answers = [answer] * n_right + [_pick(rng, wrong) for _ in range(10 - n_right)]
        answers = [answers[int(i)] for i in rng.permutation(10)]
        out.append({"question_id": first_qid + q, "image": path, "question": question, "answer": answers,
                    "dataset": "vqa"})
    return out


# ----------------------------------------------------------------------------- generation
_WORD = re.compile(r"\w+|[^\w\s]")


def _vocab(texts) -> list[str]:
    words = {w for t in texts for w in _WORD.findall(t.lower())}
    words |= {".", ",", "?"}  # un-cleaned text keeps punctuation; BERT splits it into tokens
    return list(SPECIAL_TOKENS) + sorted(words - set(SPECIAL_TOKENS))


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def split_sizes(n: int) -> dict[str, int]:
    """Number of images / pairs / questions per split for n pre-training images."""
    n_eval = max(4, n // 6)
    return {"train_images": n, "val_images": n_eval, "test_images": n_eval, "pretrain_extra_images": 3 * n,
            # NLVR pairs reuse the split's images: many pairs, as NLVR2 (86k train pairs) has, so the tiny
            # model sees each sentence form often; dev/test hold 6 pairs per eval image, so that accuracy is
            # known to about +-0.02.
            "nlvr_train": 8 * n, "nlvr_dev": 6 * n_eval, "nlvr_test": 6 * n_eval,
            "vqa_train": 2 * n, "vqa_test": max(8, n // 3)}


def _build(out: str, n: int, seed: int, image_size: int = 64) -> dict:
    """Write the whole dataset into the (existing, empty) directory ``out``; returns the metadata."""
    if n < 4:
        raise ValueError(f"synthetic dataset needs n >= 4 images, got {n}")
    sizes = split_sizes(n)
    rng = np.random.default_rng(seed)
    pools: dict[str, list[tuple[str, Scene]]] = {}
    for split in ("train", "val", "test"):
        os.makedirs(os.path.join(out, "images", split))
        scenes = _sample_scenes(rng, sizes[f"{split}_images"], eval_split=split != "train")
        pool = []
        for i, sc in enumerate(scenes):
            rel_path = f"images/{split}/{i:05d}.png"
            _render(sc, rng, image_size).save(os.path.join(out, rel_path), optimize=False)
            pool.append((rel_path, sc))
        pools[split] = pool

    captions = {split: [_captions(sc, rng) for _, sc in pools[split]] for split in pools}
    files: dict[str, list] = {}
    train = list(zip(pools["train"], captions["train"]))
    files["pretrain.json"] = [{"image": p, "caption": caps} for (p, _), caps in train]
    files["retrieval_train.json"] = [{"image": p, "caption": c, "image_id": i}
                                     for i, ((p, _), caps) in enumerate(train) for c in caps]
    for split in ("val", "test"):
        files[f"retrieval_{split}.json"] = [{"image": p, "caption": caps}
                                            for (p, _), caps in zip(pools[split], captions[split])]
    nlvr_rng = np.random.default_rng([seed, 2])  # own stream: NLVR changes leave the other files as they are
    files["nlvr_train.json"] = _nlvr_split(nlvr_rng, pools["train"], sizes["nlvr_train"])
    files["nlvr_dev.json"] = _nlvr_split(nlvr_rng, pools["val"], sizes["nlvr_dev"])
    files["nlvr_test.json"] = _nlvr_split(nlvr_rng, pools["test"], sizes["nlvr_test"])
    files["vqa_train.json"] = _vqa_split(rng, pools["train"], sizes["vqa_train"], first_qid=0)
    files["vqa_test.json"] = _vqa_split(rng, pools["test"], sizes["vqa_test"], first_qid=sizes["vqa_train"])
    answers = sorted({a for f in ("vqa_train.json", "vqa_test.json") for e in files[f] for a in e["answer"]})
    files["answer_list.json"] = answers

    # Pre-training-only images come from a separate random stream, so the other files do not depend on it.
    extra_rng = np.random.default_rng([seed, 1])
    os.makedirs(os.path.join(out, "images", "pretrain"))
    extra = []
    for i, sc in enumerate(_sample_scenes(extra_rng, sizes["pretrain_extra_images"], eval_split=False)):
        rel_path = f"images/pretrain/{i:05d}.png"
        _render(sc, extra_rng, image_size).save(os.path.join(out, rel_path), optimize=False)
        extra.append({"image": rel_path, "caption": _captions(sc, extra_rng)})
    files["pretrain_extra.json"] = extra

    texts = [c for split_caps in captions.values() for caps in split_caps for c in caps]
    texts += [c for e in extra for c in e["caption"]]
    texts += [e["sentence"] for f in ("nlvr_train.json", "nlvr_dev.json", "nlvr_test.json") for e in files[f]]
    texts += [e["question"] for f in ("vqa_train.json", "vqa_test.json") for e in files[f]]
    texts += answers
    for name, obj in files.items():
        _dump(os.path.join(out, name), obj)
    with open(os.path.join(out, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(_vocab(texts)) + "\n")
    meta = {"format_version": FORMAT_VERSION, "n": n, "seed": seed, "image_size": image_size,
            "sizes": sizes, "files": sorted(files) + ["vocab.txt"]}
    _dump(os.path.join(out, MARKER), meta)  # last: its presence means the dataset is complete
    return meta


def _temp_dir_beside(target: str) -> str:
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    # Same parent -> same filesystem, so the final os.rename is atomic.
    return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.tmp-", dir=parent)


def generate(out: str, n: int = 600, seed: int = 0, image_size: int = 64) -> dict:
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
        with open(marker, encoding="utf-8") as f:
            meta = json.load(f)
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


def main(argv: list[str] | None = None) -> None:
    """CLI: python -m dataset.synthetic --out DIR [--n N] [--seed S]."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (use it as image_root in configs)")
    parser.add_argument("--n", type=int, default=600, help="number of pre-training images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args(argv)
    start = time.time()
    try:
        meta = generate(args.out, args.n, args.seed, args.image_size)
    except (ValueError, OSError) as e:
        parser.error(str(e))  # one line, exit code 2
    print(json.dumps({"out": args.out, "seconds": round(time.time() - start, 2), **meta["sizes"]}))


if __name__ == "__main__":
    main()
