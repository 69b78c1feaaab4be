"""The command line and the start every task script shares.

build_parser / parse_args: the flags of all scripts (--config, --output_dir, --checkpoint, --resume,
--evaluate, --device, --seed, --set, the launcher's --local_rank); start(): parse, config, required
keys, validation against the task's schema, distributed init, deterministic kernels, seed; run_main():
config errors end in an `error: ...` message, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ruamel.yaml.comments import CommentedMap

from torch_files import TRUST_FLAG, UntrustedCheckpointError, set_trust_checkpoint
from training.bad_samples import TooManyBadSamples
from training.config import ConfigError, require_keys
from training.distributed import DistInfo, init_distributed
from training.reproducibility import seed_everything, use_deterministic_kernels
from training.step_guard import TooManySkippedSteps
from training.validation import load_task_config, validate_config


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
    p.add_argument(TRUST_FLAG, dest='trust_checkpoint', action='store_true',
                   help='also load weight files that a weights-only load refuses (they hold pickled '
                        'objects; unpickling can execute arbitrary code: trusted sources only)')
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


def run_main(main: Any, argv: Sequence[str] | None = None) -> None:
    """Run a script's main(argv); a config or file error ends with its one-line message, not a traceback."""
    try:
        main(argv)
    except (ConfigError, FileNotFoundError, UntrustedCheckpointError) as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
    except (TooManyBadSamples, TooManySkippedSteps) as e:  # the run saved what it had; say why it stopped
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)


def start(argv: Sequence[str] | None, parser: argparse.ArgumentParser | None = None, description: str = '',
          required: Iterable[str] | Callable[[Mapping], Iterable[str]] = (), *, task: str
          ) -> tuple[argparse.Namespace, CommentedMap, DistInfo, int]:
    """The start of every script: parse argv, load the config (with overrides) and validate it against
    task's schema (training.schema: keys, types, GRIT sizes, data paths), check `required` keys (or
    required(config)), start the process group, set deterministic kernels, seed this rank.

    Returns (args, config, info, seed); seed is config key `seed` (default 42), this rank uses seed + rank.
    """
    args = parse_args(argv, description, parser=parser)
    set_trust_checkpoint(getattr(args, 'trust_checkpoint', False))  # set on every start: no leak between runs
    # Before the process group, the data and the model: a config mistake costs seconds, not a job start.
    config = load_task_config(args, task)
    require_keys(config, required(config) if callable(required) else required, args.config)
    validate_config(config, task, args.config, getattr(args, 'set', None) or [])
    info = init_distributed(args)
    use_deterministic_kernels(config)
    seed = int(config.get('seed', 42))
    seed_everything(seed, info.rank)
    return args, config, info, seed
