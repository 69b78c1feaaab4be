"""Distributed: process-group start (torchrun / launch) and device choice, rank queries, the
reductions of logged metrics, and the DDP wrapper. Every function works unchanged in a single process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config_files import ConfigError


@dataclass
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool


def _resolve_device(name: str | None, local_rank: int, distributed: bool) -> torch.device:
    if name is None:
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f'--device {name!r} is not a valid device (use cpu, cuda or cuda:N)') from None
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            raise ConfigError(f'--device {name}: CUDA is not available on this machine (use --device cpu)')
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f'--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)')
        if distributed or device.index is None:
            # one process per GPU: the launcher's local rank picks the GPU
            device = torch.device('cuda', local_rank if distributed else torch.cuda.current_device())
    elif device.type != 'cpu':
        raise ConfigError(f'--device {name!r} is not supported (use cpu, cuda or cuda:N)')
    return device


def init_distributed(device_name: str | None = None, local_rank: int | None = None) -> DistInfo:
    """Start the process group when launched with WORLD_SIZE > 1 (torchrun / launch), else single process.

    device_name: --device (None: cuda if available, else cpu); local_rank: --local_rank (old launch),
    else LOCAL_RANK from the environment."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    env_rank = os.environ.get('LOCAL_RANK')
    local_rank = int(env_rank) if env_rank is not None else int(local_rank or 0)
    distributed = world_size > 1
    device = _resolve_device(device_name, local_rank, distributed)
    if not distributed:
        return DistInfo(rank=0, world_size=1, local_rank=local_rank, device=device, distributed=False)
    if 'RANK' not in os.environ:
        raise ConfigError('WORLD_SIZE > 1 but RANK is not set: launch with torchrun or '
                          'torch.distributed.launch (which set RANK, MASTER_ADDR and MASTER_PORT)')
    rank = int(os.environ['RANK'])
    if device.type == 'cuda':
        torch.cuda.set_device(device)
        dist.init_process_group('nccl', init_method='env://', world_size=world_size, rank=rank,
                                device_id=device)
    else:
        dist.init_process_group('gloo', init_method='env://', world_size=world_size, rank=rank)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, distributed=True)


def is_dist() -> bool:
    """True when a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    """True on global rank 0."""
    return get_rank() == 0


def barrier() -> None:
    """Wait for all ranks (no-op in a single process)."""
    if is_dist():
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if one was started."""
    if is_dist():
        dist.destroy_process_group()


def print_main(*values: Any, **kwargs: Any) -> None:
    """print() on the main process only (flushes, so lines interleave correctly in job logs)."""
    if is_main_process():
        kwargs.setdefault('flush', True)
        print(*values, **kwargs)


def all_gather_objects(value: Any) -> list[Any]:
    """[value of rank 0, value of rank 1, ...] (picklable values; a collective); [value] in one process."""
    if not is_dist():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) a float tensor on the backend's device; identity without a process group."""
    if not is_dist():
        return t
    if dist.get_backend() == 'nccl':
        t = t.to(torch.device('cuda', torch.cuda.current_device()))
    else:
        t = t.cpu()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def stack_values(values: Sequence[Any]) -> torch.Tensor:
    """(K,) float64 tensor from 0-dim tensors / numbers, on the first tensor's device (no host sync)."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device('cpu'))
    return torch.stack([v.detach().to(device, torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                        else torch.tensor(float(v), dtype=torch.float64, device=device) for v in values])


def all_reduce_mean(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Mean over ranks of each 0-dim tensor / number -> python floats, with a single host sync."""
    if not values:
        return {}
    keys = sorted(values)  # same order on every rank
    total = reduce_sum(stack_values([values[k] for k in keys])) / get_world_size()
    return dict(zip(keys, total.tolist()))


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside torch.compile and DistributedDataParallel wrappers, or the model itself."""
    model = getattr(model, '_orig_mod', model)  # torch.compile's OptimizedModule
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def wrap_ddp(model: nn.Module, info: DistInfo, find_unused_parameters: bool = False,
             broadcast_buffers: bool = True, compile: bool = False) -> nn.Module:
    """DistributedDataParallel when running distributed, else the model unchanged; compile=True (config
    key `compile`) then wraps it in torch.compile.

    Only the training forward goes through the compiled wrapper: checkpoints, evaluation and GRIT's naive
    pass use the plain module, so state-dict keys never gain torch.compile's '_orig_mod.' prefix. The
    DDP-wrapped module is compiled (not the other way round) so that DDP's optimizer splits the graph
    at its gradient buckets and keeps overlapping communication with the backward pass.
    """
    if info.distributed:
        ids = [info.device.index] if info.device.type == 'cuda' else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                    broadcast_buffers=broadcast_buffers,
                                                    find_unused_parameters=find_unused_parameters)
    return torch.compile(model) if compile else model
