"""State-dict helpers shared by the weight loaders (bert.py, vit.py, loading.py): read a weights file, do
its tensors fit the model, which model keys stayed unloaded (tied weights counted once), and one-line key
summaries."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from grit_io import InputFileError, load_torch_file

__all__ = ["check_shapes", "missing_after_tying", "read_weights_file", "summarise_keys"]


def read_weights_file(path: str, what: str) -> Any:
    """The content of a .safetensors file (a dict of tensors) or of a torch.save file (weights-only load);
    InputFileError naming `what` and the file when it cannot be read."""
    if not path.endswith(".safetensors"):
        return load_torch_file(path, what=what)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise InputFileError(f"{what} {path!r} could not be read as safetensors: {err}") from err


def check_shapes(state: Mapping[str, Tensor], own: Mapping[str, Tensor], what: str, limit: int = 5) -> None:
    """Raise InputFileError (a ValueError): `what`, then up to `limit` keys whose shapes differ between the
    file's state and the model's own."""
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        # The file does not fit the configured model: a user's mistake, reported in one line by the scripts.
        raise InputFileError(f"{what}: " + "; ".join(mismatched[:limit]))


def missing_after_tying(model: nn.Module, loaded: set[str]) -> list[str]:
    """Model keys not loaded, counting a tied tensor as loaded when any of its names was."""
    by_storage: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        by_storage.setdefault(id(tensor), []).append(name)
    missing = []
    for names in by_storage.values():
        if not any(n in loaded for n in names):
            missing.extend(names)
    order = {name: i for i, name in enumerate(state)}
    return sorted(missing, key=order.__getitem__)


def summarise_keys(keys: Sequence[str]) -> str:
    """Group parameter names for one log line: 'bert.encoder.layer.{6-11}.crossattention, cls.predictions'."""
    layered: dict[str, list[int]] = {}
    modules: list[str] = []
    for key in keys:
        match = re.match(r"(.*?\b(?:layer|blocks))\.(\d+)\.([^.]+)", key)
        if match:
            layered.setdefault(f"{match[1]}.{{}}.{match[3]}", []).append(int(match[2]))
        else:
            # Module path without the parameter name (unless that would hide it), at most 3 levels deep.
            parts = key.split(".")
            if len(parts) > 2 or parts[-1] in ("weight", "bias"):
                parts = parts[:-1] or parts
            module = ".".join(parts[:3])
            if module not in modules:
                modules.append(module)
    # A module whose parent is listed too is folded into the parent.
    out = [m for m in modules if not any(m.startswith(p + ".") for p in modules)]
    for pattern, layers in layered.items():
        layers = sorted(set(layers))
        out.append(pattern.format(str(layers[0]) if len(layers) == 1 else "{" + _ranges(layers) + "}"))
    return ", ".join(out)


def _ranges(values: list[int]) -> str:
    spans, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        spans.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(spans)
