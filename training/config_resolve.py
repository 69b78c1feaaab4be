"""From a YAML file and its overrides to the typed config (training.config), once, at start-up.

resolve_config: the file (with `base:` overlays), `--set` items and flags such as --seed, then ALBEF's
keys (aliases or refusals, training.config_albef), unknown keys (each with the nearest known key), types
and allowed values (training.config_types), required keys, the rules between keys, and that data files
and folders exist. Every check raises training.config_files.ConfigError listing all problems of its kind
at once and saying where each value came from. config_to_dict / render_config / save_resolved write a
resolved config back out (every key, each with its meaning as a comment); read back, it resolves to an
equal config.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from training.config import TaskConfig, config_class
from training.config_albef import ALBEF_KEYS, Alias
from training.config_blocks import SAMPLER_KEYS
from training.config_files import (
    ConfigError,
    apply_overrides,
    load_config,
    split_override,
    to_plain,
    unknown_key_message,
)
from training.config_types import REFUSED, bounds_problem, convert, show, type_name

__all__ = ["config_from_mapping", "known_keys", "new_spelling", "resolve_config", "tasks_with"]


# ------------------------------------------------------------------------------------------ the keys


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _block_class(tp: Any) -> type | None:
    """The dataclass a block's annotation names (`grit: Grit`), else None."""
    return tp if dataclasses.is_dataclass(tp) else None


def known_keys(task: str) -> dict[str, Any]:
    """Every dotted key of `task`'s config with its type annotation (a block's own key: its dataclass)."""
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _types(cls).items():
            if name not in _fields(cls):
                continue
            out[prefix + name] = tp
            if _block_class(tp):
                walk(tp, f"{prefix}{name}.")

    walk(config_class(task), "")
    return out


def tasks_with(key: str) -> list[str]:
    """The tasks whose config has `key` (a hint when a config is given to the wrong script)."""
    from training.config import TASK_CONFIGS

    return [t for t in TASK_CONFIGS if key in known_keys(t)]


# ------------------------------------------------------------------------------------------ sources


class _Sources:
    """Where each value came from: the --set item (or flag) that set it or a block holding it, else the
    file."""

    def __init__(self, path: str, overrides: Sequence[str], flags: Mapping[str, str]) -> None:
        self.path = path
        self.set_keys = [split_override(item)[0] for item in overrides]
        self.flags = dict(flags)  # key -> '--seed'

    def __call__(self, key: str) -> str:
        if key in self.flags:
            return self.flags[key]
        for over in self.set_keys:
            if over == key or over.startswith(key + ".") or key.startswith(over + "."):
                return "--set"
        return self.path


def _fail(errors: Sequence[str], what: str) -> None:
    """Raise one ConfigError for all `errors` (none: return)."""
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} {what}:\n  " + "\n  ".join(errors))


# ------------------------------------------------------------------------------------------ ALBEF keys

_MISSING = object()  # _get's default: the key is not in the mapping


def _get(node: Mapping, key: str, default: Any = _MISSING) -> Any:
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _pop(node: dict, key: str) -> Any:
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    return node.pop(last)


def _set(node: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _albef_keys(plain: dict, task: str, sources: _Sources) -> None:
    """Read ALBEF-only keys as ours (Alias) or refuse them with what to do instead (all refusals at once)."""
    errors = []
    for key, (tasks, rule) in ALBEF_KEYS.items():
        value = _get(plain, key)
        if value is _MISSING or task not in tasks:
            continue
        if isinstance(rule, Alias):
            if _get(plain, rule.key) is not _MISSING:
                errors.append(f"config has both '{key}' (ALBEF's) and '{rule.key}' in {sources(key)}; keep "
                              f"'{rule.key}'")
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = type(value)(value * rule.scale)
            _pop(plain, key)
            _set(plain, rule.key, value)
            continue
        problem = rule(value)
        if problem is None:
            _pop(plain, key)  # accepted: it asks for what this code does anyway
        else:
            errors.append(f"config key '{key}' ({value!r}, from {sources(key)}): {problem}")
    _fail(errors, "ALBEF config keys this code does not take")


# The `grit:` block of configs written before batching.strategy was the one axis: its keys are batching's,
# and its `enabled` was the strategy (true: grit, false: random; `grit: null`: random).
OLD_GRIT_KEYS = ("enabled", *SAMPLER_KEYS)
# The one rule both renderings below apply: the old switch's value -> batching.strategy (`grit: null` is
# grouping off); every other grit.<key> is batching.<key>.
STRATEGY_OF_ENABLED = {True: "grit", False: "random"}
_noticed: set[str] = set()


def new_spelling(override: str) -> str:
    """A --set item in the `batching` block's spelling: 'grit.enabled=false' -> 'batching.strategy=random',
    'grit.enabled=true' -> 'batching.strategy=grit', 'grit=null' -> 'batching.strategy=random',
    'grit.<key>=v' -> 'batching.<key>=v'; any other item unchanged (what tools compare commands by)."""
    key, sep, value = override.partition("=")
    if not sep or not (key == "grit" or key.startswith("grit.")):
        return override
    if key == "grit" and value.strip() in ("null", "~", ""):
        return f"batching.strategy={STRATEGY_OF_ENABLED[False]}"
    if key == "grit.enabled" and value.strip().lower() in ("true", "false"):
        return f"batching.strategy={STRATEGY_OF_ENABLED[value.strip().lower() == 'true']}"
    return f"batching.{key[len('grit.'):]}={value}" if key.startswith("grit.") else override


def _old_batching_spelling(plain: dict, sources: _Sources) -> None:
    """Read a `grit:` block as `batching:` (in place), with a one-line notice per config file; ConfigError
    when a key is set in both spellings."""
    if "grit" not in plain:
        return
    old = plain.pop("grit") or {}
    if not isinstance(old, Mapping):
        raise ConfigError(f"config key 'grit' (the old spelling of 'batching') must be a mapping or null, "
                          f"got {show(old)} from {sources('grit')}")
    batching = plain.setdefault("batching", {})
    if not isinstance(batching, dict):
        return  # _build names the wrong type of 'batching'
    errors = []
    for name, value in old.items():
        if name == "enabled":
            if not isinstance(value, bool):
                errors.append(f"config key 'grit.enabled' (the old spelling of batching.strategy) must be "
                              f"bool, got {show(value)} from {sources('grit.enabled')}")
                continue
            strategy = batching.get("strategy")
            if strategy is None or (sources("grit.enabled") == "--set" != sources("batching.strategy")
                                    and (strategy == "random") == bool(value)):
                # Unset, or a command line that turns the file's grouping on or off: the old key decides.
                batching["strategy"] = STRATEGY_OF_ENABLED[value]
            elif strategy != "random" and value is False:
                errors.append(f"batching.strategy {strategy!r} groups batches, but grit.enabled is false "
                              f"(from {sources('grit.enabled')}): drop grit.enabled (batching.strategy "
                              "decides alone) or set batching.strategy: random")
        elif name in batching and sources("grit." + name) == sources("batching." + name):
            errors.append(f"config has both 'grit.{name}' and 'batching.{name}' (from "
                          f"{sources('grit.' + name)}); keep 'batching.{name}'")
        elif name not in batching or sources("grit." + name) == "--set":
            # A command line's old key wins over the file's new one; an unknown name is reported as
            # batching.<name>.
            batching[name] = value
    strategy = batching.get("strategy")
    if not old:  # `grit: null` or `grit: {}`: GRIT off
        if strategy is None or (sources("grit") == "--set" != sources("batching.strategy")):
            batching["strategy"] = STRATEGY_OF_ENABLED[False]  # unset, or a command line turning it off
        elif strategy != "random":
            errors.append(f"batching.strategy {strategy!r} groups batches, but grit is null (from "
                          f"{sources('grit')}): drop grit (batching.strategy decides alone)")
    elif "enabled" not in old and strategy is None:
        batching["strategy"] = STRATEGY_OF_ENABLED[True]  # a grit block meant GRIT on unless enabled: false
    _fail(errors, "config keys in two spellings")
    where = sources("grit")
    if where not in _noticed and os.environ.get("RANK", "0") == "0":
        _noticed.add(where)
        print(f"notice: {where}: the `grit:` block is read as `batching:` (grit.enabled true/false -> "
              "batching.strategy grit/random, grit.<key> -> batching.<key>); write it so to silence this",
              file=sys.stderr)


# ------------------------------------------------------------------------------------------ resolution


def _unknown(key: str, task: str, known: Iterable[str], source: str) -> str:
    others = tasks_with(key)
    if others:  # a config meant for another script: a spelling hint would mislead
        return f"{unknown_key_message(key, ())} (read by {', '.join(others)}, not by {task}) in {source}"
    return f"{unknown_key_message(key, known)} in {source}"


def _unknown_keys(plain: Mapping, cls: type, task: str, sources: _Sources, prefix: str = "") -> list[str]:
    errors = []
    fields, hints = _fields(cls), _types(cls)
    for name, value in plain.items():
        key = prefix + str(name)
        if name not in fields:
            errors.append(_unknown(key, task, known_keys(task), sources(key)))
        elif _block_class(hints[name]) and isinstance(value, Mapping):
            errors += _unknown_keys(value, hints[name], task, sources, key + ".")
    return errors


def _build(cls: type, plain: Mapping, sources: _Sources, prefix: str, errors: list[str]) -> Any:
    """An instance of dataclass `cls` from `plain` (known keys only); each problem appended to errors."""
    values: dict[str, Any] = {}
    hints = _types(cls)
    for name, f in _fields(cls).items():
        key, tp = prefix + name, hints[name]
        if name not in plain:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(f"config key '{key}' is required but missing in {sources.path}")
            continue
        value = plain[name]
        block = _block_class(tp)
        if block is not None:
            if isinstance(value, Mapping):
                values[name] = _build(block, value, sources, key + ".", errors)
            else:
                errors.append(f"config key '{key}' must be a mapping, got {show(value)} from {sources(key)}")
            continue
        converted = convert(tp, value)
        if converted is REFUSED:
            errors.append(f"config key '{key}' must be {type_name(tp)}, got {show(value)} from "
                          f"{sources(key)}")
            continue
        bound = bounds_problem(f, converted)
        if bound:
            errors.append(f"config key '{key}' {bound}, got {value!r} from {sources(key)}")
            continue
        values[name] = converted
    if errors:  # one of them may be this block's: the caller raises them all
        return None
    return cls(**values)


def _derived(config: TaskConfig) -> TaskConfig:
    """Fill the keys whose null means 'take another key's value', so the saved config says what ran."""
    sched = config.schedular
    sched = dataclasses.replace(sched, lr=config.optimizer.lr if sched.lr is None else sched.lr,
                                warmup_lr=sched.min_lr if sched.warmup_lr is None else sched.warmup_lr)
    epochs = sched.epochs if config.max_epoch is None else config.max_epoch
    return dataclasses.replace(config, schedular=sched, max_epoch=epochs)


def _inside(path: str, root: Any) -> bool:
    if not isinstance(root, str) or not root:
        return False
    root = os.path.abspath(root)
    try:
        return os.path.commonpath([os.path.abspath(path), root]) == root
    except ValueError:  # different drives
        return False


def _missing_paths(config: TaskConfig, sources: _Sources) -> list[str]:
    """'key: path (no such file; from SOURCE)' for every data file or folder the run opens that is missing."""
    unread, out = config.unread(), []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            key, value = prefix + f.name, getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
                continue
            kind = f.metadata.get("path")
            if kind is None or key in unread or value is None:
                continue
            for path in [value] if isinstance(value, str) else value:
                # '' means none (image_root: ''); the synthetic world is generated on first use
                if not path or _inside(path, config.synthetic_root):
                    continue
                if not (os.path.isdir(path) if kind == "dir" else os.path.isfile(path)):
                    what = "folder" if kind == "dir" else "file"
                    out.append(f"{key}: {path} (no such {what}; from {sources(key)})")

    walk(config, "")
    return out


def config_from_mapping(task: str, mapping: Mapping, source: str = "config", overrides: Sequence[str] = (),
                        flags: Mapping[str, str] | None = None, check_paths: bool = False,
                        unknown: Sequence[str] = ()) -> TaskConfig:
    """The typed config of `task` from a mapping (a loaded YAML file, a dict): ALBEF keys, unknown keys,
    types and values, required keys, rules between keys, and (check_paths) data paths; ConfigError else.

    source names the file in messages; overrides (the --set items already applied) and flags ({key:
    '--seed'}) say which values came from the command line; unknown: messages of unknown --set keys,
    reported with the file's.
    """
    cls = config_class(task)
    sources = _Sources(source, overrides, flags or {})
    plain = to_plain(dict(mapping))
    if "scheduler" in plain:  # the common spelling, read as ALBEF's
        if "schedular" in plain:
            raise ConfigError(f"config has both 'schedular' and 'scheduler' in {source}; keep one")
        plain["schedular"] = plain.pop("scheduler")
    _albef_keys(plain, task, sources)
    if task == "pretrain":
        _old_batching_spelling(plain, sources)
    _fail(_unknown_keys(plain, cls, task, sources) + list(unknown), "unknown config keys")
    errors: list[str] = []
    config = _build(cls, plain, sources, "", errors)
    _fail(errors, "config values are wrong")
    config = _derived(config)
    problems = config.problems()
    if problems:
        where = sources.path
        if sources.set_keys or sources.flags:
            where = " and ".join(sorted({sources.path, "--set" if sources.set_keys else "the command line"}))
        _fail([f"{p} (from {where})" for p in problems], "config rules are broken")
    if check_paths:
        missing = _missing_paths(config, sources)
        # all at once: a run that fails on the first of several missing files wastes a restart each
        if missing:
            raise ConfigError("configured data paths that do not exist:\n  " + "\n  ".join(missing))
    return config


def resolve_config(task: str, path: str, overrides: Sequence[str] = (),
                   flags: Mapping[str, Any] | None = None, check_paths: bool = True) -> TaskConfig:
    """The typed config of `task` from YAML file `path`, `--set` items and flags ({'seed': 3}); ConfigError
    names the file, key or item of every problem."""
    raw = load_config(path)
    known = known_keys(task)
    albef = {k for k, (tasks, _) in ALBEF_KEYS.items() if task in tasks}
    if task == "pretrain":  # the old spelling of the batching block (_old_batching_spelling)
        albef |= {"grit", *(f"grit.{k}" for k in OLD_GRIT_KEYS)}
    blocks = {k for k, tp in known.items() if _block_class(tp)}

    def known_override(key: str) -> bool:  # a key, or an item of a known list ('train_file.1')
        parts = key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
        return key in known or key in albef or any(p in known and p not in blocks for p in prefixes)

    unknown = [_unknown(k, task, known, "--set") for k in (split_override(o)[0] for o in overrides)
               if not known_override(k)]
    apply_overrides(raw, [o for o in overrides if known_override(split_override(o)[0])], source="--set",
                    known=set(known) | albef)
    flag_sources = {}
    for name, value in (flags or {}).items():
        if value is not None:
            raw[name] = value
            flag_sources[name] = f"--{name}"
    return config_from_mapping(task, raw, path, overrides, flag_sources, check_paths, unknown)
