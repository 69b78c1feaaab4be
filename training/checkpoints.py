"""Checkpoints and resume.

A checkpoint is a plain dict (torch.load(weights_only=True) reads it): model, optimizer, lr_scheduler,
scaler, sampler, config, epoch, step, epoch_complete (+ best for the fine-tuning scripts); written
atomically, by rank 0, as checkpoint_{epoch:02d}.pth or checkpoint_step_{step:07d}.pth with
latest.json naming the newest for `--resume`. The optimizer state is always the ordinary full
AdamW state dict (a ZeroRedundancyOptimizer's shards are gathered onto rank 0 first), so a checkpoint
resumes with or without `zero` and on CPU or CUDA, fused or not.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from grit_io import InputFileError, load_torch_file
from training.config_files import atomic_write_text, to_plain
from training.distributed import all_gather_objects, get_world_size, is_main_process, print_main
from training.reproducibility import reseed, rng_state, set_rng_state

_CKPT_RE = re.compile(r'^checkpoint_(?:\d+|step_\d+)\.pth$')
_EPOCH_RE = re.compile(r'^checkpoint_(\d+)\.pth$')  # end-of-epoch checkpoints: checkpoint_path(epoch=...)
_LATEST = 'latest.json'


def checkpoint_path(output_dir: str | os.PathLike, epoch: int | None = None, step: int | None = None) -> str:
    """output_dir/checkpoint_{epoch:02d}.pth (epoch end) or checkpoint_step_{step:07d}.pth (mid-epoch)."""
    if (epoch is None) == (step is None):
        raise ValueError('checkpoint_path: give exactly one of epoch (epoch end) or step (mid-epoch)')
    name = f'checkpoint_{epoch:02d}.pth' if epoch is not None else f'checkpoint_step_{step:07d}.pth'
    return os.path.join(str(output_dir), name)


def save_checkpoint(path: str | os.PathLike, **state: Any) -> str | None:
    """Atomically torch.save(state) on the main process (others return None); config etc. made plain.

    Files named like checkpoint_path() are also recorded in output_dir/latest.json for --resume.
    """
    if not is_main_process():
        return None
    path = str(path)
    state = {k: to_plain(v) for k, v in state.items()}
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    tmp = f'{path}.tmp{os.getpid()}'
    try:
        with open(tmp, 'wb') as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    try:  # POSIX: the rename survives a power loss only once the directory is synced too
        fd = os.open(os.path.dirname(path) or '.', os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # directories cannot be opened or synced everywhere (Windows); the rename is atomic anyway
    if _CKPT_RE.match(os.path.basename(path)):
        record = {'path': os.path.basename(path), 'epoch': state.get('epoch'), 'step': state.get('step')}
        atomic_write_text(os.path.join(os.path.dirname(path) or '.', _LATEST), json.dumps(record) + '\n')
    return path


def find_latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Newest complete checkpoint in output_dir (latest.json's, else by file time), or None.

    Temp files (checkpoint_03.pth.tmp1234) never match; a missing or truncated file is skipped, saying why.
    """
    output_dir = str(output_dir)
    if not os.path.isdir(output_dir):
        return None

    def incomplete(path: str) -> str | None:
        # Cheap: torch.save writes the zip's central directory last, so reading it (not the tensors)
        # tells a complete file from one cut short; the full load comes once, in restore_training.
        try:
            with zipfile.ZipFile(path) as z:
                return None if any(n.endswith('data.pkl') for n in z.namelist()) else 'not a torch.save file'
        except FileNotFoundError:
            return 'missing'
        except (OSError, zipfile.BadZipFile) as e:
            return f'truncated or corrupt ({e})'

    found = sorted((os.path.join(output_dir, n) for n in os.listdir(output_dir) if _CKPT_RE.match(n)),
                   key=lambda p: (os.path.getmtime(p), p), reverse=True)
    try:
        with open(os.path.join(output_dir, _LATEST), encoding='utf-8') as f:
            named = json.load(f)['path']
        if not _CKPT_RE.match(named):  # only ever a bare checkpoint_*.pth name, never a path
            raise ValueError(named)
        named = os.path.join(output_dir, named)
        found = [named, *(p for p in found if p != named)]
    except FileNotFoundError:
        pass  # a run from before latest.json existed: file times decide
    except (OSError, ValueError, KeyError, TypeError) as e:
        print_main(f'--resume: ignoring unreadable {os.path.join(output_dir, _LATEST)} ({e!r})')
    for path in found:
        why = incomplete(path)
        if why is None:
            return path
        print_main(f'--resume: skipping {path}: {why}')
    return None


def resolve_resume(resume: str | None, output_dir: str | None) -> str | None:
    """Checkpoint to resume: None, an explicit path (must exist), or 'latest' in output_dir (None if none)."""
    if resume is None:
        return None
    if resume == 'latest':
        found = find_latest_checkpoint(output_dir) if output_dir else None
        if found is None:  # how an elastic restart's first attempt begins: not an error
            print_main(f'--resume: no checkpoint in {output_dir} yet: starting fresh')
        return found
    if not os.path.isfile(resume):
        raise InputFileError(f'--resume checkpoint not found: {resume}')
    return resume


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint dict (weights-only unless --trust_checkpoint) with clear errors for missing/bad files."""
    path = str(path)
    if not os.path.isfile(path):
        raise InputFileError(f'checkpoint not found: {path}')
    state = load_torch_file(path)
    if not isinstance(state, dict):
        raise InputFileError(f'checkpoint {path} holds a {type(state).__name__}, not a checkpoint dict')
    return state


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *,
                   config: Mapping, epoch: int, step: int, sampler_state: Any, seed: int, rank: int,
                   complete: bool = False, guard: Any = None, bad_samples: Any = None,
                   reseed_rng: bool = True, **extra: Any) -> dict:
    """A run's checkpoint dict; every rank reseeds from (seed, rank, step), so a resume continues alike.

    guard (StepGuard) / bad_samples (BadSampleLog): their counts so far this epoch are saved under
    'counters' (bad samples summed over ranks: a collective, every rank calls this), so an epoch
    resumed mid-way still logs its exact totals.
    reseed_rng=False (a checkpoint at an arbitrary step, e.g. on SIGTERM, that an unbroken run does
    not take): instead of reseeding, every rank's generator states are saved under 'rng' (a collective)
    and restore_training puts them back, so the resumed run still draws the same numbers.
    """
    if guard is not None or bad_samples is not None:
        extra['counters'] = {
            'skipped_steps': guard.skipped if guard is not None else 0,
            'consecutive_skips': guard.consecutive if guard is not None else 0,
            'bad_samples': bad_samples.epoch_total() if bad_samples is not None else 0,
        }
    if reseed_rng:
        reseed(seed, rank, step)
    else:
        extra['rng'] = _gather_rng_states()
    return {'model': model.state_dict(), 'optimizer': optimizer_state(optimizer),
            'lr_scheduler': scheduler.state_dict(), 'scaler': scaler.state_dict(), 'sampler': sampler_state,
            'config': config, 'epoch': epoch, 'step': step, 'epoch_complete': complete, **extra}


def restore_training(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     scaler: Any, *, seed: int, rank: int, guard: Any = None,
                     bad_samples: Any = None) -> tuple[dict, int, int]:
    """Load a training_state() checkpoint into the run; returns (state, start_epoch, global_step).

    The saved counters go back into guard and bad_samples (the bad-sample total onto rank 0, so that
    the sum over ranks stays exact). scheduler None: not restored (the trainer builds its schedule from
    the resumed position instead, which may be on another number of processes)."""
    state = load_checkpoint(path)
    counters = state.get('counters') or {}
    if guard is not None:
        guard.skipped = int(counters.get('skipped_steps', 0))
        guard.consecutive = int(counters.get('consecutive_skips', 0))
    if bad_samples is not None:
        bad_samples.count = int(counters.get('bad_samples', 0)) if rank == 0 else 0
    model.load_state_dict(state['model'])
    load_optimizer_state(optimizer, state['optimizer'])
    if scheduler is not None:
        scheduler.load_state_dict(state['lr_scheduler'])
    if state.get('scaler'):
        scaler.load_state_dict(state['scaler'])
    global_step = int(state['step'])
    start_epoch = int(state['epoch']) + (1 if state.get('epoch_complete', True) else 0)
    rng = state.get('rng')
    if rng and len(rng) == get_world_size():
        set_rng_state(rng[rank])
    else:  # saved at a reseeding checkpoint (or on another number of ranks)
        reseed(seed, rank, global_step)
    print_main(f'resumed from {path}: epoch {start_epoch}, step {global_step}')
    return state, start_epoch, global_step


def check_mid_epoch_resume(saved: Mapping, path: str, batch_size: int) -> None:
    """InputFileError (one line, exit 2) when a mid-epoch checkpoint is resumed with another per-rank batch
    size: the rest of its epoch continues on any number of processes, but only in batches of the saved size
    (GRIT's groups are batch_size long); the message names the newest end-of-epoch checkpoint beside it to
    resume from instead. Checkpoints without the saved size (from before it was recorded) pass unchecked."""
    if saved.get('epoch_complete', True):
        return
    sampler = saved.get('sampler') if isinstance(saved.get('sampler'), Mapping) else {}
    then = saved.get('batch_size', sampler.get('batch_size'))
    if then is None or int(then) == batch_size:
        return
    folder = os.path.dirname(os.path.abspath(path))
    # by epoch number, not by name: checkpoint_100.pth sorts before checkpoint_99.pth as text
    ends = sorted((n for n in os.listdir(folder) if _EPOCH_RE.match(n)),
                  key=lambda n: int(_EPOCH_RE.match(n)[1]))
    instead = (f'--resume {os.path.join(folder, ends[-1])} (the newest end-of-epoch checkpoint)' if ends else
               'an end-of-epoch checkpoint (there is none yet)')
    raise InputFileError(
        f'--resume {path}: saved mid-epoch with batch size {int(then)} per process, resumed with '
        f'{batch_size}; the rest of that epoch continues on any number of processes but only with the same '
        f'batch size per process: resume with batch size {int(then)}, or from {instead}')


# Group settings that choose how the update runs, not what it computes: a run keeps its own.
_IMPLEMENTATION_KEYS = ('fused', 'foreach', 'capturable')


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict | None:
    """The optimizer's full state dict; a ZeroRedundancyOptimizer's is gathered onto rank 0 (a
    collective: every rank calls this) and is None on the other ranks, which do not save."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    if optimizer.rank != 0:
        return None
    state = optimizer.state_dict()
    param = optimizer.param_groups[0]['params'][0]
    if param.is_cuda:
        # The shards reach the CPU by non-blocking copies (into pinned memory): finish them before
        # torch.save reads the bytes.
        torch.cuda.synchronize(param.device)
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Mapping) -> None:
    """Load a full optimizer state dict (any run's) into this run's optimizer, ZeRO or not.

    Every rank loads the whole dict; a ZeroRedundancyOptimizer keeps its own shard of it.
    """
    flags = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    # ZeroRedundancyOptimizer.load_state_dict writes None into the entries it does not own: a copy.
    optimizer.load_state_dict({**saved, 'state': dict(saved['state'])})
    # load_state_dict takes every group setting from the file, fused included: keep this run's.
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    for groups in (optimizer.param_groups, local.param_groups):
        for group, kept in zip(groups, flags):
            group.update(kept)
    if local is not optimizer:
        # Its own copy of this rank's share (the step uses optimizer.optim's); dropping it keeps the
        # memory at one shard, and no None entry can reach a later checkpoint.
        optimizer.state.clear()
    # AdamW's fused and capturable kernels want the step counters on the parameters' device as
    # float32, the others on the CPU; the file's (and ZeRO's, which moves them all to the CPU:
    # pytorch/pytorch#124133) placement can be either.
    for group in local.param_groups:
        on_device = group.get('fused') or group.get('capturable')
        for p in group['params']:
            st = local.state.get(p)
            if st and isinstance(st.get('step'), torch.Tensor):
                st['step'] = st['step'].to(p.device, torch.float32) if on_device else st['step'].cpu()


def _gather_rng_states() -> list[dict]:
    """Every rank's rng_state(), in rank order (all_gather_object when distributed)."""
    return all_gather_objects(rng_state())


def keep_best(best: dict, record: Mapping, key: str, output_dir: str, model: nn.Module, config: Mapping,
              epoch: int, step: int) -> dict:
    """If record[key] beats best[key], save output_dir/checkpoint_best.pth; returns the (new) best dict."""
    if record[key] <= best[key]:
        return best
    metrics = {k: v for k, v in record.items() if k.startswith(('val_', 'test_'))}
    save_checkpoint(os.path.join(output_dir, 'checkpoint_best.pth'), model=model.state_dict(), config=config,
                    epoch=epoch, step=step, metrics=metrics)
    return {**metrics, 'epoch': epoch}
