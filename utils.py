"""Shared plumbing for the task scripts (Pretrain.py, Retrieval.py, NLVR.py, VQA.py).

Sections: command line, config, distributed, reproducibility, optimiser and schedule,
checkpoints, logging, data loading. Nothing here knows about models/, dataset/ or grit/.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import io
import json
import math
import os
import random
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.scalarbool import ScalarBoolean
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """ArgumentParser that fills --local_rank from the LOCAL_RANK environment variable."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, 'local_rank', 0) is None:
            # torchrun and `launch --use_env` pass the local rank only through the environment.
            ns.local_rank = int(os.environ.get('LOCAL_RANK', '0'))
        return ns, rest


def build_parser(description: str = '', default_config: str | None = None,
                 default_output_dir: str | None = None) -> argparse.ArgumentParser:
    """Parser with the flags shared by all task scripts; scripts may add their own before parsing."""
    p = _Parser(description=description)
    p.add_argument('--config', default=default_config, required=default_config is None,
                   help='YAML config file')
    p.add_argument('--output_dir', default=default_output_dir,
                   help='directory for config.yaml, log.txt and checkpoints')
    p.add_argument('--checkpoint', default=None, help='weights to start from (.pth)')
    p.add_argument('--resume', nargs='?', const='latest', default=None, metavar='PATH',
                   help="resume training state from PATH; without PATH: the latest checkpoint in "
                        "--output_dir (starts fresh if there is none)")
    p.add_argument('--evaluate', action='store_true', help='evaluate only, no training')
    p.add_argument('--text_encoder', default=None,
                   help='overrides config key text_encoder (HF hub id or local dir)')
    p.add_argument('--device', default=None,
                   help='cpu | cuda | cuda:N (default: cuda if available, else cpu)')
    p.add_argument('--seed', type=int, default=None, help='overrides config key seed')
    p.add_argument('--set', dest='set', nargs='*', action='extend', default=[], metavar='KEY=VALUE',
                   help='config overrides; dotted keys reach nested entries, values are YAML '
                        '(e.g. --set grit.enabled=false optimizer.lr=1e-4 "train_file=[a.json]")')
    # torch.distributed.launch passes --local_rank (old) or --local-rank (torch >= 2.0).
    p.add_argument('--local_rank', '--local-rank', dest='local_rank', type=int, default=None,
                   help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None, description: str = '',
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse argv (default sys.argv[1:]) with `parser` or a fresh build_parser(description)."""
    parser = parser if parser is not None else build_parser(description)
    args = parser.parse_args(argv)
    if getattr(args, 'local_rank', 0) is None:  # a plain ArgumentParser built by a script
        args.local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    return args


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config file or override is malformed or lacks a key."""


def _yaml() -> YAML:
    """Round-trip YAML (1.2: `1e-4` is a float) that keeps comments and writes `null` explicitly."""
    y = YAML(typ='rt')
    y.preserve_quotes = True
    y.width = 4096  # long lists of json paths stay on one line as written
    y.representer.add_representer(
        type(None), lambda r, _: r.represent_scalar('tag:yaml.org,2002:null', 'null'))
    return y


def _flat_keys(node: Any, prefix: str = '') -> list[str]:
    """All dotted key paths of a nested mapping (mappings only, not list items)."""
    keys: list[str] = []
    if isinstance(node, Mapping):
        for k, v in node.items():
            path = f'{prefix}{k}'
            keys.append(path)
            keys.extend(_flat_keys(v, path + '.'))
    return keys


def _unknown_key(key: str, config: Any, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, _flat_keys(config), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ''
    return ConfigError(f"unknown config key '{key}'{hint} in {source}")


def _walk(config: Any, key: str, source: str) -> tuple[Any, str | int]:
    """Return (container, last_key) for dotted `key`; every part must already exist."""
    parts = key.split('.')
    node = config
    for i, part in enumerate(parts):
        is_last = i == len(parts) - 1
        if isinstance(node, Mapping) and part in node:
            sel: str | int = part
        elif isinstance(node, list) and part.lstrip('-').isdigit() and -len(node) <= int(part) < len(node):
            sel = int(part)
        else:
            raise _unknown_key(key, config, source)
        if is_last:
            return node, sel
        node = node[sel]
    raise _unknown_key(key, config, source)  # empty key


def parse_yaml_value(text: str) -> Any:
    """Parse an override value as YAML 1.2: 'false', '1e-4' (float), '[a, b]' (list), 'null' (None)."""
    try:
        return _yaml().load(text)
    except YAMLError as e:
        raise ConfigError(f'cannot parse override value {text!r} as YAML: {e}') from e


def load_config(path: str | os.PathLike, overrides: Sequence[str] | None = None) -> CommentedMap:
    """Load a YAML config (round-trip: comments kept, acts as a dict), then apply `a.b=value` overrides."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'config file not found: {path}')
    try:
        with open(path, encoding='utf-8') as f:
            config = _yaml().load(f)
    except YAMLError as e:
        raise ConfigError(f'cannot parse config file {path}: {e}') from e
    if config is None:
        config = CommentedMap()
    if not isinstance(config, Mapping):
        raise ConfigError(f'config file {path} must hold a mapping at top level, not {type(config).__name__}')
    apply_overrides(config, overrides or [], source=path)
    return config


def apply_overrides(config: MutableMapping, overrides: Sequence[str], source: str = 'config') -> None:
    """Set each `a.b.c=value` (value parsed as YAML) in place; the key must already exist."""
    for item in overrides:
        key, sep, text = item.partition('=')
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. grit.enabled=false)")
        container, last = _walk(config, key, source)
        container[last] = parse_yaml_value(text)


def apply_cli_overrides(config: MutableMapping, args: argparse.Namespace) -> None:
    """Copy --text_encoder and --seed into config keys text_encoder / seed when given on the command line."""
    for name in ('text_encoder', 'seed'):
        value = getattr(args, name, None)
        if value is not None:
            config[name] = value


def config_from_args(args: argparse.Namespace) -> CommentedMap:
    """load_config(args.config, args.set) followed by apply_cli_overrides (CLI flags win over --set)."""
    config = load_config(args.config, getattr(args, 'set', None) or [])
    apply_cli_overrides(config, args)
    return config


def save_config(config: Mapping, path: str | os.PathLike) -> None:
    """Write `config` as YAML; a round-trip CommentedMap keeps its comments."""
    buf = io.StringIO()
    _yaml().dump(config, buf)
    _atomic_write_text(str(path), buf.getvalue())


def get_key(config: Mapping, key: str, default: Any = None) -> Any:
    """config['a']['b'] for key 'a.b', or `default` when any part is missing."""
    node: Any = config
    for part in key.split('.'):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def require_keys(config: Mapping, keys: Iterable[str], source: str = 'config') -> None:
    """Raise ConfigError naming the first missing (dotted) key and the config file `source`."""
    missing = object()
    for key in keys:
        if get_key(config, key, missing) is missing:
            raise ConfigError(f"config key '{key}' is required but missing in {source}")


def to_plain(obj: Any) -> Any:
    """Recursively turn ruamel/numpy/argparse containers and scalars into plain Python (weights_only-safe)."""
    if isinstance(obj, argparse.Namespace):
        return to_plain(vars(obj))
    if isinstance(obj, CommentedMap) or type(obj) is dict:  # OrderedDict state dicts keep their type
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (CommentedSeq, list)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    if isinstance(obj, (bool, ScalarBoolean, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj  # tensors, OrderedDict state dicts, None, ...


def get_max_epoch(config: Mapping) -> int:
    """Training length: top-level `max_epoch`, else schedular.epochs (ALBEF, where horizon = length)."""
    if 'max_epoch' in config:
        return int(config['max_epoch'])
    sched = _schedule_block(config)
    if 'epochs' not in sched:
        raise ConfigError("config needs 'max_epoch' (or schedular.epochs)")
    return int(sched['epochs'])


# ----------------------------------------------------------------------------------------------
# Distributed
# ----------------------------------------------------------------------------------------------


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
    except RuntimeError as e:
        raise ValueError(f'--device {name!r} is not a valid device (use cpu, cuda or cuda:N)') from e
    if device.type == 'cuda':
        if not torch.cuda.is_available():
            raise ValueError(f'--device {name} requested but CUDA is not available (use --device cpu)')
        if distributed or device.index is None:
            # one process per GPU: the launcher's local rank picks the GPU
            device = torch.device('cuda', local_rank if distributed else torch.cuda.current_device())
    elif device.type != 'cpu':
        raise ValueError(f'--device {name!r} is not supported (use cpu, cuda or cuda:N)')
    return device


def init_distributed(args: argparse.Namespace) -> DistInfo:
    """Start the process group when launched with WORLD_SIZE > 1 (torchrun / launch), else single process."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    local_rank = os.environ.get('LOCAL_RANK')
    local_rank = int(local_rank) if local_rank is not None else int(getattr(args, 'local_rank', None) or 0)
    distributed = world_size > 1
    device = _resolve_device(getattr(args, 'device', None), local_rank, distributed)
    if not distributed:
        return DistInfo(rank=0, world_size=1, local_rank=local_rank, device=device, distributed=False)
    if 'RANK' not in os.environ:
        raise ValueError('WORLD_SIZE > 1 but RANK is not set: launch with torchrun or '
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


def _reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) a float tensor on the backend's device; identity without a process group."""
    if not is_dist():
        return t
    if dist.get_backend() == 'nccl':
        t = t.to(torch.device('cuda', torch.cuda.current_device()))
    else:
        t = t.cpu()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def _stack_values(values: Sequence[Any]) -> torch.Tensor:
    """(K,) float64 tensor from 0-dim tensors / numbers, on the first tensor's device (no host sync)."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device('cpu'))
    return torch.stack([v.detach().to(device, torch.float64).reshape(()) if isinstance(v, torch.Tensor)
                        else torch.tensor(float(v), dtype=torch.float64, device=device) for v in values])


def all_reduce_mean(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Mean over ranks of each 0-dim tensor / number -> python floats, with a single host sync."""
    if not values:
        return {}
    keys = sorted(values)  # same order on every rank
    total = _reduce_sum(_stack_values([values[k] for k in keys])) / get_world_size()
    return dict(zip(keys, total.tolist()))


# ----------------------------------------------------------------------------------------------
# Reproducibility
# ----------------------------------------------------------------------------------------------


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all devices) with seed + rank, as ALBEF; returns the seed used."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


def use_deterministic_kernels(config: Mapping) -> None:
    """Config key `deterministic` (default false): torch's deterministic kernels, so a run repeats bitwise.

    Without them, the backward of indexing with repeated indices (CPU index_put with accumulate, as in
    NLVR text assignment's `tokens[first]`) sums in a thread-dependent order: two identical tiny text-
    assignment runs differed by up to 1.5e-4 in a weight. Off by default, as ALBEF: on GPUs the
    deterministic kernels are slower; ops that have none only warn (warn_only).
    """
    # Set both ways: the flag is process-wide, and one process may run several configs (tests).
    torch.use_deterministic_algorithms(bool(config.get('deterministic', False)), warn_only=True)


def build_on_every_rank(build: Any, seed: int, rank: int) -> Any:
    """build() under the same seed on every rank (so un-loaded weights agree), then reseed for this rank."""
    seed_everything(seed, 0)
    try:
        return build()
    finally:
        seed_everything(seed, rank)


def reseed(seed: int, rank: int, step: int) -> None:
    """Reseed python, numpy and torch from (seed, rank, step): called at every checkpoint and on resume,
    so a resumed run draws the same random numbers (MLM masks, augmentation, dropout) as an unbroken one."""
    value = (int(seed) * 1_000_003 + int(rank) * 7_919 + int(step)) % (2**31 - 1)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def worker_init_fn(worker_id: int) -> None:
    """Seed python and numpy in a DataLoader worker from its torch seed (base seed + worker id)."""
    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)


def make_generator(seed: int) -> torch.Generator:
    """CPU torch.Generator for a DataLoader, so worker base seeds follow `seed`."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


# ----------------------------------------------------------------------------------------------
# Optimiser and schedule
# ----------------------------------------------------------------------------------------------

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


def _num(cfg: Mapping, key: str, source: str, default: Any = ...) -> float:
    """cfg[key] as float; strings such as '1e-4' (YAML 1.1 habit) are accepted."""
    if key not in cfg:
        if default is ...:
            raise ConfigError(f"config key '{source}.{key}' is required")
        return default
    value = cfg[key]
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key '{source}.{key}' must be a number, got {value!r}") from e


def build_optimizer(model: nn.Module, config: Mapping) -> torch.optim.AdamW:
    """AdamW over trainable params: weight decay except norms, biases, embeddings, cls/pos tokens and temp.

    config (the `optimizer` block): {opt: adamW, lr, weight_decay, betas: [0.9, 0.999], eps: 1e-8}.
    """
    opt = str(config.get('opt', 'adamW')).lower()
    if opt != 'adamw':
        raise ConfigError(f"optimizer.opt {config.get('opt')!r} is not supported (use adamW)")
    lr = _num(config, 'lr', 'optimizer')
    wd = _num(config, 'weight_decay', 'optimizer', 0.0)
    betas = tuple(float(b) for b in config.get('betas', (0.9, 0.999)))
    if len(betas) != 2:
        raise ConfigError(f"optimizer.betas must have two values, got {list(betas)}")
    eps = _num(config, 'eps', 'optimizer', 1e-8)
    decay, no_decay = split_decay_params(model)
    groups = [{'params': list(ps.values()), 'weight_decay': w, 'name': n}
              for n, ps, w in (('decay', decay, wd), ('no_decay', no_decay, 0.0)) if ps]
    if not groups:
        raise ValueError('build_optimizer: the model has no trainable parameters')
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=wd)


def _schedule_block(config: Mapping) -> Mapping:
    """The schedule block: config itself if it has 'sched', else config['schedular'|'scheduler']."""
    if 'sched' in config:
        return config
    for key in ('schedular', 'scheduler'):
        if key in config:
            return config[key]
    raise ConfigError("config has no 'schedular' (or 'scheduler') block")


def schedule_lr(step: int, steps_per_epoch: int, lr: float, epochs: int, min_lr: float = 0.0,
                warmup_lr: float | None = None, warmup_steps: int = 0) -> float:
    """Learning rate for optimiser step `step` (0-based): linear warm-up, then per-epoch cosine."""
    if step < warmup_steps:
        start = min_lr if warmup_lr is None else warmup_lr
        return start + (lr - start) * step / warmup_steps
    epoch = min(step // steps_per_epoch, epochs)  # past the horizon the rate stays at min_lr
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * epoch / epochs))


def build_scheduler(optimizer: torch.optim.Optimizer, config: Mapping,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR stepped once per optimiser step, implementing the authors' warm-up + per-epoch cosine.

    config: the `schedular` block (ALBEF's spelling; `scheduler` or the whole config also work):
      sched: cosine, lr, epochs, min_lr (0), warmup_lr (min_lr), warmup_steps (0).
    `epochs` is the cosine horizon: lr(e) = min_lr + (lr - min_lr)(1 + cos(pi e / epochs)) / 2 for epoch e,
    constant within an epoch. The paper's pre-training uses a 30-epoch horizon but stops at top-level
    `max_epoch` = 20 (see get_max_epoch). The first `warmup_steps` optimiser steps ramp linearly from
    warmup_lr to lr (ALBEF: warmup_epochs 20 x step_size 100 = 2000 steps); if they outlast epoch 0 the
    ramp continues. After the ramp epoch 0 runs at `lr`. ALBEF keys decay_rate / cooldown_epochs are
    ignored; warmup_epochs is ignored with a warning (its unit differs between ALBEF scripts).
    """
    cfg = _schedule_block(config)
    sched = str(cfg.get('sched', 'cosine')).lower()
    if sched != 'cosine':
        raise ConfigError(f"schedular.sched {cfg.get('sched')!r} is not supported (use cosine)")
    if steps_per_epoch <= 0:
        raise ValueError(f'build_scheduler: steps_per_epoch must be positive, got {steps_per_epoch}')
    base_lr = optimizer.param_groups[0].get('initial_lr', optimizer.param_groups[0]['lr'])
    lr = _num(cfg, 'lr', 'schedular', base_lr)
    if not math.isclose(lr, base_lr, rel_tol=1e-9):
        raise ConfigError(f'schedular.lr ({lr}) differs from the optimizer lr ({base_lr}); set them equal')
    if lr <= 0:
        raise ConfigError(f'schedular.lr must be positive, got {lr}')
    epochs = int(_num(cfg, 'epochs', 'schedular'))
    if epochs <= 0:
        raise ConfigError(f'schedular.epochs must be positive, got {epochs}')
    min_lr = _num(cfg, 'min_lr', 'schedular', 0.0)
    warmup_lr = _num(cfg, 'warmup_lr', 'schedular', min_lr)
    warmup_steps = int(_num(cfg, 'warmup_steps', 'schedular', 0))
    if 'warmup_epochs' in cfg and 'warmup_steps' not in cfg:
        warnings.warn('schedular.warmup_epochs is ignored; set schedular.warmup_steps (optimiser steps, '
                      'ALBEF pre-training: 2000)', stacklevel=2)

    # A closure (not a callable object) keeps the settings out of state_dict, so a resumed run
    # uses its own config and steps_per_epoch and only restores the step counter.
    def factor(step: int) -> float:
        return schedule_lr(step, steps_per_epoch, lr, epochs, min_lr, warmup_lr, warmup_steps) / lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

_CKPT_RE = re.compile(r'^checkpoint_(?:\d+|step_\d+)\.pth$')
_LATEST = 'latest.json'


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
    os.replace(tmp, path)


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
        _atomic_write_text(os.path.join(os.path.dirname(path) or '.', _LATEST), json.dumps(record) + '\n')
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


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------


def _fmt(name: str, value: float) -> str:
    return f'{value:.3e}' if name.startswith('lr') else f'{value:.4f}'


class TrainLogger:
    """Accumulates per-step metrics on device without host syncs; prints every `print_freq` steps.

    Usage: `for batch in log.log_every(loader): ...; log.update(loss_itc=loss, lr=lr)`, then
    `log.epoch_summary()` (collective: every rank calls it, with the same metric names).
    """

    def __init__(self, header: str = '', print_freq: int = 50, enabled: bool | None = None,
                 use_tqdm: bool | None = None) -> None:
        self.header = header
        self.print_freq = max(1, int(print_freq))
        self.enabled = is_main_process() if enabled is None else enabled
        self.use_tqdm = (sys.stderr.isatty() if use_tqdm is None else use_tqdm) and self.enabled
        self._sum: dict[str, Any] = {}   # running sums: 0-dim tensors (device) or floats
        self._count: dict[str, int] = {}
        self._last: dict[str, Any] = {}
        self.step = 0
        self.start_time = time.time()

    def update(self, **metrics: torch.Tensor | float) -> None:
        """Add one value per metric (0-dim tensor kept on device, or a number); no host sync."""
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().float().reshape(())
            else:
                v = float(v)
            self._sum[k] = self._sum[k] + v if k in self._sum else v
            self._count[k] = self._count.get(k, 0) + 1
            self._last[k] = v

    def local_means(self) -> dict[str, float]:
        """This rank's means so far (one host sync)."""
        keys = sorted(self._sum)
        if not keys:
            return {}
        sums = _stack_values([self._sum[k] for k in keys]).tolist()
        return {k: s / self._count[k] for k, s in zip(keys, sums)}

    def _line(self) -> str:
        keys = sorted(self._last)
        if not keys:
            return ''
        vals = _stack_values([self._last[k] for k in keys] + [self._sum[k] for k in keys]).tolist()
        n = len(keys)
        return '  '.join(f'{k}: {_fmt(k, vals[i])} ({_fmt(k, vals[n + i] / self._count[k])})'
                         for i, k in enumerate(keys))

    def log_every(self, iterable: Iterable, total: int | None = None, start: int = 0) -> Iterator:
        """Yield from `iterable`, counting steps and printing (rank 0) a progress line every print_freq."""
        if total is None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        end = None if total is None else start + total
        self.step = start
        bar = None
        if self.use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=end, initial=start, desc=self.header, dynamic_ncols=True, file=sys.stderr)
        width = len(str(end)) if end is not None else 0
        t_window, data_time, iter_time, n_window = time.time(), 0.0, 0.0, 0
        t_end = time.time()
        try:
            for obj in iterable:
                data_time += time.time() - t_end
                yield obj
                self.step += 1
                n_window += 1
                now = time.time()
                iter_time = now - t_window
                t_end = now
                if bar is not None:
                    bar.update(1)
                if self.enabled and (self.step % self.print_freq == 0 or self.step == end):
                    line = self._line()
                    if bar is not None:
                        bar.set_postfix_str(line, refresh=True)
                    else:
                        eta = ''
                        if end is not None:
                            left = (end - self.step) * iter_time / max(n_window, 1)
                            eta = f'eta: {datetime.timedelta(seconds=int(left))}  '
                        of = f'/{end}' if end is not None else ''
                        print(f'{self.header} [{self.step:>{width}}{of}]  {eta}{line}  '
                              f'time: {iter_time / n_window:.3f}s/it  data: {data_time / n_window:.3f}s/it',
                              flush=True)
                    t_window, data_time, n_window = time.time(), 0.0, 0
                    t_end = t_window
        finally:
            if bar is not None:
                bar.close()

    def epoch_summary(self) -> dict[str, float]:
        """Mean of each metric over all steps of all ranks (collective; one host sync)."""
        keys = sorted(self._sum)
        if not keys:
            return {}
        packed = _stack_values([self._sum[k] for k in keys] + [float(self._count[k]) for k in keys])
        packed = _reduce_sum(packed).tolist()
        n = len(keys)
        return {k: packed[i] / packed[n + i] for i, k in enumerate(keys)}

    @property
    def elapsed(self) -> float:
        """Seconds since the logger was created."""
        return time.time() - self.start_time


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def append_log(output_dir: str | os.PathLike, record: Mapping) -> None:
    """Append `record` as one JSON line to output_dir/log.txt (main process only)."""
    if not is_main_process():
        return
    os.makedirs(str(output_dir), exist_ok=True)
    line = json.dumps(to_plain(dict(record)), default=_json_default)
    with open(os.path.join(str(output_dir), 'log.txt'), 'a', encoding='utf-8') as f:
        f.write(line + '\n')


def setup_output_dir(args: argparse.Namespace, config: Mapping) -> str:
    """Create args.output_dir and write config.yaml there (main process); returns the directory."""
    output_dir = getattr(args, 'output_dir', None)
    if not output_dir:
        raise ValueError('--output_dir is required')
    if is_main_process():
        os.makedirs(output_dir, exist_ok=True)
        save_config(config, os.path.join(output_dir, 'config.yaml'))
    return str(output_dir)


# ----------------------------------------------------------------------------------------------
# Data loading
# ----------------------------------------------------------------------------------------------


class ResumableSampler(DistributedSampler):
    """DistributedSampler for fine-tuning that can start an epoch after `start_batch` batches (resume)."""

    def __init__(self, *args: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.start_batch = 0
        self.loader_generator = torch.Generator()  # for the DataLoader, see set_epoch

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        # The loader draws its workers' base seed from this generator, reseeded per (epoch, rank), not
        # from the global RNG: a run resumed mid-epoch then sees the same random numbers.
        self.loader_generator.manual_seed(self.seed * 1_000_003 + epoch * 10_007 + self.rank)

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start_batch * self.batch_size:])

    def __len__(self) -> int:
        return super().__len__() - self.start_batch * self.batch_size


def finetune_loader(dataset: Dataset, info: DistInfo, *, seed: int, batch_size: int, num_workers: int,
                    collate_fn: Any = None) -> tuple[ResumableSampler, DataLoader]:
    """Seeded, resumable per-rank sampler and its loader for fine-tuning (no GRIT there, as in the paper)."""
    sampler = ResumableSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=seed,
                               drop_last=True, batch_size=batch_size)
    loader = create_loader(dataset, sampler, batch_size, num_workers, collate_fn=collate_fn, drop_last=True,
                           generator=sampler.loader_generator)
    return sampler, loader


def create_loader(dataset: Dataset, sampler: Sampler | None, batch_size: int, num_workers: int,
                  collate_fn: Any = None, drop_last: bool = True, shuffle: bool = False,
                  generator: torch.Generator | None = None) -> DataLoader:
    """DataLoader with pinned memory on CUDA, persistent seeded workers; `shuffle` only without a sampler."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        shuffle=shuffle if sampler is None else False,
        num_workers=num_workers,
        collate_fn=collate_fn,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
        generator=generator,
    )


# ----------------------------------------------------------------------------------------------
# Training loop (shared by the four task scripts)
# ----------------------------------------------------------------------------------------------


def run_main(main: Any, argv: Sequence[str] | None = None) -> None:
    """Run a script's main(argv); a config or file error ends with its one-line message, not a traceback."""
    try:
        main(argv)
    except (ConfigError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)


def autocast_dtype(config: Mapping, device: torch.device) -> torch.dtype | None:
    """Mixed-precision dtype for `amp: true` on CUDA (bf16 where supported, else fp16); None = fp32."""
    if not config.get('amp', False) or device.type != 'cuda':
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def build_scaler(config: Mapping, device: torch.device) -> torch.amp.GradScaler:
    """GradScaler, enabled only for fp16 autocast (bf16 and fp32 need no loss scaling)."""
    return torch.amp.GradScaler(device.type, enabled=autocast_dtype(config, device) == torch.float16)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DistributedDataParallel, or the model itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def wrap_ddp(model: nn.Module, info: DistInfo, find_unused_parameters: bool = False,
             broadcast_buffers: bool = True) -> nn.Module:
    """DistributedDataParallel when running distributed, else the model unchanged."""
    if not info.distributed:
        return model
    ids = [info.device.index] if info.device.type == 'cuda' else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=broadcast_buffers,
                                               find_unused_parameters=find_unused_parameters)


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
    model_ddp = wrap_ddp(model, info, broadcast_buffers=broadcast_buffers)
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
