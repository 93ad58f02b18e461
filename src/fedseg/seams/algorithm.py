"""The shape every algorithm takes: a server half and a site half in one class.

Server half (runs where the engine runs)::

    init_state(ctx)                 -> state        # flat arrays, names prefixed by role
    server_round(ctx, state, rnd)   -> state, metrics  # a short loop over ctx.ask({site: Task})
    candidates(state)               -> [Candidate]  # what to validate / test

Site half (runs at each site, in simulation or deployment)::

    site_handlers() -> {task kind: handler(site, task) -> Reply}
    predictors()    -> {predictor kind: make(site, arrays, config) -> predict(x)}

The maths of a method lives in small pure functions over arrays (see
``fedseg.foundation.arrays`` and each algorithm module); this class only wires them up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from fedseg.foundation.arrays import Arrays, prefixed
from fedseg.foundation.config import RunConfig, dataclass_from_dict
from fedseg.foundation.device import fp16_refusal, to_device
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site
from fedseg.site.workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    from fedseg.seams.transport import Transport

__all__ = ["Algorithm", "Candidate", "NoParams", "ServerContext"]


def _toml_ready(table: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in table.items()}


@dataclass(frozen=True)
class NoParams:
    """An algorithm without settings of its own."""


@dataclass
class Candidate:
    """A model (or model combination) to validate during training and test at the end.

    Attributes
    ----------
    name
        Unique name, e.g. ``"global"`` or ``"local/site1"``; used as the row label and
        as the prefix of its arrays in evaluation tasks.
    arrays
        What a site needs to predict with it.
    predictor
        Site-side predictor kind (``algorithm.predictors()``); ``"model"`` loads the
        arrays into the workload model.
    val_sites
        Sites whose validation Dice (case-weighted) decides its best round; None = all.
    home_site
        For a site's own model (local, personalized): the site it belongs to.
    config
        JSON-able settings for the predictor.
    scored
        Its validation scores when the algorithm measured them while building it, ``{site: (cases, sum over
        the cases of their mean score)}`` (FedSM scores its composite, global and personalized models in one
        pass over each site's cases): the engine then does not ask the sites to evaluate it again.  None:
        the engine evaluates it.
    """

    name: str
    arrays: Arrays
    predictor: str = "model"
    val_sites: tuple[str, ...] | None = None
    home_site: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    scored: dict[str, tuple[int, float]] | None = None


@dataclass
class ServerContext:
    """What the server half may use: the transport, the sites, the config, the initial weights."""

    transport: Transport
    sites: tuple[str, ...]
    cfg: RunConfig
    init_arrays: Callable[[str], Arrays]
    """``init_arrays(role)``: seeded initial weights of a role's model (same seed → same weights)."""
    log: Callable[[str], None] = print
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """The run's device: replies are moved onto it (a deployment's replies arrive as host tensors)."""
    workload: Workload | None = None
    """The run's task, for the networks a server half builds besides the model (FedSM's selector:
    ``workload.selector``), the same ones its sites build."""

    def is_eval_round(self, rnd: int) -> bool:
        """True on the rounds the engine validates after (``RunConfig.is_eval_round``)."""
        return self.cfg.is_eval_round(rnd)

    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
        """Send tasks and collect replies (see :class:`fedseg.seams.transport.Transport`), their arrays on :attr:`device`."""
        replies = self.transport.ask(tasks, optional=optional)
        for reply in replies.values():
            reply.arrays = to_device(reply.arrays, self.device)
        return replies


class Algorithm:
    """Base class; subclasses set ``name``, ``title``, ``section``, ``Params`` and implement the hooks."""

    name: ClassVar[str] = ""
    section: ClassVar[str] = ""
    """Config section holding this method's settings (``[fedavg]``, ``[fedsm]``…)."""
    Params: ClassVar[type] = NoParams
    needs_pooled_site: ClassVar[bool] = False
    """Simulation-only methods that train on all sites' data pooled (centralized)."""
    primary: ClassVar[str | None] = "global"
    """Candidate reported as the method's row; None = each site's own (home) model."""
    title: ClassVar[str] = ""
    """Display name in tables and reports ("FedAvg", "FedSM"); the registry name when empty.  The one
    source of the methods' display names: results carry it (``results.json["label"]``, :meth:`label`)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.params = self.parse_params(cfg)
        what = self.fp16_unsupported() if cfg.train.precision == "fp16" else None
        if what:
            raise ConfigError(fp16_refusal(what))
        if cfg.privacy.dp != "off":
            why = self.dp_sample_unsupported() if cfg.privacy.dp == "sample" else self.dp_client_unsupported()
            if why:
                raise ConfigError(
                    f"privacy.dp = {cfg.privacy.dp!r} is not available for {self.name}: {why}; use --set privacy.dp=off"
                )
        why = self.secure_aggregation_unsupported() if cfg.privacy.secure_aggregation else None
        if why:
            raise ConfigError(
                f"{self.name} cannot run with privacy.secure_aggregation = true: {why}; secure aggregation lets the "
                "server learn only the sum of the sites' arrays (use --set privacy.secure_aggregation=false, or a "
                "method whose server only sums: fedavg, fedavg-even, fedprox, fwa, scaffold, fga, fedsm)"
            )

    def dp_client_unsupported(self) -> str | None:
        """Why this method cannot run client-level DP (``privacy.dp = "client"``: each site's update
        clipped and noised, :meth:`fedseg.site.dp.SiteDP.client_update`), or None.  The default: not
        supported (the site half must send its update through it)."""
        return "its site half does not send a clipped, noised update"

    def dp_sample_unsupported(self) -> str | None:
        """Why this method cannot run DP-SGD (``privacy.dp = "sample"``), or None.  DP-SGD privatizes the
        site runtime's local steps and gradients (``Site.fit``, ``Site.gradient``); a method whose site
        half computes a gradient of the data any other way refuses it.  The default: supported when
        :meth:`dp_steps_per_round` is implemented."""
        if type(self).dp_steps_per_round is Algorithm.dp_steps_per_round:
            return "its site half trains outside the site runtime's privatized steps"
        return None

    def dp_steps_per_round(self, cfg: RunConfig, n: int) -> int | None:
        """The privatized steps (``Site.fit`` steps and ``Site.gradient`` calls) one round takes at a site
        with ``n`` training cases, as planned: with ``privacy.epsilon`` and no ``privacy.noise_multiplier``
        the site's σ is the one whose ``rounds`` × these steps spend ε.  None: DP-SGD not supported."""
        return None

    def secure_aggregation_unsupported(self) -> str | None:
        """Why this method's server needs one site's arrays (so secure aggregation cannot serve it), or None for
        a method whose server steps run through secure aggregation when ``privacy.secure_aggregation`` is on;
        a run asking for it then stops at once with this reason."""
        return "its server reads each site's reply on its own, not only their sum"

    summed_kinds: ClassVar[frozenset[str]] = frozenset()
    """The site task kinds whose replies this method's server sums under ``privacy.secure_aggregation`` (its
    site half's declaration, :meth:`summed`)."""

    def summed(self, task: Task) -> bool:
        """Whether the server sums the reply to ``task`` under secure aggregation: a site whose own config has
        ``privacy.secure_aggregation`` on then never sends it unmasked (:meth:`fedseg.site.runtime.Site.handle`
        refuses such a task without the ``secagg`` field).  Default: ``task.kind`` in :attr:`summed_kinds`."""
        return task.kind in self.summed_kinds

    def fp16_unsupported(self) -> str | None:
        """The part of this method's site work that fp16 loss scaling cannot serve (it uses raw
        gradients outside an optimizer step), or None; a run asking for fp16 then stops at once."""
        return None

    @classmethod
    def parse_params(cls, cfg: RunConfig) -> Any:
        """This method's ``Params`` from its config section, validated."""
        params = dataclass_from_dict(cls.Params, cfg.params.get(cls.section, {}), cls.section or cls.name)
        validate = getattr(params, "validate", None)
        if validate is not None:
            validate()
        return params

    def label(self) -> str:
        """This run's row label in tables: :attr:`title`, plus what its settings make of it (e.g.
        "FedAvg - even", "Auto-FedAvg-N-Dirichlet"); written to ``results.json["label"]``."""
        return self.label_for(self.params)

    @classmethod
    def label_for(cls, params: Any) -> str:
        """The row label of a run of this method with settings ``params`` (its ``Params``); a method
        whose settings change its name overrides this (Auto-FedAvg)."""
        return cls.title or cls.name

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, **dataclasses.asdict(self.params)}

    def resolved_params(self) -> dict[str, dict[str, Any]]:
        """``{section: settings}`` as this run uses them (defaults and profile choices filled in), for
        ``config.toml`` and ``results.json["config"]``; empty for a method without settings."""
        if not self.section or not dataclasses.fields(self.params):
            return {}
        return {self.section: _toml_ready(dataclasses.asdict(self.params))}

    def resolved_config(self) -> RunConfig:
        """The run config with this method's sections replaced by :meth:`resolved_params`."""
        return dataclasses.replace(self.cfg, params={**self.cfg.params, **self.resolved_params()})

    # ----------------------------------------------------------- server half
    def init_state(self, ctx: ServerContext) -> Arrays:
        """Initial server state; by default one seeded model under ``global/``."""
        return prefixed("global", ctx.init_arrays("global"))

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        raise NotImplementedError

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        raise NotImplementedError

    def final_candidates(
        self, state: Arrays, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Candidate]:
        """Candidates to test in place of some best-validation ones, built after the last round from the
        best candidates (and their rounds) and the final state (FedSM assembles its composite from its
        best parts).  Returns ``{name: candidate}`` for the names replaced; the default replaces none."""
        return {}

    def test_report(
        self, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Any]:
        """Entries the method adds to ``results.json`` after the test, asked of the sites through ``ctx`` with the
        tested candidates ``best`` (FedSM: where its selector sent each site's test cases, ``results["fedsm"]``);
        the default adds none."""
        return {}

    def check_reply(self, task: Task, reply: Reply) -> None:
        """Server side, before a deployed site's reply reaches the algorithm: raise ``PayloadError`` (the
        transport rejects the reply and logs why) when the metrics of the algorithm's own task kinds do
        not have the layout the server's code reads.  The transport already checks tensor names, metric
        keys and kinds, sample counts and evaluation scores; the default checks nothing more."""

    # ------------------------------------------------------------- site half
    def site_handlers(self) -> dict[str, Callable[[Site, Task], Reply | Asks[Reply]]]:
        raise NotImplementedError

    def predictors(self) -> dict[str, Callable[[Site, Arrays, dict], Callable[[torch.Tensor], torch.Tensor]]]:
        return {"model": lambda site, arrays, config: site.model_predictor(arrays, bn_from=config.get("bn_role"))}

    def model_factory(self, site: Site, role: str) -> Callable[[], nn.Module] | None:
        """Factory of a role's model when it is not the workload's model (e.g. FedSM's selector)."""
        return None

    def optimizer_params(self, site: Site, role: str) -> list[torch.Tensor]:
        """Parameters the role's optimizer updates (to rebuild it when a site resumes)."""
        return list(site.model(role, self.model_factory(site, role)).parameters())
