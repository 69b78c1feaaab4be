"""Batch construction: which collected examples share a mini-batch.

The sampler (grit.GritSampler) does everything around a strategy, the same for all of them: it collects
the step's detached ITC projections, dataset indices and `valid` flags after every step into queues of L
(phase 1), shuffles a full queue and splits it into sub-queues of M (phase 2), asks the strategy to order
every sub-queue (phase 3), composes the next epoch's per-rank index arrays from the grouped order G and
deals them (phase 4, with its guarantees: each index at most once an epoch, fewer than N x W left out and
those back next epoch, invalid samples never grouped), shards the sub-queues over the ranks, and keeps
it all in its state_dict (the next epoch's global array under 'indices', whatever the strategy).

A strategy is a `Grouping`: given the features of some sub-queues it returns, for each, an order of its
positions whose consecutive runs of N valid entries are the batches. Its teacher is the model itself:
the ITC features of the epoch being trained, as GRIT's, so no strategy needs an extra forward pass or
an outside model. `batching.strategy` (training.config.Batching) names one:

    grit    GRIT-VLP's greedy alternating chain (the paper; grit.strategies.grit)
    random  no grouping: DistributedSampler's permutation every epoch (the ALBEF baseline)
    b3      B3's rank window [p, p + m] of every example, partitioned by METIS into communities of N
    gcbs    GCBS's bandwidth-minimising order (reverse Cuthill-McKee) of a k-nearest-neighbour graph
    rwr     BatchSampler's random walks with restart on the same k-nearest-neighbour graph

Online selection (issue 52) is the second kind of strategy: a `Selection` sees, at every step, a super-
batch of k x N candidates per rank (dealt by the sampler like random batches) with their contrastive
logits under the learner and, when it asks for one, a frozen reference model, and returns which N of them
the step trains on (grit.online.OnlineSampler; docs/batch-construction.md, 'Online batch selection'):

    jest    JEST's joint selection by learnability, chunk by chunk (Evans et al., NeurIPS 2024)
    rho     RHO-LOSS: the top N by reducible loss, each example scored alone (Mindermann et al., ICML 2022)

Adding one means a module grit/strategies/<name>.py that defines GROUPING (a Grouping subclass whose
keyword options are its config block's keys) or SELECTION (a Selection subclass, likewise), found here by
its name (ONLINE: the modules that define SELECTION), and its block (and name among batching.strategy's
values) in training/config.py; nothing else.
Importable with torch and numpy only: a strategy's own dependencies (scipy, pymetis) are imported when it
is built, with a message naming the package when one is missing.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["Grouping", "NAMES", "ONLINE", "SCORES", "Selection", "build"]



def _names() -> tuple[str, ...]:
    """'random' (no module: the sampler groups nothing) and every public module of this package."""
    return ("random", *sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


NAMES = _names()  # ('random', 'b3', 'gcbs', 'grit', 'jest', 'rho', 'rwr')
# What a Selection ranks by: the learner's loss minus the reference's (JEST's learnability, RHO-LOSS's
# reducible loss), the reference's loss alone, negated (JEST's 'easy reference'), or the learner's alone
# ('hard learner'; no reference model).
SCORES = ("learnability", "easy_reference", "hard_learner")


class Grouping(ABC):
    """How one sub-queue of collected examples is ordered so that consecutive runs of N are batches."""

    name = ""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = int(batch_size)

    @abstractmethod
    def draw(self, S: int, M: int, generator: torch.Generator) -> torch.Tensor:
        """The random numbers for S sub-queues of M (CPU), drawn on every rank before the sub-queues are
        sharded, so that a sub-queue's order is the same whichever rank computes it -> (S, ...)."""

    @abstractmethod
    def order(self, image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor,
              draws: torch.Tensor) -> torch.Tensor:
        """image, text (S, M, d) float32, valid (S, M) bool, draws (S, ...) -> LongTensor (S, M) on the
        features' device: each row a permutation of range(M) with the valid positions first."""

    def describe(self) -> str:
        """One line for the start-up summary."""
        return self.name


class Selection(ABC):
    """Which N of a super-batch of K = k x N candidates one rank trains on this step (online selection).

    The candidates come with their in-batch contrastive logits (K, K) (image i against text j) under the
    learner and under the reference model; `kind` says which loss they belong to: 'softmax' (ALBEF's ITC,
    logits = similarity / temperature) or 'sigmoid' (SigLIP's, logits = t x similarity + b)."""

    name = ""

    def __init__(self, batch_size: int, super_batch: int = 5, score: str = "learnability",
                 reference: str | None = None) -> None:
        if super_batch < 1 or score not in SCORES:
            raise ValueError(f"batching.{self.name}: super_batch must be >= 1 and score one of {SCORES}, got "
                             f"{super_batch}, {score!r}")
        self.batch_size, self.super_batch, self.score = int(batch_size), int(super_batch), score
        self.reference = reference  # the checkpoint's path; the script loads it (the sampler never does)

    @property
    def candidates(self) -> int:
        """K = k x N: the super-batch one rank sees per step."""
        return self.super_batch * self.batch_size

    @property
    def needs_reference(self) -> bool:
        """True when the score reads the reference model's logits."""
        return self.score != "hard_learner"

    @abstractmethod
    def select(self, learner: torch.Tensor, reference: torch.Tensor | None, kind: str,
               valid: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
        """learner, reference (K, K) logits (reference None with score hard_learner), valid (K,) bool or None,
        generator (CPU) for any random draw -> LongTensor (N,) of distinct positions in the super-batch, on
        the logits' device; invalid candidates only where fewer than N are valid."""

    def describe(self) -> str:
        """One line for the start-up summary."""
        return self.name


def build(name: str, batch_size: int, **options: Any) -> Grouping | Selection | None:
    """The Grouping or Selection of strategy `name` (None for 'random') with its config block's options."""
    if name not in NAMES:
        raise ValueError(f"batching.strategy must be one of {NAMES}, got {name!r}")
    if name == "random":
        return None
    module = importlib.import_module(f"{__name__}.{name}")
    made = module.SELECTION if name in ONLINE else module.GROUPING
    return made(batch_size=batch_size, **options)


def _online() -> tuple[str, ...]:
    """The strategies that select online from a super-batch: those whose module defines SELECTION (imported
    here, after Grouping and Selection exist; a module imports its own dependencies only when built)."""
    return tuple(n for n in NAMES[1:] if hasattr(importlib.import_module(f"{__name__}.{n}"), "SELECTION"))


ONLINE = _online()  # ('jest', 'rho')
