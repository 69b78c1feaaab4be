"""Bad samples: an entry whose image is missing or undecodable, or whose text is empty after
cleaning, is skipped, never replaced by another entry.

`SkipBadSamples(dataset)` returns `(item, None)` for a good entry and `(placeholder, reason)` for a bad
one; the placeholder (`dataset.placeholder(index)`) has the shapes of a real item, so every rank's
batch keeps its shape and collectives (DDP, GRIT's all_gathers) never mismatch. `SkipBadCollate`
batches such pairs as the task's collate does and appends `valid` (B,) bool and `bad`, the list of
the bad entries' reasons ("entry 17: cannot read image ..."). The models leave invalid rows out of
every loss and out of the in-batch negatives; GRIT collects them as invalid, so they come back next
epoch like unseen indices. Evaluation wraps its sets the same way and scores the good entries only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from .utils import EmptyTextError, ImageReadError

__all__ = ["BAD_SAMPLE_ERRORS", "SkipBadCollate", "SkipBadSamples", "blank_image", "device_valid"]

# What makes an entry bad. Anything else (a bug, a wrong config) still stops the run.
BAD_SAMPLE_ERRORS = (ImageReadError, EmptyTextError)


def blank_image(transform: Callable) -> torch.Tensor:
    """A black image through `transform` -> a tensor with a real item's shape (3,H,W)."""
    return transform(Image.new("RGB", (32, 32)))


def device_valid(valid: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A batch's valid (B,) CPU mask on `device`, or None when every sample is good: the models then
    run the paper's computation exactly. Checking the CPU tensor costs no device synchronisation."""
    return None if bool(valid.all()) else valid.to(device, non_blocking=True)


class SkipBadSamples(Dataset):
    """Wrap a dataset with `placeholder(index)`: items become (item, None) or (placeholder, reason)."""

    def __init__(self, dataset: Dataset) -> None:
        if not callable(getattr(dataset, "placeholder", None)):
            raise TypeError(f"{type(dataset).__name__} has no placeholder(index) for bad samples")
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, str | None]:
        try:
            return self.dataset[index], None
        except BAD_SAMPLE_ERRORS as err:
            return self.dataset.placeholder(index), f"entry {index}: {err}"

    def __getattr__(self, name: str) -> Any:
        # Attributes of the wrapped dataset (ann, image_keys, ...) stay reachable; __getattr__ only
        # runs for names the wrapper lacks. 'dataset' itself is guarded against recursion (unpickling
        # in DataLoader workers calls __getattr__ before __init__ has set it).
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SkipBadCollate:
    """Batch (item, reason) pairs with the task's collate -> (*batch, valid (B,) bool, bad [str])."""

    def __init__(self, collate: Callable[[list], tuple]) -> None:
        self.collate = collate

    def __call__(self, pairs: list[tuple[Any, str | None]]) -> tuple:
        items, reasons = zip(*pairs)
        batch = self.collate(list(items))
        valid = torch.tensor([r is None for r in reasons], dtype=torch.bool)
        return (*batch, valid, [r for r in reasons if r is not None])
