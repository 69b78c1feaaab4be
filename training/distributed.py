"""Distributed: process-group start (torchrun / launch) and device choice, rank queries, the
reductions of logged metrics, and the DDP wrapper. Every function works unchanged in a single process.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
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


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07', 'a1,a2' -> 'a1'."""
    match = re.match(r'([^,\[]+)(?:\[([^\]]+)\])?', nodelist.strip())
    if match is None:
        raise ConfigError(f'cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR')
    prefix, ranges = match.groups()
    return prefix + (ranges.split(',')[0].split('-')[0] if ranges else '')


def slurm_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT for a process that srun started (one task
    per GPU), from SLURM_PROCID, SLURM_NTASKS (SLURM_STEP_NUM_TASKS when srun set it), SLURM_LOCALID and
    the job's first node; None when torchrun or launch set WORLD_SIZE, or srun started one task. MASTER_ADDR
    and MASTER_PORT that the user set are kept; the default port is derived from the job id, so that two
    jobs sharing a node do not collide."""
    if 'WORLD_SIZE' in environ or 'SLURM_PROCID' not in environ:
        return None
    world = int(environ.get('SLURM_STEP_NUM_TASKS') or environ.get('SLURM_NTASKS') or 1)
    if world <= 1:
        return None
    nodes = (environ.get('SLURM_STEP_NODELIST') or environ.get('SLURM_JOB_NODELIST')
             or environ.get('SLURM_NODELIST'))
    master = environ.get('MASTER_ADDR') or (first_host(nodes) if nodes else '127.0.0.1')
    port = environ.get('MASTER_PORT') or str(20000 + int(environ.get('SLURM_JOB_ID') or 0) % 20000)
    return {'RANK': environ['SLURM_PROCID'], 'WORLD_SIZE': str(world),
            'LOCAL_RANK': environ.get('SLURM_LOCALID', '0'), 'MASTER_ADDR': master, 'MASTER_PORT': port}


class _RendezvousWatch:
    """Says, every `every` seconds until the process group has formed, that this rank is still waiting and
    what usually causes it, so that a hang at start-up (or at an elastic restart) cannot go unnoticed."""

    def __init__(self, rank: int, world_size: int, every: float = 60.0) -> None:
        self.rank, self.world_size, self.every = rank, world_size, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        waited = 0.0
        while not self.done.wait(self.every):
            waited += self.every
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            print(f'[rank {self.rank}] still waiting for the process group after {waited:.0f} s '
                  f'({self.world_size} ranks at {where}). Every rank must start and reach this address: '
                  'check that no rank failed before it (its log); that MASTER_ADDR, or across nodes '
                  "torchrun's --rdzv-backend c10d --rdzv-endpoint HOST:PORT, names a host every node "
                  'reaches; under SLURM, that srun started the script (not the batch script itself)',
                  file=sys.stderr, flush=True)

    def __enter__(self) -> _RendezvousWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()


def init_distributed(device_name: str | None = None, local_rank: int | None = None,
                     timeout_minutes: float = 30.0) -> DistInfo:
    """Start the process group when launched with WORLD_SIZE > 1 (torchrun / launch) or by srun with
    several tasks, else single process.

    device_name: --device (None: cuda if available, else cpu); local_rank: --local_rank (old launch),
    else LOCAL_RANK from the environment; timeout_minutes: of the rendezvous and of every collective."""
    slurm = slurm_environment(os.environ)
    if slurm is not None:
        os.environ.update(slurm)
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
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        with _RendezvousWatch(rank, world_size):
            # env:// as torch does it, but with the keys of each torchelastic attempt under their own
            # prefix: torchrun's agents keep one store across restarts, and a restarted group that reads
            # the killed attempt's addresses never forms (gloo: connection refused; measured in
            # tests/test_launch.py).
            store, rank, world_size = next(dist.rendezvous('env://', rank, world_size, timeout=timeout))
            attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
            store = dist.PrefixStore(f'grit_vlp/attempt_{attempt}', store)
            if device.type == 'cuda':
                torch.cuda.set_device(device)
                dist.init_process_group('nccl', store=store, world_size=world_size, rank=rank,
                                        device_id=device, timeout=timeout)
            else:
                dist.init_process_group('gloo', store=store, world_size=world_size, rank=rank,
                                        timeout=timeout)
    except RuntimeError as e:  # the store's timeout (DistStoreError is one) or a peer that never connected
        raise ConfigError(f'the process group of {world_size} ranks did not form within dist_timeout_minutes='
                          f'{timeout_minutes:g} ({type(e).__name__}: {str(e).splitlines()[0]}); see the '
                          '"still waiting" lines above') from None
    if slurm is not None and rank == 0:
        print(f'srun: {world_size} tasks, process group at {slurm["MASTER_ADDR"]}:{slurm["MASTER_PORT"]}',
              flush=True)
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


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (minimum) a tensor in place on its device, e.g. flags every rank must agree on; identity
    without a process group."""
    if is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


def broadcast_from_main(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's values of `t` into `t` on every rank (in place, on its device); identity in one process."""
    if is_dist():
        dist.broadcast(t, src=0)
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
             broadcast_buffers: bool = True, compile: str | None = None) -> nn.Module:
    """DistributedDataParallel when running distributed, else the model unchanged; compile, a
    torch.compile mode ('default', 'reduce-overhead' = CUDA graphs, ...; config key `compile`, None: off),
    then wraps it in torch.compile.

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
    return torch.compile(model, mode=compile) if compile else model
