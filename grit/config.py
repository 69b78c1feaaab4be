"""The defaults a GritSampler's switches take, the rules its options must obey, and the index-array files
batching.warmstart_indices may name.

DEFAULTS are the paper's: GritSampler's signature and the `batching` block of the typed config
(training.config_blocks.Batching, where each option's meaning is) both take them from here; the config
checks the same rules at start-up."""

from __future__ import annotations

import os

import numpy as np
import torch

from grit_io import InputFileError, load_torch_file, read_json

__all__ = ["DEFAULTS", "MODES", "first_grouped_epoch", "load_index_array", "option_problems"]

MODES = ("concurrent", "naive")

# The paper's GRIT (Sec. 3.1, S.M. Algorithms 1-2): grouping on, both shuffles, features collected while
# training; our extensions off or neutral (no warm-start file; sharded grouping gives the same G).
DEFAULTS = {"enabled": True, "example_shuffle": True, "batch_shuffle": True, "mode": "concurrent",
            "warmstart_indices": None, "shard_grouping": True, "group_from_epoch": 0}


def first_grouped_epoch(group_from_epoch: int, mode: str, warmstart: bool) -> int:
    """The first epoch whose batches are grouped: the paper's 1 (concurrent: epoch 0 collects the features)
    or 0 (naive mode's extra pass, or a warm-start array), unless group_from_epoch is later."""
    return max(int(group_from_epoch), 0 if mode == "naive" or warmstart else 1)


def option_problems(*, batch_size: int, enabled: bool, queue_size: int | None, search_space: int | None,
                    mode: str, group_from_epoch: int = 0, warmstart: bool = False,
                    prefix: str = "") -> list[str]:
    """What is wrong with a GritSampler's options (one message each; [] when they hold): the mode, and
    with grouping on, positive sizes with batch_size <= search_space <= queue_size, and no warm start for
    a first epoch that group_from_epoch keeps random. prefix: how the messages name the options (the
    typed config's 'batching.'; '': GritSampler's keyword arguments)."""
    if mode not in MODES:
        return [f"{prefix}mode must be one of {MODES}, got {mode!r}"]
    if not enabled:
        return []
    if group_from_epoch and warmstart:
        return [f"{prefix}warmstart_indices groups epoch 0, but {prefix}group_from_epoch "
                f"({group_from_epoch}) "
                "keeps the epochs before it random; set one of them"]
    bad = [f"{prefix}{name} must be a positive integer while batches are grouped, got {value!r}"
           for name, value in (("queue_size", queue_size), ("search_space", search_space))
           if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if bad:
        return bad
    if search_space < batch_size:
        return [f"{prefix}search_space ({search_space}) must be >= batch_size ({batch_size}): each per-rank "
                "batch is one group cut from a sub-queue"]
    if queue_size < search_space:
        return [f"{prefix}queue_size ({queue_size}) must be >= {prefix}search_space ({search_space})"]
    return []


def load_index_array(path: str, dataset_len: int, what: str = "batching.warmstart_indices") -> torch.Tensor:
    """Load a 1-D array of distinct dataset indices in [0, dataset_len) from .pt/.pth, .npy or .json."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no such file: {path}")
    if path.endswith(".json"):
        try:
            data = torch.tensor(read_json(path, what))
        except (TypeError, ValueError, RuntimeError) as e:  # not a list of numbers
            if isinstance(e, InputFileError):
                raise
            raise InputFileError(f"{what}: cannot read an index array from {path}: {e}") from None
    elif path.endswith(".npy"):
        try:
            data = torch.from_numpy(np.load(path, allow_pickle=False))
        except Exception as e:  # noqa: BLE001 - any parse failure becomes one clear message
            raise InputFileError(f"{what}: cannot read an index array from {path}: {e}") from None
    else:  # its errors name the file (and --trust_checkpoint for a pickle that needs it)
        data = load_torch_file(path, what=what)
        if isinstance(data, dict):  # a sampler state or a checkpoint holding one
            sampler = data.get("sampler", data)
            data = sampler.get("indices") if isinstance(sampler, dict) else sampler
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise InputFileError(f"{what}: {path} must hold a 1-D integer array, got {shape}")
    if data.dtype.is_floating_point or data.dtype == torch.bool or data.dtype.is_complex:
        raise InputFileError(f"{what}: {path} must hold integers, got dtype {data.dtype}")
    data = data.long()
    if data.numel() and (int(data.min()) < 0 or int(data.max()) >= dataset_len):
        raise InputFileError(f"{what}: {path} has indices outside [0, {dataset_len}) (dataset size)")
    if data.numel() != torch.unique(data).numel():
        raise InputFileError(f"{what}: {path} contains repeated indices")
    return data
