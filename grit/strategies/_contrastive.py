"""The in-batch contrastive losses that online selection scores a super-batch by, from its logits (K, K)
(image i against text j): of a whole subset of candidates, of each candidate alone, and of each candidate
added to a chosen subset. Two kinds, the two ITC losses the models train with:

    softmax  ALBEF's ITC: for a subset U, sum over r in U of (ce(r -> U texts) + ce(r -> U images)) / 2,
             ce the cross-entropy of the true pair among U (logits = similarity / temperature)
    sigmoid  SigLIP's: sum over i, j in U of -log sigmoid(z_ij a_ij), z_ij = +1 for i = j, -1 otherwise

Losses are sums over the subset's rows, not means, as JEST's scores: the subsets compared at one step all
have the same size, and a sum is what adding one example changes. A logit of -inf off the diagonal (a
pair the false-negative guard makes a positive) drops out of both losses: out of the log-sum-exp, and a
sigmoid pair term of 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KINDS", "conditional_losses", "example_losses", "pair_losses", "subset_loss"]

KINDS = ("softmax", "sigmoid")


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"contrastive loss kind must be one of {KINDS}, got {kind!r}")


def pair_losses(logits: Tensor) -> Tensor:
    """SigLIP's pair terms: logits (K, K) -> (K, K) -log sigmoid(z_ij a_ij), z = +1 on the diagonal."""
    sign = torch.eye(logits.shape[0], dtype=logits.dtype, device=logits.device) * 2 - 1
    return F.softplus(-sign * logits)


def subset_loss(logits: Tensor, kind: str, members: Tensor) -> Tensor:
    """The loss of the subset `members` (m,) long, computed on its own (m, m) logits -> 0-dim; the direct
    computation that conditional_losses updates incrementally (and the tests' brute force)."""
    _check(kind)
    sub = logits[members][:, members]
    if kind == "sigmoid":
        return pair_losses(sub).sum()
    diag = sub.diagonal()
    return 0.5 * ((sub.logsumexp(1) - diag) + (sub.logsumexp(0) - diag)).sum()


def example_losses(logits: Tensor, kind: str, valid: Tensor | None = None) -> Tensor:
    """Each candidate's own loss in the whole super-batch (its valid candidates) -> (K,): softmax, its two
    cross-entropies / 2; sigmoid, half its row and column (so that the K losses sum to the batch's)."""
    _check(kind)
    if valid is not None:
        outside = ~(valid[:, None] & valid[None, :])
        outside.fill_diagonal_(False)
    if kind == "sigmoid":
        pairs = pair_losses(logits)
        if valid is not None:
            pairs = pairs.masked_fill(outside, 0.0)
        return 0.5 * (pairs.sum(1) + pairs.sum(0))
    masked = logits if valid is None else logits.masked_fill(outside, float("-inf"))
    diag = logits.diagonal()
    return 0.5 * ((masked.logsumexp(1) - diag) + (masked.logsumexp(0) - diag))


def conditional_losses(logits: Tensor, kind: str, chosen: Tensor) -> Tensor:
    """What adding each candidate to the chosen subset S adds to its loss: loss(S + {i}) - loss(S) for every
    i not in S (entries of S: undefined) -> (K,). chosen (K,) bool. O(K^2), no loop over S.

    sigmoid: a_ii's term plus i's pair terms with S, both ways (JEST's conditional learnability exactly).
    softmax: every row of S gains i in its log-sum-exp, and i's own two cross-entropies over S + {i}; the
    loss of one example alone is 0, so an empty S gives all zeros."""
    _check(kind)
    if kind == "sigmoid":
        pairs = pair_losses(logits)
        weight = chosen.to(pairs.dtype)
        return pairs.diagonal() + pairs @ weight + weight @ pairs
    # masked_fill with a Python number: no scalar tensor copied to the device (a host synchronisation)
    rows = logits.masked_fill(~chosen[None, :], float("-inf")).logsumexp(1)  # (K,) LSE of a_rj, j in S
    cols = logits.masked_fill(~chosen[:, None], float("-inf")).logsumexp(0)  # (K,) LSE of a_jr, j in S
    # Rows r of S: adding column i to r's image->text and text i to r's text->image log-sum-exp.
    grow = (torch.logaddexp(rows[:, None], logits) - rows[:, None]
            + torch.logaddexp(cols[:, None], logits.t()) - cols[:, None])
    grow = grow.masked_fill(~chosen[:, None], 0.0).sum(0)
    diag = logits.diagonal()
    own = torch.logaddexp(rows, diag) - diag + torch.logaddexp(cols, diag) - diag
    return 0.5 * (grow + own)
