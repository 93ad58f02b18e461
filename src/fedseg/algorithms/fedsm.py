"""FedSM (Xu et al., "Closing the Generalization Gap of Cross-silo Federated Medical
Image Segmentation", CVPR 2022): a global model, SoftPull personalized models and a
model selector — plus FedSM-extra and the ensemble variant.

Training (Alg. 1), every round, every site, on the same batches:

* the global model w_g (FedAvg, weights n_k / n),
* its own personalized model w_{p,k} (its Adam moments kept at the site across rounds),
* the selector w_s with cross-entropy against label k = the site's position (Eq. 2);
  the server averages w_s — and the selector's Adam moments — with weights n_k / n,

then the server applies SoftPull (Eq. 11) to the personalized models
(:func:`fedseg.algorithms.softpull.soft_pull`).

Inference (Alg. 2): per image, the selector's softmax; ``max > γ`` → that site's
personalized model, else the global model (predictor ``"fedsm"``).

* **fedsm-extra** (Section 3.1.2): the first ``rounds − S`` rounds train global and
  personalized models only; the last S rounds (``fedsm.selector_rounds``) train a
  K + 1-class selector with labels from Eq. 1 (the model whose output has the lowest
  loss); inference takes the selector's argmax, no γ.
* **fedsm-ensemble** (Section 3.1.1): same schedule, the selector is trained through
  the loss of the softmax-weighted output mix h = Σ ŷ_{s,k} h_k, and inference
  outputs that mix.

Personalization ablation (Section 4.3, Table 6): ``fedsm.personalization`` replaces
SoftPull by another method's personalization (``ft``, ``apfl``, ``perfedavg``,
``pfedme``, ``ditto``; settings from that method's own section, e.g. ``ditto.lam``).
The site then makes its personalized model with that method's site step from the
global model w_r it received, the server stores it as ``personal/<site>`` with *no*
SoftPull, and the selector routes to it exactly as to a SoftPull model:

* ``ft``: global = FedAvg step; personal = w_r fine-tuned ``ft.steps`` steps
  (:func:`fedseg.algorithms.ft.personal_step`, fresh optimizer each round).
* ``perfedavg``: global = Per-FedAvg's meta step (:func:`fedseg.algorithms.perfedavg.local_round`);
  personal = w_r adapted by ``perfedavg.personal_steps`` gradient steps of size α.
* ``pfedme``: global = pFedMe's Moreau-envelope local round, server
  ``(1 − β) w + β Σ p_k w_k``; personal = θ̂ of the round's last batch.
* ``ditto``: global = FedAvg step; personal = the site's persistent v_k trained on
  F_k(v) + λ/2 ||v − w_r||² (:func:`fedseg.algorithms.ditto.personal_step`).
* ``apfl``: global = APFL's w step (= FedAvg's); the site sends v_k and α_k and the
  server stores the mixture α_k v_k + (1 − α_k) w_{r+1} with the new global model
  (``apfl.mix = "parameters"`` only: an output mixture is not one model).

Server state (flat arrays): ``global/…``, ``personal/<site>/…``, ``selector/…`` and
``selector_optim/<param>/<exp_avg|exp_avg_sq|step>``.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedseg.algorithms.base import Algorithm, Candidate, ServerContext
from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.fga import FP16_GRADIENT_AVERAGING, gradient_step, lockstep_round
from fedseg.algorithms.softpull import check_lambda, ensemble_mix, oracle_labels, route, routing_accuracy, soft_pull
from fedseg.core.arrays import Arrays, aggregate, check_aggregation, clone, prefixed, strip_prefix, weighted_mean
from fedseg.core.errors import ConfigError, PayloadError
from fedseg.core.messages import Reply, Task
from fedseg.core.site import Site, batch_of, dataset_len
from fedseg.models import Selector

__all__ = [
    "FedSM",
    "FedSMEnsemble",
    "FedSMExtra",
    "FedSMParams",
    "input_layout",
    "optimizer_moments",
    "oracle_accuracy",
    "pick_gamma",
    "route_task",
    "selector_role",
    "set_optimizer_moments",
]

DEFAULT_GAMMA_GRID = (0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

#: ``fedsm.personalization`` choices (FedSM Table 6 rows): SoftPull or a method whose
#: site step makes the personalized models (module ``fedseg.algorithms.<name>``).
PERSONALIZATIONS = ("softpull", "ft", "apfl", "perfedavg", "pfedme", "ditto")
_PERSONAL_CLASSES = {"ft": "FT", "apfl": "APFL", "perfedavg": "PerFedAvg", "pfedme": "PFedMe", "ditto": "Ditto"}


def personalization_class(name: str) -> type[Algorithm]:
    """The Algorithm class of a non-SoftPull ``fedsm.personalization`` (its ``Params`` and config section)."""
    if name not in _PERSONAL_CLASSES:
        raise ConfigError(f"fedsm.personalization = {name!r}; choose one of {', '.join(PERSONALIZATIONS)}")
    module = importlib.import_module(f"fedseg.algorithms.{name}")
    return getattr(module, _PERSONAL_CLASSES[name])


PROFILES = ("default", "reference")
SELECTOR_TRAININGS = ("fga", "fedavg")

#: What each profile fills in for the settings left unset (None).  "default": settings
#: that learn on the synthetic benchmark (docs/results.md); "reference": the reference
#: code's literal ones (γ 0.9, n_k/n weights, every local step, averaged selector).
PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "default": {"gamma": "auto", "selector_training": "fga", "selector_weighting": "even"},
    "reference": {
        "gamma": 0.9,
        "selector_training": "fedavg",
        "selector_weighting": "samples",
        "selector_steps": "all",
    },
}


@dataclass(frozen=True)
class FedSMParams:
    """Settings of FedSM and its variants (config section ``[fedsm]``).

    Settings left unset (None) are filled in by ``profile`` (:meth:`resolved`); a run's
    ``config.toml`` and ``results.json["config"]`` hold the resolved values.

    profile
        ``"default"``: settings that learn out of the box (γ = auto, selector trained by
        federated gradient averaging); ``"reference"``: the reference code's literal
        settings (γ = 0.9, selector averaged with n_k/n weights after every local step).
    lam
        SoftPull's λ (Eq. 11) in [0, 1]; 0.7 is the paper's best on the low-similarity
        retinal task (Table 7) and the reference code's default.  Below 1/K a site's
        own model weighs less than each other site's (warned, allowed: Table 7 has 0.1).
    gamma
        Alg. 2's confidence threshold γ: a number in [0, 1] (0.9: reference code), or
        ``"auto"`` (default profile): at each validation the sites report their validation
        Dice summed per γ of ``gamma_grid`` and the γ with the best sample-weighted Dice is used.
    gamma_grid
        Candidate γ values for ``gamma = "auto"`` and the routing reports.
    selector_width, selector_hidden
        Size of the selector (:class:`fedseg.models.Selector`: VGG-11 layout × width).
        The reference's VGG-11 has 129 M parameters (80× the U-Net).
    selector_lr
        Selector learning rate η_s (Alg. 1); None = ``train.lr``.
    selector_training
        ``"fga"`` (default profile): every selector step is a lockstep exchange of
        federated gradient averaging (:func:`fedseg.algorithms.fga.lockstep_round`): the
        sites send the gradient of their batch, the server returns the sample-weighted
        mean (= the pooled batch's gradient) and every site applies it with its own,
        identical Adam — centralized training of the selector, so no site's single class
        (Eq. 2) dominates.  ``"fedavg"`` (reference): local selector steps, then the
        server averages the selector and its Adam moments (Alg. 1 line 15).
    share_selector_moments
        ``fedavg`` selector only: average the selector's Adam moments (exp_avg,
        exp_avg_sq, step) with the weights of its parameters, as the reference code does.
    selector_rounds
        fedsm-extra / fedsm-ensemble only: how many of the run's ``rounds`` are the
        extra selector rounds that follow global + personalized training (the paper:
        50 after 100); None = ⌈rounds / 3⌉.  Ignored by fedsm, whose selector trains in
        every round.
    selector_steps
        Selector optimizer steps per round, on the first batches of the round's local
        work: an integer, or ``"all"`` (every local step, Alg. 1).  Unset: ``"all"``,
        except with ``selector_training = "fedavg"`` under the default profile, where it
        is 1 (measured, ``docs/results.md``: with 5 local steps per round the averaged
        selector collapses to one class, with 1 it learns slowly).
    weighting
        Weights of the global-model average: 'samples' (n_k/n, Alg. 1 line 15) or 'even'.
    selector_weighting
        ``fedavg`` selector only: weights of the selector (and its moments) average.
        Default profile 'even' (1/K), a departure from Alg. 1's n_k/n (reference
        profile): every site holds exactly one selector class (Eq. 2), and with n_k/n the
        averaged selector collapsed to the largest site's class on the synthetic fundus
        preset (``docs/results.md``).
    personalization
        How the personalized models are made (Section 4.3, Table 6): 'softpull' (the
        paper's FedSM, Eq. 11) or one of 'ft', 'apfl', 'perfedavg', 'pfedme', 'ditto'
        (that method's site step, its settings from its own section; no SoftPull).
    aggregation, trim
        How the global model is combined (:func:`fedseg.core.arrays.aggregate`): 'mean'
        (Alg. 1, the paper), 'trimmed_mean' (``trim`` of the sites dropped at each end per
        coordinate) or 'median' — the latter two bound one site's influence (deployment).
    """

    profile: str = "default"
    lam: float = 0.7
    gamma: float | str | None = None
    gamma_grid: tuple[float, ...] = DEFAULT_GAMMA_GRID
    selector_width: float = 0.125
    selector_hidden: int = 128
    selector_lr: float | None = None
    selector_training: str | None = None
    share_selector_moments: bool = True
    selector_rounds: int | None = None
    selector_steps: int | str | None = None
    weighting: str = "samples"
    selector_weighting: str | None = None
    personalization: str = "softpull"
    aggregation: str = "mean"
    trim: float = 0.1

    def resolved(self) -> FedSMParams:
        """These settings with every unset one filled in from ``profile``."""
        if self.profile not in PROFILES:
            raise ConfigError(
                f"fedsm.profile = {self.profile!r}; use 'default' (settings that learn) or 'reference' (the reference code's literal settings)"
            )
        fill = dict(PROFILE_DEFAULTS[self.profile])
        training = self.selector_training if self.selector_training is not None else fill["selector_training"]
        fill.setdefault("selector_steps", 1 if training == "fedavg" else "all")
        return dataclasses.replace(self, **{k: v for k, v in fill.items() if getattr(self, k) is None})

    @property
    def max_selector_steps(self) -> int | None:
        """Cap on selector steps per round (None: every local step)."""
        return None if self.selector_steps in (None, "all") else int(self.selector_steps)

    def validate(self) -> None:
        if self.profile not in PROFILES:
            raise ConfigError(
                f"fedsm.profile = {self.profile!r}; use 'default' (settings that learn) or 'reference' (the reference code's literal settings)"
            )
        if self.personalization not in PERSONALIZATIONS:
            raise ConfigError(
                f"fedsm.personalization = {self.personalization!r} is not a personalization method; "
                f"choose one of {', '.join(PERSONALIZATIONS)} (e.g. --set fedsm.personalization=ditto)"
            )
        if not (0.0 <= self.lam <= 1.0):
            raise ConfigError(f"fedsm.lam = {self.lam} must be in [0, 1] (FedSM Eq. 11); e.g. --set fedsm.lam=0.7")
        if isinstance(self.gamma, str):
            if self.gamma != "auto":
                raise ConfigError(f"fedsm.gamma = {self.gamma!r}; give a number in [0, 1] or 'auto'")
        elif self.gamma is not None and not (0.0 <= self.gamma <= 1.0):
            raise ConfigError(f"fedsm.gamma = {self.gamma} must be in [0, 1] (or 'auto'); the reference uses 0.9")
        if not self.gamma_grid or any(not (0.0 <= g <= 1.0) for g in self.gamma_grid):
            raise ConfigError(
                f"fedsm.gamma_grid = {list(self.gamma_grid)} must be a non-empty list of values in [0, 1]"
            )
        if not self.selector_width > 0:
            raise ConfigError(f"fedsm.selector_width must be > 0, got {self.selector_width}")
        if self.selector_hidden < 1:
            raise ConfigError(f"fedsm.selector_hidden must be >= 1, got {self.selector_hidden}")
        if self.selector_lr is not None and not self.selector_lr > 0:
            raise ConfigError(f"fedsm.selector_lr must be > 0 (or none for train.lr), got {self.selector_lr}")
        if self.selector_training is not None and self.selector_training not in SELECTOR_TRAININGS:
            raise ConfigError(
                f"fedsm.selector_training = {self.selector_training!r}; use 'fga' (gradient averaging each step) or 'fedavg' (average after local steps)"
            )
        if self.selector_rounds is not None and self.selector_rounds < 1:
            raise ConfigError(f"fedsm.selector_rounds must be >= 1 (or none for rounds/3), got {self.selector_rounds}")
        steps = self.selector_steps
        if steps is not None and steps != "all" and (isinstance(steps, str) or steps < 1):
            raise ConfigError(f"fedsm.selector_steps = {steps!r}; give an integer >= 1 or 'all' (every local step)")
        check_aggregation(self.aggregation, self.trim, "fedsm")
        for key in ("weighting", "selector_weighting"):
            if getattr(self, key) is not None and getattr(self, key) not in ("samples", "even"):
                raise ConfigError(f"fedsm.{key} = {getattr(self, key)!r}; use 'samples' or 'even'")


# --------------------------------------------------------------- selector roles
def selector_role(num_classes: int, prefix: str = "") -> str:
    """Role name of a selector with ``num_classes`` outputs (the count is part of the
    name so that a restarted site can rebuild the right shape before loading weights)."""
    return f"{prefix}selector@{num_classes}"


def _classes_of(role: str) -> int | None:
    head, sep, tail = role.rpartition("@")
    if sep and head.endswith("selector") and tail.isdigit():
        return int(tail)
    return None


# ---------------------------------------------------------- optimizer moments
def optimizer_moments(opt: torch.optim.Optimizer, model: nn.Module) -> Arrays:
    """An optimizer's per-parameter state as arrays ``<param name>/<key>`` (Adam: exp_avg, exp_avg_sq, step)."""
    out: Arrays = {}
    for name, p in model.named_parameters():
        for key, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"{name}/{key}"] = v.detach().clone()
    return out


def set_optimizer_moments(opt: torch.optim.Optimizer, model: nn.Module, moments: Mapping[str, torch.Tensor]) -> None:
    """Overwrite the optimizer's per-parameter state with ``moments`` (from :func:`optimizer_moments`)."""
    for name, p in model.named_parameters():
        entry = strip_prefix(name, {k: v for k, v in moments.items() if k.rpartition("/")[0] == name})
        if entry:
            opt.state[p] = {k: v.detach().clone() for k, v in entry.items()}


def input_layout(model_arrays: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(spatial_dims, in_channels) of a model from its first convolution weight (B, C_in, *kernel).

    The server builds the selector's initial weights without a site's workload; the
    segmentation model's first convolution (in state-dict order) tells the input layout.
    """
    for v in model_arrays.values():
        if v.is_floating_point() and v.dim() in (4, 5):
            return v.dim() - 2, int(v.shape[1])
    raise ConfigError("fedsm: cannot find a 2D/3D convolution in the model to size the selector's input")


# -------------------------------------------------------------- site half
def _selector_factory(site: Site, num_classes: int, params: FedSMParams) -> Callable[[], nn.Module]:
    return lambda: Selector(
        site.workload.spatial_dims,
        site.workload.in_channels,
        num_classes,
        width=params.selector_width,
        hidden=params.selector_hidden,
    )


@torch.no_grad()
def _selector_probs(site: Site, selector: nn.Module, split: str) -> torch.Tensor:
    ds = site.data.split(split)
    n = dataset_len(ds)
    selector.eval()
    out = []
    bs = site.cfg.eval.batch_size
    for start in range(0, n, bs):
        x, _ = batch_of(ds, torch.arange(start, min(n, start + bs)))
        out.append(torch.softmax(selector(x.to(site.dtype)).double(), dim=1))
    return torch.cat(out) if out else torch.zeros(0, 1, dtype=torch.float64)


def _frozen_roles(sites: Sequence[str]) -> list[str]:
    return ["frozen/global", *(f"frozen/p{j}" for j in range(len(sites)))]


def _load_frozen(site: Site, arrays: Arrays, sites: Sequence[str]) -> list[nn.Module]:
    """The frozen global and personalized models of a selector-phase round, loaded at the site (eval mode)."""
    names = ["global", *(f"personal/{s}" for s in sites)]
    bn = [
        "global",
        *("personal" if s == site.name else "global" for s in sites),
    ]  # train.bn_policy = "local": the site's own statistics
    frozen = [
        site.load(role, strip_prefix(name, arrays), bn_from=b) for role, name, b in zip(_frozen_roles(sites), names, bn)
    ]
    for m in frozen:
        m.eval()
    return frozen


@torch.no_grad()
def oracle_accuracy(site: Site, selector: nn.Module, models: Sequence[nn.Module], split: str) -> float:
    """Fraction of a split's images whose selector argmax is Eq. 1's label (the model of ``models`` —
    global first, then the personalized ones — with the lowest workload loss on the image); NaN if empty."""
    ds = site.data.split(split)
    n = dataset_len(ds)
    if n == 0:
        return float("nan")
    was = selector.training
    selector.eval()
    hits = 0
    bs = site.cfg.eval.batch_size
    for start in range(0, n, bs):
        x, y = batch_of(ds, torch.arange(start, min(n, start + bs)))
        x = x.to(site.dtype)
        y = y.to(site.dtype) if y.is_floating_point() else y
        labels = oracle_labels([m(x) for m in models], y, site.workload.loss)
        hits += int((selector(x).argmax(dim=1) == labels).sum())
    selector.train(was)
    return hits / n


def _load_composite(
    site: Site, arrays: Arrays, config: dict[str, Any], params: FedSMParams, prefix: str
) -> tuple[nn.Module, list[nn.Module]]:
    """Selector and models [global, personal_1 … personal_K] of a composite payload, loaded at the site."""
    c = int(config["num_classes"])
    role = selector_role(c, prefix)
    sel = site.load(role, strip_prefix("selector", arrays), _selector_factory(site, c, params))
    # under train.bn_policy = "local": the site's own running statistics — those of its
    # personalized model for its own, those of its global model for the others
    models = [site.load(f"{prefix}global", strip_prefix("global", arrays), bn_from="global")]
    for j, s in enumerate(config["sites"]):
        models.append(
            site.load(
                f"{prefix}p{j}",
                strip_prefix(f"personal/{s}", arrays),
                bn_from="personal" if s == site.name else "global",
            )
        )
    sel.eval()
    for m in models:
        m.eval()
    return sel, models


def _composite_predict(
    site: Site, sel: nn.Module, models: list[nn.Module], mode: str, gamma: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    wl = site.workload

    @torch.no_grad()
    def predict(x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(sel(x), dim=1)
        if mode == "mix":
            return ensemble_mix(probs, [wl.predict(m, x) for m in models])
        idx = route(probs, gamma) if mode == "gate" else probs.argmax(dim=1)
        out: torch.Tensor | None = None
        for j in idx.unique().tolist():
            mask = idx == j
            o = wl.predict(models[j], x[mask])
            if out is None:
                out = o.new_zeros((x.shape[0], *o.shape[1:]))
            out[mask] = o
        assert out is not None
        return out

    return predict


class FedSM(Algorithm):
    """FedSM: global + SoftPull personalized models + model selector (Alg. 1, Alg. 2)."""

    name = "fedsm"
    title = "FedSM"
    section = "fedsm"
    Params = FedSMParams
    primary = "fedsm"
    summary = "FedSM: global model + SoftPull personalized models + model selector (γ-gated routing)"
    labels = "site"  # Eq. 2
    mode = "gate"  # Alg. 2
    two_phase = False

    @classmethod
    def parse_params(cls, cfg) -> FedSMParams:
        """``[fedsm]`` validated, with the settings left unset filled in from ``fedsm.profile``."""
        return super().parse_params(cfg).resolved()

    def __init__(self, cfg):
        super().__init__(cfg)
        self.selector_rounds = 0
        if self.two_phase:
            if cfg.rounds < 2:
                raise ConfigError(
                    f"{self.name} needs rounds >= 2 (model rounds, then selector rounds); got rounds = {cfg.rounds}"
                )
            s = self.params.selector_rounds if self.params.selector_rounds is not None else math.ceil(cfg.rounds / 3)
            if not 1 <= s < cfg.rounds:
                raise ConfigError(
                    f"fedsm.selector_rounds = {s} must be between 1 and rounds - 1 = {cfg.rounds - 1}: "
                    "the first rounds train the global and personalized models, the last ones the selector"
                )
            self.selector_rounds = s
        self.personalization = self.params.personalization
        self.personal_params: Any = None
        if self.personalization != "softpull":
            self.personal_params = personalization_class(self.personalization).parse_params(cfg)
            if self.personalization == "apfl" and self.personal_params.mix != "parameters":
                raise ConfigError(
                    f"apfl.mix = {self.personal_params.mix!r} cannot be used inside FedSM: the selector routes to one "
                    "personalized model per site; use apfl.mix = 'parameters' (alpha*v + (1-alpha)*w)"
                )

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self.personal_params is not None:
            out[self.personalization] = dataclasses.asdict(self.personal_params)
        return out

    def resolved_params(self) -> dict[str, dict[str, Any]]:
        out = super().resolved_params()
        if self.personal_params is not None:
            out.update(personalization_class(self.personalization)(self.cfg).resolved_params())
        return out

    # ------------------------------------------------------------ helpers
    def num_classes(self, k: int) -> int:
        """Selector outputs: K sites (Eq. 2), or K + 1 with the global model as class 0 (Eq. 1 / ensemble)."""
        return k if self.labels == "site" else k + 1

    def model_factory(self, site: Site, role: str) -> Callable[[], nn.Module] | None:
        c = _classes_of(role)
        return None if c is None else _selector_factory(site, c, self.params)

    def _gamma(self) -> float:
        return 0.9 if isinstance(self.params.gamma, str) else float(self.params.gamma)

    # --------------------------------------------------------- server half
    def init_state(self, ctx: ServerContext) -> Arrays:
        try:
            if self.personalization == "softpull":
                check_lambda(self.params.lam, len(ctx.sites))
        except ValueError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        init = ctx.init_arrays("global")
        state = prefixed("global", init)
        for s in ctx.sites:
            # own copies: tensors the sites never send back (batch-norm statistics under
            # train.bn_policy = "local") must not be shared between entries of the checkpoint
            state.update(prefixed(f"personal/{s}", clone(init)))
        if not self.two_phase:
            state.update(self._init_selector(ctx))
        return state

    def _init_selector(self, ctx: ServerContext) -> Arrays:
        c = self.num_classes(len(ctx.sites))
        dims, channels = input_layout(ctx.init_arrays("global"))

        def factory() -> nn.Module:
            return Selector(dims, channels, c, width=self.params.selector_width, hidden=self.params.selector_hidden)

        return prefixed("selector", ctx.init_arrays(selector_role(c), factory=factory))

    def phase(self, rnd: int) -> str:
        if not self.two_phase:
            return "joint"
        return "models" if rnd <= self.cfg.rounds - self.selector_rounds else "selector"

    def first_selector_round(self) -> int:
        """The first round that trains the selector (1, or the first round of the selector phase)."""
        return self.cfg.rounds - self.selector_rounds + 1 if self.two_phase else 1

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        phase = self.phase(rnd)
        new = dict(state)
        if phase == "selector" and not any(k.startswith("selector/") for k in state):
            new.update(self._init_selector(ctx))
        by_fga = self.params.selector_training == "fga"
        train_models = phase in ("joint", "models")
        train_selector = phase in ("joint", "selector")
        before = {k: v for k, v in new.items() if k.startswith("selector/")}
        metrics: dict[str, Any] = {"phase": phase}
        if train_models or (train_selector and not by_fga):
            metrics.update(self._train_round(ctx, state, new, rnd, phase, train_selector and not by_fga))
        if train_selector and by_fga:
            metrics.update(self._selector_fga_round(ctx, new, rnd, phase))
        if train_selector:
            _keep_best_selector(new, before, metrics.get("routing_acc"), rnd - 1)
        return new, metrics

    def _train_round(
        self, ctx: ServerContext, state: Arrays, new: Arrays, rnd: int, phase: str, train_selector: bool
    ) -> dict[str, Any]:
        """One ``"train"`` task per site (models and/or the locally trained selector), aggregated into ``new``."""
        sites = list(ctx.sites)
        train_models = phase in ("joint", "models")
        base = {
            "round": rnd,
            "phase": phase,
            "sites": sites,
            "num_classes": self.num_classes(len(sites)),
            "mode": self.mode,
            "train_selector": train_selector,
        }
        shared: Arrays = {}
        if train_models:
            shared.update({k: v for k, v in new.items() if k.startswith("global/")})
        if train_selector:
            shared.update({k: v for k, v in new.items() if k.startswith(("selector/", "selector_optim/"))})
            if phase == "selector":
                shared.update({k: v for k, v in new.items() if k.startswith(("global/", "personal/"))})
        tasks = {}
        for s in sites:
            arrays = dict(shared)
            if train_models and self.personalization == "softpull":
                # other personalizations keep their state at the site (or start from w_r)
                arrays.update({k: v for k, v in new.items() if k.startswith(f"personal/{s}/")})
            tasks[s] = Task("train", arrays, dict(base))
        replies = ctx.ask(tasks)
        names = [s for s in sites if s in replies]
        if not names:
            raise PayloadError(f"{self.name}: no site replied in round {rnd}")
        counts = [replies[s].num_samples for s in names]
        p = aggregation_weights(counts, self.params.weighting)
        if train_models and self.personalization != "softpull":
            new.update(self._aggregate_personalization(state, replies, names, p))
        elif train_models:
            new.update(
                prefixed(
                    "global",
                    aggregate(
                        [strip_prefix("global", replies[s].arrays) for s in names],
                        p,
                        self.params.aggregation,
                        self.params.trim,
                    ),
                )
            )
            personal = {s: strip_prefix(f"personal/{s}", new) for s in sites}
            for s in names:
                personal[s] = strip_prefix(f"personal/{s}", replies[s].arrays)
            for s, a in soft_pull(personal, self.params.lam, replied=names).items():
                new.update(prefixed(f"personal/{s}", a))
        if train_selector:
            p_sel = aggregation_weights(counts, self.params.selector_weighting)
            new.update(
                prefixed("selector", weighted_mean([strip_prefix("selector", replies[s].arrays) for s in names], p_sel))
            )
            moments = [strip_prefix("selector_optim", replies[s].arrays) for s in names]
            if self.params.share_selector_moments and all(moments):
                # the moments are averaged with the weights of the selector's parameters
                new.update(prefixed("selector_optim", weighted_mean(moments, p_sel)))
        metrics: dict[str, Any] = {}
        for key, mkey in (
            ("train_loss", "loss"),
            ("personal_loss", "personal_loss"),
            ("selector_loss", "selector_loss"),
            ("routing_acc", "routing_acc"),
            ("alpha", "alpha"),
        ):
            vals = {s: replies[s].metrics.get(mkey) for s in names}
            if any(v is not None for v in vals.values()):
                metrics[key] = vals
        return metrics

    def _selector_fga_round(self, ctx: ServerContext, new: Arrays, rnd: int, phase: str) -> dict[str, Any]:
        """The selector's round by federated gradient averaging (``selector_training = "fga"``).

        Lockstep ``"selector_step"`` exchanges (:func:`fedseg.algorithms.fga.lockstep_round`):
        the initial selector goes to the sites on the first selector round only (then
        every site holds the same weights and Adam state), the frozen global and
        personalized models with step 0 of every selector-phase round; the server keeps
        the selector that site 1 returns after the last step.
        """
        sites = list(ctx.sites)
        first: Arrays = {}
        if rnd == self.first_selector_round():
            first.update({k: v for k, v in new.items() if k.startswith("selector/")})
        if phase == "selector":
            first.update({k: v for k, v in new.items() if k.startswith(("global/", "personal/"))})
        config = {"phase": phase, "sites": sites, "num_classes": self.num_classes(len(sites)), "mode": self.mode}
        weights, m, start = lockstep_round(
            ctx,
            rnd,
            kind="selector_step",
            first=first,
            config=config,
            prefix="selector",
            max_steps=self.params.max_selector_steps,
        )
        new.update(weights)
        out: dict[str, Any] = {"selector_loss": m["train_loss"], "selector_steps": m["steps"]}
        if "in_sync" in m:
            out["selector_in_sync"] = m["in_sync"]
        routing = {s: start[s].get("routing_acc") for s in sites}
        if any(v is not None for v in routing.values()):
            out["routing_acc"] = routing
        return out

    def _aggregate_personalization(
        self, state: Arrays, replies: Mapping[str, Reply], names: list[str], p: Sequence[float]
    ) -> Arrays:
        """Server half of a non-SoftPull personalization: the new global model and the replies' personalized models.

        Global: weighted mean of the sites' models with FedSM's ``weighting`` (pFedMe:
        ``(1 − β) w_r + β Σ p_k w_k``).  Personal: each replying site's model as sent,
        no SoftPull (APFL: α_k v_k + (1 − α_k) w_{r+1}); the others keep theirs.
        """
        locals_ = [strip_prefix("global", replies[s].arrays) for s in names]
        if self.personalization == "pfedme":
            from fedseg.algorithms.pfedme import server_update

            glob = server_update(strip_prefix("global", state), locals_, p, self.personal_params.beta)
        else:
            glob = aggregate(locals_, p, self.params.aggregation, self.params.trim)
        out = prefixed("global", glob)
        for s in names:
            own = strip_prefix(f"personal/{s}", replies[s].arrays)
            if self.personalization == "apfl":
                from fedseg.algorithms.apfl import mix_parameters

                own = mix_parameters(own, glob, float(replies[s].arrays["apfl_alpha"]))
            out.update(prefixed(f"personal/{s}", own))
        return out

    def composite(self, state: Arrays, ctx: ServerContext, gamma: float | None = None) -> Candidate:
        """The "fedsm" candidate: global + selector + personalized models, routed by the ``"fedsm"`` predictor."""
        sites = list(ctx.sites)
        arrays = {k: v for k, v in state.items() if k.startswith(("global/", "selector/", "personal/"))}
        config = {
            "sites": sites,
            "num_classes": self.num_classes(len(sites)),
            "mode": self.mode,
            "gamma": self._gamma() if gamma is None else gamma,
        }
        return Candidate("fedsm", arrays, predictor="fedsm", config=config)

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        have_selector = any(k.startswith("selector/") for k in state)
        out = []
        if have_selector:
            cand = self.composite(state, ctx)
            if self.params.gamma == "auto" and self.mode == "gate":
                replies = route_task(ctx.transport, cand, list(ctx.sites), "validation", self.params.gamma_grid)
                cand.config["gamma"] = pick_gamma(replies, self.params.gamma_grid)[0]
            out.append(cand)
        if not (self.two_phase and have_selector):
            out.append(Candidate("global", strip_prefix("global", state)))
            out += [
                Candidate(
                    f"personal/{s}",
                    strip_prefix(f"personal/{s}", state),
                    val_sites=(s,),
                    home_site=s,
                    config={"bn_role": "personal"},
                )
                for s in ctx.sites
            ]
        return out

    def final_candidates(
        self, state: Arrays, best: dict[str, Candidate], best_rounds: dict[str, int], ctx: ServerContext
    ) -> dict[str, Candidate]:
        """The composite to test, assembled from the best parts as the reference code keeps them.

        Global model: the best-validation ``global`` candidate; personalized models: each
        site's best-validation ``personal/<site>`` (for fedsm-extra / ensemble these are only
        validated in the model phase, so they are the model phase's best); selector: the
        final one or the best earlier one (``best_selector/…``, kept by the server), whichever
        has the higher mean validation routing accuracy over the sites (Eq. 2; Eq. 1's oracle
        labels for K + 1 classes).  With ``gamma = "auto"`` γ is picked again on validation
        for the assembled composite.  ``config["assembled"]`` records the rounds of the parts.
        """
        comp = best.get("fedsm")
        if comp is None:
            return {}
        sites = list(ctx.sites)
        arrays: Arrays = {}
        rounds: dict[str, Any] = {}
        for name in ["global", *(f"personal/{s}" for s in sites)]:
            part = best.get(name)
            arrays.update(prefixed(name, part.arrays if part is not None else strip_prefix(name, comp.arrays)))
        gate_auto = self.params.gamma == "auto" and self.mode == "gate"
        grid = self.params.gamma_grid
        options = [("final", strip_prefix("selector", state), None)]
        if "best_selector_score" in state:
            options.append(("best", strip_prefix("best_selector", state), float(state["best_selector_score"])))
        chosen = None
        for label, sel, known in options:
            cand = self.composite({**arrays, **prefixed("selector", sel)}, ctx)
            replies = route_task(ctx.transport, cand, sites, "validation", grid) if known is None or gate_auto else None
            score = known if known is not None else _mean_routing({s: r["routing_acc"] for s, r in replies.items()})
            if chosen is None or (score is not None and (chosen[1] is None or score > chosen[1])):
                chosen = (cand, score, replies, label)
        assert chosen is not None
        cand, score, replies, label = chosen
        if gate_auto and replies is not None and sum(r["n"] for r in replies.values()):
            cand.config["gamma"] = pick_gamma(replies, grid)[0]
        rounds["selector"] = int(state["best_selector_round"]) if label == "best" else self.cfg.rounds
        rounds["selector_val_routing_acc"] = score
        for name in ["global", *(f"personal/{s}" for s in sites)]:
            rounds[name] = best_rounds.get(name, best_rounds["fedsm"])
        cand.config["assembled"] = rounds
        cand.arrays = clone(cand.arrays)  # its own tensors (the best candidates keep theirs)
        return {"fedsm": cand}

    # ----------------------------------------------------------- site half
    def site_handlers(self):
        return {"train": self._train, "route": self._route, "selector_step": self._selector_step}

    def fp16_unsupported(self) -> str | None:
        if self.params.selector_training == "fga":
            return (
                FP16_GRADIENT_AVERAGING
                + ", used by FedSM's selector (fp16 runs with --set fedsm.selector_training=fedavg)"
            )
        if self.params.personalization != "softpull":
            # APFL's, pFedMe's and Per-FedAvg's answers do not depend on their settings
            return personalization_class(self.params.personalization).fp16_unsupported(self)
        return None

    def predictors(self):
        def make(site: Site, arrays: Arrays, config: dict) -> Callable[[torch.Tensor], torch.Tensor]:
            sel, models = _load_composite(site, arrays, config, self.params, "fedsm-eval/")
            return _composite_predict(site, sel, models, config.get("mode", "gate"), float(config.get("gamma", 0.9)))

        return {**super().predictors(), "fedsm": make}

    def _train(self, site: Site, task: Task) -> Reply:
        cfg = task.config
        rnd, phase, sites = cfg["round"], cfg["phase"], list(cfg["sites"])
        if site.name not in sites:
            raise PayloadError(f"site {site.name}: asked to train FedSM but not among the sites {sites}")
        own = sites.index(site.name)
        c = int(cfg["num_classes"])
        metrics: dict[str, Any] = {}
        out: Arrays = {}
        train_models = phase in ("joint", "models")
        train_selector = phase in ("joint", "selector") and cfg.get("train_selector", True)
        by_method = train_models and self.personalization != "softpull"
        if by_method:
            # the method's own site step makes the global and personalized models; the
            # loop below then trains the selector alone (on the same seeded batches)
            out, method_metrics = self._personalize(site, task)
            metrics.update(method_metrics)
            train_models = False
        if train_models:
            g = site.load("global", strip_prefix("global", task.arrays))
            opt_g = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
            pm = site.load("personal", strip_prefix(f"personal/{site.name}", task.arrays))
            opt_p = site.optimizer("personal")
            g.train()
            pm.train()
        if train_selector:
            role = selector_role(c)
            sel = site.load(role, strip_prefix("selector", task.arrays), _selector_factory(site, c, self.params))
            opt_s = site.optimizer(role, params=list(sel.parameters()), lr=self.params.selector_lr)
            moments = strip_prefix("selector_optim", task.arrays)
            if moments:
                set_optimizer_moments(opt_s, sel, moments)
        frozen = _load_frozen(site, task.arrays, sites) if phase == "selector" and train_selector else []
        if train_selector:
            if dataset_len(site.data.val) > 0:
                # routing accuracy of the selector as received (last round's average), on validation
                metrics["routing_acc"] = self._routing_accuracy(site, sel, sites, phase)
            sel.train()
        sums = {"selector_loss": 0.0}
        steps = sel_steps = 0
        max_sel = self.params.max_selector_steps
        if train_models:
            # Alg. 1 trains the models on the same batches; they are independent within a round, so
            # each runs the generic loop over the round's seeded batches (a vectorized simulation
            # then trains every site's global and personal models together: fedseg.simulation.vectorize)
            fit_g = site.fit("global", rnd, stream="train", optimizer=opt_g, steps=cfg.get("steps"))
            fit_p = site.fit("personal", rnd, stream="train", optimizer=opt_p, steps=cfg.get("steps"))
            steps = fit_g["steps"]
        for x, y in site.batches(rnd, "train", cfg.get("steps")) if train_selector else ():
            if not train_models:
                steps += 1
            if max_sel is None or sel_steps < max_sel:
                sel_steps += 1
                opt_s.zero_grad(set_to_none=True)
                with site.autocast():
                    loss = self._selector_loss(site, sel, x, y, phase, own, frozen)
                site.step(role, opt_s, loss)
                sums["selector_loss"] += loss.detach().double()  # summed on the device, read once below
        if train_models:
            out.update(prefixed("global", site.arrays("global")))
            out.update(prefixed(f"personal/{site.name}", site.arrays("personal")))
            metrics["loss"] = fit_g["loss"]
            metrics["personal_loss"] = fit_p["loss"]
        if train_selector:
            out.update(prefixed("selector", site.arrays(role)))
            if self.params.share_selector_moments:
                out.update(prefixed("selector_optim", optimizer_moments(opt_s, sel)))
            metrics["selector_loss"] = float(sums["selector_loss"]) / max(sel_steps, 1)
        metrics["steps"] = metrics["steps"] if by_method else steps
        return Reply(arrays=out, metrics=metrics, num_samples=site.num_train)

    def _selector_loss(
        self,
        site: Site,
        sel: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        phase: str,
        own: int,
        frozen: Sequence[nn.Module],
    ) -> torch.Tensor:
        """The selector's mean loss on a batch: Eq. 2 cross-entropy (joint phase), Eq. 1 cross-entropy
        (fedsm-extra) or the workload loss of the softmax-weighted output mix (ensemble)."""
        logits = sel(x)
        if phase == "joint":
            return F.cross_entropy(logits, torch.full((x.shape[0],), own, dtype=torch.long, device=logits.device))
        with torch.no_grad():
            outputs = [m(x) for m in frozen]
        if self.labels == "oracle":
            return F.cross_entropy(logits, oracle_labels(outputs, y, site.workload.loss))
        return site.workload.loss(ensemble_mix(torch.softmax(logits, dim=1), outputs), y)

    def _selector_step(self, site: Site, task: Task) -> Reply:
        """Site half of one lockstep exchange of the selector's gradient averaging (``selector_training = "fga"``).

        Config: as :func:`fedseg.algorithms.fga.gradient_step` plus ``phase``, ``sites``,
        ``num_classes``.  Step 0 also reports the routing accuracy of the selector as
        the site holds it at the round's start (validation split) and, in the selector
        phase, loads the frozen global and personalized models sent with it.
        """
        cfg = task.config
        sites, phase, c = list(cfg["sites"]), cfg["phase"], int(cfg["num_classes"])
        if site.name not in sites:
            raise PayloadError(f"site {site.name}: asked to train FedSM's selector but not among the sites {sites}")
        own = sites.index(site.name)
        role = selector_role(c)
        factory = _selector_factory(site, c, self.params)
        arrays = task.arrays
        routing = None
        if cfg.get("step") == 0:
            init = strip_prefix("selector", arrays)
            sel = site.load(role, init, factory) if init else site.model(role, factory)
            arrays = {k: v for k, v in arrays.items() if not k.startswith("selector/")}
            if phase == "selector":
                _load_frozen(site, arrays, sites)
            if dataset_len(site.data.val) > 0:
                routing = self._routing_accuracy(site, sel, sites, phase)
        frozen = [site.models[r] for r in _frozen_roles(sites)] if phase == "selector" else []
        reply = gradient_step(
            site,
            Task(task.kind, arrays, cfg),
            role=role,
            prefix="selector",
            factory=factory,
            lr=self.params.selector_lr,
            loss=lambda model, x, y: self._selector_loss(site, model, x, y, phase, own, frozen),
            check_loss=F.cross_entropy if self.labels != "mix" or phase == "joint" else None,
        )
        if routing is not None:
            reply.metrics["routing_acc"] = routing
        return reply

    def _routing_accuracy(self, site: Site, sel: nn.Module, sites: Sequence[str], phase: str) -> float:
        """Validation routing accuracy of ``sel`` at this site: for FedSM's Eq. 2 selector, the fraction of
        images whose argmax is the site itself; for the K + 1-class selectors of the selector phase, the
        fraction whose argmax is Eq. 1's oracle label (the model with the lowest loss on the image; the
        frozen models must be loaded)."""
        if phase == "selector":
            return oracle_accuracy(site, sel, [site.models[r] for r in _frozen_roles(sites)], "validation")
        return routing_accuracy(
            _selector_probs(site, sel, "validation"), sites.index(site.name), 0 if self.labels == "site" else 1
        )

    def _personalize(self, site: Site, task: Task) -> tuple[Arrays, dict[str, Any]]:
        """Site half of a non-SoftPull personalization: one round of the method from the received w_r.

        Returns the reply arrays (``global/…``: the site's new global model;
        ``personal/<site>/…``: its personalized model; APFL: v_k and ``apfl_alpha``) and
        metrics ``loss`` (global model), ``personal_loss``, ``steps`` (APFL: ``alpha``).
        """
        name, pp, rnd = self.personalization, self.personal_params, task.config["round"]
        w_r = strip_prefix("global", task.arrays)
        module = importlib.import_module(f"fedseg.algorithms.{name}")
        metrics: dict[str, Any]
        if name in ("pfedme", "apfl"):
            # these methods change the site's copy of the global model themselves
            m = module.local_round(site, w_r, rnd, pp)
            metrics = {"loss": m["loss"], "personal_loss": m.get("personal_loss", m["loss"]), "steps": m["steps"]}
        else:
            if name == "perfedavg":
                m = module.local_round(site, w_r, rnd, pp)
            else:  # ft, ditto: the global model takes FedAvg's step, as in FedSM
                site.load("global", w_r)
                opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
                m = site.fit("global", rnd, stream="train", optimizer=opt, steps=task.config.get("steps"))
            metrics = {"loss": m["loss"], "steps": m["steps"]}
            if name == "ditto":
                metrics["personal_loss"] = module.personal_step(site, w_r, rnd, pp)["loss"]
            else:
                metrics["personal_loss"] = module.personal_step(site, w_r, rnd, pp)[1]["loss"]
        out = prefixed("global", site.arrays("global"))
        out.update(prefixed(f"personal/{site.name}", site.arrays("personal")))
        if name == "apfl":
            out["apfl_alpha"] = site.store["apfl/alpha"].clone()
            metrics["alpha"] = float(site.store["apfl/alpha"])
        return out, metrics

    def _route(self, site: Site, task: Task) -> Reply:
        """Aggregate routing statistics of a composite on one split (only sums and counts leave the site).

        Config: ``split``, ``sites``, ``num_classes``, ``mode``, ``gammas``.  Metrics:
        ``n`` cases, ``routing_acc`` (Eq. 2 selector: fraction routed to the site's own
        model, None for a site outside the federation; K + 1-class selector: fraction
        whose argmax is Eq. 1's oracle label),
        ``dice_sum_per_model`` (K + 1 sums of per-case Dice: global, personal…), and
        ``selections``: one entry per γ (gate) or one entry (argmax / mix) with
        ``gamma``, ``dice_sum`` and ``counts`` (cases routed to each of the K + 1 models).
        """
        cfg = task.config
        split, sites, mode = cfg["split"], list(cfg["sites"]), cfg.get("mode", "gate")
        sel, models = _load_composite(site, task.arrays, cfg, self.params, "fedsm-eval/")
        probs = _selector_probs(site, sel, split)
        n = probs.shape[0]
        per_model = (
            torch.stack(
                [site.score(lambda x, m=m: site.workload.predict(m, x), split).mean(dim=1) for m in models], dim=1
            )
            if n
            else torch.zeros(0, len(models), dtype=torch.float64)
        )
        if probs.shape[1] == len(sites):  # Eq. 2 selector: is the site itself picked?
            acc = routing_accuracy(probs, sites.index(site.name), 0) if site.name in sites else None
        else:  # K + 1 classes (fedsm-extra, ensemble): agreement with Eq. 1's oracle labels
            acc = oracle_accuracy(site, sel, models, split) if n else None
        selections = []
        if mode == "gate":
            for gamma in cfg.get("gammas", [0.9]):
                idx = route(probs, float(gamma))
                dice = per_model.gather(1, idx.unsqueeze(1)).squeeze(1)
                selections.append(
                    {
                        "gamma": float(gamma),
                        "dice_sum": float(dice.sum()),
                        "counts": torch.bincount(idx, minlength=len(models)).tolist(),
                    }
                )
        else:
            idx = probs.argmax(dim=1)
            if mode == "mix":
                dice = site.score(_composite_predict(site, sel, models, "mix", 0.0), split).mean(dim=1)
            else:
                dice = per_model.gather(1, idx.unsqueeze(1)).squeeze(1)
            selections.append(
                {
                    "gamma": None,
                    "dice_sum": float(dice.sum()),
                    "counts": torch.bincount(idx, minlength=len(models)).tolist(),
                }
            )
        return Reply(
            metrics={
                "n": n,
                "routing_acc": acc,
                "dice_sum_per_model": per_model.sum(dim=0).tolist(),
                "selections": selections,
            },
            num_samples=n,
        )


def _mean_routing(accs: Mapping[str, Any] | None) -> float | None:
    """Mean over sites of the per-site routing accuracies (None / NaN left out); None if there is none."""
    vals = [float(v) for v in (accs or {}).values() if v is not None and not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else None


def _keep_best_selector(new: Arrays, before: Arrays, accs: Mapping[str, Any] | None, measured_round: int) -> None:
    """Keep in ``new`` the selector with the best mean validation routing accuracy so far.

    ``accs`` are the sites' routing accuracies of ``before`` — the selector the sites held at the
    start of this round, i.e. after round ``measured_round`` — so the best is kept one round late;
    the final selector is compared at the end (:meth:`FedSM.final_candidates`).
    """
    score = _mean_routing(accs)
    if score is None or not before:
        return
    if "best_selector_score" in new and float(new["best_selector_score"]) >= score:
        return
    new.update(prefixed("best_selector", {k.removeprefix("selector/"): v.clone() for k, v in before.items()}))
    new["best_selector_score"] = torch.tensor(score, dtype=torch.float64)
    new["best_selector_round"] = torch.tensor(measured_round, dtype=torch.int64)


def route_task(
    transport, candidate: Candidate, sites: Sequence[str], split: str, gammas: Sequence[float]
) -> dict[str, dict[str, Any]]:
    """Ask ``sites`` for the routing statistics of a ``"fedsm"`` candidate on ``split``; returns ``{site: metrics}``."""
    config = {**candidate.config, "split": split, "gammas": [float(g) for g in gammas if g is not None]}
    replies = transport.ask({s: Task("route", dict(candidate.arrays), config) for s in sites})
    return {s: r.metrics for s, r in replies.items()}


def pick_gamma(replies: Mapping[str, Mapping[str, Any]], gammas: Sequence[float]) -> tuple[float, float]:
    """γ with the best sample-weighted Dice Σ_sites dice_sum / Σ_sites n (first of ties); returns (γ, Dice)."""
    total_n = sum(r["n"] for r in replies.values())
    if total_n == 0:
        raise ValueError("no cases to choose gamma on: the sites' validation splits are empty")
    best: tuple[float, float] | None = None
    for i, g in enumerate(gammas):
        dice = sum(r["selections"][i]["dice_sum"] for r in replies.values()) / total_n
        if best is None or dice > best[1]:
            best = (float(g), dice)
    assert best is not None
    return best


class FedSMExtra(FedSM):
    """FedSM-extra (Section 3.1.2): selector trained in extra rounds with Eq. 1 labels."""

    name = "fedsm-extra"
    title = "FedSM-extra"
    summary = "FedSM-extra: global + SoftPull models, then extra rounds training a K+1-class selector on Eq. 1 labels"
    labels = "oracle"
    mode = "argmax"
    two_phase = True


class FedSMEnsemble(FedSM):
    """FedSM ensemble (Section 3.1.1): selector trained through the softmax-weighted output mix."""

    name = "fedsm-ensemble"
    title = "FedSM-ensemble"
    summary = "FedSM ensemble: selector trained through the loss of the softmax-weighted mix of all models' outputs"
    labels = "mix"
    mode = "mix"
    two_phase = True
