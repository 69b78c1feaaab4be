"""Data loaders: DataLoader settings shared by all scripts, the seeded, resumable per-rank sampler that
fine-tuning uses (pre-training uses grit.GritSampler instead), and the one-global-batch check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from grit import GritSampler
from grit.online import OnlineSampler
from grit.strategies import build as build_strategy
from training.config_files import ConfigError
from training.distributed import DistInfo
from training.reproducibility import worker_init_fn
from training.step_guard import ignore_stop_signals


def init_worker(worker_id: int) -> None:
    """DataLoader worker start: seeds (training.reproducibility) and stop signals left to the main process."""
    worker_init_fn(worker_id)
    ignore_stop_signals()


class ResumableSampler(DistributedSampler):
    """DistributedSampler for fine-tuning that can start an epoch after `start_batch` batches (resume), on
    the same or another number of ranks, with the interface training.trainer.Task expects of a sampler.

    With drop_last, rank r's k-th index of an epoch is entry r + k*W of the epoch's permutation, so the
    first s steps of all ranks together used exactly its first s*N*W entries: the rest of an epoch is a
    suffix of the permutation, which a resume deals over its own ranks the same way."""

    def __init__(self, *args: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.start_batch = 0
        self.left_out_on_resume = 0  # entries of a resumed epoch's rest that no new rank could take
        self._resume: tuple[int, int, int] | None = None  # (epoch, entries done, entries planned)
        self.loader_generator = torch.Generator()  # for the DataLoader, see set_epoch

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches of a full epoch on this rank (the last partial one is dropped)."""
        return self.num_samples // self.batch_size

    def state_dict(self) -> dict:
        """The seed, epoch and shape: the permutation of an epoch follows from the seed and epoch alone;
        the trainer adds the position (training.trainer.sampler_state_for_resume)."""
        return {"seed": self.seed, "epoch": self.epoch, "num_replicas": self.num_replicas,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume the saved epoch after `position` of its steps (`in_progress`), dealing its rest over this
        run's ranks; an end-of-epoch state restores nothing (set_epoch re-derives the permutation)."""
        self.start_batch = self.left_out_on_resume = 0
        self._resume = None
        if not state.get("in_progress"):
            return
        per_step = int(state["batch_size"]) * int(state["num_replicas"])
        planned = len(self.dataset) // int(state["num_replicas"]) // int(state["batch_size"]) * per_step
        done = min(int(state["position"]) * per_step, planned)
        steps = (planned - done) // (self.batch_size * self.num_replicas)
        self.left_out_on_resume = planned - done - steps * self.batch_size * self.num_replicas
        self.start_batch = self.batches_per_epoch - steps  # the epoch still ends after batches_per_epoch
        self._resume = (int(state["epoch"]), done, planned)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._resume is not None and self._resume[0] != epoch:
            self._resume, self.start_batch = None, 0
        # The loader draws its workers' base seed from this generator, reseeded per (epoch, rank), not
        # from the global RNG: a run resumed mid-epoch then sees the same random numbers.
        self.loader_generator.manual_seed(self.seed * 1_000_003 + epoch * 10_007 + self.rank)

    def __iter__(self) -> Iterator[int]:
        N, W = self.batch_size, self.num_replicas
        # Without a resume on other ranks: the batches after start_batch of DistributedSampler's deal.
        planned = self.batches_per_epoch * N * W
        _, done, planned = self._resume or (self.epoch, self.start_batch * N * W, planned)
        if self.shuffle:  # DistributedSampler's permutation of this epoch
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        mine = order[done:planned][self.rank::W][:(self.batches_per_epoch - self.start_batch) * N]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def finetune_sampler(dataset: Dataset, info: DistInfo, *, seed: int, batch_size: int) -> ResumableSampler:
    """Seeded, resumable per-rank sampler for fine-tuning (no GRIT there, as in the paper); its
    loader_generator is the DataLoader's."""
    return ResumableSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=seed,
                            drop_last=True, batch_size=batch_size)


def build_sampler(config: Any, dataset: Dataset | int, num_replicas: int, rank: int,
                  device: torch.device | str | None = None) -> GritSampler | OnlineSampler:
    """Pre-training's sampler from its config (training.config.PretrainConfig): the batching strategy with
    its options, the queues, the seed, the per-rank batch and the feature size; `dataset` a sized dataset or
    its length. Pretrain.py and the tools that rebuild a run's batches (tools.batch_scenes) build it here.
    An online strategy (jest, rho) gets grit.online.OnlineSampler: random super-batches, selected per step."""
    batching = config.batching
    if batching.online:
        name = batching.strategy
        selection = build_strategy(name, config.batch_size, **batching.options(name))
        return OnlineSampler(dataset, selection, num_replicas=num_replicas, rank=rank, seed=config.seed,
                             device=device)
    return GritSampler(dataset, num_replicas=num_replicas, rank=rank, seed=config.seed,
                       batch_size=config.batch_size, dim=config.embed_dim, device=device,
                       **config.sampler_options())


def create_loader(dataset: Dataset, sampler: Sampler | None, batch_size: int, num_workers: int,
                  collate_fn: Any = None, drop_last: bool = True, shuffle: bool = False,
                  generator: torch.Generator | None = None) -> DataLoader:
    """DataLoader with pinned memory on CUDA, persistent seeded workers; `shuffle` only without a sampler."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=shuffle if sampler is None else False,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=init_worker if num_workers > 0 else None,
        generator=generator,
    )


def check_global_batch(n: int, batch_size: int, world_size: int, files: list[str], batch_key: str,
                       unit: str = "entries") -> None:
    """ConfigError unless `n` training entries (from `files`) fill one global batch of batch_size (config
    key `batch_key`) per process x world_size processes; called where a script has loaded its data."""
    if n < batch_size * world_size:
        raise ConfigError(
            f"the training data ({', '.join(files)}) has {n} {unit}, fewer than one global batch: "
            f"{batch_key} "
            f"{batch_size} x world size {world_size} = {batch_size * world_size}; lower {batch_key} or use "
            "fewer processes")
