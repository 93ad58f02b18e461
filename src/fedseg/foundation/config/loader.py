"""Reading a run config: TOML files, ``--set key=value`` overrides, tables into the schema's dataclasses, and back.

A run is fully described by one TOML file plus ``--set key=value`` overrides; the resolved
configuration is written beside the results (``config.toml`` and inside ``results.json``) so that
``fedseg run OUT/config.toml`` reproduces it.  Each table becomes its dataclass of
:mod:`fedseg.foundation.config.schema` (:func:`dataclass_from_dict`: unknown keys refused, every
value coerced to its field's type by :func:`~fedseg.foundation.config.coerce.coerce`), then the
whole config is validated.  Algorithms' ``Params`` and ``[deploy]`` are read by the same loader.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from fedseg.foundation.config.coerce import coerce
from fedseg.foundation.config.schema import EXCLUSIVE, SECTIONS, RunConfig
from fedseg.foundation.errors import ConfigError

__all__ = ["apply_overrides", "dataclass_from_dict", "dump_toml", "load_run_config", "toml_value"]


def dataclass_from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build the frozen dataclass ``cls`` from a TOML table, rejecting unknown keys.

    Parameters
    ----------
    cls
        A dataclass type.
    data
        Its TOML table.
    where
        The table's name, used in error messages (e.g. ``"train"``).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"[{where}] must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"[{where}] has unknown key(s) {unknown}; known keys: {sorted(names)}")
    kwargs = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    """Parse an override's value as TOML (numbers, booleans, lists, strings); bare words are strings.  The
    word ``none`` stays a word: the typed loader (:func:`coerce`) reads it as unset (None), or as the
    setting's own choice where its choices name it (``fedsm.selector_augment = "none"``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "none")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``section.key=value`` overrides to a raw config table (returns a copy).

    Setting one of a pair of :data:`EXCLUSIVE` settings unsets the other unless the overrides set it too
    (``train.local_steps=60`` alone means local steps instead of the default or the file's epochs)."""
    out = json.loads(json.dumps(raw, default=list))
    given: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-4)")
        key, text = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r} has an empty key")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a table")
        node[parts[-1]] = given[".".join(parts)] = _parse_value(text.strip())
    for pair in EXCLUSIVE:
        for key, other in (pair, pair[::-1]):
            if key in given and other not in given and not _is_none(given[key]):
                *path, name = other.split(".")
                node = out
                for p in path:
                    node = node.setdefault(p, {})
                node[name] = "none"
    return out


def _is_federation_spec(raw: dict[str, Any]) -> bool:
    return "sites" in raw


def _unset_the_other_of_a_pair(raw: dict[str, Any]) -> None:
    """A file that sets one of a pair of :data:`EXCLUSIVE` settings (``[train] local_steps = 20``) leaves the
    other unset instead of at its default; a file that sets both is refused by validation."""
    for pair in EXCLUSIVE:
        found = []
        for key in pair:
            node: Any = raw
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            found.append(node is not None and not (isinstance(node, str) and node.strip().lower() == "none"))
        for key, mine, other in ((pair[1], found[0], found[1]), (pair[0], found[1], found[0])):
            if mine and not other:
                *path, last = key.split(".")
                node = raw
                for part in path:
                    node = node.setdefault(part, {})
                node[last] = "none"


def load_run_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    known_sections: set[str] | None = None,
    **fields: Any,
) -> RunConfig:
    """Load a run config from TOML (or a federation spec), apply overrides and validate.

    Parameters
    ----------
    path
        A run config (with ``federation = "..."``) or a federation spec (with
        ``[[sites]]``; then the run uses it with default settings).
    overrides
        ``key=value`` strings, dotted for sections (``train.lr=1e-4``, ``fedsm.lam=0.7``).
    known_sections
        Method sections that may appear (from the algorithm registry); others are rejected.
    **fields
        Top-level values that take precedence (``method``, ``rounds``, ``seed`` from the CLI).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass a run config TOML or a federation spec")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from None
        if _is_federation_spec(raw):
            raw = {"federation": str(p.resolve())}
        elif "federation" in raw:
            fed = Path(raw["federation"])
            raw["federation"] = str(fed if fed.is_absolute() else (p.parent / fed).resolve())
        _unset_the_other_of_a_pair(raw)
        init = raw.get("model", {}).get("init") if isinstance(raw.get("model"), dict) else None
        if isinstance(init, str) and init.lower() != "none" and not Path(init).is_absolute():
            raw["model"]["init"] = str((p.parent / init).resolve())
    for k, v in fields.items():
        if v is not None:
            raw[k] = v
    raw = apply_overrides(raw, overrides or [])
    if "federation" not in raw:
        raise ConfigError('the config names no federation; add federation = "path/to/federation.toml"')
    top = {f.name for f in dataclasses.fields(RunConfig)} - {"params", *SECTIONS}
    kwargs: dict[str, Any] = {}
    params: dict[str, dict[str, Any]] = {}
    hints = typing.get_type_hints(RunConfig)
    for k, v in raw.items():
        if k in SECTIONS:
            kwargs[k] = dataclass_from_dict(SECTIONS[k], v, k)
        elif k in top:
            kwargs[k] = coerce(v, hints[k], k)
        elif isinstance(v, dict) and (known_sections is None or k in known_sections):
            params[k] = v
        else:
            known = sorted(top | set(SECTIONS) | (known_sections or set()))
            raise ConfigError(f"unknown config key {k!r}; known keys and sections: {known}")
    cfg = RunConfig(params=params, **kwargs)
    cfg.validate()
    return cfg


def toml_value(v: Any) -> str:
    """One TOML value (a boolean, number, string, list of them, or an inline table)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (e.g. model.kwargs)
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} to TOML")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a two-level table (scalars, then one section per nested table) as TOML.

    ``None`` values are written as the string ``"none"``, which the loader reads back as None.
    """
    lines: list[str] = []
    tables = []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value('none' if v is None else v)}")
    for name, table in tables:
        lines.append(f"\n[{name}]")
        for k, v in table.items():
            lines.append(f"{k} = {toml_value('none' if v is None else v)}")
    return "\n".join(lines) + "\n"
