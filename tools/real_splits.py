"""Leak-free splits of the real corpora (tools.make_real): whole concept families to val and test, one
emoji artist held out, and the check that refuses a split in which a family crosses splits.

- Equal drawings, one family: before splitting, join_duplicates joins the families of drawings whose
  stored 64 px images are equal (OpenClipart files one drawing under several titles too: 'Baby Tux' and
  'NinJa Tux', 'Hub' and '5 port hub'; Twemoji draws two flags alike) or that share a caption as
  training cleans it (an OpenClipart drawing titled 'bacon' and the emoji whose CLDR label is 'bacon').
  An independent check of an earlier build, whose OpenClipart families included the folder, found 12 %
  of val and test pixel-equal to a training drawing and 15 % with a caption found in training; both
  checks are now tests of the build.
- Held-out concepts: a family goes to train, val or test by a hash of (seed, family), 80 / 10 / 10, so
  that its place does not depend on which other families exist. A family of more than MAX_EVAL_FAMILY
  drawings by one artist stays in training (OpenClipart's 1,375 'gramastar' stars, its icon sets of
  hundreds under one title): held out, it would be a test set of its own under one caption.
- In val and test every emoji family is drawn by one artist (by the same hash, among the artists read),
  because the artists share the CLDR captions: two drawings under one caption would make text-to-image
  recall ambiguous. For the same reason an evaluation file holds each caption once (the first drawing
  that has it keeps it; a drawing left with no caption is dropped).
- Held-out artist: HELD_OUT_ARTIST's drawings are never trained on; its test file holds its drawings of
  families that the other artists draw in training, under the same captions, at most MAX_ARTIST_TEST
  drawings, whole families by hash order (a family only the held-out artist draws is in no file).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from dataset.utils import pre_caption
from tools.real_sources import Item
from training.config_files import ConfigError

__all__ = ["HELD_OUT_ARTIST", "MAX_ARTIST_TEST", "MAX_EVAL_FAMILY", "SHARES", "assign_families",
           "check_no_leak", "eval_entries", "join_duplicates", "split_items", "unit"]

SHARES = (0.8, 0.1, 0.1)  # train, val, test
MAX_EVAL_FAMILY = 30
HELD_OUT_ARTIST = "openmoji"
MAX_ARTIST_TEST = 1000


def unit(seed: int, *key: str) -> float:
    """A number in [0, 1) fixed by (seed, key): the same on every machine and Python."""
    digest = hashlib.sha256("\x1f".join([str(seed), *key]).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64


def join_duplicates(items: Sequence[Item], keys: Mapping[str, Iterable[str]]) -> list[Item]:
    """The items with the families of equal drawings joined: keys maps each item's image to what makes two
    drawings one (the digest of its stored pixels, its cleaned captions); the families linked by a shared
    key (transitively) become one, named by the smallest of them."""
    parent: dict[str, str] = {}

    def root(family: str) -> str:
        while parent.setdefault(family, family) != family:
            parent[family] = parent[parent[family]]  # path halving
            family = parent[family]
        return family

    first: dict[str, str] = {}  # key -> a family that has it
    for it in items:
        for key in keys[it.image]:
            a, b = root(it.family), root(first.setdefault(key, it.family))
            if a != b:
                parent[max(a, b)] = min(a, b)  # the smallest name roots its component
    return [it if root(it.family) == it.family else dataclasses.replace(it, family=root(it.family))
            for it in items]


def assign_families(items: Sequence[Item], seed: int) -> dict[str, str]:
    """family -> 'train' | 'val' | 'test' (see the module docstring)."""
    size = Counter((it.family, it.artist) for it in items)
    largest: dict[str, int] = defaultdict(int)
    for (family, _), n in size.items():
        largest[family] = max(largest[family], n)
    out = {}
    for family, n in largest.items():
        u = unit(seed, "split", family)
        held = n <= MAX_EVAL_FAMILY
        out[family] = ("val" if held and u < SHARES[1] else
                       "test" if held and u < SHARES[1] + SHARES[2] else "train")
    return out


def eval_entries(items: Iterable[Item]) -> tuple[list[dict], int]:
    """Retrieval entries {"image", "caption": [...], "family", "artist", "source"} holding each caption once
    (first come, first kept) -> (entries, drawings dropped for want of a caption of their own)."""
    seen: set[str] = set()
    out, dropped = [], 0
    for it in items:
        own = [c for c in it.captions if pre_caption(c) not in seen]  # as the model reads it
        seen.update(pre_caption(c) for c in own)
        if not own:
            dropped += 1
            continue
        out.append({"image": it.image, "caption": own, "family": it.family, "artist": it.artist,
                    "source": it.source})
    return out, dropped


def split_items(items: Sequence[Item], seed: int) -> dict[str, list[Item]]:
    """The drawings of each file: 'pretrain' (training families, every artist but HELD_OUT_ARTIST), 'val'
    and 'test' (held-out families, an emoji family in one artist's drawings), 'test_artist' (the held-out
    artist's drawings of training families)."""
    where = assign_families(items, seed)
    out: dict[str, list[Item]] = {"pretrain": [], "val": [], "test": [], "test_artist": []}
    held_out_artist: dict[str, list[Item]] = defaultdict(list)  # training family -> its drawings
    drawers: dict[str, set[str]] = defaultdict(set)  # held-out emoji family -> its artists
    for it in items:
        split = where[it.family]
        if split == "train":
            (held_out_artist[it.family] if it.artist == HELD_OUT_ARTIST else out["pretrain"]).append(it)
        else:
            out[split].append(it)
            drawers[it.family].add(it.artist)
    chosen = {family: min(who, key=lambda a, f=family: unit(seed, "artist", f, a))
              for family, who in drawers.items()}
    for split in ("val", "test"):
        out[split] = [it for it in out[split] if chosen[it.family] == it.artist]
    trained = {it.family for it in out["pretrain"]}  # a family only the held-out artist draws is no test here
    for family in sorted(held_out_artist.keys() & trained, key=lambda f: unit(seed, "artist test", f)):
        if len(out["test_artist"]) + len(held_out_artist[family]) <= MAX_ARTIST_TEST:
            out["test_artist"].extend(held_out_artist[family])
    return out


def _kind(name: str) -> str:
    """A file's kind by its name: 'pretrain', 'artist' (test_artist*), or its concept split (val, test)."""
    if name.startswith("pretrain"):
        return "pretrain"
    if name.startswith("test_artist"):
        return "artist"
    if name.startswith(("val", "test")):
        return name.split("_")[0]
    raise ValueError(f"check_no_leak: {name!r} is no pretrain*, val*, test* or test_artist* file")


def check_no_leak(files: dict[str, list[dict]], held_out_artist: str = HELD_OUT_ARTIST) -> None:
    """Refuse, with ConfigError naming the family (or drawing) and the files, a split in which the held-out
    artist is trained on, a family of a val or test file is trained on, or a family is in both val and
    test; files: {file name: its entries, each with "family" and "artist"}, named pretrain*, val*, test*
    and test_artist* (the held-out artist's drawings of training families)."""
    kinds = {name: _kind(name) for name in files}
    trained: dict[str, str] = {}
    for name in (n for n, k in kinds.items() if k == "pretrain"):
        for e in files[name]:
            if e["artist"] == held_out_artist:
                raise ConfigError(f"split leak: {name} trains on {e['image']}, a drawing of the held-out "
                                  f"artist {held_out_artist}")
            trained.setdefault(e["family"], name)
    held: dict[str, tuple[str, str]] = {}  # family -> (its concept split, the file it was first seen in)
    for name, kind in kinds.items():
        for e in files[name] if kind in ("val", "test", "artist") else ():
            family = e["family"]
            if kind == "artist":
                if e["artist"] != held_out_artist:
                    raise ConfigError(f"{name}: {e['image']} is not a drawing of the held-out artist "
                                      f"{held_out_artist}")
                continue
            if family in trained:
                raise ConfigError(f"split leak: family {family!r} is in {name} and in {trained[family]}")
            split, first = held.setdefault(family, (kind, name))
            if split != kind:
                raise ConfigError(f"split leak: family {family!r} is in {first} and in {name}")
