"""The command line every script and tool shares: one flag style, one error line, one start.

Parser: argparse with ALBEF's flag style (`--output_dir`); each `--a_b` flag also answers to `--a-b`,
and a usage mistake ends in one `error: ...` line (exit 2) instead of argparse's usage block.
script_parser: the task scripts' flags. start(): parse, resolve the typed config (training.config_resolve),
--print_config, process group, deterministic kernels, seed. run_main(): a user's mistake (config, flag,
data file, checkpoint) ends in one `error:` line and exit 2, a run stopped for bad data or diverging
steps in one line and exit 1; nothing is written to output_dir before start() and the data and model
checks pass (the trainer creates it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from grit_io import TRUST_FLAG, InputFileError, set_trust_checkpoint
from training.bad_samples import TooManyBadSamples
from training.config import TaskConfig
from training.config_files import ConfigError, render_config
from training.config_resolve import resolve_config
from training.distributed import DistInfo, init_distributed
from training.reporting import check_backends
from training.reproducibility import seed_everything, use_deterministic_kernels
from training.step_guard import TooManySkippedSteps

__all__ = ["Parser", "Run", "run_main", "script_parser", "start"]


class Parser(argparse.ArgumentParser):
    """ArgumentParser with `--a-b` aliases of every `--a_b` flag and one-line errors (exit 2).

    optional_with: {required flag's dest: flags that make it optional} (e.g. --output_dir is required
    except with --print_config, which writes nothing).
    """

    optional_with: dict[str, set[str]]

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:  # type: ignore[override]
        """As argparse, plus the hyphenated spelling of every underscored long flag."""
        aliases = [n.replace("_", "-") for n in names if n.startswith("--") and "_" in n]
        return super().add_argument(*names, *(a for a in aliases if a not in names), **kwargs)

    def error(self, message: str) -> NoReturn:
        """One `error:` line naming the flag, then exit 2 (argparse prints its usage block first)."""
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        given = {a.split("=", 1)[0] for a in (sys.argv[1:] if args is None else args)}
        relaxed = [a for a in self._actions
                   if a.required and given & getattr(self, "optional_with", {}).get(a.dest, set())]
        for action in relaxed:  # required in the usage line and in every other case
            action.required = False
        try:
            ns, rest = super().parse_known_args(args, namespace)
        finally:
            for action in relaxed:
                action.required = True
        if getattr(ns, "local_rank", 0) is None:
            # torchrun and `launch --use_env` pass the local rank only through the environment.
            ns.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return ns, rest


def script_parser(script: str, description: str, *, evaluate: str = "", no_evaluate: str = "") -> Parser:
    """The flags of task script `script` (e.g. 'Retrieval.py'); evaluate: what --evaluate does, or
    no_evaluate: why the script refuses it and what to run instead (start() raises it)."""
    p = Parser(prog=f"python {script}", description=description)
    p.no_evaluate = no_evaluate
    p.optional_with = {"output_dir": {"--print_config", "--print-config"}}
    p.add_argument("--config", required=True, help="YAML config file (see --print_config for every key)")
    p.add_argument("--output_dir", required=True,
                   help="the run's folder (config.yaml, log.txt, checkpoints), required but with "
                        "--print_config; created once the config, data and model checks pass")
    p.add_argument("--checkpoint", default=None, help="weights to start from (a .pth checkpoint)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="resume the training state from PATH; without PATH: the newest checkpoint in "
                        "--output_dir (an empty or new --output_dir starts fresh, saying so)")
    p.add_argument("--evaluate", action="store_true",
                   help=evaluate or f"refused: {no_evaluate}")
    p.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true",
                   help="also load weight files that a weights-only load refuses (they hold pickled objects; "
                        "unpickling can execute arbitrary code: trusted sources only)")
    p.add_argument("--text_encoder", default=None, help="sets config key text_encoder (hub id or local dir)")
    p.add_argument("--device", default=None,
                   help="cpu | cuda | cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=None, help="sets config key seed")
    p.add_argument("--report_to", nargs="+", default=None, metavar="BACKEND",
                   help="sets config key report_to: tensorboard and/or wandb (besides log.txt and "
                        "metrics.jsonl)")
    p.add_argument("--set", dest="set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides; dotted keys reach into blocks, values are YAML "
                        "(e.g. --set batching.strategy=random optimizer.lr=1e-4 \"train_file=[a.json]\")")
    p.add_argument("--print_config", action="store_true",
                   help="print the resolved config, every key with its meaning, and exit")
    # torch.distributed.launch passes --local_rank (old) or --local-rank (torch >= 2.0).
    p.add_argument("--local_rank", dest="local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


@dataclass
class Run:
    """A started script: its parsed flags, typed config and place in the job."""

    args: argparse.Namespace
    config: TaskConfig
    info: DistInfo

    @property
    def device(self) -> Any:
        """This rank's torch.device."""
        return self.info.device


def start(argv: Sequence[str] | None, parser: Parser, task: str) -> Run:
    """The start of every script: parse argv, resolve and check `task`'s config (keys, types, values,
    rules, data paths), --print_config (prints and exits), process group, deterministic kernels, seed
    (seed + rank). Errors are ConfigError, caught by run_main."""
    args = parser.parse_args(argv)
    if args.evaluate and getattr(parser, "no_evaluate", ""):
        raise ConfigError(f"{parser.prog.removeprefix('python ')} --evaluate: {parser.no_evaluate}")
    set_trust_checkpoint(args.trust_checkpoint)  # set on every start: no leak between runs in one process
    # Before the process group, the data and the model: a config mistake costs seconds, not a job start.
    flags = {"seed": args.seed, "text_encoder": args.text_encoder, "report_to": args.report_to}
    config = resolve_config(task, args.config, args.set, flags, check_paths=not args.print_config)
    if args.print_config:
        print(render_config(config), end="")
        sys.exit(0)
    check_backends(config.report_to)
    info = init_distributed(args.device, args.local_rank, config.dist_timeout_minutes)
    use_deterministic_kernels(config.deterministic)
    seed_everything(config.seed, info.rank)
    return Run(args, config, info)


# A user's mistake: one line and exit 2. FileNotFoundError is what a missing file raises in library code.
USER_ERRORS = (ConfigError, InputFileError, FileNotFoundError)


def run_main(main: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> None:
    """Run a script's or tool's main(argv); a user's mistake ends in one `error:` line (exit 2), a run
    that saved and stopped (too many bad samples or skipped steps) in one line (exit 1)."""
    try:
        main(argv)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (TooManyBadSamples, TooManySkippedSteps) as e:  # the run saved what it had; say why it stopped
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
