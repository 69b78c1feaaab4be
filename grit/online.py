"""OnlineSampler: online batch selection (issue 52) on the batching interface: each step a rank sees a
super-batch of K = k x N candidates and trains on the N that its Selection (grit.strategies.jest, .rho)
chooses from their contrastive logits under the learner and a frozen reference model.

What an epoch is. A pass over the data in super-batches: DistributedSampler's permutation of the epoch
(seed + epoch, as random batches), cut into whole global super-batches of K x W and dealt like them
(super-batch s of rank r is chunk s*W + r), so T = D // (K x W) steps per epoch, k times fewer than random
batches of N. Within an epoch every index is a candidate at most once, and trained on at most once: only
if it is selected at the step it is a candidate in. The (k - 1) x N candidates a step passes over are not
trained on in that epoch; they are candidates again in later epochs, in a new permutation, like the fewer
than K x W indices that fill no global super-batch (the left-outs, which change every epoch).

Per rank. Each rank selects from its own super-batch, without a collective on the scores (JEST and
RHO-LOSS are defined on one device's batch; a global selection would all-gather K x W feature rows and
leave the ranks' shares unequal). The random draws of a step come from a CPU generator seeded by (seed,
epoch, step, rank), so a selection is deterministic and a resumed run draws what the unbroken run drew.

The record. Every step's candidates and selections of all ranks are gathered (one all_gather of K + N
integers, int32 below 2**31 examples, no host synchronisation) and kept on the device for the epoch
(about 4 x D x (1 + 1/k) bytes per rank): epoch_record() -> {'epoch', 'dataset_len',
'batch_size', 'super_batch', 'segments': [{'first_step', 'candidates' (t, W, K), 'selected' (t, W, N)}]};
a run resumed on another number of ranks adds a segment. The state_dict carries the epoch's record so far,
so the record of a resumed epoch is whole. tools.check_selections reads it and checks the rule above.

Sampler interface as grit.GritSampler's (set_epoch, collect after every step, end_epoch, start_batch,
batches_per_epoch, state_dict, load_state_dict), with select() called inside the step, before collect()."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from . import dist as gdist
from .epoch import stream_seed
from .sampler import GritSampler
from .strategies import Selection

__all__ = ["OnlineSampler", "STREAM_SELECT"]

STREAM_SELECT = 4  # after grit.epoch's three streams: the selections' random draws


class OnlineSampler(torch.utils.data.Sampler):
    """Deals super-batches of K = selection.candidates per rank (random, resumable: an inner GritSampler
    with strategy random) and selects N = selection.batch_size of each (select())."""

    def __init__(self, dataset, selection: Selection, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 device: torch.device | str | None = None) -> None:
        """dataset: a sized dataset or its length D; selection: the strategy (its batch_size N, its k)."""
        self.selection = selection
        self.inner = GritSampler(dataset, num_replicas, rank, shuffle, seed, batch_size=selection.candidates,
                                 queue_size=None, search_space=None, strategy="random", device=device)
        self.batch_size = selection.batch_size  # N: what a step trains on
        self.loader_batch_size = selection.candidates  # K: what the loader delivers per step
        self.num_replicas, self.rank, self.dataset_len = (self.inner.num_replicas, self.inner.rank,
                                                          self.inner.dataset_len)
        self.batches_per_epoch = self.inner.batches_per_epoch
        self.seed = self.inner.seed
        self.strategy = selection.name
        self.grouping = None  # no epoch order of its own: the super-batches are random
        self.first_grouped = 0
        self.groups_per_batch = None
        self._segments: list[dict] = []  # this epoch's finished segments (from a resumed state)
        self._rows: list[torch.Tensor] = []  # this segment's steps: (W, K + N) each, on the device
        self._first_step = 0
        self._record_epoch: int | None = None

    # ------------------------------------------------------------------------- delegated to the deal
    @property
    def start_batch(self) -> int:
        return self.inner.start_batch

    @start_batch.setter
    def start_batch(self, value: int) -> None:
        self.inner.start_batch = value

    @property
    def epoch(self) -> int | None:
        return self.inner.epoch

    @property
    def position(self) -> int:
        """Steps done this epoch (collect() calls since set_epoch, or restored)."""
        return self.inner.position

    @property
    def left_out_on_resume(self) -> int:
        return self.inner.left_out_on_resume

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int, naive_pass=None) -> None:
        """Start epoch `epoch` (no-op when resuming inside it: the loaded record goes on)."""
        resumed = self.inner.in_progress and self.inner.epoch == int(epoch)
        self.inner.set_epoch(epoch)
        if not resumed:
            self._segments, self._rows = [], []
            self._first_step, self._record_epoch = 0, int(epoch)

    def collect(self, image_feat: torch.Tensor, text_feat: torch.Tensor, index: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        """After every step: advances the position (the features are not used; the super-batches are
        random)."""
        self.inner.collect(image_feat, text_feat, index, valid)

    def end_epoch(self) -> None:
        self.inner.end_epoch()

    # ------------------------------------------------------------------------------------ selection
    def generator(self) -> torch.Generator:
        """The CPU generator of this step's draws: seeded by (seed, epoch, step, rank)."""
        step = self.inner.position
        base = stream_seed(self.seed, self.inner.epoch or 0, STREAM_SELECT)
        return torch.Generator().manual_seed((base + step * self.num_replicas + self.rank) % (2**63 - 1))

    @torch.no_grad()
    def select(self, learner: torch.Tensor, reference: torch.Tensor | None, kind: str, ids: torch.Tensor,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """learner, reference (K, K) contrastive logits of this step's candidates, kind 'softmax' | 'sigmoid',
        ids (K,) their dataset indices, valid (K,) bool | None -> positions (N,) long of those to train on.
        Records the step's candidates and selection of every rank (one all_gather)."""
        K = self.loader_batch_size
        if learner.shape != (K, K) or ids.shape != (K,):
            raise ValueError(f"OnlineSampler.select: expected logits ({K}, {K}) and ids ({K},), got "
                             f"{tuple(learner.shape)} and {tuple(ids.shape)}")
        if self.selection.needs_reference and reference is None:
            raise ValueError(f"OnlineSampler.select: score {self.selection.score!r} needs the reference "
                             "model's logits")
        with torch.autocast(learner.device.type, enabled=False):  # fp32 scores under a bf16 step
            positions = self.selection.select(learner.float(),
                                              None if reference is None else reference.float(), kind, valid,
                                              self.generator())
        ids = ids.to(positions.device, self.inner.index_dtype)  # int32 below 2**31 examples
        self._rows.append(gdist.all_gather_cat(torch.cat([ids, ids[positions]])[None]))
        return positions

    def _segment(self) -> dict:
        """This segment's steps so far -> {'first_step', 'candidates' (t, W, K), 'selected' (t, W, N)}."""
        K = self.loader_batch_size
        rows = (torch.stack(self._rows).cpu() if self._rows
                else torch.empty(0, self.num_replicas, K + self.batch_size, dtype=self.inner.index_dtype))
        return {"first_step": self._first_step, "candidates": rows[:, :, :K].clone(),
                "selected": rows[:, :, K:].clone()}

    def epoch_record(self) -> dict:
        """The epoch's candidates and selections, all ranks, every step so far (one host copy)."""
        return {"epoch": -1 if self._record_epoch is None else self._record_epoch,
                "dataset_len": self.dataset_len, "batch_size": self.batch_size,
                "super_batch": self.selection.super_batch, "strategy": self.strategy,
                "score": self.selection.score, "segments": [*self._segments, self._segment()]}

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The deal's state (GritSampler's) and, mid-epoch, the epoch's record so far."""
        in_progress = bool(self.inner.in_progress)
        return {"online": 1, "deal": self.inner.state_dict(), "strategy": self.strategy,
                "batch_size": self.batch_size,
                "record": self.epoch_record() if in_progress else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict(); a following set_epoch(saved epoch) resumes at the saved step."""
        if not isinstance(state, dict) or "deal" not in state:
            raise ValueError("OnlineSampler.load_state_dict: not an online-selection sampler's state (resume "
                             "with the batching.strategy the checkpoint was trained with)")
        if state.get("strategy") != self.strategy or int(state.get("batch_size", -1)) != self.batch_size:
            raise ValueError(f"OnlineSampler.load_state_dict: saved with strategy {state.get('strategy')!r} "
                             f"and batch_size {state.get('batch_size')}, now {self.strategy!r} and "
                             f"{self.batch_size}")
        self.inner.load_state_dict(state["deal"])
        record = state.get("record") or {}
        self._rows = []
        if record:
            self._record_epoch = int(record["epoch"])
            self._segments = [s for s in record["segments"] if len(s["candidates"])]
            self._first_step = self.inner.start_batch
        else:
            self._segments, self._record_epoch, self._first_step = [], None, 0
