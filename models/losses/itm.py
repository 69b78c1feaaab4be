"""ITM (ALBEF's ITM_hard, as GRIT-VLP uses it): cross-entropy over the B matches and the 2B non-matches the
model mined in its batch (models.negatives.mine_negatives), whose logits (3B, 2) the model returns in
itm_pairs' order; a pair with a bad sample is left out of the mean. Its metrics say whether ITM has left
chance: the share of the 3B pairs classified right and of the B matches called a match (2/3 and 0 there)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from models.losses import Objective
from models.negatives import itm_accuracy, itm_pair_weights
from models.objectives import masked_mean


class ITM(Objective):
    """loss_itm from out['itm_logits'] (3B, 2), out['neg_text_idx'] and out['neg_image_idx'] (B,)."""

    loss_names = ("loss_itm",)
    metric_names = ("itm_accuracy", "itm_match_accuracy")

    @classmethod
    def from_config(cls, config: Any) -> ITM | None:
        """On with itm."""
        return cls() if config.itm else None

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """{loss_itm}, {itm_accuracy, itm_match_accuracy}."""
        logits, neg_text, neg_image, valid = (out["itm_logits"], out["neg_text_idx"], out["neg_image_idx"],
                                              out.get("valid"))
        batch = neg_text.shape[0]
        labels = torch.zeros(3 * batch, dtype=torch.long, device=logits.device)
        labels[:batch] = 1
        if valid is None:
            loss = F.cross_entropy(logits, labels)
        else:
            loss = masked_mean(F.cross_entropy(logits, labels, reduction="none"),
                               itm_pair_weights(valid, neg_text, neg_image))
        accuracy, match_accuracy = itm_accuracy(logits.detach(), neg_text, neg_image, valid)
        return {"loss_itm": loss}, {"itm_accuracy": accuracy, "itm_match_accuracy": match_accuracy}


OBJECTIVE = ITM
