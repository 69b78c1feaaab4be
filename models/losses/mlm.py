"""MLM: cross-entropy of the vocabulary logits the model returns (R, V) against their labels (R,), -100
where no token is predicted (not masked, or a bad sample's). Summing and dividing by a clamped count keeps
the loss finite when nothing was masked. Which rows the model scores (every position, as ALBEF, or a
fixed-size selection holding every masked one, mlm_masked_only) does not change the loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from models.losses import Objective


class MLM(Objective):
    """loss_mlm from out['mlm_logits'] (R, V) and out['mlm_labels'] (R,)."""

    loss_names = ("loss_mlm",)

    @classmethod
    def from_config(cls, config: Any) -> MLM | None:
        """On with mlm (a pre-training key; the retrieval model has no MLM head)."""
        return cls() if getattr(config, "mlm", False) else None

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """{loss_mlm}, no metrics."""
        labels = out["mlm_labels"]
        loss_sum = F.cross_entropy(out["mlm_logits"], labels, ignore_index=-100, reduction="sum")
        return {"loss_mlm": loss_sum / (labels != -100).sum().clamp(min=1)}, {}


OBJECTIVE = MLM
