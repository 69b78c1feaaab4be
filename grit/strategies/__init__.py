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

Adding one means a module grit/strategies/<name>.py that defines GROUPING (a Grouping subclass whose
keyword options are its config block's keys), found here by its name, and its block (and name among
batching.strategy's values) in training/config.py; nothing else.
Importable with torch and numpy only: a strategy's own dependencies (scipy, pymetis) are imported when it
is built, with a message naming the package when one is missing.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["Grouping", "NAMES", "build"]



def _names() -> tuple[str, ...]:
    """'random' (no module: the sampler groups nothing) and every public module of this package."""
    return ("random", *sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


NAMES = _names()  # ('random', 'b3', 'gcbs', 'grit', 'rwr')


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


def build(name: str, batch_size: int, **options: Any) -> Grouping | None:
    """The Grouping of strategy `name` (None for 'random') with its config block's options."""
    if name not in NAMES:
        raise ValueError(f"batching.strategy must be one of {NAMES}, got {name!r}")
    if name == "random":
        return None
    module = importlib.import_module(f"{__name__}.{name}")
    return module.GROUPING(batch_size=batch_size, **options)
