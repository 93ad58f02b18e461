"""Tuning on validation: the record ``fedseg compare --tune`` and ``fedseg sweep`` write (``tuning.json``), its
table, its figure (validation score over the grid) and the report's section of it.

``tuning.json`` holds, per method entry, its grid points with the validation score of each seed's run
(``validation``, the score the run selects its best round by), the folders of those runs relative to the
file's folder, and ``chosen``: the index of the point with the highest mean validation score.  This module only
reads it (the runs are :mod:`fedseg.apps.studies.grid`'s).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedseg.apps.report.figures import to_png
from fedseg.apps.report.markup import figure, markdown_html
from fedseg.evaluation.tables import mean_sd

__all__ = [
    "TUNING_FILE",
    "chosen_folders",
    "grid_figure",
    "read_tuning",
    "tuned_paths",
    "tuning_markdown",
    "tuning_section",
]

TUNING_FILE = "tuning.json"


def read_tuning(folder: str | Path) -> dict[str, Any] | None:
    """The tuning record in ``folder`` (``tuning.json``), or None."""
    f = Path(folder) / TUNING_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def chosen_folders(folder: str | Path, record: Mapping[str, Any]) -> list[Path]:
    """The run folders of every method's chosen point (seeds in order), method after method."""
    return [Path(folder) / f for m in record["methods"] for f in m["points"][m["chosen"]]["folders"]]


def tuning_markdown(record: Mapping[str, Any]) -> str:
    """Per method: each grid point's validation score (mean ± sd over the seeds), the chosen one marked."""
    lines = [
        "| Method | Setting | Validation score (mean ± sd over seeds) | Chosen |",
        "|---|---|---|---|",
    ]
    for m in record["methods"]:
        for i, p in enumerate(m["points"]):
            mark = "✓" if i == m["chosen"] else ""
            lines.append(f"| {m['label']} | {p['text'] or '(as given)'} | {mean_sd(p['validation'])} | {mark} |")
    return (
        "\n".join(lines)
        + f"\n\nChosen per method: the setting with the highest mean validation score over {len(record['seeds'])} "
        "seed(s) (the best validation score each run selects its best round by, eval.best_criterion); only the "
        "chosen setting's test Dice enters the comparison.\n"
    )


def _numeric(values: Sequence[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def grid_figure(record: Mapping[str, Any]) -> bytes:
    """PNG: validation score over the grid, one line per method (mean over seeds, the seeds as dots, the chosen
    point ringed); a numeric one-setting grid on its own axis (logarithmic when it spans a factor of 10 or more)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    log_x = False
    for m in record["methods"]:
        pts = m["points"]
        single = len(m["keys"]) == 1
        xs = _numeric([p["point"][m["keys"][0]] for p in pts]) if single else None
        if xs is None:
            xs = list(range(len(pts)))
            ax.set_xticks(xs, [p["text"] for p in pts], rotation=20, ha="right", fontsize=7)
        elif min(xs) > 0 and max(xs) / min(xs) >= 10:
            log_x = True
        means = [sum(p["validation"]) / len(p["validation"]) for p in pts]
        (line,) = ax.plot(xs, means, marker="o", label=m["label"])
        for x, p in zip(xs, pts):
            ax.scatter([x] * len(p["validation"]), p["validation"], s=8, color=line.get_color(), alpha=0.5)
        c = m["chosen"]
        ax.scatter([xs[c]], [means[c]], s=160, facecolors="none", edgecolors=line.get_color(), linewidths=1.5)
    if log_x:
        ax.set_xscale("log")
    keys = {k for m in record["methods"] for k in m["keys"]}
    ax.set_xlabel(", ".join(sorted(keys)) if len(keys) <= 2 else "grid point")
    ax.set_ylabel("validation score (Dice)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    png = to_png(fig)
    plt.close(fig)
    return png


def tuning_section(records: Sequence[tuple[str, Mapping[str, Any]]]) -> str | None:
    """HTML: per tuned folder the table of validation scores over the grid and their figure; None without one."""
    if not records:
        return None
    parts = []
    for i, (name, rec) in enumerate(records):
        head = f"<p>{name}: the runs of the chosen settings are the report's runs.</p>" if len(records) > 1 else ""
        parts.append(
            head
            + figure(
                f"fig-tuning-{i}",
                grid_figure(rec),
                "Validation score over the grid per method (mean over the seeds, each seed a dot; the chosen "
                "setting ringed). The choice reads validation only; the comparison's tables report the test Dice "
                "of the chosen setting.",
            )
            + markdown_html(tuning_markdown(rec))
        )
    return "".join(parts)


def tuned_paths(paths: Iterable[str | Path]) -> tuple[list[Path], list[tuple[str, dict[str, Any]]]]:
    """``paths`` with every folder that holds a tuning record replaced by its chosen runs, and the records."""
    out: list[Path] = []
    records: list[tuple[str, dict[str, Any]]] = []
    for p in paths:
        rec = read_tuning(p)
        if rec is None:
            out.append(Path(p))
        else:
            records.append((str(p), rec))
            out += chosen_folders(p, rec)
    return out, records
