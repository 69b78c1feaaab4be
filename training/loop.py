"""The training loop: train_one_epoch (one epoch of optimiser steps, shared by all four scripts),
run_finetune (the epoch loop of Retrieval, NLVR and VQA: loader, optimiser, resume, evaluation,
best and epoch checkpoints, log records) and evaluate_only (--evaluate).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from training.checkpoints import checkpoint_path, keep_best, restore_training, save_checkpoint, training_state
from training.config import get_max_epoch
from training.distributed import DistInfo, barrier, cleanup, get_world_size, print_main, wrap_ddp
from training.loaders import finetune_loader
from training.logger import TrainLogger, append_log
from training.optimizer import autocast_dtype, build_optimizer, build_scaler, build_scheduler


def train_one_epoch(model: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, *, epoch: int, global_step: int,
                    step_fn: Any, config: Mapping, device: torch.device, output_dir: str,
                    scaler: torch.amp.GradScaler | None = None, after_step: Any = None,
                    checkpoint_state: Any = None, start_batch: int = 0, total_batches: int | None = None,
                    desc: str = 'Train') -> tuple[dict[str, float], int]:
    """Run one epoch of optimiser steps; returns (epoch means of the step metrics + lr/timing, global_step).

    step_fn(model, batch) -> (loss, {name: detached 0-dim tensor}) runs the forward pass.
    after_step(metrics, batch) runs after each optimiser step (GRIT collection).
    checkpoint_state(epoch, global_step) -> dict is saved every `checkpoint_every_steps` steps.
    start_batch: batches of this epoch already done before a resume (the loader yields only the rest).
    No host synchronisation happens per step: metrics stay on the device until the epoch summary.
    """
    model.train()
    dtype = autocast_dtype(config, device)
    clip = config.get('clip_grad')
    every = int(config.get('checkpoint_every_steps') or 0)
    logger = TrainLogger(header=f'{desc} epoch {epoch}', print_freq=int(config.get('print_freq', 50)))
    samples = 0
    start = time.time()
    for batch in logger.log_every(loader, total=total_batches, start=start_batch):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, metrics = step_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None and scaler.is_enabled():
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))
            optimizer.step()
        lr = optimizer.param_groups[0]['lr']
        scheduler.step()
        global_step += 1
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        samples += len(first)
        logger.update(lr=lr, **metrics)
        if after_step is not None:
            after_step(metrics, batch)
        if every and checkpoint_state is not None and global_step % every == 0:
            path = checkpoint_path(output_dir, step=global_step)
            save_checkpoint(path, **checkpoint_state(epoch, global_step))
    summary = logger.epoch_summary()
    seconds = time.time() - start
    summary.update(epoch=epoch, step=global_step, seconds=round(seconds, 3),
                   samples_per_s=round(samples * get_world_size() / max(seconds, 1e-9), 2))
    summary.setdefault('lr', optimizer.param_groups[0]['lr'])  # mean rate over the epoch's steps
    return summary, global_step


def evaluate_only(output_dir: str, checkpoint: str | None, evaluate: Any) -> dict:
    """--evaluate: one record {'mode', 'checkpoint'} filled by evaluate(record), printed and logged."""
    record = {'mode': 'evaluate', 'checkpoint': checkpoint}
    evaluate(record)
    print_main(json.dumps(record))
    append_log(output_dir, record)
    cleanup()
    return record


def run_finetune(model: nn.Module, train_set: Dataset, *, info: DistInfo, config: Mapping, output_dir: str,
                 resume: str | None, step_fn: Any, collate_fn: Any, log_stats: Mapping[str, str],
                 desc: str, evaluate: Any = None, best_key: str | None = None, best_summary: str = '',
                 unit: str = 'entries', broadcast_buffers: bool = True) -> dict:
    """The fine-tuning loop shared by Retrieval, NLVR and VQA; returns the last epoch's log record.

    Builds the seeded resumable loader, DDP wrapper, optimizer, schedule and scaler; resumes from
    `resume` (a checkpoint path or None); per epoch trains, logs {log name: stats name} of `log_stats`,
    calls evaluate(record, epoch) (which adds the val_/test_ metrics), keeps checkpoint_best.pth by
    record[best_key] when given, and saves the epoch checkpoint. best_summary is formatted with the
    best metrics at the end.
    """
    seed = int(config.get('seed', 42))
    batch_size = int(config['batch_size_train'])
    sampler, loader = finetune_loader(train_set, info, seed=seed, batch_size=batch_size,
                                      num_workers=int(config.get('num_workers', 0)), collate_fn=collate_fn)
    steps_per_epoch = len(sampler) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"train_file has {len(train_set)} {unit}: fewer than one batch of {batch_size} "
                         "per rank")
    # A model with an objective switched off (e.g. retrieval with itm: false) leaves modules unused.
    model_ddp = wrap_ddp(model, info, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=not getattr(model, 'uses_every_parameter', True))
    optimizer = build_optimizer(model, config['optimizer'])
    scheduler = build_scheduler(optimizer, config, steps_per_epoch)
    scaler = build_scaler(config, info.device)

    start_epoch, global_step = 0, 0
    best = {best_key: -1.0, 'epoch': -1} if best_key else None
    if resume:
        state, start_epoch, global_step = restore_training(resume, model, optimizer, scheduler, scaler,
                                                           seed=seed, rank=info.rank)
        if best is not None:
            best = dict(state.get('best', best))
        sampler.start_batch = global_step - start_epoch * steps_per_epoch

    def checkpoint_state(epoch: int, step: int, complete: bool = False) -> dict:
        extra = {} if best is None else {'best': best}
        return training_state(model, optimizer, scheduler, scaler, config=config, epoch=epoch, step=step,
                              sampler_state={'seed': seed, 'epoch': epoch}, seed=seed, rank=info.rank,
                              complete=complete, **extra)

    record: dict = {}
    for epoch in range(start_epoch, get_max_epoch(config)):
        sampler.set_epoch(epoch)
        stats, global_step = train_one_epoch(
            model_ddp, loader, optimizer, scheduler, epoch=epoch, global_step=global_step, step_fn=step_fn,
            config=config, device=info.device, output_dir=output_dir, scaler=scaler,
            checkpoint_state=checkpoint_state, start_batch=sampler.start_batch,
            total_batches=steps_per_epoch - sampler.start_batch, desc=desc)
        sampler.start_batch = 0
        record = {'epoch': epoch, 'step': global_step, 'lr': stats['lr'],
                  **{name: stats[key] for name, key in log_stats.items()},
                  'train_seconds': stats['seconds'], 'samples_per_s': stats['samples_per_s']}
        if evaluate is not None:
            evaluate(record, epoch)
        if best is not None:
            best = keep_best(best, record, best_key, output_dir, model, config, epoch, global_step)
            record['best_epoch'] = best['epoch']
        save_checkpoint(checkpoint_path(output_dir, epoch=epoch),
                        **checkpoint_state(epoch, global_step, complete=True))
        append_log(output_dir, record)
        print_main(json.dumps(record))
        barrier()
    if best is not None and best['epoch'] >= 0 and best_summary:
        print_main(best_summary.format(**best) + f": {os.path.join(output_dir, 'checkpoint_best.pth')}")
    cleanup()
    return record
