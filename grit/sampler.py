"""GritSampler: a DistributedSampler replacement that deals GRIT's grouped mini-batches (phase 4)."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from . import dist as gdist
from .collector import GritCollector, groups_per_batch
from .config import DEFAULTS, first_grouped_epoch, load_index_array, option_problems
from .epoch import (
    STREAM_COLLECT,
    STREAM_COMPOSE,
    STREAM_NAIVE,
    as_ints,
    compose_epoch,
    plain_order,
    stream_seed,
)
from .strategies import ONLINE
from .strategies import build as build_strategy

__all__ = ["GritSampler"]

NaivePass = Callable[[torch.Tensor], Iterable[tuple]]


class GritSampler(torch.utils.data.Sampler):
    """Yields this rank's dataset indices for one epoch in per-rank batch order (see grit/__init__.py).

    Use with DataLoader(batch_size=batch_size, drop_last=True): batch s of rank r is chunk s*W + r of the
    epoch's global array, i.e. one GRIT group per local batch.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, *, batch_size: int,
                 queue_size: int | None, search_space: int | None,
                 enabled: bool = DEFAULTS["enabled"], example_shuffle: bool = DEFAULTS["example_shuffle"],
                 batch_shuffle: bool = DEFAULTS["batch_shuffle"], mode: str = DEFAULTS["mode"],
                 warmstart_indices: str | None = DEFAULTS["warmstart_indices"],
                 shard_grouping: bool = DEFAULTS["shard_grouping"],
                 group_from_epoch: int = DEFAULTS["group_from_epoch"],
                 dim: int = 256, device: torch.device | str | None = None,
                 index_dtype: torch.dtype | None = None, strategy: str = "grit",
                 strategy_options: dict | None = None) -> None:
        """dataset: a sized dataset or its length D; batch_size N per rank; queue_size L and search_space M
        (N <= M <= L); the switches default to the paper's (grit.config.DEFAULTS) and are the `batching`
        block's keys (training.config_blocks.Batching says what each means; the scripts pass its
        sampler_options());
        dim: the feature size collect() gets; device: where the queues and the grouping live; strategy: how
        a sub-queue is grouped (grit.strategies: 'grit', the paper's chain; 'random' = enabled False;
        'b3', 'gcbs', 'rwr') with its keyword options. ValueError when the options break
        grit.config.option_problems."""
        self.dataset_len = int(dataset) if isinstance(dataset, numbers.Integral) else len(dataset)
        # The epoch arrays hold D indices on every rank (3.2 GB as int64 for LAION-400M): int32 whenever
        # the dataset fits, int64 beyond 2**31 - 1 entries or when asked. The batches are the same.
        self.index_dtype = index_dtype or (torch.int32 if self.dataset_len < 2**31 else torch.int64)
        if self.index_dtype not in (torch.int32, torch.int64) or (
                self.index_dtype == torch.int32 and self.dataset_len >= 2**31):
            raise ValueError(
                f"GritSampler: index_dtype {self.index_dtype} cannot hold {self.dataset_len} indices")
        world, this_rank = gdist.world_info()
        self.num_replicas = world if num_replicas is None else int(num_replicas)
        self.rank = this_rank if rank is None else int(rank)
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"GritSampler: invalid rank {self.rank} for num_replicas {self.num_replicas}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"GritSampler: batch_size must be a positive integer, got {batch_size!r}")
        if not drop_last:
            raise ValueError(
                "GritSampler: drop_last=False is not supported; every epoch leaves out fewer than "
                "batch_size * num_replicas indices, chosen anew each epoch")
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = True
        self.dim = int(dim)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if strategy == "random":  # the strategy that groups nothing: DistributedSampler's order
            enabled = False
        problems = option_problems(batch_size=batch_size, enabled=enabled, queue_size=queue_size,
                                   search_space=search_space, mode=mode, group_from_epoch=group_from_epoch,
                                   warmstart=bool(warmstart_indices))
        if problems:
            raise ValueError(f"GritSampler: {problems[0]}")
        self.grit = {"enabled": bool(enabled), "queue_size": queue_size, "search_space": search_space,
                     "example_shuffle": bool(example_shuffle), "batch_shuffle": bool(batch_shuffle),
                     "mode": mode, "warmstart_indices": warmstart_indices,
                     "shard_grouping": bool(shard_grouping), "group_from_epoch": int(group_from_epoch)}
        # Epochs before it are random batches (features are collected from the epoch before it on).
        self.first_grouped = first_grouped_epoch(group_from_epoch, mode, bool(warmstart_indices))
        self.global_batch = batch_size * self.num_replicas
        if self.dataset_len < self.global_batch:
            raise ValueError(
                f"GritSampler: dataset has {self.dataset_len} examples, fewer than one global batch "
                f"(batch_size {batch_size} x num_replicas {self.num_replicas})")
        self.batches_per_epoch = self.dataset_len // self.global_batch  # T, identical in every mode
        self.warmstart = None
        if self.grit["enabled"] and self.grit["warmstart_indices"]:
            self.warmstart = load_index_array(str(self.grit["warmstart_indices"]), self.dataset_len)
        self.collector = None
        self.strategy = strategy if self.grit["enabled"] else "random"
        if strategy in ONLINE:
            raise ValueError(f"GritSampler: strategy {strategy!r} selects online from super-batches: "
                             "use grit.online.OnlineSampler (training.loaders.build_sampler makes it)")
        self.grouping = build_strategy(self.strategy, batch_size, **(strategy_options or {}))
        if self.grit["enabled"]:
            self.collector = GritCollector(self.grit["queue_size"], self.grit["search_space"], self.dim,
                                           self.dataset_len, self.device, self.grit["example_shuffle"],
                                           shard=self.grit["shard_grouping"], index_dtype=self.index_dtype,
                                           grouping=self.grouping)
        self.epoch: int | None = None
        self.in_progress = False
        self.position = 0  # batches consumed this epoch = collect() calls since set_epoch
        self.start_batch = 0  # where __iter__ starts: 0, or the position restored by load_state_dict
        # Rows of the epoch array dealt before start_batch: start_batch * B, except after a resume on another
        # number of ranks, whose earlier steps took the saving run's global batch (load_state_dict).
        self._offset_rows = 0
        self.left_out_on_resume = 0  # indices of a resumed epoch's rest that no new rank could take
        self._epochs_started = 0
        self._epoch_array = torch.empty(0, dtype=self.index_dtype)  # (T*B,) global order, chunk k = k-th N
        self._next_array: torch.Tensor | None = None  # next epoch's array, composed by end_epoch()
        self._check_pending = False  # a loaded mid-epoch array is compared across ranks at set_epoch
        # How many groups (sub-queues) a batch of this epoch draws from on average (1: each batch one
        # group); None for an epoch that was not grouped. The next epoch's, composed at end_epoch, waits.
        self.groups_per_batch: float | None = None
        self._next_groups: float | None = None

    # ----------------------------------------------------------------------------------------- epochs
    @property
    def collecting(self) -> bool:
        """True while collect() feeds the queues (collecting_mode and an epoch in progress)."""
        return self.in_progress and self.collecting_mode

    def set_epoch(self, epoch: int, naive_pass: NaivePass | None = None) -> None:
        """Start epoch `epoch` (no-op if it is already in progress, e.g. after a mid-epoch resume).

        naive_pass (grit.mode 'naive' only): fn(indices LongTensor (T*N,)) -> iterable of local
        (image_feat (N,d), text_feat (N,d), index (N,)[, valid (N,)]) batches from a no-grad forward pass.
        """
        epoch = int(epoch)
        if self.in_progress:
            if epoch == self.epoch:
                if self._check_pending:
                    gdist.assert_same_on_all_ranks(self._epoch_array, f"resumed index array of epoch {epoch}",
                                                   self._comm_device())
                    self._check_pending = False
                return
            warnings.warn(f"GritSampler: set_epoch({epoch}) before end_epoch() of epoch {self.epoch}; "
                          "ending it now", stacklevel=2)
            self.end_epoch()
        cfg = self.grit
        array, groups = None, None
        if cfg["enabled"] and epoch >= self.first_grouped:
            if self._next_array is not None:
                array, self._next_array, groups = self._next_array, None, self._next_groups
                if array.numel() != self.batches_per_epoch * self.global_batch:  # e.g. world size changed
                    array = self._compose(array, epoch)
            elif self.warmstart is not None and self._epochs_started == 0:
                array = self._compose(self.warmstart, epoch)
            elif cfg["mode"] == "naive":
                if naive_pass is None:
                    raise ValueError(
                        "grit.mode 'naive' needs set_epoch(epoch, naive_pass=fn), see grit/__init__.py")
                array = self._compose(self._run_naive_pass(epoch, naive_pass), epoch)
                groups = groups_per_batch(self.collector.segments, self.batch_size)
        if array is None:
            array = self._plain(epoch)
        gdist.assert_same_on_all_ranks(array, f"index array of epoch {epoch}", self._comm_device())
        self.epoch = epoch
        self.groups_per_batch, self._next_groups = groups, None
        self._epochs_started += 1
        self.position = self.start_batch = self._offset_rows = 0
        self._check_pending = False
        self._epoch_array = array
        if self.collecting_mode:
            self.collector.reset(stream_seed(self.seed, epoch, STREAM_COLLECT))
        self.in_progress = True

    @property
    def collecting_mode(self) -> bool:
        """True when training steps feed the collector: GRIT enabled, mode 'concurrent', and the epoch's
        features group a next epoch (from the epoch before grit.group_from_epoch on)."""
        return (self.grit["enabled"] and self.grit["mode"] == "concurrent"
                and (self.epoch is None or self.epoch >= self.first_grouped - 1))

    def end_epoch(self) -> None:
        """Finish the epoch: group the partial queue into G, check ranks agree, compose the next epoch."""
        if not self.in_progress:
            return
        if self.collecting_mode:
            G = self.collector.finalize()
            gdist.assert_same_on_all_ranks(G, f"GRIT index array G built in epoch {self.epoch}",
                                           self._comm_device())
            self._next_array = self._compose(G, self.epoch + 1)
            self._next_groups = groups_per_batch(self.collector.segments, self.batch_size)
        self.in_progress = False

    def _run_naive_pass(self, epoch: int, naive_pass: NaivePass) -> torch.Tensor:
        """Naive GRIT (paper Remark 2): group a fresh random permutation seen through a no-grad pass."""
        gen = torch.Generator().manual_seed(stream_seed(self.seed, epoch, STREAM_NAIVE))
        T, W, N = self.batches_per_epoch, self.num_replicas, self.batch_size
        perm = torch.randperm(self.dataset_len, generator=gen)[:T * W * N]
        share = perm.view(T, W, N)[:, self.rank].reshape(-1)
        self.collector.reset(stream_seed(self.seed, epoch, STREAM_COLLECT))
        for batch in naive_pass(share.clone()):
            if len(batch) not in (3, 4):
                raise ValueError("naive_pass must yield (image_feat, text_feat, index[, valid]) tuples")
            self._collect(*batch, gathered=False)
        return self.collector.finalize()

    def _plain(self, epoch: int) -> torch.Tensor:
        """DistributedSampler's order of this epoch, whole global batches (grit.epoch.plain_order)."""
        return plain_order(self.dataset_len, self.batches_per_epoch * self.global_batch, self.seed, epoch,
                           self.shuffle, self.index_dtype)

    def _compose(self, G: torch.Tensor, epoch: int) -> torch.Tensor:
        """The epoch's array from G (grit.epoch.compose_epoch) -> (T*B,)."""
        return compose_epoch(G, self.dataset_len, self.batch_size, self.batches_per_epoch * self.num_replicas,
                             self.grit["batch_shuffle"], stream_seed(self.seed, epoch, STREAM_COMPOSE),
                             self.index_dtype)

    def _comm_device(self) -> torch.device:
        if gdist.is_distributed() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------------------------ iteration
    def _ensure_started(self) -> None:
        if not self.in_progress:
            self.set_epoch(0 if self.epoch is None else self.epoch + 1)

    def __iter__(self) -> Iterator[int]:
        self._ensure_started()
        W, N = self.num_replicas, self.batch_size
        mine = self._epoch_array[self._offset_rows:].view(-1, W, N)[:, self.rank].reshape(-1)
        return as_ints(mine)

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size

    def epoch_indices(self) -> torch.Tensor:
        """The current (or just ended) epoch's global array (T*B,): step s, rank r gets chunk s*W + r.

        In an epoch resumed on another number of ranks, the rows the saving run had dealt come first,
        then the rest re-dealt over the new ranks (load_state_dict): its length may differ from T*B."""
        if self.epoch is None:
            self._ensure_started()
        return self._epoch_array.clone()

    # ----------------------------------------------------------------------------------- collection
    def collect(self, image_feat: torch.Tensor, text_feat: torch.Tensor, index: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        """After each step, on every rank: local feats (N, d), index (N,), valid (N,) bool | None."""
        self._collect(image_feat, text_feat, index, valid, gathered=False, count=True)

    def collect_global(self, image_feat: torch.Tensor, text_feat: torch.Tensor, index: torch.Tensor,
                       valid: torch.Tensor | None = None) -> None:
        """Like collect() with a batch already gathered from all ranks in rank order: feats (N*W, d)."""
        self._collect(image_feat, text_feat, index, valid, gathered=True, count=True)

    def _collect(self, image_feat: torch.Tensor, text_feat: torch.Tensor, index: torch.Tensor,
                 valid: torch.Tensor | None = None, gathered: bool = False, count: bool = False) -> None:
        if count:
            self._ensure_started()
            self.position += 1
            if not self.collecting:  # disabled or naive: steps only advance the position
                return
        rows = self.global_batch if gathered else self.batch_size
        what = "collect_global" if gathered else "collect"
        for name, x in (("image_feat", image_feat), ("text_feat", text_feat)):
            if not isinstance(x, torch.Tensor) or x.shape != (rows, self.dim):
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(
                    f"GritSampler.{what}: {name} must have shape ({rows}, {self.dim}), got {shape}")
        if not isinstance(index, torch.Tensor) or index.shape != (rows,) or index.dtype.is_floating_point:
            raise ValueError(f"GritSampler.{what}: index must be an integer tensor of shape ({rows},)")
        if valid is not None and (not isinstance(valid, torch.Tensor) or valid.shape != (rows,)
                                  or valid.dtype != torch.bool):
            raise ValueError(f"GritSampler.{what}: valid must be a bool tensor of shape ({rows},) or None")
        with torch.no_grad():
            if not gathered and self.num_replicas > 1:
                if gdist.world_info()[0] != self.num_replicas:
                    raise ValueError(
                        f"GritSampler.collect: num_replicas={self.num_replicas} but torch.distributed world "
                        f"size is {gdist.world_info()[0]}; in a single process use collect_global()")
                dev = image_feat.device
                # Two collectives per step: features packed (N, 2d), integers packed (N, 2).
                both = torch.cat([image_feat.detach().float(), text_feat.detach().float()], 1)
                feats = gdist.all_gather_cat(both)
                index = index.to(dev, torch.long)
                ok = torch.ones_like(index) if valid is None else valid.to(dev, torch.long)
                ints = gdist.all_gather_cat(torch.stack([index, ok], 1))
                image_feat, text_feat = feats[:, :self.dim], feats[:, self.dim:]
                # Always the gathered flags: another rank's batch may hold bad samples when this one's
                # has none (valid None here), and every rank's collector must queue the same flags.
                index, valid = ints[:, 0], ints[:, 1].bool()
            self.collector.add(image_feat, text_feat, index, valid)

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Everything needed for an exact resume; loadable with torch.load(weights_only=True)."""
        in_progress = self.in_progress
        if in_progress and self.collecting_mode:
            indices = self.collector.partial_groups()
            collector = self.collector.state_dict()
        else:
            indices = self._next_array if self._next_array is not None else self._epoch_array.new_empty(0)
            collector = {}
        return {
            "version": 1,
            "epoch": -1 if self.epoch is None else self.epoch,
            "in_progress": int(in_progress),
            "position": self.position,
            "has_next": int(self._next_array is not None),
            "epochs_started": self._epochs_started,
            "dataset_len": self.dataset_len,
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "mode": self.grit["mode"] if self.grit["enabled"] else "disabled",
            "strategy": self.strategy,
            "epoch_indices": self._epoch_array.clone() if in_progress else self._epoch_array.new_empty(0),
            # rows of epoch_indices already dealt, so that a resume on any number of ranks knows the rest
            "rows_done": self._offset_rows + (self.position - self.start_batch) * self.global_batch
            if in_progress else 0,
            "indices": indices.cpu().clone(),
            "collector": collector,
            "groups_per_batch": -1.0 if self.groups_per_batch is None else float(self.groups_per_batch),
            "next_groups_per_batch": -1.0 if self._next_groups is None else float(self._next_groups),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; a following set_epoch(same epoch) resumes at the saved position."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"GritSampler.load_state_dict: {msg}")

        if not isinstance(state, dict) or state.get("version") != 1:
            raise bad("not a GritSampler state (missing version 1)")
        if int(state["dataset_len"]) != self.dataset_len:
            raise bad(f"saved for a dataset of {state['dataset_len']} examples, this one has "
                      f"{self.dataset_len}")
        in_progress = bool(state["in_progress"])
        mode = self.grit["mode"] if self.grit["enabled"] else "disabled"
        if in_progress:
            # The rest of an epoch can be re-dealt over another number of ranks, but only in batches of the
            # same size and from the same kind of array.
            saved_strategy = state.get("strategy", "random" if state["mode"] == "disabled" else "grit")
            same = (int(state["batch_size"]), state["mode"], saved_strategy)
            if same != (self.batch_size, mode, self.strategy):
                raise bad(f"mid-epoch state saved with (batch_size, mode, strategy) = {same}, now "
                          f"{(self.batch_size, mode, self.strategy)}; resume from an end-of-epoch checkpoint")
        self.seed = int(state["seed"])  # the saved seed keeps the resumed run identical
        self.epoch = None if int(state["epoch"]) < 0 else int(state["epoch"])
        self._epochs_started = int(state["epochs_started"])
        self.position = int(state["position"])
        indices = state["indices"].cpu().to(self.index_dtype)  # int64 in checkpoints from before int32
        self._next_array = None
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.dataset_len):
            raise bad(f"'indices' has values outside [0, {self.dataset_len})")
        self.left_out_on_resume = 0
        groups = float(state.get("groups_per_batch", -1))
        next_groups = float(state.get("next_groups_per_batch", -1))
        self.groups_per_batch = None if groups < 0 else groups
        self._next_groups = None if next_groups < 0 else next_groups
        if in_progress:
            self._resume_epoch_array(state, bad)
            self._check_pending = True
            if self.collecting_mode:
                self.collector.load_state_dict(state["collector"], indices)
        else:
            self.start_batch = self._offset_rows = 0
            if bool(state["has_next"]) and self.grit["enabled"]:
                self._next_array = indices
        self.in_progress = in_progress

    def _resume_epoch_array(self, state: dict, bad: Callable[[str], ValueError]) -> None:
        """The saved epoch's rest, dealt over this run's ranks: the rows the saving run had not dealt are
        cut into whole global batches of this run (chunk s*W + r to rank r, in their saved order); the
        fewer than B rows left over are left out and, never collected, come back next epoch like any
        unseen index. On the saving run's ranks this is exactly the saved array and position."""
        N, B = self.batch_size, self.global_batch
        array = state["epoch_indices"].cpu().to(self.index_dtype)
        saved_b = int(state["batch_size"]) * int(state["num_replicas"])
        done = int(state.get("rows_done", self.position * saved_b))  # states before rows_done: one layout
        if array.dim() != 1 or array.numel() % N or array.numel() > self.dataset_len \
                or not 0 <= done <= array.numel() or done % N:
            raise bad(f"'epoch_indices' ({tuple(array.shape)}) and rows_done ({done}) do not describe an "
                      f"epoch of batches of {N} from {self.dataset_len} examples")
        steps = (array.numel() - done) // B
        if steps > self.batches_per_epoch:
            raise bad(f"{steps} steps left in the saved epoch, more than an epoch's {self.batches_per_epoch}")
        self.left_out_on_resume = array.numel() - done - steps * B
        self._epoch_array = array[:done + steps * B]
        self._offset_rows = done
        # Counted back from the epoch's end, so that the epoch ends after batches_per_epoch steps and the
        # next one starts on time (the trainer numbers steps as epoch * batches_per_epoch + position).
        self.start_batch = self.position = self.batches_per_epoch - steps
