"""RHO-LOSS (Mindermann et al., ICML 2022), written from the paper, as online selection: of a super-batch of
k x N candidates, train on the N with the largest reducible loss, the learner's loss minus that of a
frozen reference model trained on held-out data (here: a named checkpoint), each candidate scored alone.

Where it departs from the paper (docs/batch-construction.md, 'Online batch selection'): the loss is the
contrastive one of this project's models, so "alone" means each candidate's own in-batch loss within the
whole super-batch (grit.strategies._contrastive.example_losses), not a per-example cross-entropy; and the
reference model is whatever checkpoint batching.rho.reference names (the paper trains it on a hold-out
set). score easy_reference (the lowest reference loss) and hard_learner (the highest learner loss, no
reference) are JEST's two ablations."""

from __future__ import annotations

import torch
from torch import Tensor

from . import Selection
from ._contrastive import example_losses


def example_scores(selection: Selection, learner: Tensor, reference: Tensor | None, kind: str,
                   valid: Tensor | None) -> Tensor:
    """Each candidate's score (K,) by selection.score from the losses of example_losses."""
    if selection.score == "hard_learner":
        return example_losses(learner, kind, valid)
    ref = example_losses(reference, kind, valid)
    return -ref if selection.score == "easy_reference" else example_losses(learner, kind, valid) - ref


class ReducibleLoss(Selection):
    """The top N of K candidates by reducible loss (learner - reference), deterministic."""

    name = "rho"

    def select(self, learner: Tensor, reference: Tensor | None, kind: str, valid: Tensor | None,
               generator: torch.Generator) -> Tensor:
        """The N highest-scoring candidates, in descending score; invalid ones last."""
        scores = example_scores(self, learner, reference, kind, valid)
        if valid is not None:  # below every valid score, still ordered (so that ties break by position)
            scores = torch.where(valid, scores, torch.finfo(scores.dtype).min)
        return scores.topk(self.batch_size).indices

    def describe(self) -> str:
        return f"RHO-LOSS top {self.batch_size} of {self.candidates} by {self.score.replace('_', ' ')}"


SELECTION = ReducibleLoss
