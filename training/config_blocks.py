"""The typed config's blocks and its key(): `optimizer`, `schedular` and `batching` (with its strategies'
blocks), each a frozen dataclass whose fields are the block's keys with their types, defaults,
bounds and meanings (training.config holds the four scripts' configs, which nest these blocks)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from grit.config import DEFAULTS as GRIT_DEFAULTS  # the sampler's defaults (the paper's), one place
from grit.config import option_problems  # the sampler's own rules, asked at start-up
from grit.strategies import ONLINE  # the online selection strategies (their modules define SELECTION)

__all__ = ["REQUIRED", "B3", "SAMPLER_KEYS", "Batching", "GCBS", "GritChain", "JEST", "RHO", "RWR",
           "Optimizer", "Schedule", "key", "meaning"]

REQUIRED = dataclasses.MISSING


def key(default: Any = REQUIRED, meaning: str = "", *, low: float | None = None, high: float | None = None,
        above: float | None = None, path: Literal["file", "dir"] | None = None) -> Any:
    """A config key: its default (REQUIRED: none), one-line meaning, bounds (low <= v <= high, v > above)
    and, for a data path, 'file' or 'dir' (checked to exist at start-up)."""
    metadata = {"meaning": meaning, "low": low, "high": high, "above": above, "path": path}
    if isinstance(default, (list, dict)):  # a fresh copy per instance
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def meaning(cls: type, name: str) -> str:
    """The one-line meaning of key `name` of config class `cls`."""
    return next(f.metadata.get("meaning", "") for f in dataclasses.fields(cls) if f.name == name)

# ------------------------------------------------------------------------------------------ blocks


@dataclass(frozen=True, kw_only=True)
class Optimizer:
    """The `optimizer` block (training.optimizer.build_optimizer)."""

    opt: Literal["adamW", "adamw", "AdamW"] = key("adamW", "AdamW, as ALBEF (the only optimizer here)")
    lr: float = key(REQUIRED, "peak learning rate", above=0)
    weight_decay: float = key(0.0, "AdamW weight decay; norms, biases, embeddings, cls/pos tokens and temp "
                                   "get none", low=0)
    betas: list[float] = key([0.9, 0.999], "AdamW betas (two numbers)")
    eps: float = key(1e-8, "AdamW epsilon", above=0)

    def problems(self) -> list[str]:
        """Rules that tie this block's keys together."""
        return [] if len(self.betas) == 2 else [f"optimizer.betas must hold two numbers, got {self.betas}"]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The `schedular` block (ALBEF's spelling; `scheduler` is read as it): warm-up, then per-epoch cosine."""

    sched: Literal["cosine"] = key("cosine", "the schedule: the authors' per-epoch cosine")
    lr: float | None = key(None, "peak rate; must equal optimizer.lr (null: optimizer.lr)", above=0)
    epochs: int = key(REQUIRED, "cosine horizon in epochs (the paper: 30, while training stops at "
                                "max_epoch 20)", low=1)
    min_lr: float = key(0.0, "rate at the end of the horizon", low=0)
    warmup_lr: float | None = key(None, "rate of the first warm-up step (null: min_lr)", low=0)
    warmup_steps: int = key(0, "optimiser steps of linear warm-up from warmup_lr to lr (ALBEF pre-training: "
                               "2000)", low=0)
    decay_rate: float | None = key(None, "ALBEF's; no effect on a one-cycle cosine, in ALBEF either: ignored")
    cooldown_epochs: float | None = key(None, "ALBEF's; its training loop never runs them either: ignored")

    def problems(self) -> list[str]:
        """Rules that tie this block's keys together."""
        return []


@dataclass(frozen=True, kw_only=True)
class GritChain:
    """The `batching.grit` block (grit.strategies.grit): options of GRIT's chain beyond the paper."""

    rank_skip: int = key(0, "p: each step of the chain passes over the p most similar unvisited entries "
                            "(as B3 skips its top p; not in the paper); 0: the paper's chain", low=0)


@dataclass(frozen=True, kw_only=True)
class B3:
    """The `batching.b3` block (grit.strategies.b3): B3's rank window and METIS communities."""

    rank_skip: int = key(10, "p: each example's p most similar are passed over (likely false negatives)",
                         low=0)
    rank_window: int = key(30, "m: each example is linked to the next m it ranks (ranks p+1 .. p+m)", low=1)
    recursive: bool = key(True, "METIS's recursive bisection (faster); false: its k-way partition")


@dataclass(frozen=True, kw_only=True)
class GCBS:
    """The `batching.gcbs` block (grit.strategies.gcbs): reverse Cuthill-McKee order of a k-NN graph."""

    neighbours: int = key(10, "k: each example is linked to its k most similar in its sub-queue", low=1)


@dataclass(frozen=True, kw_only=True)
class RWR:
    """The `batching.rwr` block (grit.strategies.rwr): BatchSampler's random walks with restart."""

    neighbours: int = key(10, "k: each example is linked to its k most similar in its sub-queue", low=1)
    restart: float = key(0.1, "probability of returning to the walk's start at each step (BatchSampler: "
                              "0.1)", low=0, high=0.99)


@dataclass(frozen=True, kw_only=True)
class OnlineSelection:
    """The keys every online selection strategy has (grit.strategies.Selection, grit.online)."""

    super_batch: int = key(5, "k: each step a rank scores k x N candidates and trains on N of them (JEST's "
                              "filtering ratio 1 - 1/k; its 0.8: 5); an epoch is a pass in super-batches",
                           low=1)
    score: Literal["learnability", "easy_reference", "hard_learner"] = key(
        "learnability", "learnability: the learner's contrastive loss minus the reference's (JEST, "
                        "RHO-LOSS); easy_reference: the reference's, negated; hard_learner: the learner's "
                        "(no reference)")
    reference: str | None = key(None, "the frozen reference model: a checkpoint of this config's model, e.g. "
                                      "ALBEF_Base pre-trained on the same data; needed unless score is "
                                      "hard_learner", path="file")


@dataclass(frozen=True, kw_only=True)
class RHO(OnlineSelection):
    """The `batching.rho` block (grit.strategies.rho): RHO-LOSS, the top N by reducible loss."""


@dataclass(frozen=True, kw_only=True)
class JEST(OnlineSelection):
    """The `batching.jest` block (grit.strategies.jest): JEST's joint selection, chunk by chunk."""

    chunks: int = key(16, "the N selected are drawn in this many chunks, each conditioned on those before "
                          "(the paper: 16); a batch_size below it draws one example per chunk", low=1)


@dataclass(frozen=True, kw_only=True)
class Batching:
    """The `batching` block: how the next epoch's batches are formed (grit.GritSampler, grit.strategies;
    paper Sec. 4.1, S.M. Algorithms 1-2 for GRIT's). Every strategy but `random` collects into queues of
    L = queue_size and orders each sub-queue of M = search_space; the sampler's guarantees are the same for
    all (docs/batch-construction.md). The old spelling, a `grit:` block with `enabled`, is read as this one
    (training.config_resolve)."""

    strategy: Literal["grit", "random", "b3", "gcbs", "rwr", "jest", "rho"] = key(
        "random", "grit (the paper), random (ALBEF's: DistributedSampler's permutation every epoch), b3, "
                  "gcbs or rwr (random walks); jest or rho: online selection from a super-batch each step")
    # Defaults: the paper's, from grit.config.DEFAULTS (GritSampler's signature takes them from there too).
    queue_size: int | None = key(None, "L: examples collected before a grouping; null only with strategy "
                                       "random", low=1)
    search_space: int | None = key(None, "M: sub-queue size a group is searched in (>= batch_size); null "
                                         "only with strategy random", low=1)
    example_shuffle: bool = key(GRIT_DEFAULTS["example_shuffle"], "phase 2: shuffle a full queue before "
                                                                  "splitting it into sub-queues")
    batch_shuffle: bool = key(GRIT_DEFAULTS["batch_shuffle"], "phase 4: shuffle the order of the next "
                                                              "epoch's groups")
    mode: Literal["concurrent", "naive"] = key(
        GRIT_DEFAULTS["mode"], "concurrent: group from the features collected while training; naive: an "
                               "extra no-grad pass per epoch (Remark 2)")
    warmstart_indices: str | None = key(
        GRIT_DEFAULTS["warmstart_indices"], "index array G for the first epoch (tools.warmstart); null: a "
                                            "random first epoch", path="file")
    group_from_epoch: int = key(GRIT_DEFAULTS["group_from_epoch"],
                                "the first epoch of grouped batches, those before it random ones (collection "
                                "starts an epoch earlier; not in the paper); 0: the paper's, from the first "
                                "epoch with features (1; 0 in naive mode or with warmstart_indices)", low=0)
    shard_grouping: bool = key(GRIT_DEFAULTS["shard_grouping"], "with W ranks, rank r orders every W-th "
                                                                "sub-queue and the orders are all-gathered "
                                                                "(the same G everywhere, W times less work "
                                                                "each)")
    grit: GritChain = key(GritChain(), "options of strategy grit")
    b3: B3 = key(B3(), "options of strategy b3")
    gcbs: GCBS = key(GCBS(), "options of strategy gcbs")
    rwr: RWR = key(RWR(), "options of strategy rwr")
    jest: JEST = key(JEST(), "options of strategy jest")
    rho: RHO = key(RHO(), "options of strategy rho")

    @property
    def grouped(self) -> bool:
        """True when the strategy groups the next epoch's batches (any but random and the online ones)."""
        return self.strategy != "random" and not self.online

    @property
    def online(self) -> bool:
        """True when the strategy selects each step's batch from a super-batch (grit.strategies.ONLINE)."""
        return self.strategy in ONLINE

    @property
    def loader_factor(self) -> int:
        """The loader's batch in per-rank batches: an online strategy's super_batch k, else 1."""
        return getattr(self, self.strategy).super_batch if self.online else 1

    def problems(self, batch_size: int) -> list[str]:
        """Settings that cannot act, one message each: an option of a strategy this run does not use (set
        away from its default), and a rank skip that passes over all M - 1 others each entry of a sub-queue
        ranks (B3's window or GRIT's chain would hold nothing to rank); then the sampler's size rules
        (grit.config.option_problems): batch_size <= search_space <= queue_size. A window or neighbourhood
        only partly inside the sub-queue is cut to it."""
        name = self.strategy
        out = []
        for block, default in _strategy_blocks().items():
            if block == name:
                continue
            options = getattr(self, block)
            out += [f"batching.{block}.{g.name} is set ({getattr(options, g.name)!r}) but this run's "
                    f"strategy is {name!r}: it acts only with batching.strategy: {block}"
                    for g in dataclasses.fields(options)
                    if getattr(options, g.name) != getattr(default, g.name)]
        others = (self.search_space or 0) - 1
        if name != "random" and others >= 1:
            where = (f"the {others} others each entry ranks in its sub-queue (batching.search_space "
                     f"{others + 1})")
            if name == "b3" and self.b3.rank_skip >= others:
                out.append(f"batching.b3.rank_skip ({self.b3.rank_skip}) passes over all {where}: B3's "
                           "window would be empty, its graph without edges")
            if name == "grit" and self.grit.rank_skip >= others:
                out.append(f"batching.grit.rank_skip ({self.grit.rank_skip}) must be below {where}: the "
                           "chain would always take the least similar")
        if self.online:  # queue_size and search_space are not read, as with strategy random
            block = getattr(self, name)
            if block.score != "hard_learner" and not block.reference:
                out.append(f"batching.{name}.score {block.score!r} compares the learner with a reference "
                           f"model: set batching.{name}.reference to its checkpoint (or score: hard_learner)")
            out += [f"batching.{k} is {getattr(self, k)!r} but strategy {name!r} selects online from random "
                    "super-batches and groups nothing: drop it"
                    for k, off in (("mode", "concurrent"), ("group_from_epoch", 0),
                                   ("warmstart_indices", None)) if getattr(self, k) != off]
        return out + option_problems(batch_size=batch_size, enabled=self.grouped, queue_size=self.queue_size,
                                     search_space=self.search_space, mode=self.mode,
                                     group_from_epoch=self.group_from_epoch,
                                     warmstart=bool(self.warmstart_indices), prefix="batching.")

    def options(self, name: str) -> dict[str, Any]:
        """Strategy `name`'s block as keyword arguments ({} for random)."""
        block = getattr(self, name) if name in _strategy_blocks() else None
        return {} if block is None else {f.name: getattr(block, f.name) for f in dataclasses.fields(block)}

    def sampler_options(self) -> dict[str, Any]:
        """grit.GritSampler's keyword arguments: the sizes and switches, the strategy and its options."""
        sampler = {k: getattr(self, k) for k in SAMPLER_KEYS}
        # No `enabled`: the sampler groups nothing with strategy random, so the strategy decides alone.
        return {**sampler, "strategy": self.strategy, "strategy_options": self.options(self.strategy)}


def _strategy_blocks() -> dict[str, Any]:
    """The strategies' option blocks of Batching (its fields that are blocks) -> their defaults."""
    return {f.name: f.default for f in dataclasses.fields(Batching) if dataclasses.is_dataclass(f.default)}


# The batching keys the sampler takes (all but the strategy and its blocks).
SAMPLER_KEYS = ("queue_size", "search_space", "example_shuffle", "batch_shuffle", "mode", "warmstart_indices",
                "group_from_epoch", "shard_grouping")
