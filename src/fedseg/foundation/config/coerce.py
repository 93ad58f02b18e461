"""What a config value of an annotated type may be: coercion of a TOML value and the checks of word options.

:func:`coerce` turns a value read from TOML or an override into the field's annotated type (an
integer-valued float into an int, a list into a tuple, ``none`` into None where the type allows it)
or raises :class:`~fedseg.foundation.errors.ConfigError` naming the key and what it takes
(``train.precision = 'fp8'; use 'fp32', 'bf16' or 'fp16' (e.g. --set train.precision=fp32)``;
``fedsm.gamma = 'x'; expected 'auto' or a number or none``).  :func:`check_literals` applies the
same check to the word options of a dataclass built in Python.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from fedseg.foundation.errors import ConfigError

__all__ = ["check_literals", "coerce", "describe"]


def _choices(allowed: Sequence[Any]) -> str:
    """``'a', 'b' or 'c'``: the allowed values of a ``Literal`` setting, for error messages."""
    names = [repr(a) for a in allowed]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def describe(tp: Any) -> str:
    """What a value of type ``tp`` looks like, for an error message ("'auto'", "a number", "none")."""
    if typing.get_origin(tp) is typing.Literal:
        return _choices(typing.get_args(tp))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "none"}
    if tp in names:
        return names[tp]
    return "a list" if typing.get_origin(tp) is tuple else getattr(tp, "__name__", str(tp))


def _literal_type(tp: Any) -> Any:
    """``tp`` if it is a ``Literal[...]``, or a union holding one (``Literal[...] | None``); else None."""
    if typing.get_origin(tp) is typing.Literal:
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and any(
        typing.get_origin(a) is typing.Literal for a in typing.get_args(tp)
    ):
        return tp
    return None


def check_literals(obj: Any, where: str) -> None:
    """Check every ``Literal``-typed field of the dataclass instance ``obj`` (as the loader does), so that a
    config built in Python gets the same error as one read from TOML: ``<where>.<key> = 'x'; use 'a' or 'b'``
    (``where`` empty: the top-level keys, ``<key> = 'x'; ...``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        tp = _literal_type(hints[f.name])
        if tp is not None:
            coerce(getattr(obj, f.name), tp, f"{where}.{f.name}" if where else f.name)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a TOML value to the annotated type ``tp`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if isinstance(value, str) and value == "none" and any("none" in typing.get_args(a) for a in args):
            return value  # "none" is one of the setting's own choices (e.g. fedsm.selector_augment), not unset
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        kinds = " or ".join(describe(a) for a in args)
        raise ConfigError(f"{where} = {value!r}; expected {kinds}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} values, got {list(value)}")
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(f"{where} = {value!r}; use {_choices(allowed)} (e.g. --set {where}={allowed[0]})")
    if origin is dict or tp is dict:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value
