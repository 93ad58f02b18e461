"""Finding run folders, labelling runs, and rebuilding a finished run's models and data.

A run folder (``docs/results-format.md``) holds ``results.json``, ``config.toml`` and
``checkpoints/best.safetensors`` + ``best.json`` (the best arrays of every candidate,
prefixed by its name: ``global/…``, ``local/site1/…``, FedSM's composite
``fedsm/global/…``, ``fedsm/selector/…``, ``fedsm/personal/<site>/…``).  The model
sections of a report (loss surface, t-SNE, sample predictions) rebuild the models
from those arrays and the data from the run's federation spec, as
:func:`fedseg.apps.studies.compare.evaluate_run` does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedseg.algorithms import REGISTRY, get_algorithm, known_sections
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.arrays import Arrays, strip_prefix
from fedseg.foundation.config import load_run_config
from fedseg.foundation.device import DTYPES
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import best_files, load_best
from fedseg.site.runtime import Site
from fedseg.site.workload import workload_for

__all__ = [
    "DataCache",
    "Run",
    "RunModels",
    "find_run_dirs",
    "given_settings",
    "load_runs",
    "method_settings",
    "primary_of",
    "run_label",
    "sites_of",
    "variant_labels",
    "variants_of",
]


@dataclass
class Run:
    """One finished run: its folder, its ``results.json``, its variant label (method + settings) and a unique label (variant + seed)."""

    path: Path
    results: dict[str, Any]
    label: str = ""
    variant: str = ""

    @property
    def method(self) -> str:
        return str(self.results["method"])

    @property
    def seed(self) -> Any:
        return self.results.get("seed")

    @property
    def heldout(self) -> str | None:
        """The site left out of training (FedSM unseen-site runs, Table 5), if any."""
        rep = self.results.get("fedsm")
        return rep.get("heldout") if isinstance(rep, dict) else None


def find_run_dirs(paths: Iterable[str | Path], max_depth: int = 3) -> list[Path]:
    """Run folders named by ``paths``: each folder with a ``results.json`` itself, or those below it.

    A comparison folder (``fedseg compare``: ``OUT/<method>/seed<k>/``) or a FedSM study
    folder (``OUT/unseen-<site>/``) expands to its runs, in sorted order.
    """
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "results.json").is_file():
            found = [p]
        elif p.is_file() and p.name == "results.json":
            found = [p.parent]
        elif p.is_dir():
            found = sorted(
                {
                    f.parent
                    for d in range(1, max_depth + 1)
                    for f in p.glob("/".join(["*"] * d) + "/results.json")
                    if "mlartifacts" not in f.relative_to(p).parts  # copies logged to a local MLflow store
                }
            )
        else:
            raise ConfigError(f"{p} does not exist; give the output folder of a finished run (it holds results.json)")
        if not found:
            raise ConfigError(
                f"{p} holds no results.json (also not in its subfolders); give the output folder of a finished fedseg run"
            )
        out += [f for f in found if f not in out]
    return out


def run_label(results: dict[str, Any]) -> str:
    """Display label of the run: ``results["label"]`` (the algorithm's, e.g. "Auto-FedAvg-N-Dirichlet", or a
    study's variant label); `` (unseen <site>)`` added for a FedSM run with a held-out site."""
    label = str(results["label"])
    rep = results.get("fedsm")
    if isinstance(rep, dict) and rep.get("heldout"):
        label += f" (unseen {rep['heldout']})"
    return label


def given_settings(results: dict[str, Any]) -> dict[str, Any]:
    """The settings a run was given in its method's own config section (``[fedsm]`` for every FedSM variant), from
    ``results["config"]``, and ``dp`` (``privacy.dp``) for a run with differential privacy (``results["privacy"]``),
    so that a DP run is never a seed of the same method's run without it."""
    cls = REGISTRY.get(str(results.get("method")))
    section = getattr(cls, "section", None) or str(results.get("method"))
    given = (results.get("config") or {}).get(section)
    out = dict(given) if isinstance(given, dict) else {}
    priv = results.get("privacy")
    if isinstance(priv, dict) and priv.get("dp"):
        out["dp"] = priv["dp"]
    return out


def _setting(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_setting(x) for x in v) + "]"
    return f"{v:g}" if isinstance(v, float) else str(v)


def variant_labels(results: Sequence[dict[str, Any]]) -> list[str]:
    """One label per run naming its method **and** variant, as ``fedseg compare`` does: ``FedSM (gamma=auto)``.

    The variant is the settings of the method's own section that differ between runs
    with the same :func:`run_label` (a setting absent from a run is not printed for it),
    so two runs with different settings never share a label, and a method run in one
    variant keeps its plain label.  Seeds are not part of the label: runs with the same
    label are seeds of one variant.
    """
    base = [run_label(r) for r in results]
    given = [given_settings(r) for r in results]
    out = []
    for i in range(len(results)):
        same = [j for j in range(len(results)) if base[j] == base[i]]
        keys = sorted({k for j in same for k in given[j]})
        differ = [k for k in keys if len({repr(given[j].get(k, "\0absent")) for j in same}) > 1]
        pairs = [f"{k}={_setting(given[i][k])}" for k in differ if k in given[i]]
        out.append(f"{base[i]} ({', '.join(pairs)})" if pairs else base[i])
    return out


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Read every run under ``paths`` (see :func:`find_run_dirs`).

    ``Run.variant`` names the method and its variant settings (:func:`variant_labels`);
    ``Run.label`` is unique: the variant, plus `` seed k`` where the variant has several runs.
    """
    runs = []
    for d in find_run_dirs(paths):
        try:
            results = json.loads((d / "results.json").read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{d / 'results.json'} is not valid JSON ({e}); was the run interrupted while writing?"
            ) from None
        missing = [
            k
            for k in ("method", "sites", "per_site_dice", "client_avg_dice", "global_dice", "history")
            if k not in results
        ]
        if missing:
            raise ConfigError(
                f"{d / 'results.json'} lacks {missing}; it is not a fedseg results file (docs/results-format.md)"
            )
        runs.append(Run(d, results))
    for r, v in zip(runs, variant_labels([r.results for r in runs])):
        r.variant = r.label = v
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.variant] = counts.get(r.variant, 0) + 1
    seen: dict[str, int] = {}
    for r in runs:
        if counts[r.variant] > 1:
            seen[r.variant] = seen.get(r.variant, 0) + 1
            r.label = f"{r.variant} seed {r.seed}" if r.seed is not None else f"{r.variant} #{seen[r.variant]}"
    labels = [r.label for r in runs]
    for r in runs:  # the same variant and seed twice (e.g. a run given by two paths): number them
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.path.name})"
    return runs


def variants_of(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """``{variant label: its runs (seeds)}`` in first-seen order."""
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(r.variant, []).append(r)
    return out


def method_settings(run: Run) -> dict[str, Any]:
    """The method's effective settings (its ``Params`` with defaults filled in), from the run's config.toml; {} if unknown."""
    try:
        cfg = load_run_config(run.path / "config.toml", known_sections=known_sections())
        params = get_algorithm(cfg).params
        return dataclasses.asdict(params) if dataclasses.is_dataclass(params) and not isinstance(params, type) else {}
    except Exception:  # an unknown method, or a config from another version
        return {}


def primary_of(method: str) -> str | None:
    """The method's primary candidate (``"global"``, ``"fedsm"``…), None for site-owned models; ``"global"`` if unknown."""
    cls = REGISTRY.get(method)
    return cls.primary if cls is not None else "global"


class DataCache:
    """Federation data loaded once per spec and shared by every run on it."""

    def __init__(self, progress: bool = False):
        self.progress = progress
        self._cache: dict[str, tuple[Any, dict[str, Any]]] = {}

    def get(self, federation: str | Path) -> tuple[Any, dict[str, Any]]:
        key = str(Path(federation).resolve())
        if key not in self._cache:
            if not Path(key).is_file():
                raise ConfigError(f"federation spec {federation} not found; the model sections need the run's data")
            self._cache[key] = load_federation_data(key, progress=self.progress)
        return self._cache[key]


@dataclass
class RunModels:
    """A finished run's configuration, data, workload, algorithm and best arrays, rebuilt from its folder."""

    run: Run
    cfg: Any
    fed: Any
    data: dict[str, Any]
    workload: Any
    algorithm: Any
    best: Arrays
    meta: dict[str, dict[str, Any]]
    _sites: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, run: Run, cache: DataCache) -> RunModels:
        fix = "the model sections need the checkpoints of a finished run: restore them or run it again"
        saved = load_best(run.path / "checkpoints", fix=fix)
        if not (run.path / "config.toml").is_file():
            raise ConfigError(f"{run.path} has no config.toml")
        cfg = load_run_config(run.path / "config.toml", known_sections=known_sections())
        fed, data = cache.get(cfg.federation)
        best, meta = best_files(saved)
        return cls(run, cfg, fed, data, workload_for(fed, cfg), get_algorithm(cfg), best, meta)

    # ------------------------------------------------------------ candidates
    def arrays(self, name: str) -> Arrays:
        """Best arrays of candidate ``name`` (prefix stripped)."""
        if name not in self.meta:
            raise KeyError(f"run {self.run.path} has no best candidate {name!r}; candidates: {sorted(self.meta)}")
        return strip_prefix(name, self.best)

    def own_candidate(self, site: str) -> str | None:
        """The candidate that belongs to ``site`` (``local/<site>``, ``personal/<site>``…), if any."""
        for name, m in self.meta.items():
            if m.get("home_site") == site:
                return name
        return None

    def build_model(self, arrays: Arrays) -> nn.Module:
        """The workload's model with ``arrays`` loaded (eval mode, the run's dtype)."""
        dtype = DTYPES[self.cfg.train.dtype]
        model = self.workload.build_model().to(dtype)
        model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in arrays.items()})
        model.eval()
        return model

    def loss_model(self, site: str) -> tuple[str, nn.Module] | None:
        """The model whose loss surface represents this method on ``site``'s data.

        Site-owned methods (local, personalization): the site's own model.  FedSM: the
        SoftPull personalized model of the site inside the composite.  Others: the
        primary candidate (FedAvg's global model).  None if the run has none that is a
        plain workload model.
        """
        primary = primary_of(self.run.method)
        if primary is None:
            name = self.own_candidate(site)
            if name is None or self.meta[name].get("predictor") != "model":
                return None
            return name, self.build_model(self.arrays(name))
        m = self.meta.get(primary)
        if m is None:
            return None
        if m.get("predictor") == "model":
            return primary, self.build_model(self.arrays(primary))
        arrays = self.arrays(primary)
        personal = strip_prefix(f"personal/{site}", arrays)
        if personal:
            return f"{primary}: personal/{site}", self.build_model(personal)
        return None

    # ----------------------------------------------------------- prediction
    def site(self, name: str):
        """A :class:`fedseg.site.runtime.Site` holding ``name``'s data (to run the algorithm's predictors)."""
        if name not in self._sites:
            index = list(self.data).index(name)
            self._sites[name] = Site(name, index, self.data[name], self.workload, self.cfg, self.algorithm)
        return self._sites[name]

    def predictor(self, site: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
        """``(candidate, predict)`` of the method's row on ``site``: the primary candidate, or the site's own model."""
        primary = primary_of(self.run.method)
        name = self.own_candidate(site) if primary is None else (primary if primary in self.meta else None)
        if name is None:
            return None
        m = self.meta[name]
        make = self.algorithm.predictors().get(m.get("predictor", "model"))
        if make is None:
            return None
        return name, make(self.site(site), self.arrays(name), m.get("config") or {})

    # -------------------------------------------------------------- selector
    def selector(self) -> nn.Module | None:
        """FedSM's trained model selector (from the composite's ``selector/`` arrays), or None."""
        for name, m in self.meta.items():
            arrays = strip_prefix("selector", self.arrays(name))
            if not arrays:
                continue
            num_classes = int((m.get("config") or {}).get("num_classes", 0)) or None
            p = self.algorithm.params
            width, hidden = getattr(p, "selector_width", 0.25), getattr(p, "selector_hidden", 128)
            if num_classes is None:
                last = [v for k, v in arrays.items() if k.endswith("weight")][-1]
                num_classes = int(last.shape[0])
            sel = self.workload.selector(num_classes, width=width, hidden=hidden)
            sel.load_state_dict(arrays)
            sel.eval()
            return sel
        return None


def sites_of(runs: Sequence[Run]) -> list[str]:
    """Union of the runs' sites, in first-seen order."""
    out: list[str] = []
    for r in runs:
        for s in r.results["sites"]:
            if s not in out:
                out.append(s)
    return out
