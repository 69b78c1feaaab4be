"""NLVR2 data: two images, one sentence, a true/false label."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from .bad_samples import blank_image
from .pretrain import PLACEHOLDER_CAPTION
from .utils import load_json_list, pre_caption, read_image, resolve_image

__all__ = ["NLVRDataset", "parse_label"]

# bool and 0/1 hash alike, so True/1 and False/0 share an entry.
_LABELS = {True: 1, False: 0, "True": 1, "False": 0, "true": 1, "false": 0}


def parse_label(label: Any) -> int:
    """NLVR2 label (bool, 'True'/'False' as in ALBEF's json, or 0/1) -> int 0/1."""
    try:
        return _LABELS[label]
    except (KeyError, TypeError):
        raise ValueError(f"'label' must be true/false (bool, 'True'/'False' or 0/1), got {label!r}") from None


def _check(entry: dict) -> None:
    images = entry["images"]
    if not (isinstance(images, list) and len(images) == 2 and all(isinstance(p, str) for p in images)):
        raise ValueError(f"'images' must be a list of two paths, got {images!r}")
    if not isinstance(entry["sentence"], str):
        raise ValueError(f"'sentence' must be a string, got {entry['sentence']!r}")
    parse_label(entry["label"])


class NLVRDataset(Dataset):
    """``[{"images": [p0, p1], "sentence", "label"}]`` -> (image0 (3,H,W), image1 (3,H,W), sentence, label).

    ``label`` is an int, 1 for true; json labels may be bools or ALBEF's 'True'/'False' strings.
    """

    def __init__(self, files: str | Sequence[str], transform: Callable, image_root: str = "",
                 max_words: int = 30):
        self.ann = load_json_list(files, required=("images", "sentence", "label"), check=_check)
        self.transform = transform
        self.image_root = image_root
        self.max_words = max_words

    def __len__(self) -> int:
        return len(self.ann)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, str, int]:
        ann = self.ann[index]
        image0, image1 = (self.transform(read_image(resolve_image(self.image_root, p)))
                          for p in ann["images"])
        return image0, image1, pre_caption(ann["sentence"], self.max_words), parse_label(ann["label"])

    def placeholder(self, index: int) -> tuple[Tensor, Tensor, str, int]:
        """An item of the right shapes standing in for bad entry `index` (masked out of every loss):
        two blank images, the placeholder sentence, label 0 (any valid label; no loss reads it)."""
        return blank_image(self.transform), blank_image(self.transform), PLACEHOLDER_CAPTION, 0
