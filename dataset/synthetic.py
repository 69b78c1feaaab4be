"""Built-in synthetic image-text data, in ALBEF's json formats, for CPU demos and tests.

Images are 64x64 PNGs of one to three coloured shapes of two sizes on a lightly noisy grey
background: one shape alone, two shapes in a spatial relation (left of, right of, above, below), or
three in a row (left to right) or a column (top to bottom). Every caption names every object with its
size, colour and shape, and the relation or order, in several paraphrases ("a small red circle to the
left of a big blue square", "from top to bottom: ..."), so

* a caption is true of exactly one scene (its own): no caption in the corpus is true of another scene,
  and GRIT's hardest negatives are hard but true negatives;
* a caption with one attribute or the relation changed is false of the image;
* the world has about 200,000 distinct scenes, the pre-training images are drawn without repeating a
  scene, and yet one-attribute-off neighbours are frequent (two-shape scenes come from 5,760), so GRIT
  finds near-duplicates inside its search space (``neighbour_rate`` in synthetic.json).

Like ALBEF's COCO and VG files, some pre-training images are listed under several entries, each with
its own captions (the false negatives the pre-training guard is for). The vocabulary is tiny, and
``vocab.txt`` is a word-level BERT vocabulary that tokenises every text without [UNK].

    python -m dataset.synthetic --out data/synthetic [--n 600] [--seed 0]

Files written under the output directory (image paths inside the json files are relative to it,
so configs use ``image_root: data/synthetic``):

    images/{train,val,test,pretrain}/NNNNN.png
    pretrain.json                          [{"image", "caption": [str, ...]}]  (n images; a fifth of
                                           them split into two entries with disjoint captions)
    pretrain_extra.json                    same, 3n further pre-training-only images (as a real
                                           pre-training corpus holds far more than the downstream
                                           train split; tiny pre-training reads both files)
    retrieval_train.json                   [{"image", "caption", "image_id": int}]     (train images)
    retrieval_val.json, retrieval_test.json [{"image", "caption": [str, ...]}]  (n/6 and 5n/3 images)
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

# 2: pretrain_extra.json; 3: NLVR sentences (colour form, any-object negatives), 8n pairs;
# 4: sizes, three-object rows/columns, fully specifying captions, split entries, probe_test.json,
#    scenes.json, 5n/3 test images
FORMAT_VERSION = 4
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
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
SIZES = ("small", "large")
SIZE_WORDS = {"small": ("small", "little"), "large": ("large", "big")}
# Radius ranges in 64 px units: far enough apart that a 48 px crop of 0.85-1.0 of the area keeps them apart.
SIZE_RADIUS = {"small": (5.0, 6.0), "large": (8.0, 9.0)}
RELATIONS = ("left", "right", "above", "below")
INVERSE = {"left": "right", "right": "left", "above": "below", "below": "above"}
# Caption paraphrases of "A <rel> B"; the first one is also the short form used in questions.
REL_PHRASES = {
    "left": ("left of", "to the left of", "on the left of"),
    "right": ("right of", "to the right of", "on the right of"),
    "above": ("above", "on top of", "over"),
    "below": ("below", "under", "beneath"),
}
# Three objects: 'row' lists them left to right, 'column' top to bottom.
ORDER_PHRASES = {"row": ("from left to right", "from right to left"),
                 "column": ("from top to bottom", "from bottom to top")}
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
N_OBJECTS_P = (0.06, 0.74, 0.20)  # 1, 2, 3 objects (one-object scenes are few: 60 in all)
PROBE_KINDS = ("colour", "shape", "size", "count", "relation")

Obj = tuple[str, str, str]  # (colour, shape, size)


@dataclass(frozen=True)
class Scene:
    """1-3 objects with distinct shapes. ``layout``: None (one object); for two objects objects[0]'s
    relation to objects[1] (left/right/above/below); for three 'row' (objects listed left to right) or
    'column' (top to bottom)."""

    objects: tuple[Obj, ...]
    layout: str | None = None

    def canonical(self) -> Scene:
        """The same scene written one way only: a two-object relation as left or above."""
        if len(self.objects) == 2 and self.layout in ("right", "below"):
            return Scene((self.objects[1], self.objects[0]), INVERSE[self.layout])
        return self

    def key(self) -> str:
        """A string naming the scene, equal for equal scenes however written (scenes.json)."""
        sc = self.canonical()
        objs = "; ".join(" ".join((z, c, s)) for c, s, z in sc.objects)
        return f"{objs} | {sc.layout or 'alone'}"

    def has(self, obj: Obj) -> bool:
        return obj in self.objects

    def shapes(self) -> set[str]:
        return {s for _, s, _ in self.objects}

    def relation_holds(self, a: Obj, rel: str, b: Obj) -> bool:
        if len(self.objects) != 2:
            return False
        o0, o1 = self.objects
        return (o0, o1, self.layout) == (a, b, rel) or (o0, o1, self.layout) == (b, a, INVERSE[rel])


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


# ----------------------------------------------------------------------------- scenes and images
def _random_object(rng: np.random.Generator, exclude_shapes=()) -> Obj:
    shapes = [s for s in SHAPES if s not in exclude_shapes]
    return (_pick(rng, list(COLOURS)), _pick(rng, shapes), _pick(rng, SIZES))


def _random_scene(rng: np.random.Generator) -> Scene:
    k = int(rng.choice(3, p=N_OBJECTS_P)) + 1
    objs: list[Obj] = []
    for _ in range(k):  # distinct shapes keep questions ("what colour is the circle?") unambiguous
        objs.append(_random_object(rng, exclude_shapes={s for _, s, _ in objs}))
    layout = None if k == 1 else _pick(rng, RELATIONS) if k == 2 else _pick(rng, ("row", "column"))
    return Scene(tuple(objs), layout)


def _sample_scenes(rng: np.random.Generator, count: int, taken: set | None = None) -> list[Scene]:
    """``count`` scenes, none equal to another or to one in ``taken`` (which is updated)."""
    taken = set() if taken is None else taken
    scenes: list[Scene] = []
    misses = 0
    while len(scenes) < count:
        sc = _random_scene(rng)
        key = sc.canonical()
        if key in taken and misses < 10_000:  # repeats only once ~200,000 scenes are nearly used up
            misses += 1
            continue
        misses = 0
        taken.add(key)
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
    elif shape == "cross":
        w = 0.38 * r
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _places(scene: Scene, rng: np.random.Generator) -> list[tuple[float, float]]:
    """Object centres in 64 px units; the off-axis jitter stays well below the on-axis gap, so exactly
    one relation (or order) is visually true."""
    n = len(scene.objects)
    if n == 1:
        return [tuple(rng.uniform(24, 40, size=2))]
    if n == 2:
        near, far = rng.uniform(15, 20), rng.uniform(44, 49)
        a_main, b_main = {"left": (near, far), "right": (far, near), "above": (near, far),
                          "below": (far, near)}[scene.layout]
        a_off, b_off = rng.uniform(26, 38, size=2)
        if scene.layout in ("left", "right"):
            return [(a_main, a_off), (b_main, b_off)]
        return [(a_off, a_main), (b_off, b_main)]
    # Centres at least 19.5 apart, two large radii at most 18: neighbours in a row never touch.
    main = np.array([10.5, 32.0, 53.5]) + rng.uniform(-1.0, 1.0, size=3)
    off = rng.uniform(27, 37, size=3)
    if scene.layout == "row":
        return list(zip(main, off))
    return list(zip(off, main))


def _render(scene: Scene, rng: np.random.Generator, size: int) -> Image.Image:
    k = size / 64.0
    noise = rng.integers(-6, 7, size=(size, size, 1), dtype=np.int16)
    bg = np.clip(228 + noise, 0, 255).astype(np.uint8).repeat(3, axis=2)
    img = Image.fromarray(bg, "RGB")
    draw = ImageDraw.Draw(img)
    for (colour, shape, sz), (cx, cy) in zip(scene.objects, _places(scene, rng)):
        _draw_shape(draw, shape, cx * k, cy * k, rng.uniform(*SIZE_RADIUS[sz]) * k, COLOURS[colour])
    return img


# ----------------------------------------------------------------------------- captions
@dataclass(frozen=True)
class Style:
    """The wording choices of one caption: template, size synonyms, relation phrase, listing direction."""

    template: int
    small: str = "small"
    large: str = "large"
    rel_phrase: int = 0
    reverse: bool = False  # two objects: name objects[1] first (inverse relation); three: reversed order


def _np(obj: Obj, style: Style, article: bool = True) -> str:
    """Noun phrase, size first: 'a small red circle', 'big orange square' (article=False)."""
    colour, shape, size = obj
    words = f"{getattr(style, size)} {colour} {shape}"
    return f"{_a(words)} {words}" if article else words


_TEMPLATES = {
    1: ("a single {o}", "{A} alone", "there is only {A}", "one {o} on its own", "the image shows only {A}"),
    2: ("{A} {rel} {B}", "there is {A} {rel} {B}", "the image shows {A} {rel} {B}",
        "an image with {A} {rel} {B}", "{A} and {B}, the {a} {rel} the {b}"),
    3: ("{order}: {A}, {B} and {C}", "{A}, {B} and {C} {order}", "the image shows {A}, {B} and {C} {order}",
        "three shapes {order}: {A}, {B} and {C}"),
}


def describe(scene: Scene, style: Style) -> str:
    """The caption of ``scene`` in ``style``; it names every object and the relation or order."""
    objs = list(scene.objects)
    n = len(objs)
    template = _TEMPLATES[n][style.template % len(_TEMPLATES[n])]
    if n == 1:
        return template.format(o=_np(objs[0], style, article=False), A=_np(objs[0], style))
    if n == 2:
        rel = scene.layout
        if style.reverse:
            objs, rel = objs[::-1], INVERSE[rel]
        a, b = objs
        return template.format(A=_np(a, style), B=_np(b, style), rel=REL_PHRASES[rel][style.rel_phrase],
                               a=a[1], b=b[1])
    order = ORDER_PHRASES[scene.layout][int(style.reverse)]
    if style.reverse:
        objs = objs[::-1]
    return template.format(order=order, A=_np(objs[0], style), B=_np(objs[1], style), C=_np(objs[2], style))


def _random_style(rng: np.random.Generator, n_objects: int, template: int | None = None) -> Style:
    return Style(template=int(rng.integers(len(_TEMPLATES[n_objects]))) if template is None else template,
                 small=_pick(rng, SIZE_WORDS["small"]), large=_pick(rng, SIZE_WORDS["large"]),
                 rel_phrase=int(rng.integers(3)), reverse=bool(rng.random() < 0.5))


def _captions(scene: Scene, rng: np.random.Generator) -> list[str]:
    """3-5 distinct paraphrases; the first in the default wording (template 0, first phrases)."""
    n = len(scene.objects)
    out = [describe(scene, Style(template=0))]
    want = int(rng.integers(3, 6))
    for _ in range(50):
        if len(out) == want:
            break
        cap = describe(scene, _random_style(rng, n))
        if cap not in out:
            out.append(cap)
    return out


# ----------------------------------------------------------------------------- one-thing-changed scenes
def _other(rng: np.random.Generator, options, exclude) -> str:
    return _pick(rng, [o for o in options if o != exclude])


def perturb(scene: Scene, kind: str, rng: np.random.Generator) -> Scene | None:
    """``scene`` with one thing changed: an object's colour, shape or size, the number of objects, or the
    relation (two objects: the inverse relation; three: two neighbours swapped). None if not possible."""
    objs = list(scene.objects)
    n = len(objs)
    if kind in ("colour", "shape", "size"):
        i = int(rng.integers(n))
        c, s, z = objs[i]
        if kind == "colour":
            objs[i] = (_other(rng, list(COLOURS), c), s, z)
        elif kind == "shape":
            objs[i] = (c, _pick(rng, [x for x in SHAPES if x not in {o[1] for o in objs}]), z)
        else:
            objs[i] = (c, s, _other(rng, SIZES, z))
        return Scene(tuple(objs), scene.layout)
    if kind == "relation":
        if n == 1:
            return None
        if n == 2:
            return Scene(scene.objects, INVERSE[scene.layout])
        i = int(rng.integers(2))
        objs[i], objs[i + 1] = objs[i + 1], objs[i]
        return Scene(tuple(objs), scene.layout)
    if kind == "count":
        if n == 1:  # a second object beside it
            return Scene((objs[0], _random_object(rng, exclude_shapes={objs[0][1]})), _pick(rng, RELATIONS))
        if n == 2:  # one of the two alone
            return Scene((objs[int(rng.integers(2))],))
        drop = int(rng.integers(3))  # three in a row or column -> two: the order gives the relation
        kept = tuple(o for j, o in enumerate(objs) if j != drop)
        return Scene(kept, "left" if scene.layout == "row" else "above")
    raise ValueError(f"unknown kind of change {kind!r}; expected one of {PROBE_KINDS}")


def _probe_entries(pool: list[tuple[str, Scene]], rng: np.random.Generator) -> list[dict]:
    """Per image: its caption and, in the same wording, the caption of each one-thing-changed scene."""
    out = []
    for path, sc in pool:
        style = _random_style(rng, len(sc.objects), template=0)
        negatives = []
        for kind in PROBE_KINDS:
            changed = perturb(sc, kind, rng)
            if changed is not None:
                # A scene of another object count keeps the wording choices but uses its own template 0.
                negatives.append({"kind": kind, "caption": describe(changed, style)})
        out.append({"image": path, "caption": describe(sc, style), "negatives": negatives})
    return out


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


# ----------------------------------------------------------------------------- NLVR sentences
def _side(side: int) -> str:
    return ("left", "right")[side]


def _obj_words(rng: np.random.Generator, obj: Obj) -> str:
    """'a big red circle' with a random size synonym."""
    words = f"{_pick(rng, SIZE_WORDS[obj[2]])} {obj[0]} {obj[1]}"
    return f"{_a(words)} {words}"


# Each template maps (rng, scenes, want, **form) to (sentence, truth), or (None, None) when this
# pair cannot give a sentence of that form with that label. `form` (which side, which number) is
# drawn before the pair, independently of the label, so no wording predicts the answer.
def _nlvr_has(rng, scenes, want, side):
    sc = scenes[side]
    # A false sentence names any object that image lacks (it often shares a colour or a shape with
    # one it has). Always one attribute off, as in the captions' hard negatives, the tiny model did
    # not learn the split within minutes (README, "NLVR2 on the synthetic data").
    obj = _pick(rng, sc.objects) if want else _random_object(rng)
    verb = _pick(rng, ("has", "contains", "shows"))
    return f"the {_side(side)} image {verb} {_obj_words(rng, obj)}", sc.has(obj)


def _nlvr_colour(rng, scenes, want, side):
    colour = _pick(rng, list(COLOURS))
    return (f"the {_side(side)} image has something {colour}",
            any(c == colour for c, _, _ in scenes[side].objects))


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
    changed = sc if want else perturb(sc, _pick(rng, ("colour", "shape", "size", "relation")), rng)
    a, b = changed.objects
    rel = changed.layout
    if rng.random() < 0.5:
        a, b, rel = b, a, INVERSE[rel]
    text = (f"the {_side(side)} image shows {_obj_words(rng, a)} {_pick(rng, REL_PHRASES[rel])} "
            f"{_obj_words(rng, b)}")
    return text, sc.relation_holds(a, rel, b)


def _nlvr_count(rng, scenes, want, side, k):
    noun = "shape" if k == 1 else "shapes"
    return f"the {_side(side)} image has exactly {COUNT_WORDS[k]} {noun}", k == len(scenes[side].objects)


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
    return _nlvr_count, {"side": side, "k": int(rng.integers(1, 4))}


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
    counts = ("0", "1", "2", "3")
    while True:
        kind = int(rng.integers(7))
        if kind == 0:
            c, s, _ = _pick(rng, sc.objects)
            return f"what colour is the {s}?", c, colours
        if kind == 1:
            obj = _pick(rng, sc.objects)
            if rng.random() < 0.5:
                obj = perturb(Scene((obj,)), _pick(rng, ("colour", "shape", "size")), rng).objects[0]
            return f"is there {_obj_words(rng, obj)}?", ("yes" if sc.has(obj) else "no"), ("yes", "no")
        if kind == 2:
            return "how many shapes are there?", str(len(sc.objects)), counts
        if kind == 3:
            c = _pick(rng, sc.objects)[0] if rng.random() < 0.6 else _pick(rng, colours)
            n = sum(1 for oc, _, _ in sc.objects if oc == c)
            return f"how many {c} shapes are there?", str(n), counts
        if kind == 4:
            _, s, z = _pick(rng, sc.objects)
            return f"what size is the {s}?", z, SIZES
        if len(sc.objects) == 2:
            a, b = sc.objects
            rel = sc.layout
            if rng.random() < 0.5:
                a, b, rel = b, a, INVERSE[rel]
            where = REL_PHRASES[rel][0]
            if kind == 5:
                return f"what shape is {where} the {b[1]}?", a[1], SHAPES
            return f"what colour is the shape {where} the {b[1]}?", a[0], colours
        if len(sc.objects) == 3 and kind == 5:
            return "what shape is in the middle?", sc.objects[1][1], SHAPES


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
    words |= {".", ",", "?", ":"}  # un-cleaned text keeps punctuation; BERT splits it into tokens
    return list(SPECIAL_TOKENS) + sorted(words - set(SPECIAL_TOKENS))


def _dump(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def split_sizes(n: int) -> dict[str, int]:
    """Number of images / pairs / questions per split for n pre-training images."""
    n_val = max(4, n // 6)
    return {"train_images": n, "val_images": n_val,
            # 1,000 test images at the default n=600: R@1 then has a standard error of about 1.4 points
            # (text retrieval, 1,000 queries) and 0.6 (image retrieval, ~4,000 captions).
            "test_images": max(4, 5 * n // 3), "pretrain_extra_images": 3 * n,
            # NLVR pairs reuse the split's images: many pairs, as NLVR2 (86k train pairs) has, so the tiny
            # model sees each sentence form often; dev/test hold 6 pairs per validation image, so that
            # accuracy is known to about +-0.02.
            "nlvr_train": 8 * n, "nlvr_dev": 6 * n_val, "nlvr_test": 6 * n_val,
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
        _render(sc, rng, image_size).save(os.path.join(out, rel_path), optimize=False)
        pool.append((rel_path, sc))
    return pool


def _build(out: str, n: int, seed: int, image_size: int = 64) -> dict:
    """Write the whole dataset into the (existing, empty) directory ``out``; returns the metadata."""
    if n < 4:
        raise ValueError(f"synthetic dataset needs n >= 4 images, got {n}")
    sizes = split_sizes(n)
    rng = np.random.default_rng(seed)
    pretrain_taken: set = set()  # pre-training images (train + extra) never repeat a scene
    pools: dict[str, list[tuple[str, Scene]]] = {}
    for split in ("train", "val", "test"):
        taken = pretrain_taken if split == "train" else set()  # eval splits: distinct within the split
        pools[split] = _render_pool(out, split, _sample_scenes(rng, sizes[f"{split}_images"], taken), rng,
                                    image_size)

    captions = {split: [_captions(sc, rng) for _, sc in pools[split]] for split in pools}
    files: dict[str, list | dict] = {}
    train = list(zip(pools["train"], captions["train"]))
    files["pretrain.json"] = _pretrain_entries([(p, caps) for (p, _), caps in train], rng)
    files["retrieval_train.json"] = [{"image": p, "caption": c, "image_id": i}
                                     for i, ((p, _), caps) in enumerate(train) for c in caps]
    for split in ("val", "test"):
        files[f"retrieval_{split}.json"] = [{"image": p, "caption": caps}
                                            for (p, _), caps in zip(pools[split], captions[split])]
    files["probe_test.json"] = _probe_entries(pools["test"], np.random.default_rng([seed, 4]))
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
    extra_scenes = _sample_scenes(extra_rng, sizes["pretrain_extra_images"], pretrain_taken)
    pools["pretrain"] = _render_pool(out, "pretrain", extra_scenes, extra_rng, image_size)
    extra_caps = [(p, _captions(sc, extra_rng)) for p, sc in pools["pretrain"]]
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
    print(json.dumps({"out": args.out, "seconds": round(time.time() - start, 2), **meta["sizes"],
                      "pretrain_statistics": meta["pretrain_statistics"]}))


if __name__ == "__main__":
    main()
