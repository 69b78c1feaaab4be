"""The real corpora's items read from their packages as they ship (tools.make_real): each drawing with its
artist, its concept family, and captions made only by joining the packages' own text fields.

Emoji (docs/real-corpora.md has the exact rules and counts):
- images: emoji-datasource-google and -twitter's 64 px PNGs (package/img/<artist>/64/), every base emoji
  and skin-tone variant; OpenMoji's colour SVGs (package/color/svg/<HEXCODE>.svg), rendered at 64 px;
- text: Unicode CLDR's English annotations from emojibase-data (package/en/data.json): a label per emoji
  and keywords per base emoji, which its skin-tone variants share. An emoji without a CLDR entry (the
  artists' own extras) is left out, so every artist draws the same concepts under the same words;
- captions: [label, "label, keyword, keyword, ..."];
- family: the code points with skin tones, gender signs and variation selectors removed and the gendered
  people (man, woman, person; boy, girl, child; old man, old woman, older person; ...) mapped to one, so
  that every skin-tone and gender variant of a base emoji, in every artist's drawing, is one family.

OpenClipart 0.18 (Debian's openclipart-svg for the text, openclipart-png for the pixels):
- text: the SVG's RDF metadata, dc:title and the dc:subject keyword bag, and the drawing's folder
  (its category path, e.g. signs_and_symbols/flags/asia); underscores read as spaces, HTML character
  references decoded ('Grampa&#39;n Gramma' -> "Grampa'n Gramma");
- captions: [title, "title, tag, tag, ...", "title, category path words"], each where its fields exist
  (tags alone when there is no title); a drawing with neither is left out;
- family: the title's stem (lower case, letters only; the tags' when there is no title), wherever the
  drawing is filed: a collection of near-copies ('gramastar', 1,375 stars) is one family, and so is a
  drawing OpenClipart files under several folders (the lighthouse in buildings/, buildings/homes/ and
  transportation/). tools.real_splits then joins the families of drawings whose stored pixels are equal.

Images are stored as 64 x 64 RGB PNGs: transparency (RGBA, LA, a palette with transparency) composited
on white, then scaled to fit 64 px and centred on white.
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field

from PIL import Image, ImageOps

from dataset.utils import EmptyTextError, pre_caption
from tools.real_packages import members
from training.config_files import ConfigError

__all__ = ["EMOJI_ARTISTS", "IMAGE_SIZE", "Item", "clipart_items", "emoji_family", "emoji_items",
           "on_white", "render_svg", "title_stem"]

IMAGE_SIZE = 64
EMOJI_ARTISTS = {"google": "emoji-datasource-google", "twitter": "emoji-datasource-twitter",
                 "openmoji": "openmoji"}


@dataclass
class Item:
    """One drawing: where it comes from, its key there, its family, its captions, and how to get its pixels
    (the package member's bytes and whether they are an SVG)."""

    source: str          # 'emoji' | 'clipart'
    artist: str          # 'google' | 'twitter' | 'openmoji' | 'openclipart'
    key: str             # the hexcode (emoji) or the drawing's path without extension (clipart)
    family: str
    captions: list[str]
    data: bytes = field(repr=False)
    svg: bool = False

    @property
    def image(self) -> str:
        """The stored image's path, relative to the corpus folder."""
        return f"images/{self.source}/{self.artist}/{self.key}.png"


# ------------------------------------------------------------------------------------------------- images

def on_white(image: Image.Image, size: int = IMAGE_SIZE) -> Image.Image:
    """Any PIL image -> size x size RGB: transparency composited on white, scaled to fit, centred on white."""
    image.load()
    if image.mode in ("P", "PA", "LA", "La", "RGBa") or "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode == "RGBA":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image)
    if image.mode.startswith("I;16"):  # 16-bit grey: to 8 bits before RGB
        image = image.point(lambda v: v / 256).convert("L")
    image = image.convert("RGB")
    return ImageOps.pad(image, (size, size), method=Image.Resampling.LANCZOS, color=(255, 255, 255))


def render_svg(data: bytes, size: int = IMAGE_SIZE) -> Image.Image:
    """An SVG drawing rendered with cairosvg at size x size (RGBA)."""
    try:
        import cairosvg
    except (ImportError, OSError) as e:  # OSError: the cairo library itself is missing
        raise ConfigError(f"OpenMoji's drawings are SVG only and need cairosvg ({e}): pip install cairosvg "
                          "(and Debian's libcairo2), or leave openmoji out (--artists)") from None
    png = cairosvg.svg2png(bytestring=data, output_width=size, output_height=size)
    return Image.open(io.BytesIO(png))


# ------------------------------------------------------------------------------------------------- emoji

SKIN_TONES = {"1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF"}
# Gendered people and their neutral form: a family is written in the neutral code points.
PEOPLE = {"1F468": "1F9D1", "1F469": "1F9D1",            # man, woman -> person
          "1F466": "1F9D2", "1F467": "1F9D2",            # boy, girl -> child
          "1F474": "1F9D3", "1F475": "1F9D3",            # old man, old woman -> older person
          "1F934": "1FAC5", "1F478": "1FAC5",            # prince, princess -> person with crown
          "1F385": "1F9D1-200D-1F384", "1F936": "1F9D1-200D-1F384",  # Santa, Mrs. Claus -> mx claus
          "1F930": "1FAC4", "1FAC3": "1FAC4",            # pregnant woman, man -> pregnant person
          "1F57A": "1F483",                              # man dancing -> woman dancing (no neutral one)
          "1F46B": "1F9D1-200D-1F91D-200D-1F9D1",        # woman and man holding hands -> people ...
          "1F46C": "1F9D1-200D-1F91D-200D-1F9D1", "1F46D": "1F9D1-200D-1F91D-200D-1F9D1",
          "1F48F": "1F9D1-200D-2764-200D-1F48B-200D-1F9D1",  # kiss -> kiss: person, person
          "1F491": "1F9D1-200D-2764-200D-1F9D1",         # couple with heart -> ...: person, person
          "1F46A": "1F9D1-200D-1F9D1-200D-1F9D2"}        # family -> family: adult, adult, child


def _points(hexcode: str) -> list[str]:
    return [p for p in hexcode.upper().split("-") if p]


def plain_hexcode(hexcode: str) -> str:
    """A hexcode without variation selectors (FE0F, FE0E): how the packages' codes are matched."""
    return "-".join(p for p in _points(hexcode) if p not in ("FE0F", "FE0E"))


def emoji_family(hexcode: str) -> str:
    """The family of an emoji: its code points without skin tones, gender signs (with their joiner) and
    variation selectors, the gendered people mapped to their neutral form (PEOPLE)."""
    points = [p for p in _points(plain_hexcode(hexcode)) if p not in SKIN_TONES]
    out: list[str] = []
    for p in points:
        if p in ("2640", "2642") and out and out[-1] == "200D":  # '... ZWJ female/male sign'
            out.pop()
            continue
        out.extend(_points(PEOPLE.get(p, p)))
    while out and out[-1] == "200D":
        out.pop()
    whole = "-".join(out)
    return PEOPLE.get(whole, whole)


def cldr_annotations(emojibase: str) -> dict[str, tuple[str, list[str]]]:
    """plain hexcode -> (CLDR label, keywords) for every emoji and skin-tone variant in emojibase-data's
    en/data.json; a variant has its base's keywords."""
    found = dict(members(emojibase, "package/en/data.json"))
    if not found:
        raise ConfigError(f"{emojibase}: no package/en/data.json (not emojibase-data?)")
    out = {}
    for entry in json.loads(found["package/en/data.json"]):
        tags = list(entry.get("tags", []))
        out[plain_hexcode(entry["hexcode"])] = (entry["label"], tags)
        for skin in entry.get("skins", []):
            out[plain_hexcode(skin["hexcode"])] = (skin["label"], tags)
    return out


def usable(captions: list[str]) -> list[str]:
    """The captions that keep some text after Pretrain.py's cleaning (a label of punctuation only does
    not), each once as cleaned: what a training step can draw."""
    out, seen = [], set()
    for c in captions:
        try:
            cleaned = pre_caption(c)
        except EmptyTextError:
            continue
        if cleaned not in seen:
            seen.add(cleaned)
            out.append(c)
    return out


def emoji_captions(label: str, keywords: list[str]) -> list[str]:
    """[label, 'label, keyword, ...'] (the second only when there are keywords), usable ones only."""
    return usable([label] + ([", ".join([label, *keywords])] if keywords else []))


def _datasource_images(path: str, artist: str) -> Iterator[tuple[str, bytes | None]]:
    """(hexcode, PNG bytes) of every emoji and skin-tone variant an emoji-datasource package draws; None
    for one its emoji.json says is drawn whose file is missing."""
    files = dict(members(path, f"package/img/{artist}/64/"))
    listing = dict(members(path, "package/emoji.json"))
    if "package/emoji.json" not in listing:
        raise ConfigError(f"{path}: no package/emoji.json (not an emoji-datasource package?)")
    for entry in json.loads(listing["package/emoji.json"]):
        for one in [entry, *entry.get("skin_variations", {}).values()]:
            name = f"package/img/{artist}/64/{one['image']}"
            if one.get(f"has_img_{artist}"):
                yield one["unified"], files.get(name)


def _openmoji_images(path: str) -> Iterator[tuple[str, bytes | None]]:
    """(hexcode, SVG bytes) of every drawing OpenMoji's data/openmoji.csv lists; None when its file is
    missing."""
    files = dict(members(path, "package/color/svg/"))
    table = dict(members(path, "package/data/openmoji.csv"))
    if "package/data/openmoji.csv" not in table:
        raise ConfigError(f"{path}: no package/data/openmoji.csv (not the openmoji package?)")
    for row in csv.DictReader(io.StringIO(table["package/data/openmoji.csv"].decode("utf-8"))):
        yield row["hexcode"], files.get(f"package/color/svg/{row['hexcode']}.svg")


def emoji_items(packages: dict[str, str], artists: list[str]) -> tuple[list[Item], dict[str, int]]:
    """The emoji drawings of `artists` (EMOJI_ARTISTS) with CLDR captions -> (items, counts of what was
    left out and why)."""
    cldr = cldr_annotations(packages["emojibase-data"])
    items, left_out = [], {"no CLDR annotation": 0, "listed without its image file": 0}
    for artist in artists:
        path = packages[EMOJI_ARTISTS[artist]]
        drawn = _openmoji_images(path) if artist == "openmoji" else _datasource_images(path, artist)
        for hexcode, data in drawn:
            if data is None:
                left_out["listed without its image file"] += 1
                continue
            code = plain_hexcode(hexcode)
            if code not in cldr:
                left_out["no CLDR annotation"] += 1
                continue
            label, keywords = cldr[code]
            captions = emoji_captions(label, keywords)
            if not captions:
                left_out["no usable caption"] = left_out.get("no usable caption", 0) + 1
                continue
            items.append(Item("emoji", artist, code, emoji_family(code), captions,
                              data, svg=artist == "openmoji"))
    return items, left_out


# ------------------------------------------------------------------------------------------------ clipart

SVG_ROOT, PNG_ROOT = "usr/share/openclipart/svg/", "usr/share/openclipart/png/"
_NS = {"svg": "http://www.w3.org/2000/svg", "dc": "http://purl.org/dc/elements/1.1/",
       "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#"}


def svg_metadata(data: bytes) -> tuple[str, list[str]] | None:
    """(dc:title, dc:subject keywords) of an SVG's RDF metadata (the work's, not its publisher's); None when
    the file cannot be parsed."""
    title, tags = "", []
    try:
        for _, element in ET.iterparse(io.BytesIO(data), events=("end",)):
            if element.tag.rpartition("}")[2] == "metadata":  # with or without the SVG namespace
                work = next((w for w in element.iter() if w.tag.endswith("}Work")), element)
                node = work.find("dc:title", _NS)
                title = (node.text or "").strip() if node is not None else ""
                tags = [(li.text or "").strip() for li in work.findall("dc:subject/rdf:Bag/rdf:li", _NS)]
                break
    except ET.ParseError:
        return None
    return title, [t for t in tags if t]


def title_stem(title: str) -> str:
    """A title's stem: lower case, letters only, words single-spaced ('gramastar 12' -> 'gramastar')."""
    return " ".join(re.sub(r"[^a-z]+", " ", title.lower()).split())


def clipart_captions(title: str, tags: list[str], folder: str) -> list[str]:
    """[title, 'title, tag, ...', 'title, category path words'], each where its fields exist; underscores
    read as spaces."""
    title = html.unescape(title).replace("_", " ").strip()
    tags = [html.unescape(t).replace("_", " ") for t in tags]
    path = " ".join(folder.replace("_", " ").split("/"))
    lead = [title] if title else []
    out = lead[:]
    if tags:
        out.append(", ".join(lead + tags))
    if path and title:
        out.append(", ".join([title, path]))
    return usable(out)


def clipart_items(packages: dict[str, str]) -> tuple[list[Item], dict[str, int]]:
    """OpenClipart's drawings with their titles, tags and folders -> (items, counts of what was left out)."""
    pngs = {name[len(PNG_ROOT):-4]: data for name, data in members(packages["openclipart-png"], PNG_ROOT)
            if name.endswith(".png")}
    items, left_out = [], {"no PNG": 0, "unreadable SVG": 0, "no title and no tags": 0}
    for name, data in members(packages["openclipart-svg"], SVG_ROOT):
        if not name.endswith(".svg"):
            continue
        key = name[len(SVG_ROOT):-4]
        meta = svg_metadata(data)
        if key not in pngs:
            left_out["no PNG"] += 1
            continue
        if meta is None:
            left_out["unreadable SVG"] += 1
            continue
        title, tags = meta
        folder = os.path.dirname(key)
        captions = clipart_captions(title, tags, folder)
        if not captions:
            left_out["no title and no tags"] += 1
            continue
        stem = title_stem(title) or title_stem(" ".join(tags)) or key  # the folder is not part of it
        items.append(Item("clipart", "openclipart", key, stem, captions, pngs[key]))
    return items, left_out
