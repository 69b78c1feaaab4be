"""Pre-training data: image-caption pairs from ALBEF json lists, and the base of every image-caption set."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from functools import cached_property

from torch import Tensor
from torch.utils.data import Dataset

from .bad_samples import blank_image
from .utils import load_json_list, pre_caption, read_image, resolve_image

__all__ = ["PLACEHOLDER_CAPTION", "ImageCaptionDataset", "PretrainDataset", "check_caption",
           "first_seen_keys", "image_file"]

# The text of a bad sample's placeholder (dataset.bad_samples); no loss ever reads it.
PLACEHOLDER_CAPTION = "bad sample"


def image_file(image_root: str, entry: dict) -> str:
    """An entry's image file, resolved against image_root and normalised: what image keys compare."""
    return os.path.normpath(resolve_image(image_root, entry["image"]))


def first_seen_keys(items: Iterable[Hashable]) -> list[int]:
    """A key per item, equal for equal items, numbered in order of first appearance: a, b, a -> 0, 1, 0."""
    seen: dict[Hashable, int] = {}
    return [seen.setdefault(item, len(seen)) for item in items]


def check_caption(entry: dict, key: str = "caption") -> None:
    """Raise ValueError unless entry[key] is a string or a non-empty list of strings."""
    cap = entry[key]
    if isinstance(cap, str):
        return
    if isinstance(cap, list) and cap and all(isinstance(c, str) for c in cap):
        return
    raise ValueError(f"'{key}' must be a string or a non-empty list of strings, got {cap!r}")


class ImageCaptionDataset(Dataset):
    """The entries ``[{"image", "caption": str | [str, ...], ...}]`` of one or more json lists, checked as
    they load (grit_io.InputFileError names the file and entry), and the image root and transform to read
    them with. Subclasses add keys to `required` and checks to `check_entry`, and say what an item is."""

    required: tuple[str, ...] = ("image", "caption")

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30) -> None:
        self.ann = load_json_list(files, required=self.required, check=self.check_entry)
        self.transform = transform
        self.image_root = image_root
        self.max_words = max_words

    @staticmethod
    def check_entry(entry: dict) -> None:
        """Raise ValueError for a bad value of `entry` (its keys are there)."""
        check_caption(entry)

    def __len__(self) -> int:
        return len(self.ann)

    def image_and_caption(self, index: int) -> tuple[Tensor, str]:
        """Entry `index` -> (transformed image (3,H,W), cleaned caption); a list caption gives a random
        member on every visit (python ``random``, which DataLoader seeds per worker)."""
        ann = self.ann[index]
        caption = ann["caption"]
        if isinstance(caption, list):
            caption = random.choice(caption)
        image = self.transform(read_image(resolve_image(self.image_root, ann["image"])))
        return image, pre_caption(caption, self.max_words)


class PretrainDataset(ImageCaptionDataset):
    """``[{"image", "caption": str | [str, ...]}]`` -> (image Tensor (3,H,W), caption str, index int).

    A list caption yields a random member on every visit. The index is what the GRIT sampler collects
    features under.

    ``image_keys[i]`` identifies entry i's image: entries whose resolved, normalised image paths
    are equal (ALBEF's COCO/VG files hold one entry per caption) share a key, numbered in order of
    first appearance. The pre-training guard against in-batch false negatives reads it.
    """

    def image_files(self) -> Iterator[str]:
        """Each entry's image file, resolved and normalised (the identity image_keys compares)."""
        return (image_file(self.image_root, ann) for ann in self.ann)

    @cached_property
    def image_keys(self) -> list[int]:
        """Entry i's image key (see the class docstring); built on first use."""
        return first_seen_keys(self.image_files())

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        image, caption = self.image_and_caption(index)
        return image, caption, index

    def placeholder(self, index: int) -> tuple[Tensor, str, int]:
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss)."""
        return blank_image(self.transform), PLACEHOLDER_CAPTION, index
