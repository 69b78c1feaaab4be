"""Text cleaning, json-list loading and image reading shared by every dataset.

All errors name the offending file (or caption), so a bad entry in a 4M-line json list is found
from the message alone. A fault of a json list stops the run (grit_io.InputFileError); a bad sample
(ImageReadError, EmptyTextError: found only when the entry is read) is skipped and counted instead
(dataset.bad_samples).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO

from PIL import Image

from grit_io import InputFileError, read_json

__all__ = [
    "EmptyTextError",
    "ImageReadError",
    "MissingTextError",
    "ShardReadError",
    "decode_image",
    "load_json_list",
    "pre_caption",
    "pre_question",
    "read_image",
    "resolve_image",
]

# ALBEF strips these characters before tokenising; '-' and '/' become spaces so that
# "black-and-white" stays three words.
_PUNCT = re.compile(r"[,.'!?\"()*#:;~`]")
_SPACES = re.compile(r"\s+")


class ImageReadError(OSError):
    """An image file is missing or cannot be decoded; ``.path`` is the file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"cannot read image {path!r}: {reason}")
        self.path = path


class EmptyTextError(ValueError):
    """A caption, question or sentence is empty after cleaning (a bad sample, not a bad config)."""


class MissingTextError(ValueError):
    """A shard sample has no caption: no `.txt` member and no `caption` in its `.json` (a bad sample)."""


class ShardReadError(OSError):
    """A sample of a tar shard cannot be reached: the shard cannot be opened or indexed (truncated,
    corrupt) or holds fewer samples than its index says (a bad sample)."""


def _clean(text: str, max_words: int, what: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__}: {text!r}")
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    cleaned = text.lower().replace("-", " ").replace("/", " ")
    cleaned = _PUNCT.sub("", cleaned)
    words = _SPACES.sub(" ", cleaned).strip().split(" ")
    if words == [""]:
        raise EmptyTextError(f"{what} {text!r} is empty after cleaning")
    return " ".join(words[:max_words])


def pre_caption(caption: str, max_words: int = 30) -> str:
    """ALBEF caption cleaning: lower case, punctuation stripped, spaces collapsed, <= max_words words."""
    return _clean(caption, max_words, "caption")


def pre_question(question: str, max_words: int = 30) -> str:
    """ALBEF question cleaning (same rules as pre_caption; '?' is dropped too)."""
    return _clean(question, max_words, "question")


def load_json_list(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    required: Iterable[str] = (),
    check: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Concatenate json lists of dict entries; every entry must have the ``required`` keys.

    ``check(entry)`` may raise ValueError for a bad value. Any fault of a file (missing, not JSON, not a
    list, an entry that is no object, lacks a key or fails ``check``) raises grit_io.InputFileError naming
    the file and, for an entry, its index.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("load_json_list: no json files given")
    required = tuple(required)
    out: list[dict] = []
    for path in paths:
        path = os.fspath(path)
        data = read_json(path)
        if not isinstance(data, list):
            raise InputFileError(f"{path}: expected a JSON list of entries, got {type(data).__name__}")
        for i, entry in enumerate(data):
            if not isinstance(entry, dict):
                raise InputFileError(f"{path}: entry {i} is a {type(entry).__name__}, expected an object")
            missing = [k for k in required if k not in entry]
            if missing:
                raise InputFileError(f"{path}: entry {i} is missing key(s) {missing} (has {sorted(entry)})")
            if check is not None:
                try:
                    check(entry)
                except ValueError as e:
                    raise InputFileError(f"{path}: entry {i}: {e}") from None
        out.extend(data)
    return out


def resolve_image(root: str | os.PathLike | None, path: str) -> str:
    """Join a json image path onto image_root; absolute paths and an empty root leave it unchanged."""
    if not root or os.path.isabs(path):
        return path
    return os.path.join(os.fspath(root), path)


def read_image(path: str) -> Image.Image:
    """Open an image file as a fully decoded PIL RGB image; ImageReadError names the file on failure."""
    if not os.path.isfile(path):
        raise ImageReadError(path, "not a file" if os.path.exists(path) else "file not found")
    return decode_image(path, path)


def decode_image(source: str | BinaryIO, name: str) -> Image.Image:
    """Decode an image file or stream (a tar member) as a fully decoded PIL RGB image; ImageReadError names
    it (`name`: the file, or shard and member) on failure. One decoder for files and shards, so that both
    give the same pixels."""
    try:
        with Image.open(source) as im:
            return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageReadError(name, f"{type(e).__name__}: {e}") from None
