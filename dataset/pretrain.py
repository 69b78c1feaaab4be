"""Pre-training data: image-caption pairs from ALBEF json lists."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence

from torch.utils.data import Dataset

from .bad_samples import blank_image
from .utils import load_json_list, pre_caption, read_image, resolve_image

__all__ = ["PLACEHOLDER_CAPTION", "PretrainDataset", "check_caption", "image_and_caption"]

# The text of a bad sample's placeholder (dataset.bad_samples); no loss ever reads it.
PLACEHOLDER_CAPTION = "bad sample"


def check_caption(entry: dict, key: str = "caption") -> None:
    """Raise ValueError unless entry[key] is a string or a non-empty list of strings."""
    cap = entry[key]
    if isinstance(cap, str):
        return
    if isinstance(cap, list) and cap and all(isinstance(c, str) for c in cap):
        return
    raise ValueError(f"'{key}' must be a string or a non-empty list of strings, got {cap!r}")


def image_and_caption(ann: dict, transform: Callable, image_root: str, max_words: int):
    """An image-caption entry -> (transformed image Tensor (3,H,W), cleaned caption); a list caption
    gives a random member (python ``random``, which DataLoader seeds per worker)."""
    caption = ann["caption"]
    if isinstance(caption, list):
        caption = random.choice(caption)
    image = transform(read_image(resolve_image(image_root, ann["image"])))
    return image, pre_caption(caption, max_words)


class PretrainDataset(Dataset):
    """``[{"image", "caption": str | [str, ...]}]`` -> (image Tensor (3,H,W), caption str, index int).

    A list caption yields a random member on every visit (python ``random``, which DataLoader
    seeds per worker). The index is what the GRIT sampler collects features under.

    ``image_keys[i]`` identifies entry i's image: entries whose resolved, normalised image paths
    are equal (ALBEF's COCO/VG files hold one entry per caption) share a key, numbered in order of
    first appearance. The pre-training guard against in-batch false negatives reads it.
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30):
        self.ann = load_json_list(files, required=("image", "caption"), check=check_caption)
        self.transform = transform
        self.image_root = image_root
        self.max_words = max_words
        first_seen: dict[str, int] = {}
        self.image_keys: list[int] = [
            first_seen.setdefault(os.path.normpath(resolve_image(image_root, ann["image"])), len(first_seen))
            for ann in self.ann
        ]

    def __len__(self) -> int:
        return len(self.ann)

    def __getitem__(self, index: int):
        image, caption = image_and_caption(self.ann[index], self.transform, self.image_root, self.max_words)
        return image, caption, index

    def placeholder(self, index: int):
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss)."""
        return blank_image(self.transform), PLACEHOLDER_CAPTION, index
