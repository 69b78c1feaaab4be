"""The scaffold Retrieval.py, NLVR.py and VQA.py share: their start-up (config, inputs, tokenizer, the three
splits, the global-batch check, the model built alike on every rank), their training side (the sampler,
bad-sample skipping, the loader's generator) and their end (fit, or --evaluate alone). Each script keeps
what is its own: its model, its data and collate, its step and its evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dataset import create_dataset
from dataset.bad_samples import SkipBadCollate, SkipBadSamples
from models.tokenization import build_tokenizer
from training.cli import Parser, Run, start
from training.config import TaskConfig
from training.distributed import DistInfo
from training.inputs import prepare_inputs
from training.loaders import check_global_batch, finetune_sampler
from training.reproducibility import build_on_every_rank
from training.task import Task
from training.trainer import Trainer

__all__ = ["Finetune", "FinetuneTask", "set_up", "train_or_evaluate"]

ModelBuilder = Callable[[Any, Any, "str | None"], nn.Module]  # (config, tokenizer, --checkpoint) -> model


@dataclass
class Finetune:
    """A fine-tuning script once set up: its run (flags, config, ranks), tokenizer, splits and model."""

    run: Run
    tokenizer: Any
    train_set: Any
    val_set: Any
    test_set: Any
    model: nn.Module

    @property
    def config(self) -> TaskConfig:
        return self.run.config

    @property
    def info(self) -> DistInfo:
        return self.run.info

    @property
    def args(self):
        return self.run.args


def set_up(argv: Sequence[str] | None, parser: Parser, task: str, build_model: ModelBuilder, *,
           unit: str = "entries", check: Callable[[Run], None] | None = None) -> Finetune:
    """Start `task`'s script: config and process group (training.cli.start), `check` (a script's own
    refusals, before any input is prepared), inputs, tokenizer, the train/val/test splits, the global
    batch checked against the training split (counted in `unit`) unless only evaluating, and the model
    from build_model(config, tokenizer, --checkpoint), built under one seed on every rank so that what
    no checkpoint loads (a fresh head) is identical everywhere."""
    run = start(argv, parser, task)
    config, info, args = run.config, run.info, run.args
    if check is not None:
        check(run)
    prepare_inputs(config)
    tokenizer = build_tokenizer(config)
    train_set, val_set, test_set = create_dataset(task, config)
    if not (args.evaluate or getattr(args, "bench", False)):
        check_global_batch(len(train_set), config.batch_size_train, info.world_size, config.train_files,
                           "batch_size_train", unit=unit)
    model = build_on_every_rank(lambda: build_model(config, tokenizer, args.checkpoint), config.seed,
                                info.rank).to(info.device)
    return Finetune(run, tokenizer, train_set, val_set, test_set, model)


def train_or_evaluate(setup: Finetune, task: Task) -> dict:
    """Fine-tune `task` (the trainer's fit), or with --evaluate only evaluate it; the last log record."""
    trainer = Trainer(setup.run, task)
    return trainer.evaluate_only() if setup.args.evaluate else trainer.fit()


class FinetuneTask(Task):
    """A fine-tuning task's training side: the set-up's model and training split, through
    finetune_sampler (seeded by config.seed), bad samples skipped and counted, batches made by
    collate_class(tokenizer, max_tokens, static_text) (self.task_collate, wrapped to drop bad samples);
    the task keeps its tokenizer, config, ranks and device."""

    def __init__(self, setup: Finetune, collate_class: type) -> None:
        config, info, train_set = setup.config, setup.info, setup.train_set
        self.task_collate = collate_class(setup.tokenizer, config.max_tokens, config.static_text_on)
        sampler = finetune_sampler(train_set, info, seed=config.seed, batch_size=config.batch_size_train)
        super().__init__(setup.model, SkipBadSamples(train_set), SkipBadCollate(self.task_collate), sampler,
                         config.batch_size_train, sampler.loader_generator)
        self.tokenizer, self.config, self.info, self.device = setup.tokenizer, config, info, info.device
