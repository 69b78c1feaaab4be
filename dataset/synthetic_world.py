"""The synthetic world: scenes of one to three coloured shapes, their images, their captions, and the
same scene with one thing changed (hard negatives, the probe). Pure numpy and PIL, no torch.

A scene's caption names every object with its size, colour and shape, and the relation (two objects)
or the order (three), so a caption is true of exactly one scene. dataset/synthetic.py writes the
corpus; dataset/synthetic_tasks.py writes NLVR2 sentences and VQA questions about the scenes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["COLOURS", "PROBE_KINDS", "RELATIONS", "SHAPES", "SIZES", "Scene", "describe", "perturb"]

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
# Objects stand at the centres of a 3 x 3 grid of cells; radius as a share of the cell side. A cell of a
# 48 px image is 16 px, 2 x 2 patches of 8 px, so every (shape, size) is one fixed pixel pattern per
# patch: a tiny ViT trained from scratch sees shapes and sizes within minutes (docs/synthetic-world.md,
# format 5).
SIZE_RADIUS = {"small": 0.25, "large": 0.42}
GRID = 3
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


def indefinite_article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


# ----------------------------------------------------------------------------- scenes and images
def random_object(rng: np.random.Generator, exclude_shapes=()) -> Obj:
    shapes = [s for s in SHAPES if s not in exclude_shapes]
    return (pick(rng, list(COLOURS)), pick(rng, shapes), pick(rng, SIZES))


def _random_scene(rng: np.random.Generator) -> Scene:
    k = int(rng.choice(3, p=N_OBJECTS_P)) + 1
    objs: list[Obj] = []
    for _ in range(k):  # distinct shapes keep questions ("what colour is the circle?") unambiguous
        objs.append(random_object(rng, exclude_shapes={s for _, s, _ in objs}))
    layout = None if k == 1 else pick(rng, RELATIONS) if k == 2 else pick(rng, ("row", "column"))
    return Scene(tuple(objs), layout)


def sample_scenes(rng: np.random.Generator, count: int, taken: set | None = None,
                  strict: bool = False) -> list[Scene]:
    """``count`` scenes, none equal to another or to one in ``taken`` (which is updated).

    Once ~200,000 scenes are nearly used up (10,000 draws in a row all taken), scenes repeat, or, with
    strict (the evaluation splits and what must stay apart from them), a ValueError is raised.
    """
    taken = set() if taken is None else taken
    scenes: list[Scene] = []
    misses = 0
    while len(scenes) < count:
        sc = _random_scene(rng)
        key = sc.canonical()
        if key in taken and misses < 10_000:
            misses += 1
            continue
        if key in taken:
            if strict:
                raise ValueError(f"the synthetic world has too few unused scenes for {count} more; "
                                 "use a smaller n")
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


def _cells(scene: Scene, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Grid cells (column, row) of the objects: two objects share a row (left/right) or a column
    (above/below), three fill one row or column, so exactly one relation (or order) is visually true."""
    n = len(scene.objects)
    if n == 1:
        return [(int(rng.integers(GRID)), int(rng.integers(GRID)))]
    line = int(rng.integers(GRID))
    if n == 2:
        near, far = sorted(int(x) for x in rng.choice(GRID, size=2, replace=False))
        a, b = (near, far) if scene.layout in ("left", "above") else (far, near)
        return [(a, line), (b, line)] if scene.layout in ("left", "right") else [(line, a), (line, b)]
    if scene.layout == "row":
        return [(j, line) for j in range(GRID)]
    return [(line, j) for j in range(GRID)]


def render(scene: Scene, rng: np.random.Generator, size: int) -> Image.Image:
    """(size x size) RGB image of ``scene`` on a lightly noisy grey background."""
    noise = rng.integers(-6, 7, size=(size, size, 1), dtype=np.int16)
    bg = np.clip(228 + noise, 0, 255).astype(np.uint8).repeat(3, axis=2)
    img = Image.fromarray(bg, "RGB")
    draw = ImageDraw.Draw(img)
    cell = size / GRID
    for (colour, shape, sz), (col, row) in zip(scene.objects, _cells(scene, rng)):
        _draw_shape(draw, shape, (col + 0.5) * cell, (row + 0.5) * cell, SIZE_RADIUS[sz] * cell,
                    COLOURS[colour])
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
    return f"{indefinite_article(words)} {words}" if article else words


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
                 small=pick(rng, SIZE_WORDS["small"]), large=pick(rng, SIZE_WORDS["large"]),
                 rel_phrase=int(rng.integers(3)), reverse=bool(rng.random() < 0.5))


def scene_captions(scene: Scene, rng: np.random.Generator) -> list[str]:
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
    return pick(rng, [o for o in options if o != exclude])


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
            objs[i] = (c, pick(rng, [x for x in SHAPES if x not in {o[1] for o in objs}]), z)
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
            return Scene((objs[0], random_object(rng, exclude_shapes={objs[0][1]})), pick(rng, RELATIONS))
        if n == 2:  # one of the two alone
            return Scene((objs[int(rng.integers(2))],))
        drop = int(rng.integers(3))  # three in a row or column -> two: the order gives the relation
        kept = tuple(o for j, o in enumerate(objs) if j != drop)
        return Scene(kept, "left" if scene.layout == "row" else "above")
    raise ValueError(f"unknown kind of change {kind!r}; expected one of {PROBE_KINDS}")


def probe_entries(pool: list[tuple[str, Scene]], rng: np.random.Generator) -> list[dict]:
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
