"""The one trainer: the epoch loop that all four task scripts run.

A script describes its task as a Task: the model, the training data (dataset, collate, sampler), the
step, what follows a step (GRIT's collection), what starts and ends an epoch, the evaluation and the
metric whose best epoch is kept. Trainer owns everything else, once: the output directory and its
config.yaml, the DDP wrapper, optimizer, schedule and loss scaling, --resume, epochs and steps, the
step guard (non-finite losses skipped; SIGTERM/SIGINT: save and stop), bad samples, the log records
and the checkpoints (every epoch, every checkpoint_every_steps steps, the best epoch), and --evaluate.

One log record per epoch, the same keys in every script: epoch, step, lr, the task's step metrics
(epoch means over all ranks), train_seconds (the optimiser steps), epoch_seconds (the epoch as a user
waits for it: steps plus the task's work around them, e.g. GRIT's grouping; evaluation and checkpoint
writing excluded), samples_per_s, bad_samples, skipped_steps, then what the task's end_epoch and
evaluate add (sampler_seconds, val_*, test_*, eval_seconds) and best_epoch when a best metric is kept.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from training.bad_samples import BadSampleLog
from training.checkpoints import (
    check_mid_epoch_resume,
    checkpoint_path,
    find_latest_checkpoint,
    keep_best,
    resolve_resume,
    restore_training,
    save_checkpoint,
    training_state,
)
from training.cli import Run
from training.config_files import config_to_dict, save_resolved
from training.distributed import barrier, cleanup, get_world_size, is_main_process, print_main, wrap_ddp
from training.faults import Fault
from training.loaders import create_loader
from training.logger import TrainLogger, append_log
from training.optimizer import autocast_dtype, build_optimizer, build_scaler, build_scheduler
from training.reporting import Reporter, peak_memory_bytes, prune_checkpoints, run_record
from training.step_guard import Preempted, StepGuard, TooManySkippedSteps
from training.task import Task

__all__ = ["Trainer"]


class Trainer:
    """Runs a Task: `fit()` trains (resuming when asked), `evaluate_only()` evaluates --checkpoint."""

    def __init__(self, run: Run, task: Task) -> None:
        self.run, self.task = run, task
        self.config, self.info = run.config, run.info
        self.output_dir = str(run.args.output_dir)
        self.resume = resolve_resume(getattr(run.args, "resume", None), self.output_dir)

    def _open_output_dir(self) -> None:
        """Create output_dir with config.yaml: only once the config, data, model and --resume checks passed,
        so that a mistake leaves output_dir untouched."""
        if is_main_process():
            os.makedirs(self.output_dir, exist_ok=True)
            save_resolved(self.config, os.path.join(self.output_dir, "config.yaml"))

    # ------------------------------------------------------------------------------------------ evaluate

    def evaluate_only(self) -> dict:
        """--evaluate: one record {'mode', 'checkpoint', ...metrics}, printed and appended to log.txt."""
        self._open_output_dir()
        record = {"mode": "evaluate", "checkpoint": self.run.args.checkpoint,
                  **self.task.evaluate(None, self.output_dir)}
        print_main(json.dumps(record))
        append_log(self.output_dir, record)
        cleanup()
        return record

    # ------------------------------------------------------------------------------------------ fit

    def fit(self) -> dict:
        """Train config.max_epoch epochs (from --resume's checkpoint if given); returns the last record."""
        config, info, task = self.config, self.info, self.task
        sampler = task.sampler
        steps_per_epoch = sampler.batches_per_epoch
        loader = create_loader(task.dataset, sampler, task.loader_batch_size, config.num_workers,
                               collate_fn=task.collate, drop_last=True, generator=task.generator)
        model = wrap_ddp(task.train_module(), info, broadcast_buffers=task.broadcast_buffers,
                         find_unused_parameters=not getattr(task.model, "uses_every_parameter", True),
                         compile=config.compile_mode)
        optimizer = build_optimizer(task.model, config.optimizer, zero=config.zero, fused=config.fused_adamw)
        scaler = build_scaler(config.amp, info.device)
        guard = StepGuard(config.max_skipped_steps)
        fault = None if self.resume else Fault.from_env()  # GRIT_VLP_FAULT: a fresh start only (faults.py)
        bad_log = BadSampleLog(config.max_bad_fraction, output_dir=self.output_dir)
        best = {task.best_key: -float("inf"), "epoch": -1} if task.best_key else None
        global_batch = task.batch_size * info.world_size

        def state(epoch: int, step: int, complete: bool = False, reseed_rng: bool = True) -> dict:
            # The shape of the run: a resume on another number of processes re-deals the rest of the epoch
            # and continues the schedule from the samples seen (_resume_position).
            extra = {"world_size": info.world_size, "batch_size": task.batch_size,
                     "steps_per_epoch": steps_per_epoch, "samples_seen": self.samples_seen,
                     "schedule_batch": self.schedule_batch}
            if best is not None:
                extra["best"] = best
            return training_state(task.model, optimizer, scheduler, scaler, config=config_to_dict(config),
                                  epoch=epoch, step=step, sampler_state=sampler.state_dict(),
                                  seed=config.seed, rank=info.rank, complete=complete, guard=guard,
                                  bad_samples=bad_log, reseed_rng=reseed_rng, **extra)

        start_epoch, global_step, saved_step = 0, 0, 0
        self.samples_seen, self.schedule_batch, self.reshaped, self.lr_then = 0, global_batch, None, None
        if self.resume:
            saved, start_epoch, saved_step = restore_training(
                self.resume, task.model, optimizer, None, scaler, seed=config.seed, rank=info.rank,
                guard=guard, bad_samples=bad_log)
            check_mid_epoch_resume(saved, self.resume, task.batch_size)
            global_step = self._resume_position(saved, start_epoch, steps_per_epoch, optimizer)
            if best is not None:
                best = dict(saved.get("best", best))
        # The schedule's warm-up is in steps of the global batch the run started with (schedule_batch), so
        # after a resume with another global batch it continues from the samples seen (build_scheduler).
        scale = global_batch / self.schedule_batch
        offset = self.samples_seen / self.schedule_batch - global_step * scale
        scheduler = build_scheduler(optimizer, config.schedular, steps_per_epoch, step=global_step,
                                    warmup_offset=offset, warmup_scale=scale)
        # ALBEF's clamp of the ITC temperature, once before the first step (and after every optimiser step:
        # training.optimizer.clamp_after_steps): a config's or checkpoint's value outside [0.001, 0.5] (an
        # older checkpoint was saved after a step that the next forward's clamp would have corrected).
        clamp = getattr(task.model, "clamp_temperature", None)
        if clamp is not None:
            clamp()
        self._open_output_dir()
        reporter = Reporter(self.output_dir, config.report_to, config_to_dict(config),
                            config.run_name or os.path.basename(os.path.normpath(self.output_dir)),
                            config.wandb_project)
        try:
            resumed = {"path": self.resume, "epoch": start_epoch, "step": saved_step}
            if global_step != saved_step:  # on another number of processes: its steps are numbered anew
                resumed["continues_at_step"] = global_step
            reporter.record_start(run_record(info.world_size, resumed if self.resume else None))
            self._print_summary(start_epoch, global_step, steps_per_epoch)
            parts = _Parts(model, loader, optimizer, scheduler, scaler, guard, bad_log, state, reporter,
                           fault)
            return self._epochs(parts, start_epoch, global_step, steps_per_epoch, best)
        finally:
            reporter.close()

    def _resume_position(self, saved: dict, start_epoch: int, steps_per_epoch: int,
                         optimizer: torch.optim.Optimizer) -> int:
        """Where a resumed run continues -> its global step: the sampler gets the saved epoch's rest (re-
        dealt over this run's ranks when their number changed), the samples seen and the warm-up's batch
        come from the checkpoint, and the learning rate from this run's config."""
        info, task, sampler = self.info, self.task, self.task.sampler
        then_world = int(saved.get("world_size", info.world_size))
        then_batch = int(saved.get("batch_size", task.batch_size))
        then_steps = int(saved.get("steps_per_epoch", steps_per_epoch))
        step = int(saved["step"])
        # What the trainer knows of the saved epoch, for samplers whose own state lacks it (fine-tuning's).
        known = {"position": step - int(saved["epoch"]) * then_steps, "num_replicas": then_world,
                 "batch_size": then_batch, "in_progress": int(not saved.get("epoch_complete", True))}
        sampler.load_state_dict({**known, **saved["sampler"]})
        self.samples_seen = int(saved.get("samples_seen", step * then_world * then_batch))
        self.schedule_batch = int(saved.get("schedule_batch", then_world * then_batch))
        base_lr = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        for group in optimizer.param_groups:  # the config's rate: a resume may set another on purpose
            group["initial_lr"] = self.config.optimizer.lr
        self.lr_then = base_lr[0]
        if (then_world, then_batch) != (info.world_size, task.batch_size):
            self.reshaped = {"world": then_world, "batch": then_batch, "steps": then_steps,
                             "mid_epoch": bool(known["in_progress"]),
                             "left_out": getattr(sampler, "left_out_on_resume", 0)}
        # Steps are numbered epoch * steps_per_epoch + the step within the epoch, in this run's steps.
        return start_epoch * steps_per_epoch + sampler.start_batch

    def _print_summary(self, start_epoch: int, global_step: int, steps_per_epoch: int) -> None:
        """What the run is about to do, before its first step (rank 0)."""
        config, info, task = self.config, self.info, self.task
        params = list(task.model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        sources = config.train_files + config.train_shard_specs
        backend = "nccl" if info.device.type == "cuda" else "gloo" if info.distributed else "single process"
        lines = [
            f"{task.name}: device {info.device}, world size {info.world_size} ({backend}); model "
            f"{sum(p.numel() for p in params) / 1e6:.2f} M parameters ({trainable / 1e6:.2f} M trainable)",
            f"  data: {len(task.dataset):,} training examples ({', '.join(sources)}); bad ones are skipped "
            f"and counted as they are read (max_bad_fraction {config.max_bad_fraction:g})",
            f"  {steps_per_epoch:,} steps per epoch, global batch {task.batch_size * info.world_size:,} "
            f"({task.batch_size} per rank x {info.world_size})",
            *self._reshape_lines(start_epoch, global_step, steps_per_epoch),
            *(f"  {line}" for line in task.summary()),
            f"  epochs {start_epoch}-{config.max_epoch - 1}"
            + (f" (resuming at step {global_step:,})" if global_step else "")
            + f"; output_dir {self.output_dir}" + (f"; report_to {', '.join(config.report_to)}"
                                                   if config.report_to else ""),
        ]
        print_main("\n".join(lines), flush=True)

    def _reshape_lines(self, start_epoch: int, global_step: int, steps_per_epoch: int) -> list[str]:
        """The summary's lines on a resume with another number of processes (what changed and what not),
        or with another learning rate in the config."""
        then, lr, was = self.reshaped, self.config.optimizer.lr, self.lr_then
        if was is None:  # a fresh start
            return []
        rate = f"lr {lr:g} as before" if lr == was else f"lr {lr:g} from the config, was {was:g}"
        if then is None:
            return [] if lr == was else [f"  resumed with {rate}"]
        world, batch, task = self.info.world_size, self.task.batch_size, self.task
        lines = [f"  resumed on another number of processes: saved by {then['world']} (global batch "
                 f"{then['world'] * then['batch']:,}, {then['steps']:,} steps per epoch), now {world} "
                 f"(global batch {batch * world:,}, {steps_per_epoch:,} steps per epoch)"]
        if then["mid_epoch"]:
            left = steps_per_epoch - task.sampler.start_batch
            lines.append(f"  the rest of epoch {start_epoch} is re-dealt over {world} process(es): {left:,} "
                         f"steps from step {global_step:,}, every index of the epoch still once; "
                         f"{then['left_out']:,} that fill no whole global batch are left out (back next "
                         "epoch with GRIT)")
        lines.append(f"  learning rate not rescaled for the new global batch ({rate}; set optimizer.lr and "
                     f"schedular.lr to scale it): the schedule continues from the {self.samples_seen:,} "
                     f"samples seen, warm-up in steps of {self.schedule_batch:,} samples")
        return lines

    def _epochs(self, parts: _Parts, start_epoch: int, global_step: int, steps_per_epoch: int,
                best: dict | None) -> dict:
        """The epochs from start_epoch on: train, end, evaluate, save, log; returns the last record."""
        config, info, task = self.config, self.info, self.task
        guard, bad_log, state, reporter = parts.guard, parts.bad_log, parts.state, parts.reporter
        record: dict = {}
        with guard:  # SIGTERM/SIGINT: finish the step, save, exit (training.step_guard)
            for epoch in range(start_epoch, config.max_epoch):
                epoch_start = time.perf_counter()
                task.start_epoch(epoch)
                stats, global_step = self._train_epoch(parts, epoch, global_step, steps_per_epoch)
                extra = task.end_epoch(epoch)
                record = {"epoch": epoch, "step": global_step, **stats,
                          "epoch_seconds": round(time.perf_counter() - epoch_start, 3),
                          "bad_samples": bad_log.epoch_total(), "skipped_steps": guard.skipped, **extra}
                bad_log.start_epoch()
                guard.start_epoch()
                record.update(task.evaluate(epoch, self.output_dir))
                if best is not None:
                    # In place: the checkpoint-state function (parts.state) holds this same dict.
                    new = keep_best(best, record, task.best_key, self.output_dir, task.model,
                                    config_to_dict(config), epoch, global_step)
                    if new is not best:
                        best.clear()
                        best.update(new)
                    record["best_epoch"] = best["epoch"]
                saved = checkpoint_path(self.output_dir, epoch=epoch)
                save_checkpoint(saved, **state(epoch, global_step, complete=True))
                latest = find_latest_checkpoint(self.output_dir) if is_main_process() else None
                prune_checkpoints(self.output_dir, config.keep_checkpoints, protect=[saved, latest or saved])
                append_log(self.output_dir, record)
                print_main(json.dumps(record))
                reporter.epoch(global_step, record)
                for tag, path in task.pictures(epoch, self.output_dir).items():
                    reporter.image(tag, path, global_step)
                loaded = steps_per_epoch * task.loader_batch_size * info.world_size
                bad_log.check(record["bad_samples"], loaded, f"epoch ({epoch})")
                barrier()
        if best is not None and best["epoch"] >= 0 and task.best_summary:
            print_main(task.best_summary.format(**best)
                       + f": {os.path.join(self.output_dir, 'checkpoint_best.pth')}")
        cleanup()
        return record

    def _train_epoch(self, parts: _Parts, epoch: int, global_step: int, steps_per_epoch: int
                     ) -> tuple[dict[str, float], int]:
        """One epoch of optimiser steps -> (lr, the step metrics' epoch means, timing; the global step).

        Metrics stay on the device until the epoch summary; the guard's per-step decision is the step's
        only host synchronisation (training.step_guard)."""
        config, task, device = self.config, self.task, self.info.device
        model, optimizer, scheduler, scaler, guard, bad_log = (parts.model, parts.optimizer, parts.scheduler,
                                                               parts.scaler, parts.guard, parts.bad_log)
        model.train()
        dtype = autocast_dtype(config.amp, device)
        start_batch = task.sampler.start_batch
        world = get_world_size()
        first_step = global_step - start_batch  # the global step of this epoch's step 0

        def on_log(step: int, values: dict[str, float]) -> None:
            values["samples_per_s_per_rank"] = values["samples_per_s"] / world
            values["peak_memory_bytes"] = peak_memory_bytes(device)
            parts.reporter.step(first_step + step, epoch, values)

        logger = TrainLogger(header=f"{task.name} epoch {epoch}", print_freq=config.print_freq,
                             samples_per_step=task.batch_size * world, on_log=on_log)
        bad_log.epoch = epoch
        # compile: reduce-overhead replays CUDA graphs, whose outputs live in memory the next step reuses.
        graphs = config.compile_mode == "reduce-overhead"
        samples, start = 0, time.time()
        for batch in logger.log_every(parts.loader, total=steps_per_epoch - start_batch, start=start_batch):
            bad_log.record(batch.reasons)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss, metrics = task.step(model, batch)
            if graphs:  # the logger keeps them for the epoch's means
                metrics = {k: v.clone() for k, v in metrics.items()}
            skip, stop = guard.decide(loss)
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]
            if skip:
                # Every rank skips together (the decision is all-reduced), so no rank waits in a backward
                # all-reduce the others never start. The schedule still advances: the batch is spent.
                print_main(f"{task.name} epoch {epoch}, step {global_step}: loss is not finite on some rank; "
                           f"step skipped without an update ({guard.consecutive} in a row)", flush=True)
            else:
                self._update(loss, optimizer, scaler)
            scheduler.step()
            global_step += 1
            self.samples_seen += task.batch_size * world
            samples += task.batch_size  # trained on (an online selection's super-batch is larger)
            if not skip:
                logger.update(lr=lr, **metrics)
            task.after_step(metrics, batch, skip)
            if stop or guard.too_many_skipped:
                self._stop(parts, epoch, global_step, stop)
            every = config.checkpoint_every_steps
            if every and global_step % every == 0:
                save_checkpoint(checkpoint_path(self.output_dir, step=global_step),
                                **parts.state(epoch, global_step))
            if parts.fault is not None:
                parts.fault.after_step(global_step, self.info.rank, guard)
        summary = logger.epoch_summary()
        seconds = time.time() - start
        lr = summary.pop("lr", optimizer.param_groups[0]["lr"])  # mean rate over the epoch's steps
        task.sampler.start_batch = 0
        return {"lr": lr, **summary, "train_seconds": round(seconds, 3),
                "samples_per_s": round(samples * get_world_size() / max(seconds, 1e-9), 2)}, global_step

    def _update(self, loss: Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        """Backward and optimiser step, with loss scaling (fp16) and gradient clipping (clip_grad)."""
        clip = self.config.clip_grad
        params = self.task.model.parameters
        if scaler.is_enabled():
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params(), clip)
            scaler.step(optimizer)
            scaler.update()
            return
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params(), clip)
        optimizer.step()

    def _stop(self, parts: _Parts, epoch: int, global_step: int, signalled: bool) -> None:
        """Save a checkpoint at this step and stop: Preempted on a signal, TooManySkippedSteps otherwise."""
        guard = parts.guard
        path = checkpoint_path(self.output_dir, step=global_step)
        # An unbroken run takes no checkpoint here: keep the generators' states, do not reseed.
        save_checkpoint(path, **parts.state(epoch, global_step, reseed_rng=False))
        barrier()
        where = f"epoch {epoch}, step {global_step}; saved {path}; continue with --resume"
        if signalled:
            print_main(f"stopping on signal {guard.signal or 'from another rank'}: {where}", flush=True)
            raise Preempted(guard.exit_code())
        raise TooManySkippedSteps(f"{guard.consecutive} consecutive steps had a non-finite loss "
                                  f"(max_skipped_steps={guard.max_skipped_steps}): {where} after fixing the "
                                  "cause (learning rate, data, amp)")


class _Parts:
    """What fit() built for the epochs: the wrapped model, loader, optimiser, schedule, scaler, guard, bad-
    sample log, the checkpoint-state function, the reporter and the injected fault (None unless asked)."""

    def __init__(self, model: nn.Module, loader: Iterable, optimizer: torch.optim.Optimizer, scheduler: Any,
                 scaler: torch.amp.GradScaler, guard: StepGuard, bad_log: BadSampleLog, state: Any,
                 reporter: Reporter, fault: Fault | None = None) -> None:
        self.model, self.loader, self.optimizer, self.scheduler = model, loader, optimizer, scheduler
        self.scaler, self.guard, self.bad_log, self.state = scaler, guard, bad_log, state
        self.reporter, self.fault = reporter, fault
