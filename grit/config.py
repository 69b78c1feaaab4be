"""The config['grit'] block (defaults and checks) and the index-array files it may name
(grit.warmstart_indices)."""

from __future__ import annotations

import json
import os

import torch

from torch_files import load_torch_file

__all__ = ["load_index_array", "parse_grit_config"]

_GRIT_DEFAULTS = {"enabled": True, "queue_size": None, "search_space": None, "example_shuffle": True,
                  "batch_shuffle": True, "mode": "concurrent", "warmstart_indices": None,
                  "shard_grouping": True}


def parse_grit_config(grit: dict | None, batch_size: int) -> dict:
    """Validate the config['grit'] block -> dict with every key of _GRIT_DEFAULTS filled in."""
    if grit is None:
        return dict(_GRIT_DEFAULTS, enabled=False)
    if not isinstance(grit, dict):
        raise ValueError(f"grit: expected a mapping (the config's grit block), got {type(grit).__name__}")
    unknown = sorted(set(grit) - set(_GRIT_DEFAULTS))
    if unknown:
        raise ValueError(f"grit: unknown key(s) {unknown}; known keys: {sorted(_GRIT_DEFAULTS)}")
    cfg = dict(_GRIT_DEFAULTS, **grit)
    for key in ("enabled", "example_shuffle", "batch_shuffle", "shard_grouping"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"grit.{key} must be true or false, got {cfg[key]!r}")
    if cfg["mode"] not in ("concurrent", "naive"):
        raise ValueError(f"grit.mode must be 'concurrent' or 'naive', got {cfg['mode']!r}")
    if not cfg["enabled"]:
        return cfg
    for key in ("queue_size", "search_space"):
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"grit.{key} must be a positive integer, got {value!r}")
    if cfg["search_space"] < batch_size:
        raise ValueError(
            f"grit.search_space ({cfg['search_space']}) must be >= batch_size ({batch_size}): each per-rank "
            "batch is one group cut from a sub-queue")
    if cfg["queue_size"] < cfg["search_space"]:
        raise ValueError(
            f"grit.queue_size ({cfg['queue_size']}) must be >= grit.search_space ({cfg['search_space']})")
    return cfg


def load_index_array(path: str, dataset_len: int, what: str = "grit.warmstart_indices") -> torch.Tensor:
    """Load a 1-D array of distinct dataset indices in [0, dataset_len) from .pt/.pth, .npy or .json."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what}: no such file: {path}")
    if path.endswith((".npy", ".json")):
        try:
            if path.endswith(".npy"):
                import numpy as np

                data = torch.from_numpy(np.load(path, allow_pickle=False))
            else:
                with open(path) as f:
                    data = torch.tensor(json.load(f))
        except Exception as e:  # noqa: BLE001 - any parse failure becomes one clear message
            raise ValueError(f"{what}: cannot read an index array from {path}: {e}") from e
    else:  # its errors name the file (and --trust-checkpoint for a pickle that needs it)
        data = load_torch_file(path, what=what)
        if isinstance(data, dict):  # a sampler state or a checkpoint holding one
            sampler = data.get("sampler", data)
            data = sampler.get("indices") if isinstance(sampler, dict) else sampler
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        shape = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{what}: {path} must hold a 1-D integer array, got {shape}")
    if data.dtype.is_floating_point or data.dtype == torch.bool or data.dtype.is_complex:
        raise ValueError(f"{what}: {path} must hold integers, got dtype {data.dtype}")
    data = data.long()
    if data.numel() and (int(data.min()) < 0 or int(data.max()) >= dataset_len):
        raise ValueError(f"{what}: {path} has indices outside [0, {dataset_len}) (dataset size)")
    if data.numel() != torch.unique(data).numel():
        raise ValueError(f"{what}: {path} contains repeated indices")
    return data
