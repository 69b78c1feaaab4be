"""Start-up checks of a task's config against training.schema, before any data is read or model built.

load_task_config: the YAML file and its `--set` overrides, unknown keys (with the nearest known key)
rejected; validate_config: value types, GRIT's sizes (pre-training), missing data files and folders;
check_global_batch: the training set fills one global batch (called where the scripts load it).
Every check raises training.config.ConfigError listing all problems of its kind at once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from ruamel.yaml.comments import CommentedMap

from training import schema
from training.config import (
    ConfigError,
    apply_cli_overrides,
    apply_overrides,
    load_config,
    split_override,
    to_plain,
    unknown_key_message,
)


def _fail(errors: Sequence[str], what: str) -> None:
    """Raise one ConfigError for all `errors` (none: return)."""
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f'{len(errors)} {what}:\n  ' + '\n  '.join(errors))


def _blocks(keys: Collection[str]) -> set[str]:
    """The keys that have dotted keys below them (mappings such as grit, optimizer)."""
    return {k.rsplit('.', 1)[0] for k in keys if '.' in k}


def _items(node: Mapping, blocks: Collection[str], prefix: str = '') -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every entry, descending into the schema's blocks only."""
    for key, value in node.items():
        path = f'{prefix}{key}'
        yield path, value
        if path in blocks and isinstance(value, Mapping):
            yield from _items(value, blocks, path + '.')


def _unknown(key: str, task: str, known: Collection[str], source: str) -> str:
    """The unknown-key message, saying which scripts read the key when another one does."""
    others = schema.tasks_with(key)
    if others:  # a config meant for another script: a spelling hint would mislead
        return f'{unknown_key_message(key, ())} (read by {", ".join(others)}, not by {task}) in {source}'
    return f'{unknown_key_message(key, known)} in {source}'


def _override_is_known(key: str, known: Collection[str], blocks: Collection[str]) -> bool:
    """A schema key, or a part of a known non-block value (a list item: 'train_file.1')."""
    parts = key.split('.')
    prefixes = ('.'.join(parts[:i]) for i in range(1, len(parts)))
    return key in known or any(p in known and p not in blocks for p in prefixes)


def load_task_config(args: argparse.Namespace, task: str) -> CommentedMap:
    """args.config with args.set and --seed/--text_encoder applied; ConfigError lists every key that
    `task` does not know, in the file or in --set. A --set key the schema knows is set even when the
    file lacks it."""
    known = schema.keys(task)
    blocks = _blocks(known)
    config = load_config(args.config)
    errors = [_unknown(key, task, known, args.config)
              for key, _ in _items(config, blocks) if key not in known]
    if 'schedular' in config and 'scheduler' in config:
        errors.append(f"config has both 'schedular' and 'scheduler' in {args.config}; only 'schedular' is "
                      "read: keep one")
    overrides = getattr(args, 'set', None) or []
    errors += [_unknown(key, task, known, '--set') for key in (split_override(item)[0] for item in overrides)
               if not _override_is_known(key, known, blocks)]
    _fail(errors, 'unknown config keys')
    apply_overrides(config, overrides, source='--set', known=known)
    # A mapping given whole ('--set grit={...}') may itself hold unknown keys.
    _fail([_unknown(key, task, known, '--set') for key, _ in _items(config, blocks) if key not in known],
          'unknown config keys')
    apply_cli_overrides(config, args)
    return config


def _show(value: Any) -> str:
    if value is None:
        return 'null'
    return f'{value!r} ({type(value).__name__})'


def _source(key: str, source: str, overrides: Sequence[str]) -> str:
    """'--set' when an override set `key`, a part of it or a block holding it; else the config file."""
    for item in overrides:
        over = split_override(item)[0]
        if over == key or over.startswith(key + '.') or key.startswith(over + '.'):
            return '--set'
    return source


def _unread(config: Mapping, task: str) -> set[str]:
    """Keys whose paths this run does not open (so a stale path there is no error)."""
    unread = set()
    grit = config.get('grit')
    if not (isinstance(grit, Mapping) and grit.get('enabled', True)):
        unread.add('grit.warmstart_indices')  # GritSampler loads it only with GRIT on
    if task == 'nlvr' and config.get('text_assignment'):
        unread.update(('val_file', 'test_file'))  # stage 1 has no evaluation split
    return unread


def _inside(path: str, root: Any) -> bool:
    """True if `path` lies in folder `root` (a non-empty string)."""
    if not isinstance(root, str) or not root:
        return False
    root = os.path.abspath(root)
    try:
        return os.path.commonpath([os.path.abspath(path), root]) == root
    except ValueError:  # different drives
        return False


def _missing_paths(config: Mapping, task: str, known: Mapping[str, schema.Type],
                   source: str, overrides: Sequence[str]) -> list[str]:
    """'key: path (no such file)' for every configured data file or folder that does not exist."""
    # dataset.prepare_data generates the synthetic set on first use: its files may not exist yet.
    synthetic_root = config.get('synthetic_root')
    unread = _unread(config, task)
    missing = []
    for key, value in _items(config, _blocks(known)):
        kind = known[key].path if key in known else None
        if kind is None or key in unread:
            continue
        for path in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            if not path or _inside(path, synthetic_root):  # '' means none (image_root: '')
                continue
            if not (os.path.isdir(path) if kind == 'dir' else os.path.isfile(path)):
                what = 'folder' if kind == 'dir' else 'file'
                missing.append(f'{key}: {path} (no such {what}; from {_source(key, source, overrides)})')
    return missing


def _check_grit(config: Mapping, source: str, overrides: Sequence[str]) -> None:
    """GRIT's size rules (search_space >= batch_size, queue_size >= search_space) when GRIT is on."""
    if 'batch_size' not in config:
        return  # a missing batch_size fails where Pretrain.py reads it
    # grit/ owns the block's rules and GritSampler applies them when built, after the data is read;
    # asking the same function here reports them at start-up. Imported here, not at the top, so that
    # training/ stays free of grit/ for every other task.
    from grit.config import parse_grit_config

    try:
        parse_grit_config(config.get('grit'), config['batch_size'])
    except ValueError as e:
        where = ' and '.join(sorted({_source(key, source, overrides) for key in ('grit', 'batch_size')}))
        raise ConfigError(f'{e} (from {where})') from None


def validate_config(config: Mapping, task: str, source: str = 'config',
                    overrides: Sequence[str] = ()) -> None:
    """Check value types, then (pre-training) GRIT's sizes, then that data files and folders exist.

    ConfigError lists every problem of the first failing kind; `source` (the config file) and
    `overrides` (the --set items) say where a value came from.
    """
    known = schema.keys(task)
    plain = to_plain(config)
    _fail([f"config key '{key}' must be {known[key].name}, got {_show(value)} from "
           f"{_source(key, source, overrides)}"
           for key, value in _items(plain, _blocks(known)) if key in known and not known[key].accepts(value)],
          'config values have the wrong type')
    if task == 'pretrain':
        _check_grit(plain, source, overrides)
    missing = _missing_paths(plain, task, known, source, overrides)
    if missing:  # all at once: a run that fails on the first of several missing files wastes a restart each
        raise ConfigError('configured data paths that do not exist:\n  ' + '\n  '.join(missing))


def check_global_batch(n: int, config: Mapping, batch_key: str, world_size: int,
                       unit: str = 'entries') -> None:
    """ConfigError unless `n` training entries (config['train_file']) fill one global batch:
    config[batch_key] per process x world_size processes."""
    batch_size = int(config[batch_key])
    if n < batch_size * world_size:
        files = config.get('train_file')
        names = ', '.join(str(f) for f in ([files] if isinstance(files, str) else files or []))
        raise ConfigError(
            f'train_file ({names}) has {n} {unit}, fewer than one global batch: {batch_key} {batch_size} x '
            f'world size {world_size} = {batch_size * world_size}; lower {batch_key} or use fewer processes')
