"""ITC, softmax form: the paper's Eq. 1-2 with GRIT's consistency term (Eq. 6, weight lambda_cons), and
the two loss-side switches beside GRIT (0: the paper's ITC): HN-NCE's negative weights (itc_hn_beta) and
MAFA's S-ITC, targets smoothed towards uniform (itc_smoothing) from epoch itc_smoothing_epoch on.

In-batch (the paper), over the gathered batch (itc_gather) or, for retrieval, against the momentum
features and the queue (the model's image_bank / text_bank). The maths is models.objectives.itc_loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from models.losses import Objective, contrast_rows
from models.objectives import itc_loss


class SoftmaxITC(Objective):
    """loss_itc and loss_cons from the ITC projections (B, d) and the temperature in the outputs."""

    loss_names = ("loss_itc", "loss_cons")

    def __init__(self, lambda_cons: float, gather: bool, hn_beta: float, smoothing: float,
                 smoothing_epoch: int) -> None:
        super().__init__()
        self.lambda_cons, self.gather, self.hn_beta = lambda_cons, gather, hn_beta
        self.smoothing_value, self.smoothing_epoch = smoothing, smoothing_epoch
        self.smoothing = 0.0 if smoothing_epoch else smoothing

    @classmethod
    def from_config(cls, config: Any) -> SoftmaxITC | None:
        """On with itc (the retrieval model always has it) and the softmax form (contrastive_loss)."""
        if not getattr(config, "itc", True) or getattr(config, "contrastive_loss", "softmax") != "softmax":
            return None
        return cls(config.lambda_cons, getattr(config, "itc_gather", False),
                   getattr(config, "itc_hn_beta", 0.0), getattr(config, "itc_smoothing", 0.0),
                   getattr(config, "itc_smoothing_epoch", 0))

    def start_epoch(self, epoch: int) -> None:
        """S-ITC smooths from epoch itc_smoothing_epoch on."""
        self.smoothing = self.smoothing_value if epoch >= self.smoothing_epoch else 0.0

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """{loss_itc, loss_cons}, no metrics."""
        if out.get("image_bank") is not None:
            return self._against_bank(out), {}
        positive, valid = contrast_rows(out, self.gather)
        itc = itc_loss(out["image_feat"], out["text_feat"], out["temp"], self.lambda_cons, positive=positive,
                       gather=self.gather, valid=valid, hn_beta=self.hn_beta, smoothing=self.smoothing)
        return {"loss_itc": itc["loss_itc"], "loss_cons": itc["loss_cons"]}, {}

    def _against_bank(self, out: Mapping[str, Any]) -> dict[str, Tensor]:
        """Against the bank (B+K, d): batch columns valid per `valid`, queued ones per out['bank_valid']."""
        positive, valid = contrast_rows(out, gather=False)

        def itc(row_valid: Tensor | None, column_valid: Tensor | None = None) -> dict[str, Tensor]:
            return itc_loss(out["image_feat"], out["text_feat"], out["temp"], self.lambda_cons,
                            positive=positive, image_bank=out["image_bank"], text_bank=out["text_bank"],
                            valid=row_valid, valid_columns=column_valid, hn_beta=self.hn_beta,
                            smoothing=self.smoothing)

        queued = out["bank_valid"]
        if valid is not None:
            found = itc(valid, torch.cat([valid, queued]))
            return {"loss_itc": found["loss_itc"], "loss_cons": found["loss_cons"]}
        # A good batch may still face bad samples queued by earlier steps, on any rank. Whether the queue
        # holds one is known only on the device, and asking the host would stall every step, so both losses
        # are computed and the device picks: the plain one (the exact pre-bad-sample result, and gradient:
        # the other branch gets exact zeros) while the queue is clean, the masked one otherwise. The extra
        # cost is one (B, B+K) softmax pair, small next to the encoders.
        plain = itc(None)
        ones = torch.ones_like(positive[:, 0])
        masked = itc(ones, torch.cat([ones, queued]))
        clean = queued.all()
        return {"loss_itc": torch.where(clean, plain["loss_itc"], masked["loss_itc"]),
                "loss_cons": torch.where(clean, plain["loss_cons"], masked["loss_cons"])}


OBJECTIVE = SoftmaxITC
