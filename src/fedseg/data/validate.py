"""Checking a federation's data before a run, reporting every problem.

``validate_federation(path)`` never raises for bad data: it returns a list of
:class:`Problem` (empty = valid) and keeps going after each one, so a user can
fix everything in one pass. ``raise_if_invalid(path)`` is the engine's guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedseg.data.datalist import SPLITS, load_datalist
from fedseg.data.readers import check_case
from fedseg.data.spec import load_federation
from fedseg.data.volumes.load import read_channels
from fedseg.foundation.errors import ConfigError, DataError


@dataclass(frozen=True)
class Problem:
    """One problem in a federation's data.

    Attributes
    ----------
    site : str
        Site name ("federation" for problems of the spec file itself).
    file : str
        The offending file.
    message : str
        What is wrong.
    fix : str
        How to fix it.
    """

    site: str
    file: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.site}: {self.file}: {self.message} -> {self.fix}"


def _split_message(text: str, prefix: str) -> tuple[str, str]:
    """Split an error text "prefix: message -> fix" into (message, fix)."""
    if text.startswith(prefix + ": "):
        text = text[len(prefix) + 2 :]
    message, _, fix = text.partition(" -> ")
    return message, fix or "see docs/data.md"


def _channel_files(fed, site: str, images: list[Path], label: Path) -> list[Problem]:
    """The problems of an image stored as one file per channel (volumes only)."""
    if not fed.volumes:
        return [
            Problem(site, str(images[0]), "an image listed as one file per channel needs volumes", 'set mode = "3d"')
        ]
    missing = [str(p) for p in [*images, label] if not Path(p).is_file()]
    if missing:
        return [Problem(site, missing[0], "file listed in the datalist does not exist", "fix the path in the datalist")]
    try:
        read_channels(images, label, fed.in_channels, fed.label_values)
    except DataError as e:  # the message starts with the file it is about
        bad = next((str(p) for p in [*images, label] if str(e).startswith(f"{p}:")), str(images[0]))
        message, fix = _split_message(str(e), bad)
        return [Problem(site, bad, message, fix)]
    return []


def validate_federation(path: str | Path) -> list[Problem]:
    """List every problem of a federation spec, its datalists and data files.

    Checks: spec malformed; datalist missing or invalid; empty split; listed
    image or label file missing or unreadable; wrong dimensionality; channel
    count vs ``in_channels``; NaN/inf in an image; constant image; label not
    single-channel integer; label values outside {0} and the declared values;
    image/label spatial shape mismatch; cases of different sizes when no
    ``image_size`` is set.

    Parameters
    ----------
    path : str or Path
        The federation spec TOML file.

    Returns
    -------
    list of Problem
        Empty when the federation is valid.
    """
    path = Path(path).expanduser().resolve()
    try:
        fed = load_federation(path)
    except ConfigError as e:
        message, fix = _split_message(str(e), str(path))
        return [Problem("federation", str(path), message, fix)]
    problems: list[Problem] = []
    shapes: dict[tuple, tuple[str, str]] = {}  # spatial shape -> first (site, file) with it
    for site in fed.sites:
        try:
            datalist = load_datalist(site.datalist, site=site.name)
        except DataError as e:
            message, fix = _split_message(str(e), f"{site.name}: {site.datalist}")
            problems.append(Problem(site.name, str(site.datalist), message, fix))
            continue
        for split in SPLITS:
            if not datalist[split]:
                problems.append(
                    Problem(
                        site.name,
                        str(site.datalist),
                        f"split {split!r} is empty",
                        f"add cases to {split!r} in the datalist",
                    )
                )
            for entry in datalist[split]:
                if isinstance(entry["image"], list):  # one file per channel
                    problems += _channel_files(fed, site.name, entry["image"], entry["label"])
                    continue
                case, issues = check_case(fed, entry["image"], entry["label"])
                problems += [Problem(site.name, i.file, i.message, i.fix) for i in issues]
                if case is not None:
                    shape = case.image.shape[1:] if fed.mode != "slices" else case.image.shape[1:-1]
                    shapes.setdefault(shape, (site.name, str(entry["image"])))
    # volumes ("3d", "patches2d") are resampled onto the plan's grid, so their sizes may differ
    if fed.image_size is None and len(shapes) > 1 and not fed.volumes:
        (s0, (_, f0)), (s1, (site1, f1)) = list(shapes.items())[:2]
        problems.append(
            Problem(
                site1,
                f1,
                f"size {s1} differs from {s0} of {f0} and no image_size is set",
                f"set data.image_size in {fed.path} to resize all cases to one size",
            )
        )
    return problems


def raise_if_invalid(path: str | Path) -> None:
    """Raise DataError listing every problem of the federation, if any.

    Raises
    ------
    DataError
        With one line per :class:`Problem`.
    """
    problems = validate_federation(path)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise DataError(f"federation {path} has {len(problems)} data problem(s):\n{lines}")
