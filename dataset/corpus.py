"""Several pre-training sources as one epoch: json lists and tar shards concatenated into one index space.

ALBEF's 4M corpus is COCO + VG + CC3M + SBU; a web-scale one adds shards. GRIT deals a permutation of the
whole index space every epoch, each index at most once, and puts back the ones an epoch left out, so
every source shares that exactness. A source with repeat factor k appears k times in a row, each copy
with its own indices: its examples are seen k times an epoch, and each copy keeps the once-per-epoch rule.
With json lists only and no repeats the indices are those of the concatenated lists, as before.

`image_keys` (the false-negative guard's image identity, training.config key guard_false_negatives) is
shared by entries of json lists that name the same image file (in any of the lists) and by the copies of
a repeated source; every shard sample is an image of its own.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping, Sequence
from functools import cached_property

import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, Dataset

from grit_io import read_json

from .pretrain import PretrainDataset, first_seen_keys

__all__ = ["SCENE_TABLE", "PretrainCorpus"]

SCENE_TABLE = "scenes.json"  # beside a json list: the scene each of its images shows (the synthetic world)


class PretrainCorpus(ConcatDataset):
    """Named sources (each with image_and_caption(i) and placeholder(i)), source `name` repeated
    repeat[name] times -> global index i -> (image Tensor (3,H,W), caption str, i)."""

    def __init__(self, sources: Sequence[tuple[str, Dataset]],
                 repeat: Mapping[str, int] | None = None) -> None:
        repeat = dict(repeat or {})
        unknown = set(repeat) - {name for name, _ in sources}
        if unknown:
            raise ValueError(f"PretrainCorpus: repeat names unknown sources {sorted(unknown)}")
        self.sources = list(sources)
        self.copies = [(name, ds) for name, ds in self.sources for _ in range(int(repeat.get(name, 1)))]
        super().__init__([ds for _, ds in self.copies])

    def locate(self, index: int) -> tuple[int, int]:
        """Global index -> (copy number in self.copies, index within that source)."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a corpus of {len(self)} examples")
        part = bisect.bisect_right(self.cumulative_sizes, index)
        return part, index - (self.cumulative_sizes[part - 1] if part else 0)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        part, inner = self.locate(index)
        image, caption = self.datasets[part].image_and_caption(inner)
        return image, caption, index

    def placeholder(self, index: int) -> tuple[Tensor, str, int]:
        """The placeholder of bad example `index`, from its source (masked out of every loss)."""
        part, inner = self.locate(index)
        image, caption, _ = self.datasets[part].placeholder(inner)
        return image, caption, index

    def empty_shards(self) -> list[str]:
        """The tar shards of zero samples among the sources (img2dataset's shards whose urls all failed)."""
        return [url for _, ds in self.sources for url in getattr(ds, "empty_shards", [])]

    def source_of(self, index: int) -> str:
        """The name (train_file or train_shards entry) of the source example `index` comes from."""
        return self.copies[self.locate(index)[0]][0]

    @cached_property
    def image_keys(self) -> Tensor:
        """(len,) int64 image identity of every example (see the module docstring); built on first use."""
        unique = list({id(ds): ds for _, ds in self.sources}.values())
        lists = [ds for ds in unique if isinstance(ds, PretrainDataset)]
        # json lists first: one key per image file, across all lists
        joint = torch.tensor(first_seen_keys(f for ds in lists for f in ds.image_files()), dtype=torch.long)
        keys = dict(zip(map(id, lists), joint.split([len(ds) for ds in lists])))
        offset = int(joint.max()) + 1 if joint.numel() else 0
        for ds in unique:  # then every other source's own keys, after all of those
            if id(ds) not in keys:
                own = torch.as_tensor(ds.image_keys, dtype=torch.long)
                keys[id(ds)] = own + offset
                offset += int(own.max()) + 1 if own.numel() else 0
        return torch.cat([keys[id(ds)] for _, ds in self.copies])

    @cached_property
    def scene_ids(self) -> Tensor | None:
        """(len,) int64: which scene each example shows, equal for equal scenes, from the scene table
        (scenes.json: {image path relative to its folder: scene}) beside every json list, as the synthetic
        world writes one; None when a source has none (real corpora): the truth behind the false-negative
        rate of the mined ITM negatives (Pretrain.py's itm_false_negatives)."""
        tables: dict[int, list[str]] = {}
        for name, ds in self.sources:
            path = os.path.join(os.path.dirname(os.path.abspath(name)), SCENE_TABLE)
            if not isinstance(ds, PretrainDataset) or not os.path.isfile(path):
                return None
            folder = os.path.dirname(path)
            table = {os.path.normpath(os.path.join(folder, k)): v
                     for k, v in read_json(path, "scene table").items()}
            scenes = [table.get(os.path.abspath(f)) for f in ds.image_files()]
            if None in scenes:  # an image the table does not know: no truth for this corpus
                return None
            tables[id(ds)] = scenes
        keys = first_seen_keys(scene for _, ds in self.copies for scene in tables[id(ds)])
        return torch.tensor(keys, dtype=torch.long)

