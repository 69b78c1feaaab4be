"""The command line and the start every task script shares.

build_parser / parse_args: the flags of all scripts (--config, --output_dir, --checkpoint, --resume,
--evaluate, --device, --seed, --set, the launcher's --local_rank); start(): parse, config, required
keys, distributed init, deterministic kernels, seed; run_main(): config errors end in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ruamel.yaml.comments import CommentedMap

from training.config import ConfigError, config_from_args, require_keys
from training.distributed import DistInfo, init_distributed
from training.reproducibility import seed_everything, use_deterministic_kernels


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


def run_main(main: Any, argv: Sequence[str] | None = None) -> None:
    """Run a script's main(argv); a config or file error ends with its one-line message, not a traceback."""
    try:
        main(argv)
    except (ConfigError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)


def start(argv: Sequence[str] | None, parser: argparse.ArgumentParser | None = None, description: str = '',
          required: Iterable[str] | Callable[[Mapping], Iterable[str]] = ()
          ) -> tuple[argparse.Namespace, CommentedMap, DistInfo, int]:
    """The start of every script: parse argv, load the config (with overrides), check `required` keys
    (or required(config)), start the process group, set deterministic kernels, seed this rank.

    Returns (args, config, info, seed); seed is config key `seed` (default 42), this rank uses seed + rank.
    """
    args = parse_args(argv, description, parser=parser)
    config = config_from_args(args)
    require_keys(config, required(config) if callable(required) else required, args.config)
    info = init_distributed(args)
    use_deterministic_kernels(config)
    seed = int(config.get('seed', 42))
    seed_everything(seed, info.rank)
    return args, config, info, seed
