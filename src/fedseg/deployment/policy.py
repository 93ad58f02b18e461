"""A deployed site's own privacy policy: floors it enforces whatever the server's job says.

The policy is a JSON file of the site's, beside its site config in its kit's ``local/`` folder
(``fedseg_policy.json``; ``fedseg deploy site --policy FILE`` names another).  ``fedseg deploy site``
writes it with the defaults below when it does not exist.  The server never sees the file; it sees
what the site does with it:

* **at setup** the site checks the run config the server sends against every floor
  (:meth:`SitePolicy.refusals`); a run below one is refused — the site logs why, answers the setup
  with ``{"refused": [reasons]}`` (the server logs it as the site's dropout and, when too few sites
  remain, stops the run with the reasons), and answers every later task of that run with the refusal;
* **per task** it refuses a kind its policy does not allow (:meth:`SitePolicy.task_refusal`), the
  release of its final model without consent included;
* **evaluation** replies carry per-case scores or, under ``"evaluation": "aggregates"``, each
  candidate's mean over the site's cases only (:func:`aggregate_scores`);
* **the site's own settings** replace the run's whatever it says (:func:`site_held`: its identity signs,
  its DP randomness is its OS's unless ``reproducible``), and what it enforced is logged and reported
  (:func:`enforced`).

The settings mirror NVIDIA FLARE's site-enforced privacy scopes (a site's ``privacy.json`` names the
scopes it accepts and the filters it applies, and a job asking for another scope is refused).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from fedseg.foundation.config import DP_MODES
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import split_name

__all__ = [
    "POLICY_NAME",
    "RELEASE_KINDS",
    "SitePolicy",
    "aggregate_scores",
    "enforced",
    "read_policy",
    "site_held",
    "write_policy",
]

POLICY_NAME = "fedseg_policy.json"
"""File name of a site's policy inside its kit's ``local/`` folder."""

RELEASE_KINDS = frozenset({"fedsm_release"})
"""Task kinds that hand a site's final model (one it keeps as its own, never summed) to the server:
refused unless the policy's ``release_models`` is true."""

ALWAYS_ALLOWED = ("privacy",)
"""Task kinds a site answers whatever its ``tasks`` list says: its ε report (``"privacy"``) and secure
aggregation's own steps (``"secagg/…"``), which carry keys and shares, never data."""

EVALUATION = ("per_case", "aggregates")

EVALUATION_KINDS = frozenset({"evaluate", "route"})
"""Task kinds that score models on a split the task names (the built-in evaluation, FedSM's routing)."""


@dataclass(frozen=True)
class SitePolicy:
    """A site's floors (docs/deploy.md, "Site policy").  Every field has a default; a file may give any subset."""

    secure_aggregation: bool = True
    """The run must have ``privacy.secure_aggregation = true``: the server learns sums only, never this
    site's update.  false: the site also joins runs without it (methods whose server reads each reply)."""
    dp: str = "off"
    """The run's ``privacy.dp`` must be this ('sample' or 'client'); 'off': any DP mode, none included."""
    max_epsilon: float | None = None
    """ε ceiling: the run must set ``privacy.epsilon`` at most this, with ``privacy.budget_action = "stop"``
    (so training ends before a round would pass it).  None: no ceiling."""
    min_noise_multiplier: float | None = None
    """σ floor: the run's noise multiplier (given, or derived from ε at this site) must be at least this.
    None: no floor."""
    max_delta: float | None = None
    """δ ceiling: a run with differential privacy must set ``privacy.delta`` at most this (ε means nothing without
    its δ: ε = 1 at δ = 0.5 is ε ≈ 7.4 at δ = 1e-5).  None: min(1e-5, 1 / (10 · n_k)), n_k this site's training
    cases."""
    min_sites: int = 3
    """The run must have at least this many sites (secure aggregation's participant minimum: with fewer, a
    sum is one site's value, and with two the other site's); under a ``privacy.secagg_min_sites`` setting the
    site raises it to this."""
    methods: tuple[str, ...] | None = None
    """Methods the site joins (e.g. ["fedavg", "fedsm"]); None (or "*" in the file): any."""
    tasks: tuple[str, ...] | None = None
    """Task kinds the site answers (e.g. ["train", "evaluate"]); None (or "*"): any.  Its ε report and
    secure aggregation's steps are always answered."""
    evaluation: str = "aggregates"
    """'aggregates' (default): evaluation replies carry each candidate's mean over the site's cases only;
    'per_case': one score per case (per-case scores of a model the server crafts reveal each case's labels)."""
    allowed_models: tuple[str, ...] = ()
    """Digests (:func:`fedseg.privacy.protocol.model_digest`, 64 hex digits) of models the site evaluates besides
    the ones it saw leave training (docs/deploy.md, "Site policy"), e.g. a model trained elsewhere that the
    federation compares with."""
    max_histogram_requests: int = 256
    """How many intensity intervals (``histogram`` requests of the volume plan) the site answers between two
    run setups; a plan's exact percentiles take at most 64 per CT channel (4 ranks × 16 exchanges)."""
    min_histogram_width: float = 0.0
    """The narrowest bin (interval width / bins, in intensity units) the site answers; 0: any (the plan's exact
    float percentiles narrow their interval 4096-fold per exchange)."""
    release_models: bool = True
    """Consent to hand the site's final own model to the server (FedSM's ``fedsm_release``); false refuses it."""
    reproducible: bool = False
    """The site lets the run seed drive its randomness — seeded DP noise and, without a site salt, batch order and
    augmentation — for rehearsals that compare deployment with simulation; never in production.  false: the
    site's DP noise and batches come from its operating system's random source whatever
    ``privacy.dp_randomness`` the run ships, and it mixes its own salt (``WORKDIR/site_salt``) into its non-DP
    batch order and augmentation, so two runs never give bitwise-equal updates."""

    # ---------------------------------------------------------------- checks
    def delta_limit(self, num_train: int | None) -> float | None:
        """The largest ``privacy.delta`` this site accepts: ``max_delta``, or min(1e-5, 1 / (10 · n_k)) for its
        ``num_train`` = n_k training cases (None while n_k is unknown and the policy names no ceiling)."""
        if self.max_delta is not None:
            return self.max_delta
        if num_train is None:
            return None
        return min(1e-5, 1.0 / (10 * max(1, num_train)))

    def refusals(
        self, cfg: Any, sites: list[str], sigma: float | None = None, num_train: int | None = None
    ) -> list[str]:
        """Why the run ``cfg`` (the server's resolved run config) over ``sites`` is below this policy ([]: it is not).
        ``sigma``: the noise multiplier the site derived for it (checked against ``min_noise_multiplier``);
        ``num_train``: the site's training cases (the default δ ceiling depends on them)."""
        out = []
        p = cfg.privacy
        if self.methods is not None and cfg.method not in self.methods:
            out.append(f"method {cfg.method!r} is not among the policy's methods {list(self.methods)}")
        if self.secure_aggregation and not p.secure_aggregation:
            out.append("the run has privacy.secure_aggregation = false and the policy requires secure aggregation")
        if self.dp != "off" and p.dp != self.dp:
            out.append(f"the run has privacy.dp = {p.dp!r} and the policy requires {self.dp!r}")
        if self.max_epsilon is not None:
            if p.dp == "off":
                out.append(f"the run has no differential privacy and the policy's ε ceiling is {self.max_epsilon:g}")
            elif p.epsilon is None or p.epsilon > self.max_epsilon:
                out.append(
                    f"the run's privacy.epsilon = {p.epsilon} is above the policy's ceiling {self.max_epsilon:g}"
                )
            elif p.budget_action != "stop":
                out.append(
                    f"the run has privacy.budget_action = {p.budget_action!r}: it trains past its ε, and the "
                    f"policy's ceiling is {self.max_epsilon:g} (it needs 'stop')"
                )
        if self.min_noise_multiplier is not None:
            if p.dp == "off":
                out.append(f"the run adds no noise and the policy's σ floor is {self.min_noise_multiplier:g}")
            elif sigma is not None and sigma < self.min_noise_multiplier:
                out.append(
                    f"the run's noise multiplier σ = {sigma:.4g} is below the policy's floor {self.min_noise_multiplier:g}"
                )
        limit = self.delta_limit(num_train)
        if p.dp != "off" and limit is not None and p.delta > limit:
            why = "the policy's max_delta" if self.max_delta is not None else "min(1e-5, 1/(10·n_k)) of this site"
            out.append(
                f"the run's privacy.delta = {p.delta:g} is above {why} = {limit:g} (an ε means nothing at a large δ)"
            )
        if len(sites) < self.min_sites:
            out.append(f"the run has {len(sites)} sites and the policy's minimum is {self.min_sites}")
        return out

    def task_refusal(self, kind: str) -> str | None:
        """Why a task of ``kind`` is refused (None: it is answered)."""
        if kind in RELEASE_KINDS and not self.release_models:
            return f"task {kind!r} releases this site's final model and the policy has release_models = false"
        if self.tasks is None or kind in self.tasks or kind in ALWAYS_ALLOWED or kind.startswith("secagg/"):
            return None
        return f"task kind {kind!r} is not among the policy's tasks {list(self.tasks)}"

    def evaluation_refusal(self, kind: str, config: dict[str, Any]) -> str | None:
        """Why an evaluation-like task (``evaluate``, FedSM's ``route``) is refused for the split it names: the
        training split never (a model the server crafts, e.g. an all-foreground probe, would give each training
        case's foreground size: no DP noise covers an evaluation)."""
        if kind not in EVALUATION_KINDS:
            return None
        try:
            split = split_name(str(config.get("split")))
        except PayloadError as e:
            return str(e)
        if split == "training":
            return (
                f"task {kind!r} scores models on the training split; this site evaluates only on its validation "
                "and testing splits (a crafted model's scores on the training cases are a label oracle that no "
                "DP noise covers)"
            )
        return None

    def histogram_refusal(self, body: dict[str, Any], answered: int) -> str | None:
        """Why a ``histogram`` request of the volume plan is refused: more intervals than
        ``max_histogram_requests`` since the last setup (``answered`` so far), or a bin narrower than
        ``min_histogram_width``."""
        requests = body.get("requests")
        if not isinstance(requests, list):
            return None  # malformed: the planning operation names that itself
        if answered + len(requests) > self.max_histogram_requests:
            return (
                f"{answered} histogram intervals answered since the last setup and {len(requests)} more asked; the "
                f"policy's max_histogram_requests is {self.max_histogram_requests}"
            )
        for r in requests:
            try:
                width = (float(r["hi"]) - float(r["lo"])) / max(1, int(r["bins"]))
            except (KeyError, TypeError, ValueError):
                continue
            if width < self.min_histogram_width:
                return (
                    f"a histogram bin of width {width:.3g} is asked; the policy's min_histogram_width is "
                    f"{self.min_histogram_width:g}"
                )
        return None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("methods", "tasks"):
            d[k] = "*" if d[k] is None else list(d[k])
        d["allowed_models"] = list(d["allowed_models"])
        return d


def site_held(cfg: Any, policy: SitePolicy | None, has_identity: bool, warn: Any = None) -> Any:
    """The run config ``cfg`` with the settings that are the site's, not the server's: a site that holds a kit
    (``has_identity``) signs its secure-aggregation keys whatever ``privacy.secagg_identity`` says, and its DP
    noise and batches come from its operating system's random source whatever ``privacy.dp_randomness`` says,
    unless its ``policy`` is ``reproducible`` (rehearsals).  ``warn(message)`` is told of each override."""
    p = cfg.privacy
    changes: dict[str, Any] = {}
    said = []
    if p.secagg_identity != "auto" and has_identity:
        changes["secagg_identity"] = "auto"
        said.append(
            f"the run sets privacy.secagg_identity = {p.secagg_identity!r}; a site with a kit signs its "
            "secure-aggregation keys and checks its peers against its roster whatever the run says"
        )
    if p.dp_randomness != "os" and not (policy is not None and policy.reproducible):
        changes["dp_randomness"] = "os"
        if p.dp != "off":
            said.append(
                f"the run sets privacy.dp_randomness = {p.dp_randomness!r}; this site draws its DP noise and batches "
                "from its operating system's random source (its policy is not reproducible: the server knows the "
                "seed and could regenerate seeded draws)"
            )
    for message in said if warn is not None else ():
        warn(message)
    return dataclasses.replace(cfg, privacy=dataclasses.replace(p, **changes)) if changes else cfg


def enforced(cfg: Any, policy: SitePolicy | None, where: str | None, identity: Any, num_train: int) -> dict[str, Any]:
    """What a site enforces in the run ``cfg`` it set up (the config after :func:`site_held` and its policy's
    own values): its keys' signing and roster (``identity``: its :class:`~fedseg.privacy.identity.Identity` or
    None), its DP randomness, and its ``policy``'s floors (``where``: the policy file).  Logged at setup and sent
    with its ``privacy`` report, so the site's own account of a run does not rest on the server's results."""
    p = cfg.privacy
    roster = getattr(identity, "roster", None)
    out: dict[str, Any] = {
        "secure_aggregation": bool(p.secure_aggregation),
        "signed_keys": identity is not None if p.secure_aggregation else None,
        "roster_sites": sorted(roster.sites) if roster is not None else None,
        "secagg_min_sites": p.secagg_min_sites if p.secure_aggregation else None,
        "dp": p.dp,
        "dp_randomness": p.dp_randomness if p.dp != "off" else None,
        "epsilon_against_server": None if p.dp == "off" else ("inf" if p.dp_randomness == "seeded" else "epsilon"),
        "policy": where,
    }
    if policy is not None:
        out.update(
            max_epsilon=policy.max_epsilon,
            max_delta=policy.delta_limit(num_train),
            min_noise_multiplier=policy.min_noise_multiplier,
            min_sites=policy.min_sites,
            evaluation=policy.evaluation,
            reproducible=policy.reproducible,
            salted=not policy.reproducible,
        )
    return out


def _number(key: str, v: Any, *, minimum: float, integer: bool = False) -> Any:
    ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool)
    if not ok or not math.isfinite(v) or v < minimum:
        what = "an integer" if integer else "a number"
        raise ValueError(f"{what} >= {minimum:g}" + ("" if integer else " (or null: none)"))
    return v


def _names(key: str, v: Any) -> tuple[str, ...] | None:
    if v == "*" or v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ValueError('a non-empty list of names (e.g. ["fedavg", "fedsm"]) or "*" (any)')
    return tuple(v)


def _digests(v: Any) -> tuple[str, ...]:
    ok = isinstance(v, list) and all(
        isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x) for x in v
    )
    if not ok:
        raise ValueError("a list of model digests (64 lowercase hex digits each; [] for none)")
    return tuple(v)


def _choice(options: tuple[str, ...]):
    def check(key: str, v: Any) -> str:
        if v not in options:
            raise ValueError(" or ".join(repr(o) for o in options))
        return v

    return check


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


_CHECKS = {
    "secure_aggregation": _bool,
    "dp": _choice(DP_MODES),
    "max_epsilon": lambda k, v: None if v is None else _number(k, v, minimum=0.0),
    "min_noise_multiplier": lambda k, v: None if v is None else _number(k, v, minimum=0.0),
    "max_delta": lambda k, v: None if v is None else _number(k, v, minimum=0.0),
    "min_sites": lambda k, v: _number(k, v, minimum=1, integer=True),
    "methods": _names,
    "tasks": _names,
    "evaluation": _choice(EVALUATION),
    "allowed_models": lambda k, v: _digests(v),
    "max_histogram_requests": lambda k, v: _number(k, v, minimum=0, integer=True),
    "min_histogram_width": lambda k, v: _number(k, v, minimum=0.0),
    "release_models": _bool,
    "reproducible": _bool,
}
assert set(_CHECKS) == {f.name for f in fields(SitePolicy)}


def policy_from_dict(raw: Any, where: str = "site policy") -> SitePolicy:
    """A :class:`SitePolicy` from a JSON object; every bad key is named in one :class:`ConfigError`, with its fix."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} is a JSON {type(raw).__name__}, not an object; write {{}} for the defaults")
    errors = []
    values: dict[str, Any] = {}
    for key, v in raw.items():
        check = _CHECKS.get(key)
        if check is None:
            errors.append(f"{where}: unknown key {key!r}; remove it (the keys are {', '.join(_CHECKS)})")
            continue
        try:
            values[key] = check(key, v)
        except ValueError as e:
            default = SitePolicy().to_json()[key]
            errors.append(
                f"{where}: {key} = {json.dumps(v)}; give {e} (default: {json.dumps(default)}, docs/deploy.md 'Site policy')"
            )
    if errors:
        raise ConfigError("\n".join(errors))
    return SitePolicy(**values)


def read_policy(path: str | Path) -> SitePolicy:
    """The site policy in ``path`` (a JSON object; absent keys take their defaults), validated."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"site policy {path} does not exist; write one (`fedseg deploy site` writes the defaults) or give "
            "--policy FILE"
        )
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(
            f"site policy {path} is not valid JSON ({e}); fix it or delete it to get the defaults"
        ) from None
    return policy_from_dict(raw, f"site policy {path}")


def write_policy(path: str | Path, policy: SitePolicy | None = None) -> Path:
    """Write ``policy`` (default: the defaults) to ``path`` as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps((policy or SitePolicy()).to_json(), indent=1) + "\n")
    return path


def aggregate_scores(metrics: dict[str, Any]) -> dict[str, Any]:
    """An evaluation reply's metrics under ``"evaluation": "aggregates"``: instead of per-case scores
    (``per_case``: ``{candidate: N × C}``; ``test_metrics``: ``{metric: {candidate: N × C}}``) each candidate's
    mean over the cases (``mean``: ``{candidate: C means}``, ``test_mean``: ``{metric: {candidate: C means}}``;
    None where the split has no cases).  The server counts each mean for the site's declared cases."""

    def means(cases: list[list[float]]) -> list[float] | None:
        if not cases:
            return None
        return [sum(col) / len(cases) for col in zip(*cases)]

    out = {k: v for k, v in metrics.items() if k not in ("per_case", "test_metrics")}
    out["mean"] = {name: means(cases) for name, cases in metrics.get("per_case", {}).items()}
    if metrics.get("test_metrics"):
        out["test_mean"] = {
            metric: {name: means(cases) for name, cases in by_cand.items()}
            for metric, by_cand in metrics["test_metrics"].items()
        }
    return out
