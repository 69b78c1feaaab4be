"""Bad samples: an entry whose image is missing or undecodable, or whose text is empty after
cleaning or missing (a shard sample without caption), or a shard sample that cannot be reached (a
truncated shard), is skipped, never replaced by another entry.

`SkipBadSamples(dataset)` returns `(item, None)` for a good entry and `(placeholder, reason)` for a bad
one; the placeholder (`dataset.placeholder(index)`) has the shapes of a real item, so every rank's
batch keeps its shape and collectives (DDP, GRIT's all_gathers) never mismatch. `SkipBadCollate`
batches such pairs with the task's collate (dataset.collate) and sets the Batch's `valid` (B,) bool
and `reasons`, the bad entries' reasons ("entry 17: cannot read image ..."). The models leave invalid
rows out of every loss and out of the in-batch negatives; GRIT collects them as invalid, so they come
back next epoch like unseen indices. Evaluation wraps its sets the same way and scores the good entries only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from .collate import Batch
from .utils import EmptyTextError, ImageReadError, MissingTextError, ShardReadError

__all__ = ["BAD_SAMPLE_ERRORS", "SkipBadCollate", "SkipBadSamples", "blank_image"]

# What makes an entry bad. Anything else (a bug, a wrong config) still stops the run.
BAD_SAMPLE_ERRORS = (ImageReadError, EmptyTextError, MissingTextError, ShardReadError)


def blank_image(transform: Callable) -> torch.Tensor:
    """A black image through `transform` -> a tensor with a real item's shape (3,H,W)."""
    return transform(Image.new("RGB", (32, 32)))


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
    """Batch (item, reason) pairs with the task's collate -> its Batch, valid (B,) bool and reasons set."""

    def __init__(self, collate: Callable[[list], Batch]) -> None:
        self.collate = collate

    def __call__(self, pairs: list[tuple[Any, str | None]]) -> Batch:
        """pairs [B] of (item, None | reason) -> the collate's Batch; valid[b] False where a reason is."""
        items, reasons = zip(*pairs)
        batch = self.collate(list(items))
        if not isinstance(batch, Batch):
            raise TypeError(f"{type(self.collate).__name__} returned a {type(batch).__name__}, not a "
                            "dataset.collate.Batch")
        batch.valid = torch.tensor([r is None for r in reasons], dtype=torch.bool)
        batch.reasons = [r for r in reasons if r is not None]
        return batch
