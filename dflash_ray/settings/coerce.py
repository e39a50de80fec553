"""A YAML value read as the type its setting declares: the plain types it must already be (a string
given for a list would be read character by character), finite numbers, literals and nested
sections, each error naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Literal

from dflash_ray.errors import DFlashError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The plain types a YAML value must already be: the check, and what the error says was expected.
# A bare string given for a list would be read character by character, so it is refused too.
_PLAIN: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true/false"),
    int: (_is_int, "an integer"),
    dict: (lambda v: isinstance(v, dict), "a mapping"),
    list: (lambda v: isinstance(v, list), "a list such as [a, b]"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DFlashError(f"expected a mapping, got {value!r}", field=where)
        return build(typing.cast(type, tp), value, where)
    if origin is typing.Union or origin is types.UnionType:
        return _coerce_union(value, tp, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise DFlashError(f"{value!r} is not one of {list(choices)}", field=where)
        return value
    if origin is list:  # list[X]: each element built as an X, named `where[i]`
        if not isinstance(value, list):
            raise DFlashError(f"expected a list such as [a, b], got {value!r}", field=where)
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        return _coerce_float(value, where)
    if tp in _PLAIN:
        fits, expected = _PLAIN[tp]
        if not fits(value):
            raise DFlashError(f"expected {expected}, got {value!r}", field=where)
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    """The first of the union's types the value fits; `X | None` gives the error X gives."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    options = [arg for arg in args if arg is not type(None)]
    if len(options) == 1:
        return _coerce(value, options[0], where)
    for arg in options:
        try:
            return _coerce(value, arg, where)
        except DFlashError:
            pass
    raise DFlashError(f"{value!r} fits none of {tp}", field=where)


def _coerce_float(value: Any, where: str) -> float:
    number = None
    if _is_int(value) or isinstance(value, float):
        number = float(value)
    elif isinstance(value, str):  # YAML 1.1 reads `3e-3` (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            pass
    if number is not None and math.isfinite(number):
        return number
    # nan and inf pass every range check (nan compares false, inf is above every bound) and train to garbage
    raise DFlashError(f"expected a finite number, got {value!r}", field=where)


def coerce_field(cls: type, key: str, value: Any, where: str) -> Any:
    """`value` read as the field `key` of the config section `cls` is (the rules of a YAML value)."""
    return _coerce(value, typing.get_type_hints(cls)[key], where)


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in names:
            moved = getattr(cls, "MOVED", {})  # a setting that moved: said where to
            if key in moved:
                raise DFlashError(f"{where} moved to {prefix}.{moved[key]}", field=where)
            raise DFlashError(f"unknown config key; valid keys here: {names}", field=where)
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)
