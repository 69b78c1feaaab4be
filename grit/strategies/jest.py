"""JEST's joint example selection (Evans et al., NeurIPS 2024, arXiv 2406.17711), written from the paper:
of a super-batch of K = k x N candidates (filtering ratio f = 1 - 1/k; the paper's 0.8: k = 5), the N
trained on are drawn chunk by chunk (the paper: 16 chunks). The first chunk is drawn uniformly (the
paper's Algorithm 1); every later one, without replacement among the rest, with probabilities
proportional to exp(its conditional score): what the candidate adds to the score of the chunks already
drawn (its own term included). The score of a subset is its learnability, the learner's in-batch
contrastive loss on it minus the frozen reference model's (score: learnability), or JEST's ablations: the
reference's loss negated (easy_reference) or the learner's alone (hard_learner).

Where it departs from the paper (docs/batch-construction.md, 'Online batch selection'):
- JEST trains SigLIP models, whose loss is a sum of pair terms, so the conditional score is the candidate's
  own term plus its pair terms with the chosen ones. With this project's softmax ITC the loss of a subset
  is no sum of pairs; the conditional score is still exact, loss(S + {i}) - loss(S) by the log-sum-exp
  update (grit.strategies._contrastive.conditional_losses). contrastive_loss: sigmoid gives the paper's
  scores.
- The learner scores with the full-resolution model in eval mode (JEST's cheaper FlexiViT scoring at a
  lower resolution has no counterpart in our ViT); the cost of the scoring forwards is counted and logged.
- A chunk is drawn with the Gumbel top-k trick, which samples without replacement with exactly these
  probabilities in one step, from CPU random numbers seeded per step and rank (the same draw on any
  device)."""

from __future__ import annotations

import torch
from torch import Tensor

from . import Selection
from ._contrastive import conditional_losses


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """`total` split into `chunks` parts as equal as possible, the larger first."""
    return [total // chunks + (c < total % chunks) for c in range(chunks)]


class JointSelection(Selection):
    """N of K candidates in `chunks` chunks, each drawn by exp(conditional score) without replacement."""

    name = "jest"

    def __init__(self, batch_size: int, super_batch: int = 5, score: str = "learnability",
                 reference: str | None = None, chunks: int = 16) -> None:
        super().__init__(batch_size, super_batch, score, reference)
        if chunks < 1:
            raise ValueError(f"batching.jest.chunks must be >= 1, got {chunks}")
        # A batch smaller than the chunk count (the tiny config's 8 against the paper's 16) draws one
        # example per chunk: the finest the procedure goes.
        self.chunks = min(int(chunks), self.batch_size)

    def conditional_scores(self, learner: Tensor, reference: Tensor | None, kind: str,
                           chosen: Tensor) -> Tensor:
        """What each candidate adds to the chosen subset's score (K,), by self.score."""
        if self.score == "hard_learner":
            return conditional_losses(learner, kind, chosen)
        ref = conditional_losses(reference, kind, chosen)
        return -ref if self.score == "easy_reference" else conditional_losses(learner, kind, chosen) - ref

    def select(self, learner: Tensor, reference: Tensor | None, kind: str, valid: Tensor | None,
               generator: torch.Generator) -> Tensor:
        """The N positions in the order drawn (chunk by chunk)."""
        K = learner.shape[0]
        sizes = chunk_sizes(self.batch_size, self.chunks)
        uniform = torch.rand(len(sizes), K, generator=generator, dtype=torch.float64)
        gumbel = (-(-uniform.clamp_min(1e-300).log()).log()).to(learner.dtype)
        if learner.device.type == "cuda":  # an asynchronous copy needs pinned memory
            gumbel = gumbel.pin_memory()
        gumbel = gumbel.to(learner.device, non_blocking=True)
        chosen = torch.zeros(K, dtype=torch.bool, device=learner.device)
        low = torch.finfo(learner.dtype).min / 4  # invalid candidates: after every valid one
        drawn = []
        for c, (size, noise) in enumerate(zip(sizes, gumbel)):  # each chunk conditioned on those before it
            # The first chunk uniformly, as the paper's Algorithm 1 (noise alone: a uniform draw of `size`).
            keys = noise if c == 0 else self.conditional_scores(learner, reference, kind, chosen) + noise
            if valid is not None:
                keys = torch.where(valid, keys, low + noise)
            keys = keys.masked_fill(chosen, float("-inf"))
            pick = keys.topk(size).indices
            chosen[pick] = True
            drawn.append(pick)
        return torch.cat(drawn)

    def describe(self) -> str:
        return (f"JEST: {self.batch_size} of {self.candidates} in {self.chunks} chunks by "
                f"{self.score.replace('_', ' ')}")


SELECTION = JointSelection
