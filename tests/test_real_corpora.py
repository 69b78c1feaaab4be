"""The real corpora's converter (tools.make_real) offline, on packages the tests make in each package's own
layout: emoji-datasource-google/-twitter (emoji.json, 64 px PNGs), openmoji (openmoji.csv, colour SVGs),
emojibase-data (en/data.json) and Debian's openclipart-svg/-png (.deb archives, SVGs with RDF metadata).
Captions, RGB images on white, families, leak-free splits (a property over seeds), the fetch's record
and errors, and a tiny pre-training on the result, from the json lists and from the shards, evaluated
zero-shot."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import stat
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from tools.real_packages import PACKAGES, fetch, members
from tools.real_sources import Item, clipart_captions, emoji_family, on_white, svg_metadata, title_stem
from tools.real_splits import MAX_EVAL_FAMILY, check_no_leak, eval_entries, split_items
from training.config_files import ConfigError

# ------------------------------------------------------------------------------------------ the packages

EMOJIBASE = [  # emojibase-data's en/data.json: label, hexcode, tags, skins
    {"label": "waving hand", "hexcode": "1F44B", "tags": ["hand", "wave"],
     "skins": [{"label": f"waving hand: {tone} skin tone", "hexcode": f"1F44B-{code}", "tone": i + 1}
               for i, (tone, code) in enumerate([("light", "1F3FB"), ("dark", "1F3FF")])]},
    {"label": "grinning face", "hexcode": "1F600", "tags": ["face", "grin"]},
    {"label": "person running", "hexcode": "1F3C3", "tags": ["marathon", "running"]},
    {"label": "man running", "hexcode": "1F3C3-200D-2642-FE0F", "tags": ["man", "running"]},
    {"label": "woman running", "hexcode": "1F3C3-200D-2640-FE0F", "tags": ["running", "woman"]},
    {"label": "man", "hexcode": "1F468", "tags": ["adult"]},
    {"label": "woman", "hexcode": "1F469", "tags": ["adult"]},
    {"label": "red heart", "hexcode": "2764-FE0F", "tags": ["heart"]},
    {"label": "keycap: #", "hexcode": "0023-FE0F-20E3", "tags": []},
    {"label": "keycap: *", "hexcode": "002A-FE0F-20E3", "tags": []},
    {"label": "!!", "hexcode": "203C-FE0F", "tags": []},  # nothing left after cleaning: left out
]
DRAWN = ["1F44B", "1F600", "1F3C3", "1F3C3-200D-2642-FE0F", "1F3C3-200D-2640-FE0F", "1F468", "1F469",
         "2764-FE0F", "0023-FE0F-20E3", "002A-FE0F-20E3", "203C-FE0F"]
N_CLIPART = 60  # one-drawing families, plus a collection of near-copies


def _png(mode: str, size: int = 20, seed: int = 0) -> bytes:
    """A small PNG in `mode` whose left half is transparent (where the mode has transparency) and whose
    right half holds a colour and a bar, both drawn from the seed (distinct drawings for distinct seeds)."""
    rng = random.Random(seed)
    colour = tuple(rng.randrange(40, 200) for _ in range(3))
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    image.paste(Image.new("RGBA", (size // 2, size), (*colour, 255)), (size // 2, 0))
    image.paste(Image.new("RGBA", (size // 2, 2), (0, 0, 0, 255)), (size // 2, 2 * (seed % (size // 2))))
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE)  # RGBA -> P keeps a transparent index
    elif mode != "RGBA":
        image = image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _svg(title: str | None, tags: list[str], colour: str = "#c03020") -> bytes:
    meta = "" if title is None else (
        '<metadata><rdf:RDF><cc:Work rdf:about=""><dc:title>' + title + "</dc:title><dc:subject><rdf:Bag>"
        + "".join(f"<rdf:li>{t}</rdf:li>" for t in tags) + "<rdf:li></rdf:li></rdf:Bag></dc:subject>"
        "<dc:publisher><cc:Agent><dc:title>Somebody Else</dc:title></cc:Agent></dc:publisher>"
        "</cc:Work></rdf:RDF></metadata>")
    return ('<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" '
            'xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:cc="http://web.resource.org/cc/" '
            'xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#" width="40" height="40">'
            f'{meta}<rect x="20" y="0" width="20" height="40" fill="{colour}"/></svg>').encode()


def _tgz(path: str, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _deb(path: str, files: dict[str, bytes]) -> None:
    """A Debian package: an ar archive of debian-binary, control.tar.xz and data.tar.xz ('./' names)."""
    def tar_xz(entries: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, data in entries.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    parts = [("debian-binary", b"2.0\n"), ("control.tar.xz", tar_xz({"control": b"Package: x\n"})),
             ("data.tar.xz", tar_xz(files))]
    with open(path, "wb") as f:
        f.write(b"!<arch>\n")
        for name, data in parts:
            f.write(f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode())
            f.write(data + (b"\n" if len(data) % 2 else b""))


def clipart_fixture() -> dict[str, tuple[bytes | None, bytes | None]]:
    """OpenClipart drawings: folder/name -> (SVG, PNG); a PNG in LA, P or RGB mode; one SVG without a PNG,
    one without metadata, and eight 'gramastar' near-copies (one family)."""
    out = {}
    for i in range(N_CLIPART):
        mode = ("LA", "P", "RGB")[i % 3]
        out[f"things/group{i % 4}/thing_{i:02d}"] = (_svg(f"Thing number {i} {chr(97 + i % 26) * 3}",
                                                          ["thing", f"kind_{i}"]), _png(mode, 30, i))
    for i in range(8):
        out[f"shapes/stars/star_{i}"] = (_svg("gramastar", ["stars", "shapes"]), _png("RGBA", 24, 100 + i))
    tux = _png("RGB", 30, 500)  # one drawing under two titles, and one under one title in two folders
    out["animals/birds/baby_tux"] = (_svg("Baby Tux", ["penguin"]), tux)
    out["computer/icons/ninja_tux"] = (_svg("NinJa Tux", ["penguin"]), tux)
    out["buildings/lighthouse"] = (_svg("Lighthouse", ["sea"]), _png("RGB", 30, 501))
    out["transportation/lighthouse"] = (_svg("Lighthouse", ["boat"]), _png("RGB", 30, 501))
    out["people/waving_hand"] = (_svg("Waving hand", ["hello"]), _png("RGB", 30, 502))  # CLDR's label
    out["misc/no_png"] = (_svg("lonely", ["x"]), None)
    out["misc/no_metadata"] = (_svg(None, []), _png("RGB", 16, 7))
    return out


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> str:
    """The six packages in their layouts, recorded in packages.json as tools.real_packages.fetch records
    them (so the build reads them, offline)."""
    folder = str(tmp_path_factory.mktemp("packages"))
    files = {}
    for artist, mode in (("google", "RGBA"), ("twitter", "P")):
        entries, images = [], {}
        for k, code in enumerate(c for c in DRAWN if "-1F3F" not in c):
            entry = {"unified": code, "image": f"{code.lower()}.png", f"has_img_{artist}": True}
            if code == "1F44B":
                entry["skin_variations"] = {t: {"unified": f"1F44B-{t}", "image": f"1f44b-{t.lower()}.png",
                                                f"has_img_{artist}": True} for t in ("1F3FB", "1F3FF")}
            entries.append(entry)
            for one in [entry, *entry.get("skin_variations", {}).values()]:
                images[f"package/img/{artist}/64/{one['image']}"] = _png(mode, 64, k)
        entries.append({"unified": "E000", "image": "e000.png", f"has_img_{artist}": True})  # not CLDR
        images[f"package/img/{artist}/64/e000.png"] = _png(mode, 64, 99)
        name = PACKAGES[f"emoji-datasource-{artist}"]
        files[name.name] = f"{name.name}-{name.version}.tgz"
        _tgz(os.path.join(folder, files[name.name]), {"package/emoji.json": json.dumps(entries).encode(),
                                                       **images})
    rows = ["emoji,hexcode,group,annotation"] + [f"x,{c},g,a" for c in [*DRAWN, "1F44B-1F3FB", "E0FF"]]
    rows.append("x,1F600-FE0F,g,a")  # listed, no SVG: counted, not read
    svgs = {f"package/color/svg/{c}.svg": _svg(None, [], f"#{20 * k:02x}60c0")
            for k, c in enumerate([*DRAWN, "1F44B-1F3FB", "E0FF"])}
    files["openmoji"] = "openmoji-17.0.0.tgz"
    _tgz(os.path.join(folder, files["openmoji"]), {"package/data/openmoji.csv": "\n".join(rows).encode(),
                                                   **svgs})
    files["emojibase-data"] = "emojibase-data-17.0.0.tgz"
    _tgz(os.path.join(folder, files["emojibase-data"]),
         {"package/en/data.json": json.dumps(EMOJIBASE).encode()})
    clip = clipart_fixture()
    files["openclipart-svg"] = "openclipart-svg_1%3a0.18+dfsg-19_all.deb"
    _deb(os.path.join(folder, files["openclipart-svg"]),
         {f"usr/share/openclipart/svg/{k}.svg": s for k, (s, _) in clip.items()})
    files["openclipart-png"] = "openclipart-png_1%3a0.18+dfsg-19_all.deb"
    _deb(os.path.join(folder, files["openclipart-png"]),
         {f"usr/share/openclipart/png/{k}.png": p for k, (_, p) in clip.items() if p is not None})
    record = {}
    for name, file in files.items():
        with open(os.path.join(folder, file), "rb") as f:
            record[name] = {"version": PACKAGES[name].version, "registry": PACKAGES[name].registry,
                            "file": file, "sha256": hashlib.sha256(f.read()).hexdigest(),
                            "licence": PACKAGES[name].licence}
    with open(os.path.join(folder, "packages.json"), "w") as f:
        json.dump(record, f)
    return folder


@pytest.fixture(scope="module")
def built(packages, tmp_path_factory) -> tuple[str, dict]:
    """tools.make_real run on the fixture packages: (its output folder, its data card)."""
    from tools.make_real import main

    out = str(tmp_path_factory.mktemp("real"))
    card = main(["--output_dir", out, "--packages", packages, "--shard_size", "20", "--vocab_size", "200"])
    return out, card


def _load(folder: str, name: str):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------ the tests

def test_emoji_families_join_skin_tones_and_genders_across_code_forms():
    assert emoji_family("1F44B-1F3FF") == emoji_family("1F44B") == "1F44B"
    assert emoji_family("1F3C3-200D-2642-FE0F") == emoji_family("1F3C3-200D-2640") == "1F3C3"
    assert emoji_family("1F468") == emoji_family("1F469") == emoji_family("1F9D1-1F3FD") == "1F9D1"
    assert emoji_family("1F468-1F3FB-200D-1F4BB") == emoji_family("1F9D1-200D-1F4BB")  # technologists
    assert emoji_family("1F46B-1F3FB") == emoji_family("1F9D1-1F3FF-200D-1F91D-200D-1F9D1-1F3FB")
    assert emoji_family("2764-FE0F") == "2764" and emoji_family("1F600") != emoji_family("1F601")


def test_the_vocabulary_is_the_words_of_two_drawings_with_characters_and_the_same_every_time():
    """train_vocab: special tokens, every character alone and as '##' continuation, then the words found in
    at least two drawings (one drawing's three captions count once), most drawings first, ties by the
    word; cut at the size; the same list from the same captions in any order; the tokenizer built on it
    keeps such a word whole and spells a new one in characters."""
    from transformers import BertTokenizerFast

    from tools.make_real import train_vocab

    drawings = [["Red apple", "Red apple, fruit"], ["green Apple", "apple, fruit"], ["Pear", "pear, fruit"],
                ["Crème brûlée", "dessert"]]
    vocab = train_vocab(drawings, 100)
    chars = sorted(set("red apple green fruit pear creme brulee dessert") - {" "})  # accents stripped
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert vocab[5:5 + len(chars)] == chars
    assert vocab[5 + len(chars):5 + 2 * len(chars)] == [f"##{c}" for c in chars]
    assert vocab[5 + 2 * len(chars):] == ["fruit", "apple"]  # 3 drawings, then 2; red, pear: one drawing each
    assert train_vocab(list(reversed(drawings)), 100) == vocab
    assert train_vocab(drawings, 5 + 2 * len(chars) + 1)[-1] == "fruit"
    with pytest.raises(ConfigError, match="--vocab_size 10"):
        train_vocab(drawings, 10)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "vocab.txt")
        with open(path, "w") as f:
            f.write("\n".join(vocab) + "\n")
        tokens = BertTokenizerFast(vocab_file=path).tokenize("apple pear")
    assert tokens == ["apple", "p", "##e", "##a", "##r"]


def test_captions_are_the_fields_joined_and_nothing_else():
    assert svg_metadata(_svg("Chinese flag (correct)", ["flags", "asia"])) == ("Chinese flag (correct)",
                                                                                ["flags", "asia"])
    assert svg_metadata(b"<svg") is None
    assert clipart_captions("Chinese flag", ["united_nations_member", "flag"], "signs_and_symbols/flags") == [
        "Chinese flag", "Chinese flag, united nations member, flag", "Chinese flag, signs and symbols flags"]
    assert clipart_captions("", ["star", "shape"], "shapes") == ["star, shape"]
    assert title_stem("Gramastar 12 (b)") == "gramastar b"


def test_images_become_rgb_on_white_at_64_px():
    for mode in ("RGBA", "P", "LA", "RGB", "L"):
        image = on_white(Image.open(io.BytesIO(_png(mode, 20, 3))))
        assert image.mode == "RGB" and image.size == (64, 64), mode
        if mode != "RGB" and mode != "L":  # the transparent left half is white, not black
            assert image.getpixel((5, 32)) == (255, 255, 255), mode
    wide = on_white(Image.new("RGB", (80, 20), (0, 0, 0)))  # fitted: padded with white above and below
    assert wide.getpixel((32, 2)) == (255, 255, 255) and wide.getpixel((32, 32)) == (0, 0, 0)


def test_emoji_items_carry_cldr_captions_for_every_artist(packages):
    from tools.real_sources import emoji_items

    record = _load(packages, "packages.json")
    paths = {name: os.path.join(packages, r["file"]) for name, r in record.items()}
    items, left_out = emoji_items(paths, ["google", "twitter", "openmoji"])
    by_key = {(it.artist, it.key): it for it in items}
    dark = by_key[("google", "1F44B-1F3FF")]
    assert dark.captions == ["waving hand: dark skin tone", "waving hand: dark skin tone, hand, wave"]
    assert dark.family == by_key[("openmoji", "1F44B-1F3FB")].family == "1F44B"
    assert by_key[("twitter", "2764")].captions == ["red heart", "red heart, heart"]
    keycap = by_key[("openmoji", "0023-20E3")]
    assert keycap.captions == ["keycap: #"] and keycap.svg
    assert left_out == {"no CLDR annotation": 3, "no usable caption": 3,  # E000 twice, E0FF; '!!' thrice
                        "listed without its image file": 1}  # OpenMoji's row without its SVG
    assert len(items) == 3 * (len(DRAWN) - 1) + 2 * 2 + 1  # + tones: 2 by google, twitter; 1 by openmoji


def test_the_build_writes_captions_images_families_and_a_clean_split(built):
    out, card = built
    emoji = _load(out, "pretrain_emoji.json")
    pretrain = emoji + _load(out, "pretrain_clipart.json")
    by_image = {e["image"]: e for e in pretrain + _load(out, "val.json") + _load(out, "test.json")}
    running = {e["family"] for e in by_image.values() if e["caption"][0].endswith("running")}
    assert running <= {"1F3C3"}  # man, woman and person running: one family
    assert not any(e["artist"] == "openmoji" for e in pretrain)  # the held-out artist
    assert all(e["artist"] == "openmoji" for e in _load(out, "test_artist.json"))
    assert not any("E000" in e["image"] or "203C" in e["image"] for e in by_image.values())  # no CLDR text
    assert card["left_out"]["emoji"] == {"no CLDR annotation": 3, "no usable caption": 3,
                                         "listed without its image file": 1}
    assert card["left_out"]["clipart"] == {"no PNG": 1, "unreadable SVG": 0, "no title and no tags": 1}
    stars = [e for e in by_image.values() if "/shapes/stars/" in e["image"]]
    assert len({e["family"] for e in stars}) == 1 and len(stars) == 8  # near-copies: one family, all kept
    for name in ("images/emoji/google/1F600.png", "images/emoji/twitter/1F600.png"):
        image = Image.open(os.path.join(out, name))
        assert image.mode == "RGB" and image.size == (64, 64) and image.getpixel((3, 30)) == (255, 255, 255)
    # every held-out file: families nobody trains on, each caption (as cleaned) once
    trained = {e["family"] for e in pretrain}
    for name in ("val.json", "test.json"):
        held = _load(out, name)
        assert held and not {e["family"] for e in held} & trained
        cleaned = [c.lower().replace(":", "").replace("#", "").strip() for e in held for c in e["caption"]]
        assert len(cleaned) == len(set(cleaned))
    scenes = _load(out, "scenes.json")
    assert scenes == {e["image"]: e["family"] for e in pretrain}
    vocab = open(os.path.join(out, "vocab.txt")).read().split()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and "thing" in vocab
    assert card["files"]["pretrain_clipart"]["drawings"] == len(_load(out, "pretrain_clipart.json"))
    assert card["shards"]["samples"] == len(pretrain)


def test_equal_drawings_are_one_family_and_never_in_two_splits(built):
    """A drawing filed under two titles, or under one title in two folders, is one family, and so are an
    emoji and a clip art under one caption; no stored image of val or test has the pixels of a training
    image, and no caption of theirs is a training caption (what an independent check of an earlier build
    found in 12 % and 15 % of them, when OpenClipart's families included the folder)."""
    import hashlib

    out, _ = built
    files = {n: _load(out, f"{n}.json") for n in ("pretrain_emoji", "pretrain_clipart", "val", "test")}
    family = {e["image"]: e["family"] for entries in files.values() for e in entries}
    clip = "images/clipart/openclipart/"
    tux = (family[f"{clip}animals/birds/baby_tux.png"], family[f"{clip}computer/icons/ninja_tux.png"])
    assert tux == ("baby tux", "baby tux")  # the smaller name of the two
    assert family[f"{clip}buildings/lighthouse.png"] == family[f"{clip}transportation/lighthouse.png"]

    def digests(names):
        return {hashlib.sha256(Image.open(os.path.join(out, e["image"])).convert("RGB").tobytes()).hexdigest()
                for n in names for e in files[n]}

    trained = digests(["pretrain_emoji", "pretrain_clipart"])
    assert not digests(["val"]) & trained and not digests(["test"]) & trained
    assert not digests(["val"]) & digests(["test"])
    from dataset.utils import pre_caption

    def captions(names):
        return {pre_caption(c) for n in names for e in files[n] for c in e["caption"]}

    seen = captions(["pretrain_emoji", "pretrain_clipart"])  # 'waving hand' is an emoji and a clip art
    assert not captions(["val"]) & seen and not captions(["test"]) & seen
    wave = {f for image, f in family.items() if "/1F44B" in image}
    assert wave == {family[f"{clip}people/waving_hand.png"]}


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=30))
def test_join_duplicates_gives_equal_pixels_one_family_and_joins_nothing_else(drawn):
    """Items (family, pixel digest): after the join, equal digests share a family; two families are joined
    only when a chain of shared digests links them; each joined family is named by its smallest member.
    (A caption is a key like a digest: the build passes both.)"""
    from tools.real_splits import join_duplicates

    items = [Item("clipart", "a", f"k{i}", f"f{fam}", ["c"], b"") for i, (fam, _) in enumerate(drawn)]
    pixels = {it.image: f"d{digest}" for it, (_, digest) in zip(items, drawn)}
    joined = join_duplicates(items, {image: [d] for image, d in pixels.items()})
    by_digest: dict[str, set[str]] = {}
    for it in joined:
        by_digest.setdefault(pixels[it.image], set()).add(it.family)
    assert all(len(f) == 1 for f in by_digest.values())
    linked = {f"f{fam}": {f"f{fam}"} for fam, _ in drawn}  # the components, by brute force
    changed = True
    while changed:
        changed = False
        for d in {d for _, d in drawn}:
            group = set().union(*(linked[f"f{fam}"] for fam, dd in drawn if dd == d))
            for f in group:
                if linked[f] != group:
                    linked[f], changed = group, True
    assert [it.family for it in joined] == [min(linked[it.family]) for it in items]


def test_a_second_build_resumes_and_writes_the_same(built, packages):
    from tools.make_real import main

    out, card = built
    stamps = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in ("pretrain_emoji.json", "vocab.txt")}
    image = os.path.join(out, "images/emoji/google/1F600.png")
    image_stamp = os.stat(image).st_mtime_ns
    shard = os.path.join(out, "shards", "real-000000.tar")
    shard_stamp = os.stat(shard).st_mtime_ns
    again = main(["--output_dir", out, "--packages", packages, "--shard_size", "20", "--vocab_size", "200"])
    assert again == card
    assert os.stat(image).st_mtime_ns == image_stamp  # kept, not made again
    assert os.stat(shard).st_mtime_ns == shard_stamp  # a complete shard is kept
    assert os.stat(os.path.join(out, "pretrain_emoji.json")).st_mtime_ns == stamps["pretrain_emoji.json"]
    trained = sum(card["files"][n]["drawings"] for n in ("pretrain_emoji", "pretrain_clipart"))
    assert again["shards"] == {"index": "shards/real.json", "samples": trained, "shards": -(-trained // 20),
                               "missing_images": 0}


def _items(draw_families: list[tuple[int, int, bool]]) -> list[Item]:
    """Items of families (size per artist, number of artists, emoji?) for the split properties."""
    items = []
    for f, (size, artists, emoji) in enumerate(draw_families):
        for a in range(artists if emoji else 1):
            artist = ("google", "twitter", "openmoji")[a] if emoji else "openclipart"
            for k in range(size):
                items.append(Item("emoji" if emoji else "clipart", artist, f"f{f}_{k}", f"family{f}",
                                  [f"caption {f} {k}", f"caption {f} {k}, extra"], b""))
    return items


@given(st.lists(st.tuples(st.integers(1, MAX_EVAL_FAMILY + 3), st.integers(1, 3), st.booleans()),
                min_size=1, max_size=40), st.integers(0, 2 ** 31))
def test_no_family_is_in_two_splits_for_any_seed(families, seed):
    splits = split_items(_items(families), seed)
    seen = {}
    for name in ("pretrain", "val", "test"):
        for it in splits[name]:
            assert seen.setdefault(it.family, name) == name
    assert not any(it.artist == "openmoji" for it in splits["pretrain"])
    assert all(it.artist == "openmoji" and seen.get(it.family) == "pretrain" for it in splits["test_artist"])
    for name in ("val", "test"):  # one artist per held-out emoji family; large families are trained on
        artists = {}
        for it in splits[name]:
            assert artists.setdefault(it.family, it.artist) == it.artist
    files = {"pretrain": [{"family": it.family, "artist": it.artist, "image": it.image}
                          for it in splits["pretrain"]]}
    for name in ("val", "test", "test_artist"):
        files[name] = eval_entries(splits[name])[0]
    check_no_leak(files)  # what the build checks agrees


def test_a_leaking_split_is_refused_naming_the_family():
    a = {"image": "a.png", "family": "f1", "artist": "google"}
    b = {"image": "b.png", "family": "f2", "artist": "google"}
    with pytest.raises(ConfigError, match="family 'f1' is in val and in pretrain_emoji"):
        check_no_leak({"pretrain_emoji": [a], "val": [a]})
    with pytest.raises(ConfigError, match="family 'f2' is in val and in test"):
        check_no_leak({"pretrain_emoji": [a], "val": [b], "test": [b]})
    with pytest.raises(ConfigError, match="trains on c.png, a drawing of the held-out artist openmoji"):
        check_no_leak({"pretrain_emoji": [{"image": "c.png", "family": "f3", "artist": "openmoji"}]})


def _fake_client(folder, name: str, script: str) -> None:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + script)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def test_fetch_records_versions_and_checksums_resumes_and_names_what_is_missing(tmp_path, monkeypatch):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    # a stand-in npm: `npm pack --json NAME@VERSION` writes NAME-VERSION.tgz and says so, as npm does
    _fake_client(bin_dir, "npm", f'echo "$@" >> {calls}\nspec="$3"; file="${{spec%@*}}-${{spec##*@}}.tgz"\n'
                                 'case "$spec" in nope*) echo "npm error 404 Not Found - $spec" >&2; '
                                 'exit 1;; esac\n'
                                 'echo data > "$file"; echo "[{\\"filename\\": \\"$file\\"}]"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    folder = str(tmp_path / "pkgs")
    got = fetch(["emojibase-data"], folder, log=lambda *_: None)
    assert got == {"emojibase-data": os.path.join(folder, "emojibase-data-17.0.0.tgz")}
    record = _load(folder, "packages.json")["emojibase-data"]
    assert record["version"] == "17.0.0" and record["sha256"] == hashlib.sha256(b"data\n").hexdigest()
    fetch(["emojibase-data"], folder, log=lambda *_: None)
    assert open(calls).read().count("pack") == 1  # the recorded file, not fetched again
    with open(got["emojibase-data"], "w") as f:
        f.write("changed")
    fetch(["emojibase-data"], folder, log=lambda *_: None)
    assert open(calls).read().count("pack") == 2  # its checksum changed: fetched again
    monkeypatch.setitem(PACKAGES, "emojibase-data", PACKAGES["emojibase-data"].__class__(
        "nope-data", "1.0.0", "npm", "x"))
    with pytest.raises(ConfigError, match=r"could not fetch npm package nope-data@1.0.0 .*404 Not Found"):
        fetch(["emojibase-data"], folder, log=lambda *_: None)
    # a stand-in apt-get: `apt-get download NAME=VERSION` writes NAME_VERSION_all.deb in the folder
    _fake_client(bin_dir, "apt-get",
                 f'echo "$@" >> {calls}\nspec="$2"; echo deb > "${{spec%=*}}_1_all.deb"\n')
    debs = str(tmp_path / "debs")
    fetch(["openclipart-png"], debs, log=lambda *_: None)
    with open(os.path.join(debs, "openclipart-png_1_all.deb"), "w") as f:
        f.write("changed")
    fetch(["openclipart-png"], debs, log=lambda *_: None)  # the changed .deb goes; apt-get makes it anew
    assert open(calls).read().count("download") == 2 and _load(debs, "packages.json")["openclipart-png"][
        "sha256"] == hashlib.sha256(b"deb\n").hexdigest()
    with open(os.path.join(debs, "packages.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match="packages.json: not a package record"):
        fetch(["openclipart-png"], debs, log=lambda *_: None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="^apt-get not found: Debian's apt-get"):
        fetch(["openclipart-svg"], str(tmp_path / "other"), log=lambda *_: None)


def test_a_missing_renderer_stops_the_build_and_a_refused_drawing_is_counted(tmp_path, monkeypatch):
    """write_images: no cairosvg is a ConfigError that stops the build (it once counted every OpenMoji
    drawing as refused and went on without the artist); a drawing the decoder refuses is counted."""
    from tools import make_real

    svg = Item("emoji", "openmoji", "1F600", "1F600", ["grinning face"], _svg(None, []), svg=True)
    broken = Item("clipart", "openclipart", "x/broken", "broken", ["broken"], b"not a png")

    def no_cairosvg(data, size=64):
        raise ConfigError("cairosvg is not installed")

    monkeypatch.setattr(make_real, "render_svg", no_cairosvg)
    with pytest.raises(ConfigError, match="cairosvg"):
        make_real.write_images([svg], str(tmp_path))
    kept, failed = make_real.write_images([broken], str(tmp_path))
    assert kept == [] and failed == {"openclipart: UnidentifiedImageError": 1}


def test_a_rebuild_removes_lists_it_no_longer_makes_and_refuses_other_packages_images(built, packages,
                                                                                      tmp_path):
    """A build into a folder that holds an earlier one: a list this build does not make is removed (so it
    cannot stay in train_file unseen); a folder built from other package files is refused (its kept images
    are theirs)."""
    import shutil as sh

    from tools.make_real import main

    out = str(tmp_path / "again")
    sh.copytree(built[0], out)
    main(["--output_dir", out, "--packages", packages, "--sources", "emoji", "--shard_size", "20"])
    assert not os.path.exists(os.path.join(out, "pretrain_clipart.json"))
    card = _load(out, "card.json")
    card["packages"]["openmoji"]["sha256"] = "0" * 64
    with open(os.path.join(out, "card.json"), "w") as f:
        json.dump(card, f)
    with pytest.raises(ConfigError, match="holds a build from other files of openmoji"):
        main(["--output_dir", out, "--packages", packages, "--sources", "emoji"])


def test_members_reads_tgz_and_deb_archives(tmp_path):
    _tgz(str(tmp_path / "a.tgz"), {"package/x.txt": b"x", "package/y/z.txt": b"z"})
    _deb(str(tmp_path / "b.deb"), {"usr/share/q.txt": b"q"})
    assert dict(members(str(tmp_path / "a.tgz"), "package/y/")) == {"package/y/z.txt": b"z"}
    assert dict(members(str(tmp_path / "b.deb"))) == {"usr/share/q.txt": b"q"}
    (tmp_path / "c.deb").write_bytes(b"not an archive")
    with pytest.raises(ConfigError, match="not a Debian package"):
        list(members(str(tmp_path / "c.deb")))


# ------------------------------------------------------------------- the configs and a tiny end-to-end run

REAL = {"pretrain": "configs/real/Pretrain.yaml", "retrieval": "configs/real/Retrieval.yaml",
        "artist": "configs/real/Retrieval_artist.yaml"}
TIMINGS = {"train_seconds", "epoch_seconds", "samples_per_s", "sampler_seconds"}


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_real_configs_print_and_point_at_the_built_corpora(name, capsys):
    """Each shipped config passes --print_config (every key known and typed) and names tools.make_real's
    files, with the real corpora's vocabulary and the drawings' augmentation."""
    import training.cli

    script = __import__("Pretrain" if name == "pretrain" else "Retrieval")
    task = "pretrain" if name == "pretrain" else "retrieval"
    with pytest.raises(SystemExit) as stop:
        training.cli.start(["--config", REAL[name], "--print_config"], script.PARSER, task)
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "vocab_file: data/real/vocab.txt" in out and "hflip: false" in out
    wanted = {"pretrain": "data/real/pretrain_clipart.json", "retrieval": "test_file: data/real/test.json",
              "artist": "test_file: data/real/test_artist.json"}[name]
    assert wanted in out


def test_pretraining_on_the_built_corpora_from_json_and_shards_then_zero_shot_retrieval(built, tmp_path):
    """configs/real as they ship, on the fixture's build: Pretrain.py trains one epoch from the json lists
    and one from the shards, on the same examples in the same batches (the same losses; only the json run
    knows the families, scenes.json), and Retrieval.py evaluates the checkpoint zero-shot on the held-out
    concepts and on the held-out artist."""
    from conftest import run_here

    import Pretrain
    import Retrieval

    root, _ = built
    shape = ["image_res=32", "patch_size=16", "vision_depth=1", "vision_init=null", "synthetic_root=null",
             f"vocab_file={root}/vocab.txt", f"image_root={root}"]
    lists = f"train_file=[{root}/pretrain_emoji.json,{root}/pretrain_clipart.json]"
    small = ["max_epoch=1", "schedular.epochs=1", "schedular.warmup_steps=2", "batching.queue_size=24",
             "batching.search_space=16", "batch_pictures=false", "print_freq=1000"]
    logs = {}
    for source in ("json", f"shards={root}/shards/real.json"):
        out = str(tmp_path / source.split("=")[0])
        chosen = [lists] if source == "json" else ["train_file=null", f"train_{source}"]
        run_here(Pretrain, ["--config", REAL["pretrain"], "--output_dir", out, "--device", "cpu", "--seed",
                            "1", "--set", *shape, *small, *chosen])
        with open(os.path.join(out, "log.txt")) as f:
            logs[source.split("=")[0]] = [json.loads(line) for line in f]
    scene_keys = {"itm_false_negatives", "batch_same_scene"}
    assert all(scene_keys <= set(r) for r in logs["json"])
    assert not any(scene_keys & set(r) for r in logs["shards"])
    same = [[{k: v for k, v in r.items() if k not in TIMINGS | scene_keys} for r in rows]
            for rows in logs.values()]
    assert same[0] == same[1] and len(same[0]) == 1
    checkpoint = str(tmp_path / "json" / "checkpoint_00.pth")
    for name in ("retrieval", "artist"):
        out = str(tmp_path / name)
        run_here(Retrieval, ["--config", REAL[name], "--checkpoint", checkpoint, "--evaluate", "--output_dir",
                             out, "--device", "cpu", "--set", *shape, lists, f"val_file={root}/val.json",
                             f"test_file={root}/{'test' if name == 'retrieval' else 'test_artist'}.json"])
        with open(os.path.join(out, "log.txt")) as f:
            record = [json.loads(line) for line in f][-1]
        for split in ("val", "test"):
            assert 0.0 <= record[f"{split}_txt_r1"] <= 100.0 and 0.0 <= record[f"{split}_itc_img_r1"] <= 100.0


def test_the_guard_by_scene_never_mines_a_family_member_and_needs_the_families(built, tmp_path):
    """guard_by: scene takes a family's drawings as one image: with the guard, no mined ITM negative is from
    the anchor's family (itm_false_negatives 0 every epoch; the fixture's batches never hold one family only,
    where the guard falls back to the diagonal), where guard_by: image mines them; data without families
    (the shards) is refused, naming the key."""
    from conftest import run_here

    import Pretrain

    root, _ = built
    sets = ["image_res=32", "patch_size=16", "vision_depth=1", "vision_init=null", "synthetic_root=null",
            f"vocab_file={root}/vocab.txt", f"image_root={root}", "max_epoch=2", "schedular.epochs=2",
            "schedular.warmup_steps=2", "batching.queue_size=24", "batching.search_space=16",
            "batch_pictures=false", "print_freq=1000", "guard_false_negatives=true",
            f"train_file=[{root}/pretrain_emoji.json,{root}/pretrain_clipart.json]"]
    start = ["--config", REAL["pretrain"], "--device", "cpu", "--seed", "1", "--output_dir"]
    rates = {}
    for by in ("image", "scene"):
        out = str(tmp_path / by)
        run_here(Pretrain, [*start, out, "--set", *sets, f"guard_by={by}"])
        with open(os.path.join(out, "log.txt")) as f:
            rates[by] = [json.loads(line)["itm_false_negatives"] for line in f]
    assert max(rates["image"]) > 0 and rates["scene"] == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"'guard_by' is 'scene'.*real\.json.*no scene table"):
        run_here(Pretrain, [*start, str(tmp_path / "shards"), "--set", *sets[:-1], "train_file=null",
                            f"train_shards={root}/shards/real.json", "guard_by=scene"])


def test_guard_by_without_the_guard_is_refused_naming_both_keys():
    """guard_by only says what the guard takes as one image: set without the guard it would change nothing,
    so the config is refused, naming both keys; with the guard on it is accepted."""
    from conftest import tiny_config

    with pytest.raises(ConfigError, match="guard_by is scene but guard_false_negatives is false"):
        tiny_config("pretrain", guard_by="scene", guard_false_negatives=False)
    assert tiny_config("pretrain", guard_by="scene", guard_false_negatives=True).guard_by == "scene"


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("npm") and shutil.which("apt-get")), reason="needs npm and apt-get")
def test_the_real_packages_build_the_corpora_of_the_data_card(tmp_path):
    """The real packages, fetched by name (about 5 minutes here): the build's card (versions, checksums,
    every count) is the one docs/real-corpora.md reports, docs/results/real_card.json."""
    from tools.make_real import main

    card = main(["--output_dir", str(tmp_path / "real")])
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results",
                           "real_card.json"), encoding="utf-8") as f:
        assert card == json.load(f)
