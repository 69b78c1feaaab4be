"""ITM's in-batch negatives (ALBEF's ITM_hard, as GRIT-VLP uses it): mining one negative text per image
and one negative image per text from the ITC similarities (hard: argmax or multinomial; or random), which
of the 3B pairs count when a batch holds bad samples, ITM's accuracy over them, and the batch hardness
the logs report. Pure functions of tensors, shared by the pre-training and retrieval models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from models.objectives import check_rows, masked_mean, upcast

__all__ = ["hardest_negative_similarity", "itm_accuracy", "itm_pair_weights", "mine_negatives"]


_MODES = ("hard", "random")
_SAMPLINGS = ("argmax", "multinomial")


@torch.no_grad()
def mine_negatives(
    sim_i2t: Tensor,
    sim_t2i: Tensor,
    positive: Tensor | None = None,
    mode: str = "hard",
    sampling: str = "argmax",
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """In-batch ITM negatives: sims (B, B) -> (neg_text_idx (B,), neg_image_idx (B,)) LongTensors.

    neg_text_idx[i] is the text paired with image i, neg_image_idx[i] the image paired with text i.
    Candidates are the in-batch items that are not positives: positive[i, j] True means image i
    matches text j (None -> only the true pairs, the diagonal, which is always excluded too); the
    text side uses positive.T. With image-id positives every caption of the same image is excluded.
      mode='hard', sampling='argmax':      the most similar negative (GRIT-VLP authors' code);
      mode='hard', sampling='multinomial': drawn from softmax(sim) + 1e-5 with positives zeroed (ALBEF);
      mode='random':                       uniform over the negatives (`sampling` is ignored).
    Pass the temperature-scaled sims of itc_loss (only the multinomial weights depend on the scale).
    valid (B,) bool: invalid items (bad samples) are never taken as negatives; a row left without
    a valid candidate picks among the others, and the caller weighs that pair out (itm_pair_weights).
    Raises ValueError when B < 2 or some row has no negative (e.g. the whole batch is one image).
    """
    if mode not in _MODES:
        raise ValueError(f"mine_negatives: mode must be one of {_MODES}, got {mode!r}")
    if sampling not in _SAMPLINGS:
        raise ValueError(f"mine_negatives: sampling must be one of {_SAMPLINGS}, got {sampling!r}")
    b = sim_i2t.shape[0]
    if sim_i2t.dim() != 2 or sim_i2t.shape != (b, b) or sim_t2i.shape != (b, b):
        raise ValueError(
            f"mine_negatives: sims must be square (B, B) in-batch matrices, got "
            f"{tuple(sim_i2t.shape)} and {tuple(sim_t2i.shape)} (use local_columns after gather)"
        )
    if b < 2:
        raise ValueError("mine_negatives: batch size must be >= 2 to mine in-batch ITM negatives")
    excluded = torch.eye(b, dtype=torch.bool, device=sim_i2t.device)
    if positive is not None:
        if positive.shape != (b, b) or positive.dtype != torch.bool:
            raise ValueError(
                f"mine_negatives: positive must be a bool ({b}, {b}) mask, got "
                f"{positive.dtype} {tuple(positive.shape)}"
            )
        excluded = excluded | positive
        check_rows(
            torch.cat([~excluded, ~excluded.t()]),
            "mine_negatives: some image or text has no in-batch negative (all items are positives); "
            "batch size must be >= 2 with at least two distinct images",
        )
    excluded_t = excluded.t()
    if valid is not None:
        excluded, excluded_t = _exclude_invalid(excluded, valid), _exclude_invalid(excluded_t, valid)
    return (
        _pick(sim_i2t, excluded, mode, sampling, generator),
        _pick(sim_t2i, excluded_t, mode, sampling, generator),
    )


def _exclude_invalid(excluded: Tensor, valid: Tensor) -> Tensor:
    """Also exclude invalid columns, except in rows that would then have no candidate left."""
    more = excluded | ~valid[None, :]
    return torch.where(more.all(dim=1, keepdim=True), excluded, more)


def itm_pair_weights(valid: Tensor, neg_text_idx: Tensor, neg_image_idx: Tensor) -> Tensor:
    """valid (B,), mined indices (B,) -> (3B,) bool: which of [positives, (i, neg text), (neg image, t)]
    pairs count in the ITM loss (both members valid)."""
    return torch.cat([valid, valid & valid[neg_text_idx], valid & valid[neg_image_idx]])


@torch.no_grad()
def itm_accuracy(logits: Tensor, neg_text_idx: Tensor, neg_image_idx: Tensor,
                 valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """ITM logits (3B, 2) in itm_pairs' order, mined indices (B,) each -> 0-dim floats: the share of the
    3B pairs classified right, and of the B matches called a match. An ITM at chance calls every pair a
    non-match: 2/3 and 0. Pairs with a bad sample (valid (B,) False) are left out. No host sync."""
    batch = neg_text_idx.shape[0]
    labels = torch.zeros(3 * batch, dtype=torch.long, device=logits.device)
    labels[:batch] = 1
    right = (logits.argmax(dim=1) == labels).float()
    weight = (torch.ones_like(right) if valid is None
              else itm_pair_weights(valid, neg_text_idx, neg_image_idx).float())
    return masked_mean(right, weight), masked_mean(right[:batch], weight[:batch])


def _pick(
    sim: Tensor, excluded: Tensor, mode: str, sampling: str, generator: torch.Generator | None
) -> Tensor:
    """One negative column per row of sim (B, B), never an excluded one -> (B,) LongTensor."""
    if mode == "hard" and sampling == "argmax":
        return sim.masked_fill(excluded, float("-inf")).argmax(dim=1)
    if mode == "hard":
        # ALBEF's +1e-5 keeps every negative reachable when the softmax underflows to zero.
        weights = F.softmax(upcast(sim), dim=1) + 1e-5
    else:
        weights = torch.ones_like(sim, dtype=torch.float)
    weights = weights.masked_fill(excluded, 0.0)
    return torch.multinomial(weights, 1, generator=generator).squeeze(1)


@torch.no_grad()
def hardest_negative_similarity(sim: Tensor, positive: Tensor | None = None) -> Tensor:
    """Cosine sims (B, N) (not /temp) -> 0-dim: mean over rows of the largest negative similarity.

    positive (B, N) bool as in itc_loss (None -> the diagonal); the diagonal is always excluded.
    Rows without a negative are left out of the mean (NaN if no row has one). Detached; no host sync.
    """
    b, n = sim.shape
    excluded = torch.eye(b, n, dtype=torch.bool, device=sim.device)
    if positive is not None:
        if positive.shape != sim.shape or positive.dtype != torch.bool:
            raise ValueError(
                f"hardest_negative_similarity: positive must be a bool {tuple(sim.shape)} mask, got "
                f"{positive.dtype} {tuple(positive.shape)}"
            )
        excluded = excluded | positive
    hardest = upcast(sim.detach()).masked_fill(excluded, float("-inf")).amax(dim=1)
    valid = torch.isfinite(hardest)
    return torch.where(valid, hardest, 0.0).sum() / valid.sum()
