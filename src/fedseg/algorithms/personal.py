"""Personalization: how a method makes each site's personalized model (FT, APFL, Per-FedAvg, pFedMe,
Ditto — and SoftPull, FedSM's own), and the machinery those methods share.

The :class:`Personalization` protocol is a method's personalization as two steps:

* the **site step** (:meth:`Personalization.site_step`): one round at a site from the global model
  w_r it received — the method's local work on its copy of the global model and its personalized
  model.  It leaves them in ``site.models["global"]`` and ``site.models["personal"]`` and returns
  one type for every method, :class:`PersonalStep` (metrics, and arrays the server step needs
  besides the two models: APFL's α);
* the **server step** (:meth:`Personalization.server_step`): from the replies, the new global model
  and each replying site's personalized model, as flat server state.

FedSM's personalization ablation (``fedsm.personalization``, Table 6) takes any implementation
through its mapping ``fedseg.algorithms.fedsm.method.PERSONALIZATIONS``; the stand-alone methods
reuse the parts of theirs (their ``train`` task is the site step, or its global-model part; FT's and
Per-FedAvg's ``personalize`` task its :meth:`PersonalizationBase.personal_step`).

Each stand-alone personalization method keeps one personalized model per site (``site.models
["personal"]``, saved with the site) and reports it to the server only on the rounds the engine
evaluates (:meth:`fedseg.seams.algorithm.ServerContext.is_eval_round`), so that the other rounds
cost no extra bytes.  The server keeps the latest personalized models in its flat state under
``personal/<site>/...`` and offers them as candidates with ``home_site=<site>``
(:func:`personal_candidates`): with ``primary = None`` the method's row is each site's
personalized model on its own test set, and the model × site matrix in ``results["rows"]`` shows
how they fare on the other sites.  The global model, where a method has one, is the candidate
``global``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix, weighted_mean
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = [
    "Combine",
    "PersonalStep",
    "Personalization",
    "PersonalizationBase",
    "PersonalizedAlgorithm",
    "aggregate_global",
    "check_nonneg_int",
    "check_positive",
    "finetune",
    "local_work",
    "personal_candidates",
    "personalize_handler",
    "store_personal",
    "train_handler",
]

Combine = Callable[[Sequence[Arrays], Sequence[float]], Arrays]
"""``combine(models, weights) -> model``: how the server combines the sites' global models (FedAvg's
weighted mean, or a robust rule: :func:`fedseg.foundation.arrays.aggregate`)."""


@dataclass
class PersonalStep:
    """What a personalization's site step returns (one type for every method).

    The models themselves stay at the site: its new global model in ``site.models["global"]``,
    its personalized model in ``site.models["personal"]``.

    Attributes
    ----------
    metrics
        ``loss`` (the global model's local work), ``personal_loss``, ``steps``, and the method's
        own (APFL: ``alpha``).
    extra
        Arrays the server step needs besides the two models (APFL: ``alpha``, its α_k).
    """

    metrics: dict[str, Any]
    extra: Arrays = field(default_factory=dict)


@runtime_checkable
class Personalization(Protocol):
    """A method's personalization: its site step and its server step (see the module docstring).

    Attributes
    ----------
    name
        The method's registry name (``"ft"``…; ``"softpull"`` for FedSM's own).
    title
        Display name ("FT", "Per-FedAvg"…), e.g. in FedSM's row label.
    section
        Config section of its settings (``""``: none of its own — SoftPull's λ is ``fedsm.lam``).
    params
        Its parsed settings.
    server_holds_personal
        True when the server keeps the personalized models and sends each site its own every round
        (SoftPull); False when they stay at the site or start from w_r.
    """

    @property
    def name(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def section(self) -> str: ...

    @property
    def params(self) -> Any: ...

    @property
    def server_holds_personal(self) -> bool: ...

    def site_step(self, site: Site, task: Task) -> Asks[PersonalStep]:
        """One round at ``site`` from the task's ``global/…`` model w_r (``round``, ``steps`` in its config)."""
        ...

    def server_step(
        self,
        state: Arrays,
        replies: Mapping[str, Reply],
        sites: Sequence[str],
        weights: Sequence[float],
        combine: Combine,
    ) -> Arrays:
        """``global/…`` and ``personal/<site>/…`` after the round, from the round's ``state`` and the
        replies (``weights``: one per reply, in their order; ``sites``: the whole federation)."""
        ...

    def settings(self) -> dict[str, dict[str, Any]]:
        """``{section: settings as used}`` for ``config.toml`` (empty without a section)."""
        ...

    def fp16_unsupported(self) -> str | None:
        """What of its site step fp16 loss scaling cannot serve (:meth:`Algorithm.fp16_unsupported`)."""
        ...


class PersonalizationBase:
    """A :class:`Personalization` whose site step is the method's local work on the global model
    (:meth:`global_step`, FedAvg's by default) followed by its personal step from the same received
    w_r (:meth:`personal_step`), and whose server step combines the global models and stores each
    site's personalized model as sent.  Methods whose two models come out of one loop (APFL, pFedMe)
    override :meth:`site_step`."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    section: ClassVar[str] = ""
    server_holds_personal: ClassVar[bool] = False
    fp16_unsupported_by: ClassVar[str | None] = None
    """What fp16 loss scaling cannot serve in this method's site step (:meth:`fp16_unsupported`), or None."""

    def __init__(self, params: Any):
        self.params = params

    def global_step(self, site: Site, global_arrays: Arrays, rnd: int, steps: int | None) -> Asks[dict[str, Any]]:
        """The method's local work on the site's global model from w_r; FedAvg's (stream ``"train"``,
        optimizer ``"global"``) by default.  Returns ``{"loss", "steps"}``."""
        site.load("global", global_arrays)
        opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
        return (yield from site.fit("global", rnd, stream="train", optimizer=opt, steps=steps))

    def personal_step(self, site: Site, global_arrays: Arrays, rnd: int) -> Asks[dict[str, Any]]:
        """Make the site's personalized model (``site.models["personal"]``) from w_r; returns ``{"loss", "steps"}``."""
        raise NotImplementedError

    def site_step(self, site: Site, task: Task) -> Asks[PersonalStep]:
        w_r = strip_prefix("global", task.arrays)
        rnd = task.config["round"]
        m = yield from self.global_step(site, w_r, rnd, task.config.get("steps"))
        personal = yield from self.personal_step(site, w_r, rnd)
        return PersonalStep({"loss": m["loss"], "personal_loss": personal["loss"], "steps": m["steps"]})

    def combine_global(
        self, state: Arrays, models: Sequence[Arrays], weights: Sequence[float], combine: Combine
    ) -> Arrays:
        """The new global model from the sites' (``combine``; pFedMe overrides it)."""
        return combine(models, weights)

    def personal_model(self, own: Arrays, new_global: Arrays, reply: Reply) -> Arrays:
        """A site's personalized model to store, from the one it sent (as sent; APFL mixes it)."""
        return own

    def server_step(
        self,
        state: Arrays,
        replies: Mapping[str, Reply],
        sites: Sequence[str],
        weights: Sequence[float],
        combine: Combine,
    ) -> Arrays:
        names = list(replies)
        glob = self.combine_global(state, [strip_prefix("global", replies[s].arrays) for s in names], weights, combine)
        out = prefixed("global", glob)
        for s in names:
            own = strip_prefix(f"personal/{s}", replies[s].arrays)
            out.update(prefixed(f"personal/{s}", self.personal_model(own, glob, replies[s])))
        return out

    def settings(self) -> dict[str, dict[str, Any]]:
        if not self.section:
            return {}
        values = dataclasses.asdict(self.params)
        return {self.section: {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}}

    def fp16_unsupported(self) -> str | None:
        return self.fp16_unsupported_by


class PersonalizedAlgorithm(Algorithm):
    """A stand-alone personalization method: :attr:`personal` is its :class:`Personalization`
    (class :attr:`Personal`) over its parsed settings, whose pieces its site half runs."""

    Personal: ClassVar[type[PersonalizationBase]] = PersonalizationBase

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.personal = self.Personal(self.params)

    @classmethod
    def personalization(cls, cfg: RunConfig) -> PersonalizationBase:
        """This method's personalization with the settings of its own section (e.g. inside FedSM, Table 6)."""
        return cls.Personal(cls.parse_params(cfg))

    def fp16_unsupported(self) -> str | None:
        return self.Personal.fp16_unsupported_by


def aggregate_global(replies: Mapping[str, Reply], weighting: Weighting, prefix: str = "global") -> Arrays:
    """FedAvg's Σ_k p_k w^{(k)} over the replies' ``prefix/...`` arrays, still prefixed."""
    names = list(replies)
    p = aggregation_weights([replies[s].num_samples for s in names], weighting)
    return prefixed(prefix, weighted_mean([strip_prefix(prefix, replies[s].arrays) for s in names], p))


def store_personal(state: Arrays, replies: Mapping[str, Reply], prefix: str = "personal") -> None:
    """Copy each reply's ``prefix/...`` arrays into ``state`` as ``prefix/<site>/...`` (in place)."""
    for s, rep in replies.items():
        own = strip_prefix(prefix, rep.arrays)
        if own:
            state.update(prefixed(f"{prefix}/{s}", own))


def personal_candidates(state: Arrays, ctx: ServerContext, with_global: bool = True) -> list[Candidate]:
    """``global`` (if present and wanted) and ``personal/<site>`` (home_site = site, validated on its site only)."""
    out = []
    if with_global:
        g = strip_prefix("global", state)
        if g:
            out.append(Candidate("global", g))
    for s in ctx.sites:
        own = strip_prefix(f"personal/{s}", state)
        if own:
            out.append(Candidate(f"personal/{s}", own, val_sites=(s,), home_site=s))
    return out


def finetune(
    site: Site,
    arrays: Arrays,
    rnd: int,
    steps: int,
    lr: float | None = None,
    optimizer: str = "train",
    role: str = "personal",
    stream: str = "finetune",
) -> Asks[dict[str, Any]]:
    """Copy ``arrays`` into the site's ``role`` model and train it ``steps`` steps on local data.

    Parameters
    ----------
    site
        The site (its training split, seeded batches from stream ``stream``).
    arrays
        Starting weights (the global model).
    rnd
        Round number (keys the random stream).
    steps
        Optimizer steps; 0 leaves ``arrays``' values unchanged.
    lr
        Learning rate (None: ``train.lr``).
    optimizer
        ``"train"``: a fresh optimizer of the run's kind (``train.optimizer``, Adam by
        default) — FT; ``"sgd"``: plain gradient descent w ← w − lr ∇f — Per-FedAvg's
        adaptation step.
    role, stream
        Model role and random stream name.

    Returns
    -------
    dict
        ``{"loss", "steps"}``; the fine-tuned model is ``site.models[role]``.
    """
    model = site.load(role, arrays)
    if steps <= 0:
        return {"loss": None, "steps": 0}
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr or site.cfg.train.lr, momentum=0.0)
    else:
        opt = site.optimizer(role, reset=True, lr=lr)
    return (yield from site.fit(role, rnd, stream=stream, optimizer=opt, steps=steps))


def personalize_handler(personal: PersonalizationBase) -> Callable[[Site, Task], Asks[Reply]]:
    """Site half of a ``personalize`` task: ``personal``'s personal step from the sent ``global/`` model;
    the reply carries the personalized model under ``personal/``."""

    def handle(site: Site, task: Task) -> Asks[Reply]:
        metrics = yield from personal.personal_step(site, strip_prefix("global", task.arrays), task.config["round"])
        return Reply(arrays=prefixed("personal", site.arrays("personal")), metrics=metrics, num_samples=site.num_train)

    return handle


def train_handler(personal: Personalization) -> Callable[[Site, Task], Asks[Reply]]:
    """Site half of a ``train`` task that is ``personal``'s site step (Ditto, pFedMe, APFL): the reply
    carries the site's global model under ``global/`` and, on the rounds the server asks for it
    (``report_personal``), its personalized model under ``personal/`` and the step's extra arrays."""

    def handle(site: Site, task: Task) -> Asks[Reply]:
        step = yield from personal.site_step(site, task)
        arrays = prefixed("global", site.arrays("global"))
        if task.config.get("report_personal"):
            arrays.update(prefixed("personal", site.arrays("personal")))
            arrays.update(step.extra)
        return Reply(arrays=arrays, metrics=step.metrics, num_samples=site.num_train)

    return handle


def local_work(site: Site, steps: int | None) -> int:
    """Steps of one round of local work (``steps`` if given, else the run's ``train.local_*``)."""
    return site.steps_per_round() if steps is None else steps


def check_nonneg_int(section: str, key: str, value: int | None, allow_none: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{section}.{key} must be set to an integer >= 0")
        return
    if value < 0:
        raise ConfigError(
            f"{section}.{key} = {value}; it must be >= 0"
            + (" (or none for one round of local work)" if allow_none else "")
        )


def check_positive(section: str, key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not (value > 0.0 and value < float("inf")):
        raise ConfigError(f"{section}.{key} = {value}; it must be a finite number > 0")
