"""Checkpoint files: atomic writes, the commit protocol, best models and site state — safetensors + JSON, no pickle.

Every file fedseg writes for a run and reads back goes through this module, so the format
is spelled out once.  Layout of a run folder's ``checkpoints/``:

* ``server.safetensors`` — the algorithm's server state (one flat ``dict[str, Tensor]``);
* ``best.safetensors`` + ``best.json`` — the best arrays of every candidate, each prefixed by
  its name (``global/…``, ``local/site1/…``, ``fedsm/selector/…``), and per candidate its
  validation score, round, predictor kind, validation sites, home site and predictor config
  (:func:`best_files` writes them, :func:`load_best` reads them back as :class:`Best`);
* ``sites/<site>.safetensors`` + ``<site>.json`` — each site's models, optimizer moments,
  fp16 scalers and ``store`` (:meth:`fedseg.site.runtime.Site.state_arrays`;
  :func:`save_site` / :func:`restore_site`; deployed sites write the same two files into
  their own work folder);
* ``progress.json`` — the last completed round, the history, the names/shapes/dtypes of the
  server and best arrays (``layout``) and the staged file names: the commit record;
* ``pruned.json`` — written when a finished run's resumable state was removed
  (:func:`prune_checkpoints`, ``checkpoint_keep``): what went, its bytes and the setting; a resume of
  that run is refused with one message (:func:`check_resumable`).

A checkpoint is written as one unit: every file first as ``<name>.next`` (sites to
``sites.next/``), then ``progress.json.next`` (the record), then everything is moved into
place (:func:`commit_checkpoint`), so a crash never pairs one round's server state with
another round's progress.  :class:`fedseg.seams.writer.CheckpointWriter` does this from host copies, in a
background thread.  Every tensor on disk is a host (CPU) tensor, so a run checkpointed on a
GPU resumes on the CPU and back.

Layer: this module sits beside :mod:`fedseg.seams.algorithm` (``tests/unit/test_layers.py``),
above :mod:`fedseg.site.runtime`, because each best-model record it reads and writes is a
:class:`~fedseg.seams.algorithm.Candidate` of the server half and the site state it saves is a
:class:`~fedseg.site.runtime.Site`'s; the site itself does no file I/O, and no algorithm imports
this module.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from fedseg.foundation.arrays import Arrays, check_layout, nonfinite, prefixed, strip_prefix
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.seams.algorithm import Candidate

__all__ = [
    "BEST_ARRAYS",
    "BEST_META",
    "PROGRESS",
    "PRUNED",
    "SERVER",
    "SITES",
    "Best",
    "JsonDoc",
    "best_files",
    "check_resumable",
    "commit_checkpoint",
    "compact_best",
    "load_best",
    "load_checked",
    "prunable",
    "prune_checkpoints",
    "read_best_meta",
    "read_progress",
    "restore_site",
    "save_arrays",
    "save_json",
    "save_site",
]

SERVER = "server.safetensors"
BEST_ARRAYS = "best.safetensors"
BEST_META = "best.json"
PROGRESS = "progress.json"
PRUNED = "pruned.json"
SITES = "sites"
_RESUME_FIX = "restore {name} from a backup, or start the run again without --resume"


# ------------------------------------------------------------------ atomic writes
def save_arrays(arrays: Arrays, path: Path) -> None:
    """Write safetensors atomically: a temp file, then a rename (a crash leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in arrays.items()}, str(tmp))
    os.replace(tmp, path)


def save_json(data: Any, path: Path) -> None:
    """Write JSON atomically: a temp file, fsync, rename (a crash leaves the old file or the new one, never half)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(data, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checked(path: Path, layout: dict[str, Any] | None, fix: str | None = None) -> Arrays:
    """Load a safetensors file fedseg wrote: readable, the names/shapes/dtypes recorded when it was saved
    (``progress.json["layout"]``; None: not checked), every float finite; else one error naming
    the file and ``fix`` (default: restore it or start the run again without ``--resume``).

    With a layout the arrays come back in its order, the order they had when saved (a safetensors file
    gives them back in an order of its own, by dtype and name), so a resumed run iterates over its state
    as the uninterrupted run does and every sum over it (a diagnostic norm) is bitwise the same."""
    fix = fix or _RESUME_FIX.format(name=path.name)
    try:
        arrays = load_file(str(path))
    except Exception as e:
        raise ConfigError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e}); {fix}") from None
    try:
        if layout is not None:
            check_layout(arrays, layout)
            arrays = {k: arrays[k] for k in layout}
        bad = nonfinite(arrays)
        if bad:
            raise PayloadError(f"non-finite values in {bad[:5]}")
    except PayloadError as e:
        raise ConfigError(f"checkpoint file {path} is not the one this run saved: {e}; {fix}") from None
    return arrays


# ------------------------------------------------------------------ best models
@dataclass
class Best:
    """Best validation result of one candidate so far: its score, its round and the candidate (arrays + how to run it)."""

    score: float
    round: int
    candidate: Candidate


def best_files(best: Mapping[str, Best]) -> tuple[Arrays, dict[str, Any]]:
    """The contents of ``best.safetensors`` (every candidate's arrays prefixed by its name) and ``best.json``."""
    meta = {}
    arrays: Arrays = {}
    for name, b in best.items():
        c = b.candidate
        meta[name] = {
            "score": b.score,
            "round": b.round,
            "predictor": c.predictor,
            "val_sites": c.val_sites,
            "home_site": c.home_site,
            "config": c.config,
        }
    for name, b in best.items():
        arrays.update(prefixed(name, b.candidate.arrays))
    return arrays, meta


_BEST_KEYS = ("score", "round", "predictor", "val_sites", "home_site", "config")


def read_best_meta(folder: str | Path, fix: str | None = None) -> dict[str, dict[str, Any]]:
    """``best.json`` of the checkpoint folder ``folder``: ``{candidate: {score, round, predictor, val_sites,
    home_site, config}}`` (what :func:`best_files` wrote), without loading the arrays; one error naming the
    file when it is missing or damaged."""
    path = Path(folder) / BEST_META
    if not path.is_file() or not (Path(folder) / BEST_ARRAYS).is_file():
        raise ConfigError(
            f"{path.parent.parent} has no {path.parent.name}/{BEST_META} + {BEST_ARRAYS} (the best models of a "
            "finished fedseg run); give the folder of a finished run"
        )
    try:
        meta = json.loads(path.read_text())
        bad = [n for n, m in meta.items() if not isinstance(m, dict) or any(k not in m for k in _BEST_KEYS)]
    except (ValueError, AttributeError) as e:
        bad, meta = [f"{type(e).__name__}: {e}"], None
    if bad or not isinstance(meta, dict):
        raise ConfigError(
            f"{path} is damaged (entries {bad[:3]} lack {list(_BEST_KEYS)}); "
            f"{fix or _RESUME_FIX.format(name=path.name)}"
        )
    return meta


def load_best(folder: str | Path, layout: dict[str, Any] | None = None, fix: str | None = None) -> dict[str, Best]:
    """``{candidate: Best}`` from ``folder/best.safetensors`` + ``best.json`` (host tensors), checked as
    :func:`load_checked` and :func:`read_best_meta`; a tensor a finished run stores once for several candidates
    (``best.json``'s ``aliases``, :func:`compact_best`) is given to each of them."""
    meta = read_best_meta(folder, fix)
    arrays = load_checked(Path(folder) / BEST_ARRAYS, layout, fix)
    out = {}
    for name, m in meta.items():
        vs = tuple(m["val_sites"]) if m["val_sites"] is not None else None
        own = strip_prefix(name, arrays)
        try:  # a finished run's shared tensors (compact_best): stored once, under another candidate's name
            own.update({k: arrays[t].clone() for k, t in (m.get("aliases") or {}).items()})
        except (KeyError, AttributeError, TypeError) as e:
            raise ConfigError(
                f"{Path(folder) / BEST_META} names a shared tensor that {BEST_ARRAYS} lacks ({e}); "
                f"{fix or _RESUME_FIX.format(name=BEST_META)}"
            ) from None
        cand = Candidate(name, own, m["predictor"], vs, m["home_site"], m["config"])
        out[name] = Best(m["score"], m["round"], cand)
    return out


# ------------------------------------------------------------------ site state
class SiteState(Protocol):
    """What a site's state files are written from and read into (a :class:`fedseg.site.runtime.Site`)."""

    name: str

    def state_arrays(self, copy: bool = True) -> tuple[Arrays, dict[str, Any]]: ...

    def load_state_arrays(self, arrays: Arrays, meta: dict[str, Any]) -> None: ...


def save_site(site: SiteState, folder: str | Path) -> Path:
    """Write the site's state (:meth:`Site.state_arrays`) to ``folder/<site>.safetensors`` + ``.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays, meta = site.state_arrays()
    path = folder / f"{site.name}.safetensors"
    save_arrays(arrays, path)
    save_json(meta, path.with_suffix(".json"))
    return path


def restore_site(site: SiteState, folder: str | Path) -> bool:
    """Load the state :func:`save_site` wrote into ``site``; False when ``folder`` holds none for it.
    A state that is unreadable, non-finite or does not fit the site's models is one error naming the file."""
    path = Path(folder) / f"{site.name}.safetensors"
    if not path.is_file():
        return False
    arrays = load_checked(path, None)
    fix = f"restore {path.name} and its .json from a backup, or start the run again without --resume"
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        site.load_state_arrays(arrays, meta)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:  # unreadable JSON, state that does not fit
        raise ConfigError(
            f"site state {path} does not fit this run's site {site.name!r} ({type(e).__name__}: {str(e)[:300]}); {fix}"
        ) from None
    return True


# ------------------------------------------------------------------ commit protocol
def read_progress(d: str | Path) -> dict[str, Any] | None:
    """``progress.json`` of the last committed checkpoint in ``d`` (round, history, layout), None when there
    is none yet; a damaged record is one error naming the file.  Reads only (a supervisor may poll it while
    the server writes): :func:`commit_checkpoint` first to finish an interrupted commit."""
    path = Path(d) / PROGRESS
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        progress = json.loads(text)
        int(progress["round"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} is damaged ({type(e).__name__}: {e}); {_RESUME_FIX.format(name=path.name)}"
        ) from None
    return progress


@dataclass(frozen=True)
class JsonDoc:
    """A JSON file of a staged checkpoint (a snapshot: nothing the round loop changes later)."""

    data: Any


def commit_checkpoint(d: Path) -> None:
    """Move a staged checkpoint into place if its commit record ``progress.json.next`` exists (idempotent:
    safe to repeat after a crash half-way); otherwise drop staged leftovers of an unfinished save."""
    record = d / (PROGRESS + ".next")
    if record.is_file():
        for name in json.loads(record.read_text()).get("staged", []):
            if (d / (name + ".next")).is_file():
                os.replace(d / (name + ".next"), d / name)
        if (d / (SITES + ".next")).is_dir():
            (d / SITES).mkdir(exist_ok=True)
            for f in (d / (SITES + ".next")).iterdir():
                os.replace(f, d / SITES / f.name)
            (d / (SITES + ".next")).rmdir()
        os.replace(record, d / PROGRESS)
        return
    for f in d.glob("*.next"):
        if f.is_dir():
            shutil.rmtree(f)
        else:
            f.unlink()


# ------------------------------------------------------------------ finished runs
def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def prunable(d: str | Path, keep: str) -> list[tuple[Path, int]]:
    """The files and folders of the checkpoint folder ``d`` a finished run does not keep under ``keep``
    (``checkpoint_keep``), each with its bytes: every site's state (``sites/``, models, optimizer moments and
    scalers: what only ``--resume`` reads), staged leftovers (``*.next``, ``*.tmp``) and, under ``"best"``, the
    last round's server state.  Kept: ``best.safetensors`` + ``best.json`` (every candidate's best round and the
    models assembled after the last round, FedSM's composite: what ``evaluate``, ``predict``, ``export``, the
    report and MLflow read), ``progress.json`` (the last round and the history) and, under ``"final"``,
    ``server.safetensors``; ``"all"`` keeps everything."""
    d = Path(d)
    if keep not in ("best", "final", "all"):
        raise ConfigError(f"checkpoint_keep = {keep!r}; use 'best', 'final' or 'all'")
    if keep == "all" or not d.is_dir():
        return []
    gone = [d / SITES, *sorted(d.glob("*.next")), *sorted(d.glob("*.tmp"))]
    if keep == "best":
        gone.append(d / SERVER)
    return [(p, _size(p)) for p in gone if p.exists()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (so that -0.0 and 0.0 differ)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def compact_best(d: str | Path, dry_run: bool = False) -> int:
    """Store every tensor of ``d/best.safetensors`` once: a candidate's tensor equal (dtype, shape, bytes) to one
    stored under an earlier candidate's name is dropped from the file and named in that candidate's ``aliases``
    in ``best.json`` (``{its name: the stored name}``; :func:`load_best` gives it back).  FedSM's composite is
    its best global and personalized models and a selector: its copies of them go.  Returns the bytes saved
    (``dry_run``: the bytes of the tensors it would drop, nothing written).  Only for a finished run: the file no
    longer has the layout ``progress.json`` records for ``--resume``."""
    d = Path(d)
    path = d / BEST_ARRAYS
    if not path.is_file() or not (d / BEST_META).is_file():
        return 0
    meta = read_best_meta(d)
    arrays = load_checked(path, None, fix=f"restore {path} from a backup or run the run again")
    kept: Arrays = {}
    by_shape: dict[tuple[Any, ...], list[str]] = {}
    for name, m in meta.items():
        aliases = dict(m.get("aliases") or {})
        for k, v in strip_prefix(name, arrays).items():
            key = (v.dtype, tuple(v.shape))
            same = next((t for t in by_shape.get(key, []) if torch.equal(_bits(kept[t]), _bits(v))), None)
            if same is None:
                kept[f"{name}/{k}"] = v
                by_shape.setdefault(key, []).append(f"{name}/{k}")
            else:
                aliases[k] = same
        if aliases:
            m["aliases"] = aliases
    saved = path.stat().st_size
    if len(kept) == len(arrays):
        return 0
    if dry_run:
        return sum(v.numel() * v.element_size() for k, v in arrays.items() if k not in kept)
    save_arrays(kept, path)
    save_json(meta, d / BEST_META)
    return saved - path.stat().st_size


def prune_checkpoints(d: str | Path, keep: str, *, force: bool = False) -> list[tuple[Path, int]]:
    """Remove what a finished run does not keep (:func:`prunable`) from the checkpoint folder ``d`` and record it
    in ``pruned.json``; returns what was removed (nothing under ``keep = "all"``).  A folder without
    ``best.safetensors`` + ``best.json`` is refused unless ``force``: pruning it would leave no model."""
    d = Path(d)
    gone = prunable(d, keep)
    if not gone:
        return []
    if not force and not ((d / BEST_ARRAYS).is_file() and (d / BEST_META).is_file()):
        raise ConfigError(
            f"{d} has no {BEST_ARRAYS} + {BEST_META}: pruning its resumable state would leave no model; "
            "finish the run first (or force it)"
        )
    prev = json.loads((d / PRUNED).read_text()) if (d / PRUNED).is_file() else {"removed": {}}
    removed = dict(prev.get("removed") or {})
    for path, size in gone:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed[path.name] = removed.get(path.name, 0) + size
    shared = compact_best(d)
    if shared:
        gone.append((d / f"{BEST_ARRAYS} (tensors stored twice)", shared))
        removed[f"{BEST_ARRAYS} (tensors stored twice)"] = shared
    save_json({"keep": keep, "removed": removed, "bytes": sum(removed.values())}, d / PRUNED)
    return gone


def check_resumable(d: str | Path) -> None:
    """Refuse, with one message, to resume from the checkpoint folder ``d`` of a finished run whose resumable
    state was pruned (``pruned.json``)."""
    path = Path(d) / PRUNED
    if not path.is_file():
        return
    try:
        keep = json.loads(path.read_text()).get("keep", "best")
    except (ValueError, AttributeError):
        keep = "best"
    raise ConfigError(
        f"{Path(d).parent} is a finished run whose resumable state (every site's state and optimizer moments) was "
        f"pruned (checkpoint_keep = {keep!r}, see {path.name}); its best models, results and config are kept for "
        "fedseg evaluate / predict / export / report. To train further start a new run; set checkpoint_keep = "
        '"all" (--set checkpoint_keep=all) to keep what --resume needs'
    )
