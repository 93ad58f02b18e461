"""The settings reference: every field of a settings dataclass as one :class:`Setting` row.

A setting's description is its field docstring (the string literal right after the field, the
attribute-docstring convention), read from the class's source with :mod:`ast`, or where the field has
none the :class:`Doc` of its vocabulary (a word option shared by several sections, declared once as
``Annotated[Literal[...], Doc("...")]``, e.g. :data:`fedseg.algorithms.weighting.Weighting`); its type, default
and allowed values (``Literal[...]``) come from the dataclass itself, so the reference cannot
drift from the code.  This module knows the foundation's sections (the top-level run settings,
``[model]``, ``[train]``, ``[eval]``, ``[simulation]``); the methods' sections and ``[deploy]``
are added by :mod:`fedseg.apps.settings`, which also renders the table (``fedseg settings``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from fedseg.foundation.config import SECTIONS, RunConfig

__all__ = ["TOP", "Doc", "Setting", "describe", "field_docs", "plain", "run_sections"]

TOP = "run"
"""Name of the top-level settings (``rounds``, ``seed``… written before any ``[section]``)."""


@dataclass(frozen=True)
class Doc:
    """The description of a vocabulary that several settings share: ``Annotated[Literal[...], Doc("...")]``.

    A field of that type without a docstring of its own is described by it in the reference, so the words'
    meaning is written once, beside the words."""

    text: str


def _vocabulary_doc(tp: Any) -> str:
    """The :class:`Doc` text of the type ``tp`` (an ``Annotated`` alias, or a union holding one), else ``""``."""
    if typing.get_origin(tp) is typing.Annotated:
        return next((m.text for m in tp.__metadata__ if isinstance(m, Doc)), "")
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((d for d in map(_vocabulary_doc, typing.get_args(tp)) if d), "")
    return ""


@dataclass(frozen=True)
class Setting:
    """One setting of the reference table."""

    section: str
    """Its config section (``train``), or :data:`TOP` for a top-level key."""
    name: str
    """The field's name (``lr``)."""
    type: str
    """Its type in words (``float``, ``list of int``, ``int | none``)."""
    default: str
    """Its default as written in TOML (``0.001``, ``"auto"``, ``none``), or ``required``."""
    choices: tuple[str, ...]
    """The allowed words of a ``Literal[...]`` setting, else empty."""
    doc: str
    """Its description (the field docstring on one line, reST roles as plain backquotes), empty when the
    field has none."""

    @property
    def key(self) -> str:
        """How ``--set`` names it: ``train.lr``, or ``rounds`` for a top-level key."""
        return self.name if self.section == TOP else f"{self.section}.{self.name}"


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of the dataclass ``cls``: each string literal that directly follows an
    annotated field in the class body, whitespace collapsed to one line; a field a base class declares has
    the base's docstring unless ``cls`` restates it; a field without one has its vocabulary's :class:`Doc`."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out[node.target.id] = " ".join(nxt.value.value.split())
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        if f.name not in out and (doc := _vocabulary_doc(hints[f.name])):
            out[f.name] = " ".join(doc.split())
    return out


def plain(doc: str) -> str:
    """A docstring's reST markup as plain backquotes: ``:mod:`x``` and ````x```` become ```x```."""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc).replace("``", "`")


def _type_words(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "choice"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(_type_words(a) for a in typing.get_args(tp)))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_words(args[0])}"
        return f"list of {len(args)} {' | '.join(dict.fromkeys(_type_words(a) for a in args))}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _choices(tp: Any) -> tuple[str, ...]:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return tuple(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return tuple(c for a in typing.get_args(tp) for c in _choices(a))
    return ()


def _toml(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def describe(cls: type, section: str, skip: typing.Collection[str] = ()) -> list[Setting]:
    """The rows of the dataclass ``cls`` read as config section ``section`` (fields in ``skip`` left out)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.default is not dataclasses.MISSING:
            default = _toml(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _toml(f.default_factory())
        else:
            default = "required"
        tp = hints[f.name]
        rows.append(Setting(section, f.name, _type_words(tp), default, _choices(tp), plain(docs.get(f.name, ""))))
    return rows


def run_sections() -> dict[str, tuple[type, list[Setting]]]:
    """The foundation's sections: ``{name: (dataclass, rows)}``, the top-level settings first."""
    out: dict[str, tuple[type, list[Setting]]] = {
        TOP: (RunConfig, describe(RunConfig, TOP, skip={"params", *SECTIONS}))
    }
    for name, cls in SECTIONS.items():
        out[name] = (cls, describe(cls, name))
    return out
