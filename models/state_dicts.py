"""A check shared by the encoders' weight loaders (bert.py, vit.py): do a file's tensors fit the model?"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def check_shapes(state: Mapping[str, Tensor], own: Mapping[str, Tensor], what: str, limit: int = 5) -> None:
    """Raise ValueError: `what`, then up to `limit` keys whose shapes differ between state and own."""
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"{what}: " + "; ".join(mismatched[:limit]))
