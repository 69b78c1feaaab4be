"""A config value against its key's annotation and bounds (training.config): the type's name in messages,
the conversion (an int where a float is wanted, PyYAML's '1e-4' string), the numeric bounds.
training.config_resolve applies them to every key at start-up.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["REFUSED", "bounds_problem", "convert", "show", "type_name"]


def type_name(tp: Any) -> str:
    """A type annotation as a message names it: 'int or null', "one of 'a', 'b'", 'list of str', ..."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        values = typing.get_args(tp)
        return repr(values[0]) if len(values) == 1 else "one of " + ", ".join(repr(a) for a in values)
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"a mapping of {type_name(key_tp)} to {type_name(value_tp)}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):  # a block (grit, optimizer, ...)
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


REFUSED = object()  # what convert() returns for a value the type refuses


def convert(tp: Any, value: Any) -> Any:
    """`value` as type `tp` (an int for a float becomes a float, '1e-4' too), or REFUSED."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = convert(arg, value)
            if out is not REFUSED:
                return out
        return REFUSED
    if origin is Literal:
        # bool is an int: True must not pass for 1, nor 1 for True
        return value if any(value == a and type(value) is type(a) for a in typing.get_args(tp)) else REFUSED
    if origin is list:
        if not isinstance(value, list):
            return REFUSED
        items = [convert(typing.get_args(tp)[0], v) for v in value]
        return REFUSED if any(v is REFUSED for v in items) else items
    if origin is dict:
        if not isinstance(value, Mapping):
            return REFUSED
        key_tp, value_tp = typing.get_args(tp)
        pairs = [(convert(key_tp, k), convert(value_tp, v)) for k, v in value.items()]
        return REFUSED if any(k is REFUSED or v is REFUSED for k, v in pairs) else dict(pairs)
    if tp is type(None):
        return None if value is None else REFUSED
    if tp is bool:
        return value if isinstance(value, bool) else REFUSED
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else REFUSED
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML (YAML 1.1), as ALBEF used, reads 1e-4 as a string
            try:
                return float(value)
            except ValueError:
                return REFUSED
        return REFUSED
    if tp is str:
        return value if isinstance(value, str) else REFUSED
    raise TypeError(f"config type {tp!r} is not supported")


def show(value: Any) -> str:
    """A value as a message shows it: null, or its repr and type."""
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def bounds_problem(f: dataclasses.Field, value: Any) -> str | None:
    """'must be >= 1' etc. when a number breaks the field's bounds; None when it holds (or is no number)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    low, high, above = f.metadata.get("low"), f.metadata.get("high"), f.metadata.get("above")
    if low is not None and value < low:
        return f"must be >= {low:g}"
    if above is not None and value <= above:
        return f"must be > {above:g}"
    if high is not None and value > high:
        return f"must be <= {high:g}"
    return None
