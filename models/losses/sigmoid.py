"""SigLIP's pairwise sigmoid loss (Zhai et al., ICCV 2023) in place of the softmax ITC (contrastive_loss:
sigmoid): every image-text pair of the batch is a binary match / non-match decision,

    loss = -1/|B| sum_i sum_j log sigmoid(z_ij (t x_i . y_j + b)),   z_ij = +1 for a match, -1 otherwise,

with its own learnt temperature t = exp(t') and bias b, initialised as the paper's t' = log 10, b = -10
(they are objectives.sigmoid.* in the checkpoint; the model's softmax temperature `temp` then only scales
ALBEF's multinomial ITM mining, and is not trained). No negative is normalised per row, so a grouped batch
changes every pair's term independently: whether grouping still helps is the question
docs/batch-construction.md records.

The false-negative guard's positives are matches (z = +1), a bad sample's row and column are left out, and
|B| counts the good rows. Over the gathered batch (itc_gather) each rank scores its B images against all
W x B texts, gathered with their gradient (an all_gather whose backward returns to each rank the
gradient on its rows from every rank): DDP's mean over the ranks is then the single-device loss of the
global batch, and its gradient. This all-gather is the documented equivalent of the paper's chunked
exchange, which sends the same W x B x d floats in W steps to save memory; the results are the same."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from models.losses import Objective, contrast_rows
from models.objectives import concat_all_gather, upcast

__all__ = ["SigmoidITC", "sigmoid_loss"]


class _GatherWithGrad(torch.autograd.Function):
    """All ranks' rows, (B, d) -> (W*B, d); the backward returns to each rank the sum over ranks of the
    gradient on its own rows (torch.distributed.nn's all_gather does the same and is deprecated)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        """(B, d) -> (W*B, d) in rank order."""
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        """(W*B, d) -> (B, d): every rank's gradient on this rank's rows, summed."""
        grad = grad.contiguous().clone()  # all_reduce works in place; the incoming gradient is autograd's
        dist.all_reduce(grad)  # gloo has no reduce_scatter; the rows are few next to the encoders' work
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def _gather_with_grad(x: Tensor) -> tuple[Tensor, int]:
    """(B, d) -> ((W*B, d) all ranks' rows in rank order, gradient to every rank's own rows; offset of this
    rank's rows)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    return _GatherWithGrad.apply(x), dist.get_rank() * x.shape[0]


def sigmoid_loss(image_feat: Tensor, text_feat: Tensor, log_scale: Tensor, bias: Tensor,
                 positive: Tensor | None = None, valid: Tensor | None = None,
                 gather: bool = False) -> Tensor:
    """Feats (B, d) L2-normalised, log_scale t' and bias b 0-dim -> 0-dim SigLIP loss of this rank's rows.

    positive (B, N) bool: the matches (None: the true pair, column rank*B + i); valid (B,) bool: bad samples
    are neither rows nor columns (None: all good). gather: the texts of every rank (N = W*B). Each rank's
    loss is scaled so that the mean over ranks (DDP's) is the loss of the global batch."""
    b = image_feat.shape[0]
    texts, offset = _gather_with_grad(text_feat) if gather else (text_feat, 0)
    n = texts.shape[0]
    # fp32 at least, autocast off: in bf16 a learnt scale near 100 would round the logits to steps of 0.5.
    with torch.autocast(image_feat.device.type, enabled=False):
        logits = upcast(image_feat) @ upcast(texts).t() * upcast(log_scale).exp() + upcast(bias)
    if positive is None:
        positive = torch.zeros(b, n, dtype=torch.bool, device=logits.device)
        rows = torch.arange(b, device=logits.device)
        positive[rows, rows + offset] = True
    sign = positive.to(logits.dtype) * 2 - 1
    pair_loss = -F.logsigmoid(sign * logits)
    if valid is None:
        return pair_loss.sum() / b
    # uint8 on the wire: not every backend all_gathers bool tensors.
    columns = concat_all_gather(valid.to(torch.uint8)).bool() if gather else valid
    # |B| counts the good rows of the global batch (= its good columns), so that DDP's mean over the W
    # ranks is the single-device loss however the bad samples fall.
    pairs = valid[:, None] & columns[None, :]
    return (pair_loss * pairs).sum() * (n // b) / columns.sum().clamp(min=1)


class SigmoidITC(Objective):
    """loss_itc in SigLIP's sigmoid form, from the ITC projections; loss_cons stays zero (no softmax)."""

    loss_names = ("loss_itc",)
    replaces = ("temp",)

    def __init__(self, gather: bool) -> None:
        super().__init__()
        self.gather = gather
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(-10.0))

    @classmethod
    def from_config(cls, config: Any) -> SigmoidITC | None:
        """On with itc and contrastive_loss: sigmoid."""
        if not getattr(config, "itc", True) or getattr(config, "contrastive_loss", "softmax") != "sigmoid":
            return None
        return cls(getattr(config, "itc_gather", False))

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """{loss_itc}, no metrics."""
        positive, valid = contrast_rows(out, self.gather)
        loss = sigmoid_loss(out["image_feat"], out["text_feat"], self.log_scale, self.bias, positive, valid,
                            self.gather)
        return {"loss_itc": loss}, {}


OBJECTIVE = SigmoidITC
