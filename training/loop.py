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

from training.bad_samples import BadSampleLog
from training.checkpoints import checkpoint_path, keep_best, restore_training, save_checkpoint, training_state
from training.config import get_max_epoch
from training.distributed import DistInfo, barrier, cleanup, get_world_size, print_main, wrap_ddp
from training.loaders import finetune_loader
from training.logger import TrainLogger, append_log
from training.optimizer import autocast_dtype, build_optimizer, build_scaler, build_scheduler
from training.step_guard import Preempted, StepGuard, TooManySkippedSteps


def train_one_epoch(model: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, *, epoch: int, global_step: int,
                    step_fn: Any, config: Mapping, device: torch.device, output_dir: str,
                    scaler: torch.amp.GradScaler | None = None, after_step: Any = None,
                    checkpoint_state: Any = None, start_batch: int = 0, total_batches: int | None = None,
                    desc: str = 'Train', guard: StepGuard | None = None,
                    bad_samples: BadSampleLog | None = None) -> tuple[dict[str, float], int]:
    """Run one epoch of optimiser steps; returns (epoch means of the step metrics + lr/timing, global_step).

    step_fn(model, batch) -> (loss, {name: detached 0-dim tensor}) runs the forward pass.
    after_step(metrics, batch, skipped) runs after each step (GRIT collection); skipped is True when
    the step was skipped for a non-finite loss.
    checkpoint_state(epoch, global_step[, reseed_rng=False]) -> dict is saved every
    `checkpoint_every_steps` steps (and on a stop, without reseeding).
    start_batch: batches of this epoch already done before a resume (the loader yields only the rest).
    guard: skips a step whose loss is not finite on any rank (no update; its metrics are not logged)
    and, after a SIGTERM/SIGINT, saves a checkpoint at the end of the step and raises Preempted;
    its per-step decision is the only host synchronisation of a step (training.step_guard).
    bad_samples: batches end with (valid, reasons) (dataset.bad_samples); the reasons are counted.
    Metrics stay on the device until the epoch summary.
    """
    model.train()
    dtype = autocast_dtype(config, device)
    clip = config.get('clip_grad')
    every = int(config.get('checkpoint_every_steps') or 0)
    logger = TrainLogger(header=f'{desc} epoch {epoch}', print_freq=int(config.get('print_freq', 50)))
    samples = 0
    start = time.time()
    if bad_samples is not None:
        bad_samples.epoch = epoch
    for batch in logger.log_every(loader, total=total_batches, start=start_batch):
        if bad_samples is not None:
            bad_samples.record(batch[-1])
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, metrics = step_fn(model, batch)
        skip, stop = guard.decide(loss) if guard is not None else (False, False)
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]['lr']
        if skip:
            # Every rank skips together (the decision is all-reduced), so no rank waits in a backward
            # all-reduce the others never start. The schedule still advances: the batch is spent.
            print_main(f'{desc} epoch {epoch}, step {global_step}: loss is not finite on some rank; step '
                       f'skipped without an update ({guard.consecutive} in a row)', flush=True)
        elif scaler is not None and scaler.is_enabled():
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
        scheduler.step()
        global_step += 1
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        samples += len(first)
        if not skip:
            logger.update(lr=lr, **metrics)
        if after_step is not None:
            after_step(metrics, batch, skip)
        if guard is not None and (stop or guard.too_many_skipped):
            path = checkpoint_path(output_dir, step=global_step)
            if checkpoint_state is not None:
                # An unbroken run takes no checkpoint here: keep the generators' states, do not reseed.
                save_checkpoint(path, **checkpoint_state(epoch, global_step, reseed_rng=False))
            barrier()
            where = f'epoch {epoch}, step {global_step}; saved {path}; continue with --resume'
            if stop:
                print_main(f'stopping on signal {guard.signal or "from another rank"}: {where}', flush=True)
                raise Preempted(guard.exit_code())
            raise TooManySkippedSteps(f'{guard.consecutive} consecutive steps had a non-finite loss '
                                      f'(max_skipped_steps={guard.max_skipped_steps}): {where} after '
                                      'fixing the cause (learning rate, data, amp)')
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
                 broadcast_buffers: bool = True) -> dict:
    """The fine-tuning loop shared by Retrieval, NLVR and VQA; returns the last epoch's log record.

    Builds the seeded resumable loader, DDP wrapper, optimizer, schedule and scaler; resumes from
    `resume` (a checkpoint path or None); per epoch trains, logs {log name: stats name} of `log_stats`
    plus bad_samples and skipped_steps (train_set is wrapped in dataset.bad_samples.SkipBadSamples and
    collate_fn in SkipBadCollate by the caller, so batches end with (valid, reasons)); calls
    evaluate(record, epoch) (which adds the val_/test_ metrics), keeps checkpoint_best.pth by
    record[best_key] when given, and saves the epoch checkpoint. best_summary is formatted with the
    best metrics at the end. The caller checks that train_set fills one global batch
    (training.validation.check_global_batch) where it loads it, before it builds the model.
    """
    seed = int(config.get('seed', 42))
    batch_size = int(config['batch_size_train'])
    sampler, loader = finetune_loader(train_set, info, seed=seed, batch_size=batch_size,
                                      num_workers=int(config.get('num_workers', 0)), collate_fn=collate_fn)
    steps_per_epoch = len(sampler) // batch_size  # >= 1: the script ran check_global_batch on train_set
    # A model with an objective switched off (e.g. retrieval with itm: false) leaves modules unused.
    model_ddp = wrap_ddp(model, info, broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=not getattr(model, 'uses_every_parameter', True),
                         compile=bool(config.get('compile', False)))
    optimizer = build_optimizer(model, config['optimizer'], zero=bool(config.get('zero', False)),
                                fused=config.get('fused_adamw'))
    scheduler = build_scheduler(optimizer, config, steps_per_epoch)
    scaler = build_scaler(config, info.device)

    guard = StepGuard(int(config.get('max_skipped_steps', 10)))
    bad_log = BadSampleLog(float(config.get('max_bad_fraction', 0.01)), output_dir=output_dir)
    start_epoch, global_step = 0, 0
    best = {best_key: -1.0, 'epoch': -1} if best_key else None
    if resume:
        state, start_epoch, global_step = restore_training(resume, model, optimizer, scheduler, scaler,
                                                           seed=seed, rank=info.rank, guard=guard,
                                                           bad_samples=bad_log)
        if best is not None:
            best = dict(state.get('best', best))
        sampler.start_batch = global_step - start_epoch * steps_per_epoch

    def checkpoint_state(epoch: int, step: int, complete: bool = False, reseed_rng: bool = True) -> dict:
        extra = {} if best is None else {'best': best}
        return training_state(model, optimizer, scheduler, scaler, config=config, epoch=epoch, step=step,
                              sampler_state={'seed': seed, 'epoch': epoch}, seed=seed, rank=info.rank,
                              complete=complete, guard=guard, bad_samples=bad_log, reseed_rng=reseed_rng,
                              **extra)

    record: dict = {}
    with guard:  # SIGTERM/SIGINT: finish the step, save, exit (training.step_guard)
        for epoch in range(start_epoch, get_max_epoch(config)):
            sampler.set_epoch(epoch)
            stats, global_step = train_one_epoch(
                model_ddp, loader, optimizer, scheduler, epoch=epoch, global_step=global_step,
                step_fn=step_fn, config=config, device=info.device, output_dir=output_dir, scaler=scaler,
                checkpoint_state=checkpoint_state, start_batch=sampler.start_batch,
                total_batches=steps_per_epoch - sampler.start_batch, desc=desc, guard=guard,
                bad_samples=bad_log)
            sampler.start_batch = 0
            record = {'epoch': epoch, 'step': global_step, 'lr': stats['lr'],
                      **{name: stats[key] for name, key in log_stats.items()},
                      'train_seconds': stats['seconds'], 'samples_per_s': stats['samples_per_s'],
                      'bad_samples': bad_log.epoch_total(), 'skipped_steps': guard.skipped}
            bad_log.start_epoch()
            guard.start_epoch()
            if evaluate is not None:
                evaluate(record, epoch)
            if best is not None:
                best = keep_best(best, record, best_key, output_dir, model, config, epoch, global_step)
                record['best_epoch'] = best['epoch']
            save_checkpoint(checkpoint_path(output_dir, epoch=epoch),
                            **checkpoint_state(epoch, global_step, complete=True))
            append_log(output_dir, record)
            print_main(json.dumps(record))
            bad_log.check(record['bad_samples'], steps_per_epoch * batch_size * info.world_size,
                          f'epoch ({epoch})')
            barrier()
    if best is not None and best['epoch'] >= 0 and best_summary:
        print_main(best_summary.format(**best) + f": {os.path.join(output_dir, 'checkpoint_best.pth')}")
    cleanup()
    return record
