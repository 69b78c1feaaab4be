"""`zero: true` (ZeroRedundancyOptimizer) and fused AdamW: the same training as plain AdamW, checkpoints
in the ordinary full form that resume with or without zero. Pretrain.py with zero on two ranks, stopped by
SIGTERM and resumed exactly: tests/test_robustness.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from training.checkpoints import (
    load_checkpoint,
    load_optimizer_state,
    restore_training,
    save_checkpoint,
    training_state,
)
from training.config import Optimizer, Schedule
from training.optimizer import build_optimizer, build_scheduler

OPT = Optimizer(lr=1e-2, weight_decay=0.02)
SCHED = Schedule(sched='cosine', lr=1e-2, epochs=3, min_lr=1e-3, warmup_steps=2)
STEPS = 4  # a checkpoint after STEPS steps, the run ends after 2 * STEPS


class Net(nn.Module):
    """Both parameter groups (decayed matrices; embeddings, norm and biases without decay)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(tokens).mean(1))))


def _train(ddp: nn.Module, optimizer, scheduler, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        tokens, target = torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(tokens), target).backward()
        optimizer.step()
        scheduler.step()


def _run(out: str, tag: str, rank: int, zero: bool, resume: str | None = None) -> None:
    """Train to step 2 * STEPS, saving out/{tag}_mid.pth at STEPS (unless resumed) and out/{tag}_end.pth."""
    torch.manual_seed(0)
    model = Net()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = build_optimizer(model, OPT, zero=zero)
    assert isinstance(optimizer, torch.distributed.optim.ZeroRedundancyOptimizer) == zero
    scheduler = build_scheduler(optimizer, SCHED, steps_per_epoch=3)
    scaler = torch.amp.GradScaler('cpu', enabled=False)

    def save(name: str, step: int) -> None:
        state = training_state(model, optimizer, scheduler, scaler, config={}, epoch=0, step=step,
                               sampler_state=None, seed=0, rank=rank)
        save_checkpoint(os.path.join(out, f'{tag}_{name}.pth'), **state)

    start = 0
    if resume:
        _, _, start = restore_training(resume, model, optimizer, scheduler, scaler, seed=0, rank=rank)
    else:
        _train(ddp, optimizer, scheduler, rank, 0, STEPS)
        save('mid', STEPS)
        start = STEPS
    _train(ddp, optimizer, scheduler, rank, start, 2 * STEPS)
    save('end', 2 * STEPS)


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    torch.set_num_threads(1)
    _run(out, 'plain', rank, zero=False)
    _run(out, 'zero', rank, zero=True)
    _run(out, 'zero_from_zero', rank, zero=True, resume=os.path.join(out, 'zero_mid.pth'))
    _run(out, 'zero_from_plain', rank, zero=True, resume=os.path.join(out, 'plain_mid.pth'))
    _run(out, 'plain_from_zero', rank, zero=False, resume=os.path.join(out, 'zero_mid.pth'))
    dist.destroy_process_group()


def assert_same_training(a: dict, b: dict) -> None:
    """Same weights and the same full optimizer state, every tensor equal."""
    assert a['step'] == b['step']
    assert a['model'].keys() == b['model'].keys()
    for key, value in a['model'].items():
        assert torch.equal(value, b['model'][key]), key
    assert a['optimizer']['param_groups'] == b['optimizer']['param_groups']
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    for index, state in a['optimizer']['state'].items():
        assert state.keys() == b['optimizer']['state'][index].keys()
        for name, value in state.items():
            other = b['optimizer']['state'][index][name]
            assert torch.equal(value, other), (index, name)
    assert a['lr_scheduler'] == b['lr_scheduler']


def test_zero_trains_and_checkpoints_like_adamw(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / 'init'), str(tmp_path)), nprocs=2, join=True)
    ckpt = {p.stem: load_checkpoint(p) for p in tmp_path.glob('*.pth')}
    plain = ckpt['plain_end']
    assert len(plain['optimizer']['state']) == sum(1 for _ in Net().parameters())  # every parameter stepped
    assert [g['name'] for g in plain['optimizer']['param_groups']] == ['decay', 'no_decay']
    # The same updates, and a zero checkpoint is the plain AdamW state dict (gathered onto rank 0).
    assert_same_training(ckpt['plain_mid'], ckpt['zero_mid'])
    assert_same_training(plain, ckpt['zero_end'])
    # Resume with zero from zero, with zero from a plain checkpoint, without zero from a zero one.
    for name in ('zero_from_zero', 'zero_from_plain', 'plain_from_zero'):
        assert_same_training(plain, ckpt[f'{name}_end'])


def test_zero_in_one_process_is_plain_adamw(capsys):
    optimizer = build_optimizer(Net(), OPT, zero=True)
    assert type(optimizer) is torch.optim.AdamW
    assert 'zero: true has no effect in a single process' in capsys.readouterr().out
    assert not any(g['fused'] for g in optimizer.param_groups)  # auto: fused on CUDA only


def test_resume_keeps_this_runs_fused_setting():
    # A checkpoint from a fused run resumes unfused (and back): load_state_dict alone would take the
    # file's `fused` and the file's placement of the step counters.
    torch.manual_seed(0)
    model = Net()
    fused = build_optimizer(model, OPT, fused=True)
    F.cross_entropy(model(torch.randint(0, 11, (4, 5))), torch.tensor([0, 1, 2, 0])).backward()
    fused.step()
    plain = build_optimizer(model, OPT, fused=False)
    load_optimizer_state(plain, fused.state_dict())
    assert not any(g['fused'] for g in plain.param_groups)
    assert all(s['step'].device.type == 'cpu' and float(s['step']) == 1 for s in plain.state.values())
    load_optimizer_state(fused, plain.state_dict())
    assert all(g['fused'] for g in fused.param_groups)
    plain.step()
    fused.step()
