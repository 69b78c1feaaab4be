"""Checkpoints and resume.

A checkpoint is a plain dict (torch.load(weights_only=True) reads it): model, optimizer, lr_scheduler,
scaler, sampler, config, epoch, step, epoch_complete (+ best for the fine-tuning scripts); written
atomically, by rank 0, as checkpoint_{epoch:02d}.pth or checkpoint_step_{step:07d}.pth with
latest.json naming the newest for `--resume`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from training.config import atomic_write_text, to_plain
from training.distributed import is_main_process, print_main
from training.reproducibility import reseed

_CKPT_RE = re.compile(r'^checkpoint_(?:\d+|step_\d+)\.pth$')
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
    if _CKPT_RE.match(os.path.basename(path)):
        record = {'path': os.path.basename(path), 'epoch': state.get('epoch'), 'step': state.get('step')}
        atomic_write_text(os.path.join(os.path.dirname(path) or '.', _LATEST), json.dumps(record) + '\n')
    return path


def find_latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """Most recently saved checkpoint in output_dir (latest.json, else newest checkpoint_*.pth), or None."""
    output_dir = str(output_dir)
    if not os.path.isdir(output_dir):
        return None
    try:
        with open(os.path.join(output_dir, _LATEST), encoding='utf-8') as f:
            candidate = os.path.join(output_dir, json.load(f)['path'])
        if os.path.isfile(candidate):
            return candidate
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no or unreadable sidecar: fall back to file times
    found = [os.path.join(output_dir, n) for n in os.listdir(output_dir) if _CKPT_RE.match(n)]
    return max(found, key=lambda p: (os.path.getmtime(p), p)) if found else None


def resolve_resume(resume: str | None, output_dir: str | None) -> str | None:
    """Checkpoint to resume: None, an explicit path (must exist), or 'latest' in output_dir (None if none)."""
    if resume is None:
        return None
    if resume == 'latest':
        return find_latest_checkpoint(output_dir) if output_dir else None
    if not os.path.isfile(resume):
        raise FileNotFoundError(f'--resume checkpoint not found: {resume}')
    return resume


def load_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> dict:
    """torch.load(path, map_location='cpu', weights_only=True) with clear errors for missing/corrupt files."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint not found: {path}')
    try:
        state = torch.load(path, map_location='cpu', weights_only=weights_only)
    except Exception as e:  # torch raises many exception types for bad files
        raise ValueError(f'cannot load checkpoint {path} (truncated, corrupt, or holds objects that '
                         f'weights_only=True refuses): {type(e).__name__}: {e}') from e
    if not isinstance(state, dict):
        raise ValueError(f'checkpoint {path} holds a {type(state).__name__}, expected a dict')
    return state


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, *,
                   config: Mapping, epoch: int, step: int, sampler_state: Any, seed: int, rank: int,
                   complete: bool = False, **extra: Any) -> dict:
    """A run's checkpoint dict; every rank reseeds from (seed, rank, step), so a resume continues alike."""
    reseed(seed, rank, step)
    return {'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
            'lr_scheduler': scheduler.state_dict(), 'scaler': scaler.state_dict(), 'sampler': sampler_state,
            'config': config, 'epoch': epoch, 'step': step, 'epoch_complete': complete, **extra}


def restore_training(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                     scaler: Any, *, seed: int, rank: int) -> tuple[dict, int, int]:
    """Load a training_state() checkpoint into the run; returns (state, start_epoch, global_step)."""
    state = load_checkpoint(path)
    model.load_state_dict(state['model'])
    optimizer.load_state_dict(state['optimizer'])
    scheduler.load_state_dict(state['lr_scheduler'])
    if state.get('scaler'):
        scaler.load_state_dict(state['scaler'])
    global_step = int(state['step'])
    start_epoch = int(state['epoch']) + (1 if state.get('epoch_complete', True) else 0)
    reseed(seed, rank, global_step)
    print_main(f'resumed from {path}: epoch {start_epoch}, step {global_step}')
    return state, start_epoch, global_step


def keep_best(best: dict, record: Mapping, key: str, output_dir: str, model: nn.Module, config: Mapping,
              epoch: int, step: int) -> dict:
    """If record[key] beats best[key], save output_dir/checkpoint_best.pth; returns the (new) best dict."""
    if record[key] <= best[key]:
        return best
    metrics = {k: v for k, v in record.items() if k.startswith(('val_', 'test_'))}
    save_checkpoint(os.path.join(output_dir, 'checkpoint_best.pth'), model=model.state_dict(), config=config,
                    epoch=epoch, step=step, metrics=metrics)
    return {**metrics, 'epoch': epoch}
