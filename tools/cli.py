"""The command line every tool shares: the task scripts' Parser under the name the tool is typed as, the
flags the checkpoint tools share, the typed config, and the one tail of every tool's main.

A tool is a module tools/X.py whose main(argv) builds its parser with tool_parser('tools.X', ...), reads
the typed config with tool_config (resolve_config with the tool's --config and --set), raises a user's
mistake (training.config_files.ConfigError, grit_io.InputFileError, FileNotFoundError), ends with
emit_record (print the JSON record; with --output_dir, also write it there) and is started by
`if __name__ == "__main__": run_main(main)` (training.cli.run_main: one `error:` line, exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from grit_io import TRUST_FLAG, InputFileError
from training.cli import Parser
from training.config import TaskConfig
from training.config_resolve import resolve_config

__all__ = ["add_checkpoint_args", "add_config_args", "add_output_dir", "add_record_name", "checkpoint_parser",
           "emit_record", "record_claim", "resolve_device", "tool_config", "tool_parser"]


def tool_parser(module: str, description: str) -> Parser:
    """The parser of tool `module` ('tools.probe'): its usage names the command as typed,
    `python -m tools.probe`; every `--a_b` flag also answers to `--a-b`; a mistake is one `error:` line."""
    return Parser(prog=f"python -m {module}", description=description)


def add_config_args(parser: Parser, config_help: str, *, required: bool = True) -> None:
    """--config (a task script's YAML) and --set (its overrides), read by tool_config."""
    parser.add_argument("--config", required=required, default=None, help=config_help)
    parser.add_argument("--set", dest="set", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides, as the task scripts take them; dotted keys reach into "
                             "blocks, values are YAML (e.g. --set image_root=data/x "
                             "batching.search_space=128)")


def add_checkpoint_args(parser: Parser, checkpoint_help: str) -> None:
    """--checkpoint, --device and --trust_checkpoint (pass args.trust_checkpoint to
    files.set_trust_checkpoint)."""
    parser.add_argument("--checkpoint", required=True, help=checkpoint_help)
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument(TRUST_FLAG, dest="trust_checkpoint", action="store_true",
                        help="also load weight files that a weights-only load refuses (they hold pickled "
                             "objects; unpickling can execute arbitrary code: trusted sources only)")


def add_output_dir(parser: Parser, writes: str, *, required: bool = False, default: str | None = None,
                   without: str = "nothing is written") -> None:
    """--output_dir (also --output-dir): the folder the tool writes `writes` into, created when missing;
    `without`: what happens when it is not given (and has no default)."""
    parser.add_argument("--output_dir", required=required, default=default,
                        help=f"folder to write {writes} into (created when missing)"
                             + ("" if required or default else f"; without it {without}"))


def _record_name(value: str) -> str:
    """--record's value: a file name without a folder (the record stays in --output_dir)."""
    if not value or value in (".", "..") or "/" in value or os.sep in value:
        raise argparse.ArgumentTypeError(f"{value!r}: a file name without a folder (the record is written "
                                         "into --output_dir)")
    return value


def add_record_name(parser: Parser, default: str | None, shown: str | None = None) -> None:
    """--record: the name of the record the tool writes into --output_dir (<name>.json, <name>.md, ...),
    so that two invocations sharing one folder of runs keep each its own record (record_claim); `shown`:
    how the help names a default the tool derives itself (default None)."""
    name = shown or default
    parser.add_argument("--record", type=_record_name, default=default, metavar="NAME",
                        help=f"the record's file name in the output folder (default: {name}, that is "
                             f"{name}.json and {name}.md); two invocations sharing one folder of runs "
                             "(seeds run in parallel) need one each")


@contextlib.contextmanager
def record_claim(output_dir: str, name: str, module: str) -> Iterator[None]:
    """Hold output_dir/<name>.json for this process while the tool runs: a second invocation of a tool
    writing the same record there (it would overwrite this one's on finishing) is refused at its start,
    naming the one that holds it, instead of one record silently replacing the other hours later."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f".{name}.lock")
    try:
        import fcntl  # POSIX; where it is missing (Windows) the claim is not checked
    except ImportError:
        yield
        return
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: another process claimed the record
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise InputFileError(
                f"{os.path.join(output_dir, name + '.json')}: {holder} is writing this record; give this "
                f"one its own --record (e.g. --record {name}_2, the runs are still shared and reused) or "
                "its own --output_dir") from None
        except OSError:  # a file system without locks (some NFS mounts): unchecked, as without fcntl
            yield
            return
        f.seek(0)
        f.truncate()
        f.write(f"python -m {module} (pid {os.getpid()})\n")
        f.flush()
        try:
            yield
        finally:  # the lock goes with the file's closing; the file stays, empty, for the next claim
            f.seek(0)
            f.truncate()


def checkpoint_parser(module: str, description: str, config_help: str, checkpoint_help: str,
                      writes: str, *, output_required: bool = False) -> Parser:
    """The parser of a tool that loads a pre-training checkpoint: --config, --set, --checkpoint, --device,
    --trust_checkpoint and --output_dir (the folder `writes` goes to)."""
    parser = tool_parser(module, description)
    add_config_args(parser, config_help)
    add_checkpoint_args(parser, checkpoint_help)
    add_output_dir(parser, writes, required=output_required)
    return parser


def tool_config(task: str, args: argparse.Namespace, flags: Mapping[str, object] | None = None,
                check_paths: bool = False) -> TaskConfig:
    """The typed config of `task` from args.config and args.set (and flags such as {'seed': 3});
    check_paths: the data files and folders it names must exist (for a tool that reads the data)."""
    return resolve_config(task, args.config, args.set, flags, check_paths=check_paths)


def resolve_device(name: str | None) -> torch.device:
    """--device, or cuda when available, else cpu."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _strict(value: Any) -> Any:
    """value with every non-finite float (a figure a run lacks, the std of one seed) as None: strict JSON,
    which every reader parses (Python's json would otherwise write the bare NaN most others refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def emit_record(record: Mapping, output_dir: str | None, name: str, table: str | None = None) -> Mapping:
    """The tail of every tool's main: print `record` as one JSON line and, with output_dir, write it
    (indented) to output_dir/<name>.json as well, non-finite numbers as null, and `table` (markdown) to
    output_dir/<name>.md; returns record."""
    strict = _strict(record)
    print(json.dumps(strict, allow_nan=False), flush=True)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        if table is not None:
            with open(os.path.join(output_dir, f"{name}.md"), "w", encoding="utf-8") as f:
                f.write(table)
        with open(os.path.join(output_dir, f"{name}.json"), "w", encoding="utf-8") as f:
            json.dump(strict, f, indent=2, allow_nan=False)
            f.write("\n")
    return record
