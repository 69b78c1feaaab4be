"""NLVR2 sentences and VQA questions about synthetic scenes (dataset/synthetic_world.py): balanced
labels, forms drawn independently of the label, answers with annotator noise."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .synthetic_world import (
    COLOURS,
    COUNT_WORDS,
    INVERSE,
    REL_PHRASES,
    SHAPES,
    SIZE_WORDS,
    SIZES,
    Obj,
    Scene,
    indefinite_article,
    perturb,
    pick,
    random_object,
)

__all__ = ["nlvr_split", "vqa_split"]


# ----------------------------------------------------------------------------- NLVR sentences
def _side(side: int) -> str:
    return ("left", "right")[side]


def _obj_words(rng: np.random.Generator, obj: Obj) -> str:
    """'a big red circle' with a random size synonym."""
    words = f"{pick(rng, SIZE_WORDS[obj[2]])} {obj[0]} {obj[1]}"
    return f"{indefinite_article(words)} {words}"


# Each template maps (rng, scenes, want, **form) to (sentence, truth), or (None, None) when this
# pair cannot give a sentence of that form with that label. `form` (which side, which number) is
# drawn before the pair, independently of the label, so no wording predicts the answer.
def _nlvr_has(rng, scenes, want, side):
    sc = scenes[side]
    # A false sentence names any object that image lacks (it often shares a colour or a shape with
    # one it has). Always one attribute off, as in the captions' hard negatives, the tiny model did
    # not learn the split within minutes (docs/synthetic-world.md, 'NLVR2 on the synthetic data').
    obj = pick(rng, sc.objects) if want else random_object(rng)
    verb = pick(rng, ("has", "contains", "shows"))
    return f"the {_side(side)} image {verb} {_obj_words(rng, obj)}", sc.has(obj)


def _nlvr_colour(rng, scenes, want, side):
    colour = pick(rng, list(COLOURS))
    return (f"the {_side(side)} image has something {colour}",
            any(c == colour for c, _, _ in scenes[side].objects))


def _nlvr_both(rng, scenes, want):
    options = sorted(scenes[0].shapes() & scenes[1].shapes()) if want else SHAPES
    if not options:
        return None, None
    shape = pick(rng, options)
    sentence = f"both images contain {indefinite_article(shape)} {shape}"
    return sentence, all(shape in sc.shapes() for sc in scenes)


def _nlvr_neither(rng, scenes, want):
    present = scenes[0].shapes() | scenes[1].shapes()
    options = [s for s in SHAPES if (s not in present) == want]
    if not options:
        return None, None
    shape = pick(rng, options)
    return f"neither image contains {indefinite_article(shape)} {shape}", shape not in present


def _nlvr_rel(rng, scenes, want, side):
    sc = scenes[side]
    if len(sc.objects) != 2:
        return None, None
    changed = sc if want else perturb(sc, pick(rng, ("colour", "shape", "size", "relation")), rng)
    a, b = changed.objects
    rel = changed.layout
    if rng.random() < 0.5:
        a, b, rel = b, a, INVERSE[rel]
    text = (f"the {_side(side)} image shows {_obj_words(rng, a)} {pick(rng, REL_PHRASES[rel])} "
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


def nlvr_split(rng: np.random.Generator, pool: list[tuple[str, Scene]], count: int) -> list[dict]:
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
            c, s, _ = pick(rng, sc.objects)
            return f"what colour is the {s}?", c, colours
        if kind == 1:
            obj = pick(rng, sc.objects)
            if rng.random() < 0.5:
                obj = perturb(Scene((obj,)), pick(rng, ("colour", "shape", "size")), rng).objects[0]
            return f"is there {_obj_words(rng, obj)}?", ("yes" if sc.has(obj) else "no"), ("yes", "no")
        if kind == 2:
            return "how many shapes are there?", str(len(sc.objects)), counts
        if kind == 3:
            c = pick(rng, sc.objects)[0] if rng.random() < 0.6 else pick(rng, colours)
            n = sum(1 for oc, _, _ in sc.objects if oc == c)
            return f"how many {c} shapes are there?", str(n), counts
        if kind == 4:
            _, s, z = pick(rng, sc.objects)
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


def vqa_split(rng: np.random.Generator, pool: list[tuple[str, Scene]], count: int,
               first_qid: int) -> list[dict]:
    out = []
    for q in range(count):
        path, sc = pool[int(rng.integers(len(pool)))]
        question, answer, domain = _vqa_question(rng, sc)
        n_right = int(rng.integers(7, 11))  # annotators mostly agree -> soft scores 0.7-1.0
        wrong = [o for o in domain if o != answer]
        answers = [answer] * n_right + [pick(rng, wrong) for _ in range(10 - n_right)]
        answers = [answers[int(i)] for i in rng.permutation(10)]
        out.append({"question_id": first_qid + q, "image": path, "question": question, "answer": answers,
                    "dataset": "vqa"})
    return out
