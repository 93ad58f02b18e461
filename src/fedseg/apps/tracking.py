"""MLflow tracking of runs: ``--track mlflow`` or a ``[tracking]`` section in the run config.

Every finished run becomes one MLflow run: its parameters (the resolved config, flattened to dotted keys), its
per-round metrics from ``results.json``'s history (``train_loss/<site>``, ``val_dice/<candidate>/<site>``,
``val_score/<candidate>``, ``bytes_sent`` / ``bytes_received`` summed over the sites, ``epsilon/<site>`` under
differential privacy; step = round), its final numbers (``client_avg_dice``, ``global_dice``,
``test_dice/<site>``, ``validation_score``) and its files as artifacts (``results.json``, ``results.md``,
``config.toml``, the best checkpoints: in a local store a hard link to the run's file, so that the checkpoint is on
disk once).  The runs of one ``fedseg compare`` or ``fedseg sweep`` are nested under
one parent run that holds the table, the tuning record and the HTML report.

The store is a local SQLite database beside the output (``OUT/mlflow.db``, artifacts in ``OUT/mlartifacts``; no
server) unless ``tracking.uri``, ``--track-uri`` or the environment's ``MLFLOW_TRACKING_URI`` names another (a
tracking server: ``http://host:5000``, which remote workers reach).  A run is logged once: a run already in the
store (tag ``fedseg.folder``) is not logged again when a comparison is continued.

The runs of a study are tracked live (:class:`LiveRun`): the process that runs a run — the driver, a local
worker process, a Ray task or a Slurm task — opens its MLflow run under the study's parent run when it starts
(:class:`TrackTarget`: the store's URI, the experiment, the parent run's id), logs each round's metrics through
the engine's ``on_round`` hook as the round ends, and its final numbers and kept files when it finishes; a
resumed run goes on logging into the same MLflow run.  A failure to log is reported and never ends a run.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedseg.algorithms import known_sections
from fedseg.foundation.config import RunConfig, dataclass_from_dict, load_run_config
from fedseg.foundation.errors import ConfigError

__all__ = [
    "SECTION",
    "LiveRun",
    "MlflowTracker",
    "TrackTarget",
    "TrackingParams",
    "flatten",
    "round_metrics",
    "tracker_for",
    "tracking_params",
]

SECTION = "tracking"


@dataclass(frozen=True)
class TrackingParams:
    """Experiment tracking of finished runs (MLflow).

    backend
        'mlflow' logs every run of ``fedseg run``, ``compare``, ``sweep`` and ``deploy run|rehearse`` as an MLflow run; 'off' (default)
        logs nothing.  ``--track mlflow`` on the command line turns it on as well.
    experiment
        The MLflow experiment the runs go to.
    uri
        The tracking store: empty (default) for ``MLFLOW_TRACKING_URI`` when it is set, else a SQLite store
        beside the output (``OUT/mlflow.db``); or any MLflow tracking URI (``http://host:5000``,
        ``sqlite:///path/mlflow.db``).
    """

    backend: Literal["off", "mlflow"] = "off"
    """'mlflow': each run an MLflow run (parameters, per-round metrics, results, best checkpoints), nested under one parent per compare / sweep; 'off': none (``--track mlflow`` also turns it on)."""
    experiment: str = "fedseg"
    """The MLflow experiment the runs are logged to."""
    uri: str = ""
    """Tracking store: empty = ``MLFLOW_TRACKING_URI`` if set, else a SQLite store beside the output (OUT/mlflow.db, artifacts in OUT/mlartifacts); or any MLflow URI (http://host:5000)."""

    def validate(self) -> None:
        if not self.experiment.strip():
            raise ConfigError('tracking.experiment is empty; name an MLflow experiment (e.g. "fedseg")')


def tracking_params(cfg: RunConfig | Mapping[str, Any]) -> TrackingParams:
    """The run's :class:`TrackingParams` (``cfg.params["tracking"]`` or a plain table), validated."""
    table = cfg.params.get(SECTION, {}) if isinstance(cfg, RunConfig) else cfg
    p = dataclass_from_dict(TrackingParams, dict(table), SECTION)
    p.validate()
    return p


def tracker_for(
    track: str | None,
    out: str | Path,
    config: str | Path | RunConfig | None = None,
    overrides: Sequence[str] = (),
    uri: str | None = None,
) -> MlflowTracker | None:
    """The tracker a command asks for: ``track`` (``--track``: ``"mlflow"`` or ``"off"``) before the run config's
    ``[tracking]`` section (read from ``config`` with ``overrides``; a config that is not there is left to the run
    to refuse); None when tracking is off.  ``uri`` (``--track-uri``): the store, before ``tracking.uri``; it
    turns tracking on unless ``track`` is ``"off"``."""
    params = TrackingParams()
    if config is not None and (isinstance(config, RunConfig) or Path(config).is_file()):
        cfg = config if isinstance(config, RunConfig) else load_run_config(config, list(overrides), known_sections())
        params = tracking_params(cfg)
    backend = track or ("mlflow" if uri else params.backend)
    if backend == "off":
        return None
    if backend != "mlflow":
        raise ConfigError(f"--track {backend!r}: use 'mlflow' (or 'off')")
    return MlflowTracker(out, params.experiment, uri or params.uri)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` → ``{"train.lr": "0.001"}``; lists as ``[a, b]``."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = "[" + ", ".join(str(x) for x in v) + "]"
        else:
            out[key] = str(v)
    return out


_BAD = re.compile(r"[^\w\-. /:]")


def _key(*parts: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . / :`` and spaces): others become ``_``."""
    return _BAD.sub("_", "/".join(parts))


def round_metrics(history: Sequence[Mapping[str, Any]]) -> list[tuple[str, float, int]]:
    """``(name, value, round)`` of every per-round number of a run's history (None and NaN left out)."""
    out: list[tuple[str, float, int]] = []

    def add(name: str, v: Any, step: int) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(float(v)):
            out.append((name, float(v), step))

    for e in history:
        r = int(e["round"])
        for s, v in (e.get("train_loss") or {}).items():
            add(_key("train_loss", s), v, r)
        for cand, per_site in (e.get("val_dice") or {}).items():
            for s, v in (per_site or {}).items():
                add(_key("val_dice", cand, s), v, r)
        for cand, v in (e.get("val_score") or {}).items():
            add(_key("val_score", cand), v, r)
        for kind in ("sent", "received"):
            total = sum(int(b.get(kind, 0)) for b in (e.get("bytes") or {}).values())
            add(f"bytes_{kind}", total, r)
        for s, v in (e.get("epsilon") or {}).items():
            add(_key("epsilon", s), v, r)
        add("time_s", e.get("time_s"), r)
    return out


RUN_FILES = ("results.json", "results.md", "config.toml")
CHECKPOINT_FILES = ("best.safetensors", "best.json")


class MlflowTracker:
    """Logs finished run folders to an MLflow store through ``MlflowClient`` (see the module's docstring)."""

    def __init__(self, out: str | Path, experiment: str = "fedseg", uri: str = ""):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ConfigError(
                f"--track mlflow needs MLflow ({e}); install it with: pip install 'fedseg[track]'"
            ) from None
        out = Path(out).resolve()
        self.experiment = experiment
        self.uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / 'mlflow.db'}"
        local = self.uri.startswith("sqlite:") and not (uri or os.environ.get("MLFLOW_TRACKING_URI"))
        if local:
            out.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = (
            exp.experiment_id
            if exp is not None
            else self.client.create_experiment(
                experiment, artifact_location=(out / "mlartifacts").as_uri() if local else None
            )
        )

    def _find_run(self, tag: str, value: str) -> Any:
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{tag}` = '{value.replace(chr(39), '')}'", max_results=1
        )
        return found[0] if found else None

    def _find(self, tag: str, value: str) -> str | None:
        found = self._find_run(tag, value)
        return found.info.run_id if found is not None else None

    def target(self, parent_id: str | None = None) -> TrackTarget:
        """What a worker needs to log a run of this store live under ``parent_id`` (:class:`LiveRun`)."""
        return TrackTarget(self.uri, self.experiment, parent_id)

    def start_run(self, folder: str | Path, parent_id: str | None = None, name: str | None = None) -> str:
        """The MLflow run of the run in ``folder`` as it starts (tag ``fedseg.live``): the one already opened for
        that folder (a resumed run), else a new one under ``parent_id``."""
        folder = Path(folder).resolve()
        found = self._find_run("fedseg.folder", str(folder))
        if found is not None:
            if "fedseg.complete" not in found.data.tags:
                self.client.update_run(found.info.run_id, status="RUNNING")
            return str(found.info.run_id)
        tags = {"fedseg.folder": str(folder), "fedseg.live": "1"}
        if parent_id is not None:
            tags["mlflow.parentRunId"] = parent_id
        return str(self.client.create_run(self.experiment_id, run_name=name or folder.name, tags=tags).info.run_id)

    def log_round(self, run_id: str, entry: Mapping[str, Any]) -> None:
        """One round's metrics (a history entry, :func:`round_metrics`) at step = its round."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        ms = [Metric(k, v, now, step) for k, v, step in round_metrics([entry])]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(run_id, metrics=ms[i : i + 1000])
        self.client.log_batch(run_id, tags=[RunTag("fedseg.round", str(int(entry["round"])))])

    def parent(self, out: str | Path, kind: str, params: Mapping[str, Any] | None = None) -> str:
        """The parent run of a ``compare`` / ``sweep`` into ``out`` (the same one when the command is continued)."""
        folder = str(Path(out).resolve())
        found = self._find("fedseg.parent", folder)
        if found is not None:
            return found
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"{kind} {Path(out).name}",
            tags={"fedseg.parent": folder, "fedseg.kind": kind},
        )
        self._params(run.info.run_id, flatten(params or {}))
        return run.info.run_id

    def _params(self, run_id: str, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_run(
        self,
        folder: str | Path,
        parent_id: str | None = None,
        params: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> str:
        """Log the finished run in ``folder`` (its ``results.json``) as one MLflow run, with ``params`` and
        ``metrics`` of the caller's (a grid point, its validation score) beside the run's own; returns its id.
        A run already logged from this folder is not logged again; one tracked live (:class:`LiveRun`) gets what
        it lacks (its final numbers and files, then the caller's ``params`` and ``metrics``) once."""
        from mlflow.entities import Metric

        folder = Path(folder).resolve()
        found = self._find_run("fedseg.folder", str(folder))
        tags_now = found.data.tags if found is not None else {}
        if found is not None and "fedseg.live" not in tags_now:
            return str(found.info.run_id)
        extra = bool(params or metrics) and "fedseg.study" not in tags_now
        if "fedseg.complete" in tags_now and not extra:
            return str(found.info.run_id)
        res = json.loads((folder / "results.json").read_text())
        tags = {"fedseg.folder": str(folder), "fedseg.method": str(res["method"]), "fedseg.seed": str(res["seed"])}
        if parent_id is not None:
            tags["mlflow.parentRunId"] = parent_id
        if found is None:
            run = self.client.create_run(self.experiment_id, run_name=f"{res['label']} seed {res['seed']}", tags=tags)
            rid = run.info.run_id
        else:
            rid = found.info.run_id
            if "fedseg.complete" in tags_now:  # finished by its worker: the study's own numbers only
                self._params(rid, flatten(params or {}))
                self.log_metrics(
                    rid, dict(metrics or {}), step=max((int(e["round"]) for e in res.get("history") or []), default=0)
                )
                self.client.set_tag(rid, "fedseg.study", "1")
                return str(rid)
            for k, v in tags.items():
                self.client.set_tag(rid, k, v)
            self.client.set_tag(rid, "mlflow.runName", f"{res['label']} seed {res['seed']}")
        self._params(rid, {**flatten(res.get("config") or {}), **flatten(params or {})})
        now = int(time.time() * 1000)
        logged = int(tags_now.get("fedseg.round", 0))  # a live run's rounds up to this one were logged as they ended
        history = [e for e in res.get("history") or [] if int(e["round"]) > logged]
        ms = [Metric(k, v, now, step) for k, v, step in round_metrics(history)]
        final = {
            "client_avg_dice": res.get("client_avg_dice"),
            "global_dice": res.get("global_dice"),
            **(metrics or {}),
        }
        final.update({_key("test_dice", s): v for s, v in (res.get("per_site_dice") or {}).items()})
        last = max((int(e["round"]) for e in res.get("history") or []), default=0)
        ms += [
            Metric(k, float(v), now, last)
            for k, v in final.items()
            if isinstance(v, (int, float)) and not math.isnan(v)
        ]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(rid, metrics=ms[i : i + 1000])
        for name in RUN_FILES:
            if (folder / name).is_file():
                self.client.log_artifact(rid, str(folder / name))
        for name in CHECKPOINT_FILES:
            if (folder / "checkpoints" / name).is_file():
                self.log_once(rid, folder / "checkpoints" / name, "checkpoints")
        self.client.set_tag(rid, "fedseg.complete", "1")
        if params or metrics:
            self.client.set_tag(rid, "fedseg.study", "1")
        self.client.set_terminated(rid)
        return str(rid)

    def log_once(self, run_id: str, path: Path, artifact_path: str) -> None:
        """Log ``path`` as an artifact of the run without a second copy on this machine: in a local artifact store
        (``file:`` URI, the default ``OUT/mlartifacts``) a hard link to the file (the run's checkpoint and the
        artifact are one file on disk; a later rewrite of the run's file replaces it, the artifact keeps its
        bytes); in a remote store (a tracking server) an upload, and a copy where a link is not possible (another
        file system)."""
        uri = self.client.get_run(run_id).info.artifact_uri
        if uri.startswith("file:") or Path(uri).is_absolute():
            from mlflow.utils.file_utils import local_file_uri_to_path

            dest = Path(local_file_uri_to_path(uri)) / artifact_path / path.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                if dest.exists():
                    dest.unlink()
                os.link(path, dest)
                return
            except OSError:
                pass  # another file system: copied by MLflow below
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_files(self, run_id: str, files: Sequence[str | Path]) -> None:
        """Attach the files that exist among ``files`` to a run as artifacts."""
        for f in files:
            if Path(f).is_file():
                self.client.log_artifact(run_id, str(f))

    def log_metrics(self, run_id: str, values: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(_key(k), float(v), now, step) for k, v in values.items() if not math.isnan(float(v))]
        if ms:
            self.client.log_batch(run_id, metrics=ms)

    def end(self, run_id: str) -> None:
        self.client.set_terminated(run_id)


@dataclass(frozen=True)
class TrackTarget:
    """Where a worker logs a study's run live: the tracking store's URI (one the worker reaches), the
    experiment, and the study's parent run (None: a run of its own)."""

    uri: str
    experiment: str = "fedseg"
    parent_id: str | None = None


class LiveRun:
    """A run's MLflow run, logged as the run goes: opened (or reopened, for a resumed run) under
    ``target.parent_id`` when made, each round's metrics when the engine calls it with the round's history entry
    (its ``on_round`` hook), the final numbers and kept files on :meth:`finish`.  Any failure to log is said once
    through ``log`` and ends the logging, never the run."""

    def __init__(self, target: TrackTarget, folder: str | Path, name: str | None = None, log: Any = print) -> None:
        self.target, self.folder, self.log = target, Path(folder), log
        self.tracker: MlflowTracker | None = None
        self.run_id: str | None = None
        try:
            self.tracker = MlflowTracker(folder, target.experiment, target.uri)
            self.run_id = self.tracker.start_run(folder, target.parent_id, name)
        except Exception as e:
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        self.log(f"{self.folder}: MLflow logging stopped ({type(e).__name__}: {e}); the run goes on")
        self.tracker = None

    def __call__(self, entry: Mapping[str, Any]) -> None:
        if self.tracker is None or self.run_id is None:
            return
        try:
            self.tracker.log_round(self.run_id, entry)
        except Exception as e:
            self._failed(e)

    def finish(self) -> None:
        """Log the finished run's final numbers and kept files (:meth:`MlflowTracker.log_run`)."""
        if self.tracker is None:
            return
        try:
            self.tracker.log_run(self.folder, self.target.parent_id)
        except Exception as e:
            self._failed(e)
