"""The training objectives, composed from the config: one module per objective, found by name.

A model (models.pretrain.ALBEF_Base, models.retrieval.ALBEF_Retrieval) returns what the objectives need
and computes no loss: the ITC projections with their graph, the temperature, the false-negative guard's
positives and the bad-sample flags, ITM's logits over its mined pairs, MLM's vocabulary logits and
labels. Each objective is an `Objective`, a small module with one interface: the model's outputs ->
(its named losses, each already weighted as the config says; its own metrics). `Objectives` holds the
ones the config switches on and sums them; `WithObjectives` runs a model and then its objectives in one
forward, which is what DDP and torch.compile wrap (so the composition keeps the compiled step whole).

    itc      ITC, softmax (paper Eq. 1-2) with GRIT's consistency (Eq. 6), HN-NCE's weights and MAFA's
             S-ITC (smoothing from a start epoch); in-batch, over the gathered batch or against a queue
    sigmoid  SigLIP's pairwise sigmoid loss (contrastive_loss: sigmoid), with its own temperature and bias
    itm      ITM's cross-entropy over the B matches and 2B mined non-matches; its accuracies
    mlm      MLM's cross-entropy over the masked tokens

Adding one means a module models/losses/<name>.py that defines OBJECTIVE (an Objective subclass whose
`from_config` returns None when the config does not ask for it) and its config value in
training/config.py; nothing else. The guard's positives and the bad-sample flags reach every
objective through `contrast_rows`, the one place they are read.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NAMES", "Objective", "Objectives", "WithObjectives", "build_objectives", "contrast_rows"]


def _names() -> tuple[str, ...]:
    """Every public module of this package, in a fixed order (the losses' sum and the logs follow it)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


NAMES = _names()  # ('itc', 'itm', 'mlm', 'sigmoid')


class Objective(nn.Module):
    """One objective: the model's outputs -> ({loss name: weighted 0-dim}, {metric name: detached 0-dim}).

    A subclass sets loss_names and metric_names (what its forward returns), writes from_config and
    forward, and, when its losses depend on the epoch, start_epoch. Learnable parameters it owns (SigLIP's
    temperature and bias) are the model's, under objectives.<name>.*, so the optimiser and the checkpoints
    hold them.
    """

    loss_names: tuple[str, ...] = ()
    metric_names: tuple[str, ...] = ()  # what its forward measures besides (each a detached 0-dim)
    # Parameters of the model this objective takes the place of (they then get no gradient: DDP is told).
    replaces: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Any) -> Objective | None:
        """The objective the config asks for, or None."""
        raise NotImplementedError

    def start_epoch(self, epoch: int) -> None:
        """Per-epoch settings (none by default)."""

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The model's outputs -> (losses, metrics)."""
        raise NotImplementedError


class Objectives(nn.ModuleDict):
    """The config's objectives in NAMES' order; forward sums nothing, total() does."""

    def __init__(self, objectives: dict[str, Objective], logged: tuple[str, ...]) -> None:
        super().__init__(objectives)
        names = [*logged]
        for objective in objectives.values():
            names += [n for n in objective.loss_names if n not in names]
        # The task's paper losses are always reported (an exact zero when switched off), so that every
        # record keeps its columns; the objectives' own names follow.
        self.loss_names = tuple(names)
        self.metric_names = tuple(n for objective in objectives.values() for n in objective.metric_names)

    @property
    def replaced(self) -> tuple[str, ...]:
        """Model parameters some objective takes the place of (no gradient reaches them)."""
        return tuple(name for objective in self.values() for name in objective.replaces)

    def start_epoch(self, epoch: int) -> None:
        """Every objective's per-epoch settings (S-ITC's start)."""
        for objective in self.values():
            objective.start_epoch(epoch)

    def forward(self, out: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The model's outputs -> ({every loss name: 0-dim}, {metric: 0-dim}); absent losses are zeros."""
        losses: dict[str, Tensor] = {}
        metrics: dict[str, Tensor] = {}
        for objective in self.values():
            own, measured = objective(out)
            losses.update(own)
            metrics.update(measured)
        zero = out["image_feat"].new_zeros(())
        return {name: losses.get(name, zero) for name in self.loss_names}, metrics

    def total(self, losses: Mapping[str, Tensor]) -> Tensor:
        """The training loss: the named losses summed in loss_names' order -> 0-dim."""
        names = self.loss_names
        total = losses[names[0]]
        for name in names[1:]:
            total = total + losses[name]
        return total


def build_objectives(config: Any, logged: tuple[str, ...]) -> Objectives:
    """Every objective of NAMES that `config` asks for; `logged`: the loss names always reported."""
    built = {}
    for name in NAMES:
        module = importlib.import_module(f"{__name__}.{name}")
        objective = module.OBJECTIVE.from_config(config)
        if objective is not None:
            built[name] = objective
    return Objectives(built, logged)


class WithObjectives(nn.Module):
    """A model and its objectives as one forward: model(*args) -> its outputs, every loss, 'loss' (their
    sum) and the objectives' metrics, in one dict. DDP and torch.compile wrap this; checkpoints save the
    model (whose submodule `objectives` holds any parameters an objective learns)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's forward, then its objectives -> {outputs..., losses..., 'loss', metrics...}."""
        out = self.model(*args, **kwargs)
        losses, metrics = self.model.objectives(out)
        return {**out, **losses, "loss": self.model.objectives.total(losses), **metrics}


def contrast_rows(out: Mapping[str, Any], gather: bool) -> tuple[Tensor | None, Tensor | None]:
    """The guard's ITC positives (B, N) bool or None and the bad-sample flags (B,) bool or None that every
    contrastive objective applies: the one place they are read.

    With the gathered batch every rank passes flags when any rank may hold a bad sample: a rank that
    skipped their all_gather would desynchronise the collectives (our extension, not the paper's)."""
    valid = out.get("valid")
    if gather and valid is None:
        valid = torch.ones(out["image_feat"].shape[0], dtype=torch.bool, device=out["image_feat"].device)
    return out.get("positive"), valid
