"""Optimiser and schedule: AdamW with the no-decay parameter groups (fused on CUDA, sharded over the
ranks with `zero: true`), the authors' warm-up + per-epoch cosine learning rate, and mixed precision
(autocast dtype, GradScaler).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from training.distributed import get_world_size, print_main

# Parameters that get no weight decay, matched on dotted-name components: embedding tables and
# tokens (decay would shrink them toward zero for no regularisation benefit) and the ITC temperature.
_NO_DECAY_NAMES = {'word_embeddings', 'position_embeddings', 'token_type_embeddings',
                   'cls_token', 'pos_embed', 'temp', 'bias'}


def _no_decay(name: str, p: torch.Tensor) -> bool:
    parts = name.split('.')
    if p.ndim <= 1:  # biases, norm weights, scalars
        return True
    return any(part in _NO_DECAY_NAMES or 'norm' in part.lower() for part in parts)


def split_decay_params(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """Trainable parameters split into (decay, no_decay) by name; frozen ones (momentum copies) left out."""
    no_decay_ids: set[int] = set()
    # A tied weight (MLM decoder = word embeddings) is no-decay if any of its names is.
    for name, p in model.named_parameters(remove_duplicate=False):
        if _no_decay(name, p):
            no_decay_ids.add(id(p))
    decay: dict[str, nn.Parameter] = {}
    no_decay: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if id(p) in no_decay_ids else decay)[name] = p
    return decay, no_decay



def build_optimizer(model: nn.Module, config: Any, *, zero: bool = False,
                    fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW over trainable params: weight decay except norms, biases, embeddings, cls/pos tokens and temp.

    config: the `optimizer` block (training.config.Optimizer: lr, weight_decay, betas, eps).
    zero (top-level `zero`): in a multi-process run, a ZeroRedundancyOptimizer over the same groups and
    settings, each rank keeping the AdamW state of its share of the parameters only; a no-op (with a
    notice) in a single process. fused (top-level `fused_adamw`): the fused AdamW kernel; None = when
    every parameter is on CUDA.
    """
    lr, wd, betas, eps = config.lr, config.weight_decay, tuple(config.betas), config.eps
    decay, no_decay = split_decay_params(model)
    groups = [{'params': list(ps.values()), 'weight_decay': w, 'name': n}
              for n, ps, w in (('decay', decay, wd), ('no_decay', no_decay, 0.0)) if ps]
    if not groups:
        raise ValueError('build_optimizer: the model has no trainable parameters')
    if fused is None:
        # Safe as a default: the fused kernel computes the same AdamW update as the per-parameter
        # path (equal up to rounding), in one launch per device and dtype instead of several per
        # parameter. Off on CPU, where the reference path is what the tests pin down.
        fused = all(p.is_cuda for g in groups for p in g['params'])
    settings = {'lr': lr, 'betas': betas, 'eps': eps, 'weight_decay': wd, 'fused': bool(fused)}
    if zero and get_world_size() > 1:
        # All groups at construction: the sorted-greedy partition (each parameter whole, on one rank)
        # runs group by group, as add_param_group would; parameters stay ordinary tensors (no bucket
        # views), so DDP and the tied MLM decoder weight see no difference.
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **settings)
    else:
        if zero:
            print_main('zero: true has no effect in a single process (nothing to shard the optimizer state '
                       'over)')
        optimizer = torch.optim.AdamW(groups, **settings)
    clamp_after_steps(model, optimizer)
    return optimizer


def clamp_after_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Run model.clamp_temperature() (when the model has one) after every optimiser step.

    ALBEF clamps the learnt ITC temperature to [0.001, 0.5] at the start of every training forward. The
    clamp after each step (and the trainer's once before the first) gives every forward the same value,
    and the forward then writes no parameter, which a CUDA-graph replay (compile: reduce-overhead) would
    not repeat. A step the loss scaler skips changes nothing, so needs no clamp.
    """
    clamp = getattr(model, 'clamp_temperature', None)
    if clamp is not None:
        optimizer.register_step_post_hook(lambda *_: clamp())


def schedule_lr(step: int, steps_per_epoch: int, lr: float, epochs: int, min_lr: float = 0.0,
                warmup_lr: float | None = None, warmup_steps: int = 0, warmup_position: float | None = None
                ) -> float:
    """Learning rate for optimiser step `step` (0-based): linear warm-up, then per-epoch cosine.

    warmup_position: how far the warm-up has come, in its own steps (default `step`); differs from step
    only after a resume with another global batch (build_scheduler)."""
    position = step if warmup_position is None else warmup_position
    if position < warmup_steps:
        start = min_lr if warmup_lr is None else warmup_lr
        return start + (lr - start) * position / warmup_steps
    epoch = min(step // steps_per_epoch, epochs)  # past the horizon the rate stays at min_lr
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * epoch / epochs))


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, steps_per_epoch: int, *, step: int = 0,
                    warmup_offset: float = 0.0, warmup_scale: float = 1.0
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR stepped once per optimiser step, implementing the authors' warm-up + per-epoch cosine.

    config: the resolved `schedular` block (training.config.Schedule: lr, epochs, min_lr, warmup_lr,
    warmup_steps). `epochs` is the cosine horizon: for epoch e,
    lr(e) = min_lr + (lr - min_lr)(1 + cos(pi e / epochs)) / 2, constant within an epoch. The paper's
    pre-training uses a 30-epoch horizon but stops at max_epoch 20. The first `warmup_steps` optimiser
    steps ramp linearly from warmup_lr to lr (ALBEF: warmup_epochs 20 x step_size 100 = 2000 steps); if
    they outlast epoch 0 the ramp continues. After the ramp epoch 0 runs at `lr`. ALBEF's warmup_epochs
    is read as warmup_steps (x 100, training.config_albef.ALBEF_KEYS); its decay_rate and cooldown_epochs
    change nothing.

    A resumed run starts at `step` (epoch * steps_per_epoch + the steps done in it). The warm-up counts
    samples: at step k it has come warmup_offset + warmup_scale * k of its steps, which is k itself unless
    the run resumed with another global batch (training.trainer: warmup_steps are steps of the global
    batch the run started with), so the rate continues from the samples seen, without a jump.
    """
    if steps_per_epoch <= 0:
        raise ValueError(f'build_scheduler: steps_per_epoch must be positive, got {steps_per_epoch}')
    base_lr = optimizer.param_groups[0].get('initial_lr', optimizer.param_groups[0]['lr'])
    lr = base_lr if config.lr is None else config.lr
    if not math.isclose(lr, base_lr, rel_tol=1e-9):
        raise ValueError(f'build_scheduler: schedular.lr ({lr}) differs from the optimizer lr ({base_lr})')
    epochs, min_lr, warmup_steps = config.epochs, config.min_lr, config.warmup_steps
    warmup_lr = min_lr if config.warmup_lr is None else config.warmup_lr

    # A closure (not a callable object) keeps the settings out of state_dict: a resumed run rebuilds its
    # schedule from its own config, steps_per_epoch and position.
    def factor(k: int) -> float:
        return schedule_lr(k, steps_per_epoch, lr, epochs, min_lr, warmup_lr, warmup_steps,
                           warmup_offset + warmup_scale * k) / lr

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if step:
        # The constructor set step 0's rate; LambdaLR's rate is a closed form of the step counter.
        scheduler.last_epoch = step
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group['lr'] = base * factor(step)
        scheduler._last_lr = [group['lr'] for group in optimizer.param_groups]  # get_last_lr()'s answer
    return scheduler


def autocast_dtype(amp: bool | str | None, device: torch.device) -> torch.dtype | None:
    """Mixed-precision dtype of config key `amp`: true on CUDA (bf16 where supported, else fp16), 'bf16'
    on any device (the CPU included: tests, benchmarks); None = fp32.

    Under autocast the ITC/ITM/MLM losses and GRIT's features are still computed in fp32
    (models.objectives upcasts the similarities; the models return fp32 features for GRIT).
    """
    if amp not in (True, False, None, 'bf16'):
        raise ValueError(f"config key 'amp' must be true, false or 'bf16', got {amp!r}")
    if amp == 'bf16':
        return torch.bfloat16
    if not amp or device.type != 'cuda':
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def build_scaler(amp: bool | str | None, device: torch.device) -> torch.amp.GradScaler:
    """GradScaler for config key `amp`, enabled only for fp16 autocast (bf16 and fp32 need no scaling)."""
    return torch.amp.GradScaler(device.type, enabled=autocast_dtype(amp, device) == torch.float16)
