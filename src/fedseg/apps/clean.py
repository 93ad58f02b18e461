"""``fedseg clean OUT``: prune the finished runs under an output folder as a run does when it finishes.

A run folder is a folder holding ``checkpoints/`` (``fedseg run``'s ``OUT``, or every ``<entry>/<point>/seed<k>``
of a ``compare`` / ``sweep``).  Each finished one (``results.json`` written) loses what only ``--resume`` reads
(:func:`fedseg.seams.checkpoint.prunable`: every site's state and optimizer moments, staged leftovers; with
``keep = "best"`` also the last round's server state; a tensor its best models hold twice is stored once,
:func:`fedseg.seams.checkpoint.compact_best`) and keeps its best models, results, config and history, so
``evaluate``, ``predict``, ``export`` and ``report`` work as before.  An MLflow store beside the runs
(``OUT/mlartifacts``, written by ``--track mlflow`` before it linked the checkpoints) holding a copy of a run's best
checkpoint gets a hard link to the run's file in place of the copy (one copy on disk).

A run without ``results.json`` is unfinished (an interrupted run that ``--resume`` or the same ``compare`` continues):
the command refuses, naming them, before anything is removed, unless ``force``.
"""

from __future__ import annotations

import argparse
import filecmp
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import BEST_ARRAYS, BEST_META, compact_best, prunable, prune_checkpoints

__all__ = ["CleanReport", "add_clean_parser", "clean", "run_folders"]


@dataclass
class CleanReport:
    """What :func:`clean` removed (or would remove, ``dry_run``): ``removed`` [(path, bytes)], ``linked`` MLflow
    copies replaced by hard links [(path, bytes)], the runs found and those left unfinished."""

    runs: list[Path] = field(default_factory=list)
    removed: list[tuple[Path, int]] = field(default_factory=list)
    linked: list[tuple[Path, int]] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(b for _, b in self.removed) + sum(b for _, b in self.linked)


def run_folders(out: str | Path) -> list[Path]:
    """Every run folder under ``out`` (``out`` itself included): a folder with a ``checkpoints/`` folder."""
    found = []
    for root, dirs, _files in os.walk(out):
        if "checkpoints" in dirs:
            found.append(Path(root))
        dirs[:] = sorted(d for d in dirs if d not in ("checkpoints", "mlartifacts", "data"))
    return sorted(found)


def _mlflow_copies(out: Path, runs: list[Path]) -> list[tuple[Path, Path, bool]]:
    """(artifact in ``out/mlartifacts``, the run's file, whether the artifact is a separate copy) for the best
    checkpoints MLflow holds: an artifact folder's ``best.safetensors`` and ``best.json`` both equal to one run's
    (copies, or links to the run's files), so that, linked to the run's files once pruned, they stay a pair."""
    store = out / "mlartifacts"
    if not store.is_dir():
        return []
    by_size: dict[int, list[Path]] = {}
    for r in runs:
        f = r / "checkpoints" / BEST_ARRAYS
        if f.is_file() and (r / "checkpoints" / BEST_META).is_file():
            by_size.setdefault(f.stat().st_size, []).append(r / "checkpoints")
    found = []
    for art in sorted(store.rglob(BEST_ARRAYS)):
        meta = art.with_name(BEST_META)
        for ck in by_size.get(art.stat().st_size, []):
            pair = [(a, ck / a.name) for a in (art, meta)]
            if all(a.is_file() and (os.path.samefile(a, o) or filecmp.cmp(a, o, shallow=False)) for a, o in pair):
                found += [(a, o, not os.path.samefile(a, o)) for a, o in pair]
                break
    return found


def clean(
    out: str | Path,
    keep: str = "best",
    dry_run: bool = False,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> CleanReport:
    """Prune every finished run under ``out`` to what ``keep`` says (``checkpoint_keep``: 'best', a run's default,
    or 'final', which keeps the last round's server state too) and link MLflow's copies of their best checkpoints;
    ``dry_run`` only lists.  Refuses (one error naming them) when some runs are unfinished, unless ``force``, which
    prunes them too (they can no longer be resumed)."""
    out = Path(out)
    if not out.is_dir():
        raise ConfigError(f"{out} is not a folder; give the output folder of a fedseg run, compare or sweep")
    if keep not in ("best", "final"):
        raise ConfigError(f"--keep {keep!r}: use 'best' (the best models) or 'final' (and last round's server state)")
    rep = CleanReport(runs=run_folders(out))
    if not rep.runs:
        raise ConfigError(f"{out} holds no fedseg run (no checkpoints/ folder under it); check the path")
    rep.unfinished = [r for r in rep.runs if not (r / "results.json").is_file()]
    if rep.unfinished and not force:
        names = ", ".join(str(r) for r in rep.unfinished[:5]) + (" …" if len(rep.unfinished) > 5 else "")
        raise ConfigError(
            f"{len(rep.unfinished)} run(s) under {out} are unfinished (no results.json): {names}; finish them "
            "(fedseg run --resume, or the same compare / sweep command) or add --force to prune them anyway "
            "(they can then not be resumed); nothing was removed"
        )
    copies = _mlflow_copies(out, rep.runs)  # matched before pruning rewrites a best file (shared tensors once)
    for r in rep.runs:
        ck = r / "checkpoints"
        gone = prunable(ck, keep)
        if gone and not dry_run:
            gone = prune_checkpoints(ck, keep, force=force)
        elif gone:  # what pruning would also save: the best models' tensors stored twice, stored once
            shared = compact_best(ck, dry_run=True)
            gone = gone + [(ck / f"{BEST_ARRAYS} (tensors stored twice)", shared)] * (shared > 0)
        rep.removed += gone
    for copy, orig, separate in copies:
        size = copy.stat().st_size
        if not dry_run and not os.path.samefile(copy, orig):  # a copy, or a link to the file before pruning
            # the run's file as it is now: best.safetensors and best.json stay a pair
            tmp = copy.with_name(copy.name + ".link")
            try:
                os.link(orig, tmp)
            except OSError as e:  # another file system: the copy stays
                log(f"{copy} stays a copy: it cannot be linked to {orig} ({e})")
                continue
            os.replace(tmp, copy)
        if separate:
            rep.linked.append((copy, size))
    verb = "would remove" if dry_run else "removed"
    for path, size in rep.removed:
        log(f"{verb} {path} ({size / 1e6:.1f} MB)")
    for path, size in rep.linked:
        log(f"{'would link' if dry_run else 'linked'} {path} to its run's file ({size / 1e6:.1f} MB)")
    log(
        f"{len(rep.runs)} run(s) under {out}: {verb} {rep.freed / 1e6:.1f} MB "
        f"({len(rep.removed)} item(s), {len(rep.linked)} MLflow copies); kept the best models, results, config"
        + (" and the last round's server state" if keep == "final" else "")
    )
    return rep


def add_clean_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``clean`` verb to the command line's sub-parsers."""
    c = sub.add_parser(
        "clean",
        help="prune finished runs under OUT to their best models, results and config (what a run keeps by default)",
    )
    c.add_argument("out", help="a run folder, or a compare / sweep / demo folder of runs")
    c.add_argument(
        "--keep",
        choices=["best", "final"],
        default="best",
        help="best (default, what a run keeps): the best models; final: also the last round's server state",
    )
    c.add_argument("--dry-run", action="store_true", help="list what would go and its bytes; remove nothing")
    c.add_argument("--force", action="store_true", help="prune unfinished runs too (they can then not be resumed)")
    c.set_defaults(func=lambda a: (clean(a.out, a.keep, a.dry_run, a.force), 0)[1])
