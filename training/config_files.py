"""YAML config files: load (comments kept, `base:` overlays), `--set a.b=value` overrides, save, plain dicts.

What the keys mean and how a file becomes the typed config is training.config and
training.config_resolve. ConfigError is the one exception a bad config or override raises;
training.cli turns it into a one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import io
import os
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError
from ruamel.yaml.scalarbool import ScalarBoolean


class ConfigError(ValueError):
    """A config file or override is malformed or lacks a key."""


def round_trip_yaml() -> YAML:
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


def unknown_key_message(key: str, candidates: Iterable[str]) -> str:
    """"unknown config key 'key'", with the closest of `candidates` (difflib) as a hint: a key of the same
    block first ('batching.gcbs.k' -> 'batching.gcbs.neighbours', not the block 'batching.gcbs')."""
    candidates = list(candidates)
    parent = key.rpartition('.')[0]
    siblings = [c for c in candidates if c.rpartition('.')[0] == parent]
    close = (difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
             or difflib.get_close_matches(key, candidates, n=1, cutoff=0.6))
    hint = f" (did you mean '{close[0]}'?)" if close else ''
    return f"unknown config key '{key}'{hint}"


def _unknown_key(key: str, candidates: Iterable[str], source: str) -> ConfigError:
    return ConfigError(f'{unknown_key_message(key, candidates)} in {source}')


def _walk(config: Any, key: str, source: str, known: Collection[str] = ()) -> tuple[Any, str | int]:
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
            raise _unknown_key(key, known or _flat_keys(config), source)
        if is_last:
            return node, sel
        node = node[sel]
    raise _unknown_key(key, known or _flat_keys(config), source)  # empty key


def _make_path(config: MutableMapping, key: str, source: str) -> tuple[MutableMapping, str]:
    """Return (container, last_key) for dotted `key`, creating missing (or null) mappings on the way."""
    *parents, last = key.split('.')
    node = config
    for i, part in enumerate(parents):
        if node.get(part) is None:
            node[part] = CommentedMap()
        node = node[part]
        if not isinstance(node, MutableMapping):
            parent = '.'.join(parents[:i + 1])
            raise ConfigError(f"cannot set '{key}' in {source}: '{parent}' is not a mapping")
    return node, last


def parse_yaml_value(text: str) -> Any:
    """Parse an override value as YAML 1.2: 'false', '1e-4' (float), '[a, b]' (list), 'null' (None)."""
    try:
        return round_trip_yaml().load(text)
    except YAMLError as e:
        raise ConfigError(f'cannot parse override value {text!r} as YAML: {e}') from e


BASE_KEY = 'base'
_MISSING = object()


def load_config(path: str | os.PathLike, overrides: Sequence[str] | None = None) -> CommentedMap:
    """Load a YAML config (round-trip: comments kept, acts as a dict), then apply `a.b=value` overrides.

    A file with a top-level `base: OTHER.yaml` (relative to the file) is that config with the rest of
    the file laid over it (configs/ablation/): every key it sets must exist in the base, nested
    mappings merge key by key, and the result holds no `base` key. Bases may chain.
    """
    return _load(str(path), overrides or [], chain=())


def _read_yaml(path: str) -> CommentedMap:
    if not os.path.isfile(path):
        raise FileNotFoundError(f'config file not found: {path}')
    try:
        with open(path, encoding='utf-8') as f:
            config = round_trip_yaml().load(f)
    except YAMLError as e:
        raise ConfigError(f'cannot parse config file {path}: {e}') from e
    if config is None:
        config = CommentedMap()
    if not isinstance(config, Mapping):
        raise ConfigError(f'config file {path} must hold a mapping at top level, not {type(config).__name__}')
    return config


def _load(path: str, overrides: Sequence[str], chain: tuple[str, ...]) -> CommentedMap:
    config = _read_yaml(path)
    if BASE_KEY in config:
        base_name = config.pop(BASE_KEY)
        if not isinstance(base_name, str) or not base_name:
            raise ConfigError(f"config key '{BASE_KEY}' in {path} must be a file path, got {base_name!r}")
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base_name))
        if os.path.abspath(base_path) in chain:
            raise ConfigError(f"config {path}: '{BASE_KEY}' chain loops back to {base_path}")
        base = _load(base_path, [], (*chain, os.path.abspath(path)))
        _lay_over(base, config, source=path)
        config = base
    apply_overrides(config, overrides, source=path)
    return config


def _lay_over(base: MutableMapping, top: Mapping, source: str, prefix: str = '') -> None:
    """Set every key of `top` in `base` (in place); each must exist there; mappings merge recursively."""
    for key, value in top.items():
        dotted = f'{prefix}{key}'
        if key not in base:
            raise _unknown_key(dotted, _flat_keys(base), f'{source} (not in its base config)')
        if isinstance(value, Mapping) and isinstance(base[key], MutableMapping):
            _lay_over(base[key], value, source, prefix=dotted + '.')
        else:
            base[key] = value


def split_override(item: str) -> tuple[str, str]:
    """'a.b=value' -> ('a.b', 'value'); ConfigError unless it looks like key=value."""
    key, sep, text = item.partition('=')
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. batching.strategy=random)")
    return key, text


def apply_overrides(config: MutableMapping, overrides: Sequence[str], source: str = 'config',
                    known: Collection[str] = ()) -> None:
    """Set each `a.b.c=value` (value parsed as YAML) in place; the key must already exist, or be one of
    `known` (a schema's dotted keys: set even when the file lacks it); unknown keys are hinted from
    `known`, else from the config's keys."""
    for item in overrides:
        key, text = split_override(item)
        if key in known and get_key(config, key, _MISSING) is _MISSING:
            container, last = _make_path(config, key, source)
        else:
            container, last = _walk(config, key, source, known)
        container[last] = parse_yaml_value(text)






def save_config(config: Mapping, path: str | os.PathLike) -> None:
    """Write `config` as YAML; a round-trip CommentedMap keeps its comments."""
    buf = io.StringIO()
    round_trip_yaml().dump(config, buf)
    atomic_write_text(str(path), buf.getvalue())


def get_key(config: Mapping, key: str, default: Any = None) -> Any:
    """config['a']['b'] for key 'a.b', or `default` when any part is missing."""
    node: Any = config
    for part in key.split('.'):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node




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






def atomic_write_text(path: str, text: str) -> None:
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a resolved config, written out


def config_to_dict(config: Any) -> dict:
    """Every key of a resolved config as plain nested dicts (blocks as mappings)."""
    return dataclasses.asdict(config)


def _commented(obj: Any) -> CommentedMap:
    out = CommentedMap()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _commented(value)
        elif isinstance(value, list):
            seq = CommentedSeq(value)
            seq.fa.set_flow_style()
            out[f.name] = seq
        elif isinstance(value, dict):
            mapping = CommentedMap(value)
            mapping.fa.set_flow_style()
            out[f.name] = mapping
        else:
            out[f.name] = value
        out.yaml_add_eol_comment(f.metadata.get("meaning", ""), f.name, column=40)
    return out


def render_config(config: Any) -> str:
    """The resolved config as YAML, each key with its meaning as a comment."""
    buf = io.StringIO()
    buf.write(f"# {type(config).__name__}: the resolved config (every key, defaults included) with the "
              "meaning of each\n")
    round_trip_yaml().dump(_commented(config), buf)
    return buf.getvalue()


def save_resolved(config: Any, path: str) -> None:
    """Write render_config(config) to `path` atomically."""
    atomic_write_text(path, render_config(config))
