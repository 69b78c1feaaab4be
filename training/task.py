"""Task: what one script trains, the interface between a script and the one trainer (training.trainer).
A script subclasses it (the fine-tuning scripts through training.finetune.FinetuneTask) and hands it to
Trainer, which owns everything else."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, Sampler

from models.losses import WithObjectives

__all__ = ["Task"]


class Task:
    """What one script trains. Subclass it: set the class attributes, pass the parts to __init__ and
    write step(); override the other hooks where the task does more.

    The sampler yields this rank's indices in batch order and has set_epoch(epoch), start_batch
    (batches of the current epoch already done before a resume), batches_per_epoch, state_dict() and
    load_state_dict() (grit.GritSampler, training.loaders.ResumableSampler). The dataset wraps the
    task's dataset in dataset.bad_samples.SkipBadSamples and the collate in SkipBadCollate, so that
    every batch is a named dataset.collate.Batch with `valid` and `reasons`.
    """

    name = "Train"                  # the progress header
    best_key: str | None = None     # a metric of evaluate() whose best epoch is kept as checkpoint_best.pth
    best_summary = ""               # printed at the end, formatted with the best epoch's metrics
    broadcast_buffers = True        # DDP: re-send buffers every step (False when every rank agrees already)

    def __init__(self, model: nn.Module, dataset: Dataset, collate: Any, sampler: Sampler, batch_size: int,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.dataset = dataset
        self.collate = collate
        self.sampler = sampler
        self.batch_size = int(batch_size)
        # What the loader delivers per step: the batch, or an online selection's super-batch of k x N
        # candidates (the sampler's loader_batch_size), of which step() trains on batch_size.
        self.loader_batch_size = int(getattr(sampler, "loader_batch_size", batch_size))
        # The DataLoader's generator: its workers' base seeds, independent of the model's random stream.
        self.generator = generator

    def train_module(self) -> nn.Module:
        """What the trainer wraps in DDP and torch.compile and step() gets: a model with objectives
        (models.losses) runs them in the same forward (WithObjectives); any other model is itself."""
        return WithObjectives(self.model) if hasattr(self.model, "objectives") else self.model

    def step(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward one batch through `model` (the DDP/compile-wrapped train_module()) -> (loss, {name: 0-dim
        detached tensor}); runs under autocast when the config asks for it."""
        raise NotImplementedError

    def after_step(self, metrics: dict[str, Tensor], batch: Any, skipped: bool) -> None:
        """After every optimiser step (skipped: the loss was not finite on some rank, nothing was updated)."""

    def start_epoch(self, epoch: int) -> None:
        """Before the epoch's first step (also when resuming inside it)."""
        self.sampler.set_epoch(epoch)

    def end_epoch(self, epoch: int) -> dict[str, Any]:
        """After the epoch's last step, before evaluation; returns extra log fields."""
        return {}

    def evaluate(self, epoch: int | None, output_dir: str) -> dict[str, Any]:
        """Evaluation metrics after epoch `epoch`, or of --checkpoint alone (epoch None: --evaluate)."""
        return {}

    def summary(self) -> list[str]:
        """Lines of the start-up summary that only the task knows (e.g. GRIT's sizes)."""
        return []

    def pictures(self, epoch: int, output_dir: str) -> dict[str, str]:
        """PNGs written into output_dir after epoch `epoch` (every rank calls it): {tag: path}."""
        return {}
