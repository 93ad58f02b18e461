"""The settings reference: every setting described, ``docs/settings.md`` current, ``fedseg settings``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pytest

from fedseg.algorithms import REGISTRY
from fedseg.apps.settings import MARKDOWN_COMMAND, markdown, sections
from fedseg.apps.tracking import TrackingParams
from fedseg.cli import main
from fedseg.deployment.params import DeployParams
from fedseg.foundation.config import SECTIONS, RunConfig
from fedseg.foundation.settings import Doc, describe, field_docs
from fedseg.seams.algorithm import NoParams

DOC = Path(__file__).resolve().parents[3] / "docs" / "settings.md"


def _settings_classes() -> dict[type, set[str]]:
    """Every settings dataclass, found without the reference's own list: ``{class: fields to describe}``."""
    out: dict[type, set[str]] = {RunConfig: {f.name for f in dataclasses.fields(RunConfig)} - {"params", *SECTIONS}}
    for cls in [*SECTIONS.values(), DeployParams, TrackingParams, *(c.Params for c in REGISTRY.values())]:
        if cls is not NoParams:
            out[cls] = {f.name for f in dataclasses.fields(cls)}
    return out


def test_every_field_of_every_settings_dataclass_has_a_description():
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{name}"
        for cls, names in _settings_classes().items()
        for name in sorted(names)
        if not field_docs(cls).get(name, "").strip()
    ]
    assert not missing, (
        "these settings have no description; add a field docstring (a string literal on the line after "
        f"the field): {', '.join(missing)}"
    )


def test_the_reference_lists_every_settings_dataclass_and_every_field():
    listed = {cls: {r.name for r in rows} for cls, rows, _ in sections().values()}
    assert listed == _settings_classes()
    assert all(r.doc for _, rows, _ in sections().values() for r in rows)


def test_docs_settings_md_is_generated_from_the_code():
    assert DOC.read_text() == markdown(), f"docs/settings.md is stale; regenerate it with: {MARKDOWN_COMMAND}"


def test_settings_markdown_prints_the_generated_file(capsys):
    assert main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown()


def test_settings_train_lists_the_learning_rate_with_its_default(capsys):
    assert main(["settings", "train"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.split()[:1] == ["train.lr"]]
    assert line.split()[1:3] == ["float", "0.001"] and "Learning rate" in line
    assert "train.optimizer" in out and '"adam" | "sgd"' in out
    assert "fedsm." not in out  # one section only


def test_settings_without_a_section_lists_every_section(capsys):
    assert main(["settings"]) == 0
    out = capsys.readouterr().out
    for key in ("rounds", "model.channels", "simulation.vectorize_group", "fedsm.lam", "deploy.min_sites"):
        assert f"  {key} " in out


def test_an_unknown_section_is_one_clear_error_naming_the_known_ones(capsys):
    assert main(["settings", "trian"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert "unknown settings section 'trian'" in line
    for name in ("run", "train", "fedsm", "deploy"):
        assert name in line.split("known sections:")[1]


@dataclass(frozen=True)
class _Example:
    """A class docstring is not a field's."""

    plain: int = 3
    """An integer,
    on two lines."""
    undocumented: float | None = None
    word: Literal["a", "b"] | None = "a"
    """A word."""
    items: tuple[int, ...] = (1, 2)
    """A list."""


def test_rows_carry_type_default_allowed_values_and_docstring():
    rows = {r.name: r for r in describe(_Example, "ex")}
    assert rows["plain"].doc == "An integer, on two lines."
    assert (rows["plain"].type, rows["plain"].default, rows["plain"].key) == ("int", "3", "ex.plain")
    assert rows["undocumented"].doc == "" and rows["undocumented"].default == "none"
    assert rows["undocumented"].type == "float | none"
    assert rows["word"].choices == ("a", "b") and rows["word"].default == '"a"'
    assert rows["items"].type == "list of int" and rows["items"].default == "[1, 2]"


@pytest.mark.parametrize("key", ["train.weight_decay", "apfl.alpha_lr", "perfedavg.hvp", "pfedme.personal_lr"])
def test_the_generated_file_documents_every_setting(key):
    assert f"| `{key}` |" in DOC.read_text()


@dataclass(frozen=True)
class _Markup:
    value: int = 0
    """See :mod:`fedseg.foundation.device` and ``train.lr``."""


def test_rest_markup_becomes_plain_backquotes():
    (row,) = describe(_Markup, "m")
    assert row.doc == "See `fedseg.foundation.device` and `train.lr`."


_Vocabulary = Annotated[Literal["x", "y"], Doc("The one description of the words x and y.")]


@dataclass(frozen=True)
class _Shared:
    plain: _Vocabulary = "x"
    optional: _Vocabulary | None = None
    own: _Vocabulary = "y"
    """This field's own words."""


def test_a_field_without_a_docstring_is_described_by_its_vocabulary():
    """A vocabulary declared once (``Annotated[Literal[...], Doc(...)]``) describes every field of its type
    that says nothing of its own, also under ``| None``; a field docstring still wins, and the words stay
    the setting's allowed values."""
    rows = {r.name: r for r in describe(_Shared, "s")}
    assert rows["plain"].doc == rows["optional"].doc == "The one description of the words x and y."
    assert rows["own"].doc == "This field's own words."
    assert rows["plain"].choices == ("x", "y") and rows["optional"].type == "choice | none"


def test_the_two_weighting_vocabularies_describe_their_settings_once():
    """FedAvg's weights (n_k: training samples) and FGA's (b_k: batch samples) are two vocabularies with the
    same words; every method's setting reads its description from the one it uses."""
    rows = {r.key: r.doc for _, rs, _ in sections().values() for r in rs}
    models, gradients = rows["fedavg.weighting"], rows["fga.weighting"]
    assert "n_k" in models and "b_k" in gradients
    assert all(rows[f"{m}.weighting"] == models for m in ("ditto", "apfl", "ft", "fwa", "pfedme", "scaffold"))
