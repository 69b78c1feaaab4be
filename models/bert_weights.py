"""BERT weight files: find them (a local directory or file, or a hub id that transformers fetches),
read them, and map transformers' key layouts (BertModel / BertFor*, old gamma/beta names) to ours."""

from __future__ import annotations

import os
import re

from torch import Tensor

from grit_io import InputFileError
from models.state_dicts import read_weights_file

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

__all__ = ["normalise_bert_keys", "read_bert_weights", "resolve_bert_weights"]


def resolve_bert_weights(name_or_dir: str) -> str:
    """Local dir / file -> its weights file; otherwise treat as a hub id and let transformers fetch it."""
    if os.path.isdir(name_or_dir):
        for fname in _WEIGHT_FILES:
            path = os.path.join(name_or_dir, fname)
            if os.path.isfile(path):
                return path
        raise FileNotFoundError(f"text_encoder directory {name_or_dir!r} has none of {list(_WEIGHT_FILES)}")
    if os.path.isfile(name_or_dir):
        return name_or_dir
    # Hub ids are 'name' or 'org/name'; anything else that does not exist is a missing local path.
    looks_local = name_or_dir.startswith((".", "/", "~")) or name_or_dir.count("/") > 1
    if looks_local or name_or_dir.endswith((".bin", ".safetensors", ".pth", ".pt")):
        raise FileNotFoundError(f"text_encoder: no such directory or file: {name_or_dir!r}")
    from transformers.utils import cached_file

    errors = []
    for fname in _WEIGHT_FILES:
        try:
            path = cached_file(name_or_dir, fname)
        except (OSError, ValueError) as err:
            errors.append(str(err).splitlines()[0] if str(err) else type(err).__name__)
            continue
        if path:
            return path
    raise FileNotFoundError(
        f"text_encoder {name_or_dir!r} is not a local directory and its weights could not be fetched from "
        f"the Hugging Face hub ({'; '.join(errors)}); download it and pass the local directory"
    )


def read_bert_weights(path: str) -> dict[str, Tensor]:
    """A .safetensors / .bin / .pth file (raw or under 'model') -> its state dict; InputFileError naming the
    file when it holds none."""
    state = read_weights_file(path, "text_encoder weights")
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InputFileError(f"text_encoder weights {path!r} do not hold a state dict of tensors")
    return state


def normalise_bert_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers BERT keys (any of BertModel / BertFor* layouts, old gamma/beta) -> our names."""
    out = {}
    for key, value in state.items():
        if key.startswith(("cls.seq_relationship", "pooler.", "bert.pooler.")) or key.endswith(
            "position_ids"
        ):
            continue
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        if not key.startswith(("bert.", "cls.")):
            key = "bert." + key
        out[key] = value
    return out
