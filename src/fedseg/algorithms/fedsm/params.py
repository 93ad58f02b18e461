"""FedSM's settings (config section ``[fedsm]``, shared by FedSM, FedSM-extra and the ensemble):
:class:`FedSMParams` and the two profiles that fill in the settings left unset."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fedseg.algorithms.fedavg import FedAvgParams
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.errors import ConfigError

__all__ = ["DEFAULT_GAMMA_GRID", "DEFAULT_GAMMA_MARGIN", "PROFILE_DEFAULTS", "FedSMParams", "PersonalizationName"]

DEFAULT_GAMMA_GRID = (0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

#: ``fedsm.gamma_margin`` of the default profile where it applies (``gamma = "auto-per-model"``, 1.0 in the
#: grid); 0 elsewhere and in the reference profile (docs/results/fedsm.md, "Main result").
DEFAULT_GAMMA_MARGIN = 0.01

PersonalizationName = Literal["softpull", "ft", "apfl", "perfedavg", "pfedme", "ditto"]
"""``fedsm.personalization`` choices (FedSM Table 6 rows); the keys of :data:`fedseg.algorithms.fedsm.PERSONALIZATIONS`."""

#: What each profile fills in for the settings left unset (None).  "default": settings
#: that learn on the synthetic benchmark (docs/results/fedsm.md); "reference": the reference
#: code's literal ones (γ 0.9, n_k/n weights, every local step, averaged selector).
PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "default": {
        "gamma": "auto-per-model",
        "selector_training": "fga",
        "selector_weighting": "even",
        "selector_augment": "flip",
        "ensemble_objective": "experts",
        "global_training": "fedavg",
    },
    "reference": {
        "gamma": 0.9,
        "ensemble_objective": "mix",
        "selector_training": "fedavg",
        "selector_weighting": "samples",
        "selector_steps": "all",
        "selector_augment": "none",
        "global_training": "fedavg",
    },
}


@dataclass(frozen=True)
class FedSMParams(FedAvgParams):
    """Settings of FedSM and its variants (config section ``[fedsm]``).

    FedAvg's settings of the global model's average (:class:`~fedseg.algorithms.fedavg.FedAvgParams`:
    ``weighting``, ``aggregation``, ``trim``) and FedSM's own.

    Settings left unset (None) are filled in by ``profile`` (:meth:`resolved`); a run's
    ``config.toml`` and ``results.json["config"]`` hold the resolved values.

    profile
        ``"default"``: settings that learn out of the box (one γ per personalized model chosen on
        validation, selector trained by federated gradient averaging on flipped batches);
        ``"reference"``: the reference code's literal settings (γ = 0.9, selector averaged with n_k/n
        weights after every local step, no flips).
    lam
        SoftPull's λ (Eq. 11) in [0, 1]; 0.7 is the paper's best on the low-similarity
        retinal task (Table 7) and the reference code's default.  Below 1/K a site's
        own model weighs less than each other site's (warned, allowed: Table 7 has 0.1).
    gamma
        Alg. 2's confidence threshold γ: a number in [0, 1] (0.9: reference code), or
        ``"auto"``: at each validation the sites report their validation
        Dice summed per γ of ``gamma_grid`` and the γ with the best Dice by the run's
        ``eval.best_criterion`` (pooled cases, or the mean of per-site means) is used.
        ``"auto-per-model"`` (default profile): one threshold per personalized model, each the best of
        ``gamma_grid`` on the validation cases whose top class is that model (γ_j = 1 sends them all to
        the global model: a personalized model that is worse than the global model on validation is then
        not used).
    gamma_grid
        Candidate γ values for ``gamma = "auto"`` and the routing reports.
    gamma_margin
        ``gamma = "auto-per-model"`` only: a personalized model's threshold is set below 1 (some of its
        cases sent to it instead of the global model) only where that raises the mean validation Dice of the
        cases whose top class it is by at least this much over γ_j = 1 (all of them to the global model);
        0: the best of ``gamma_grid``, ties to the earlier γ.  A margin keeps the global model where a few
        validation cases cannot tell the two apart; ``gamma_grid`` must hold 1.0.  Unset: the default
        profile's :data:`DEFAULT_GAMMA_MARGIN` (0.01) where it applies, else 0 (one γ, a grid without 1.0,
        the reference profile).
    selector_width, selector_hidden
        Size of the selector (the workload's, ``Workload.selector``; by default the papers'
        VGG-11 layout × width).  The reference's VGG-11 has 129 M parameters (80× the U-Net).
        Width 1/32 (12 k parameters for 3 channels and 6 sites): the ``fga`` selector sends one gradient
        each way per selector step, so its bytes a round are 2 T w_s against the models' 4 w_g (T steps,
        w_s and w_g the selector's and the U-Net's sizes); at ``make demo``'s half-width U-Net and
        T = 15 that keeps a FedSM round within 3× FedAvg's (2.88× measured; width 0.125, 154 k parameters:
        13×).  FedSM on the fundus preset (three seeds, 40 rounds): Dice 0.3949 against width 0.125's 0.3924,
        test routing 0.92 against 0.86; the selector alone on fundus and prostate routes within the seeds'
        spread of width 0.125's, one fundus seed of three staying below 0.9 (``docs/results/fedsm-selector.md``,
        "Selector size").  ``--set fedsm.selector_width=0.125`` runs the wider selector.
    selector_lr
        Selector learning rate η_s (Alg. 1); None = ``train.lr``.
    selector_augment
        ``"flip"``: every image of a selector batch is flipped along each spatial axis with probability
        1/2 (seeded by run seed, site, round and step), so that the selector learns a site's appearance
        rather than its few training images (each mask flipped with its image, for the targets computed from
        the segmentation models' losses); the default profile's for FedSM.  ``"none"``: the batches as drawn;
        the reference profile's, and the default profile's for FedSM-extra and the ensemble (their targets,
        which model segments an image best, do not survive a flip as a site label does).
    selector_training
        ``"fga"`` (default profile): every selector step is a lockstep exchange of
        federated gradient averaging (:func:`fedseg.algorithms.lockstep.lockstep_round`): the
        sites send the gradient of their batch, the server returns the sample-weighted
        mean (= the pooled batch's gradient) and every site applies it with its own,
        identical Adam — centralized training of the selector, so no site's single class
        (Eq. 2) dominates.  ``"fedavg"`` (reference): local selector steps, then the
        server averages the selector and its Adam moments (Alg. 1 line 15).  ``"fedrs"``:
        as ``"fedavg"``, but the local loss is FedRS's restricted softmax (Li & Zhan, KDD
        2021): the logits of the classes a site does not hold (Eq. 2: every class but its
        own) are scaled by ``fedrs_alpha``, so local steps stop pushing the other sites'
        classes down; FedSM-extra's / the ensemble's selector phase (no fixed class per
        site) trains as ``"fedavg"``.  ``"fedaws"``: FedAwS (Yu et al., ICML 2020): the sites'
        local steps minimize a positive-only loss (squared hinge on the cosine of the image's
        embedding and its own class embedding, a row of the selector's last layer), the
        server averages, takes each class embedding from its site and pushes the class
        embeddings apart with a step of the spread-out regularizer
        (:mod:`fedseg.algorithms.fedsm.fedaws`); traffic as ``"fedavg"``; FedSM-extra's / the
        ensemble's selector phase trains as ``"fedavg"``.
    fedrs_alpha
        FedRS's α in [0, 1] (``selector_training = "fedrs"`` only): 1 = plain softmax
        (``"fedavg"``), 0 = the other classes' logits do not enter the local loss.  0.5,
        the FedRS paper's default.
    fedaws_nu, fedaws_lr, fedaws_margin
        FedAwS (``selector_training = "fedaws"`` only): ν in (0, 4], the squared distance
        between normalized class embeddings below which the spread-out regularizer pushes a
        pair apart (2: orthogonal); η_sp > 0, the step size of the server's spread-out step
        (the paper's λη); m in (0, 1], the cosine the positive-only loss asks of an image and
        its own class embedding.
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
        is 1 (``"fedrs"``, ``"fedaws"``: every local step, the point of their local losses) (``docs/results/fedsm-selector.md``, "Selector training": with 5 local steps per round the averaged
        selector collapses to one class, with 1 it learns slowly).
    ensemble_objective
        fedsm-ensemble only: what its K + 1-class selector is trained on.  ``"experts"``
        (default profile): the mixture-of-experts likelihood −log Σ_k ŷ_k exp(−(L_k − min L)/τ)
        of the frozen models' per-image losses L_k (its logit gradient is ŷ − the posterior of
        each model given the image; τ → 0 gives Eq. 1's cross-entropy).  ``"mix"`` (reference
        profile, the paper's Section 3.1.1): the workload loss of the mixed output
        L(Σ_k ŷ_k h_k, y), whose gradient vanishes once the softmax saturates — it drove the
        selector to the global model on every image (``docs/results/fedsm-extra.md``; derivation in
        ``docs/algorithms.md``).  Inference is the mix
        Σ_k ŷ_k h_k either way.
    extra_objective
        fedsm-extra only: what its K + 1-class selector is trained on.  ``"oracle"`` (both
        profiles, the paper's Section 3.1.2): the cross-entropy with Eq. 1's one-hot label, the model
        with the lowest loss on the training image.  ``"experts"``: the ensemble's mixture-of-experts
        objective above (τ = ``ensemble_tau``; τ → 0 gives Eq. 1's cross-entropy), which shares the
        target between models whose losses on the image are within about τ; its selectors are
        compared by the composite's validation Dice.  ``"oracle"`` stays the default: on the synthetic
        benchmark the mixture objective did not beat it.  Inference is the argmax either way;
        routing is measured against Eq. 1's labels.
    ensemble_tau
        τ > 0 of the ``"experts"`` objective (``ensemble_objective``, ``extra_objective``), in units
        of the workload loss: per-image loss gaps much larger than τ give Eq. 1's one-hot target,
        gaps much smaller share the weight.
    weighting
        Weights of the global-model average: 'samples' (n_k/n, Alg. 1 line 15) or 'even'.
    selector_weighting
        ``fedavg`` selector only: weights of the selector (and its moments) average.
        Default profile 'even' (1/K), a departure from Alg. 1's n_k/n (reference
        profile): every site holds exactly one selector class (Eq. 2), and with n_k/n the
        averaged selector collapsed to the largest site's class on the synthetic fundus
        preset (``docs/results/fedsm-selector.md``, "Selector training").
    global_training
        How the global model is trained.  ``"fedavg"`` (both profiles; Alg. 1): local steps at every
        site, then the server averages the sites' models (``weighting``, ``aggregation``).  ``"fga"``:
        every local step is a lockstep exchange of federated gradient averaging (the third paper;
        :func:`fedseg.algorithms.lockstep.lockstep_round`, ``"global_step"`` tasks): the server averages
        the sites' batch gradients (``weighting = "samples"``: the pooled batch's gradient) and every
        site applies the average with its own, identical Adam — the global model is then the one
        centralized training on the pooled batches would give, at the cost of one gradient each way per
        local step instead of one model per round.  SoftPull only (the other personalizations start
        their personalized models from the averaged global model of the round); ``aggregation`` must
        be ``"mean"``.
    personalization
        How the personalized models are made (Section 4.3, Table 6): 'softpull' (the
        paper's FedSM, Eq. 11) or one of 'ft', 'apfl', 'perfedavg', 'pfedme', 'ditto'
        (that method's :class:`~fedseg.algorithms.personal.Personalization`, its settings from
        its own section; no SoftPull).
    aggregation, trim
        How the global model is combined (:func:`fedseg.foundation.arrays.aggregate`): 'mean'
        (Alg. 1, the paper), 'trimmed_mean' (``trim`` of the sites dropped at each end per
        coordinate) or 'median' — the latter two bound one site's influence (deployment).
    """

    section: ClassVar[str] = "fedsm"
    profile: Literal["default", "reference"] = "default"
    """Fills in the settings left unset: 'default' (settings that learn out of the box) or 'reference' (the reference code's literal settings)."""
    lam: float = 0.7
    """SoftPull's lambda in [0, 1] (Eq. 11): weight of a site's own model in its personalized model."""
    gamma: Literal["auto", "auto-per-model"] | float | None = None
    """Selector confidence threshold: a number in [0, 1], 'auto' (the best of gamma_grid on validation) or 'auto-per-model' (one threshold per personalized model); none: the profile's."""
    gamma_grid: tuple[float, ...] = DEFAULT_GAMMA_GRID
    """Candidate thresholds for gamma = 'auto' / 'auto-per-model' and the routing reports."""
    gamma_margin: float | None = None
    """'auto-per-model' only: least gain in mean validation Dice for a model's threshold to go below 1; none: 0.01 under the default profile where it applies, else 0."""
    selector_width: float = 0.03125
    """Width multiplier of the selector network (the papers' VGG-11 layout); 0.03125 keeps a FedSM round of make demo within 3x FedAvg's traffic (0.125: 13x)."""
    selector_hidden: int = 128
    """Hidden units of the selector's classifier head."""
    selector_lr: float | None = None
    """Selector learning rate; none = train.lr."""
    selector_augment: Literal["none", "flip"] | None = None
    """'flip': random flips of the selector's training images; 'none': the batches as drawn; none: the profile's."""
    selector_training: Literal["fga", "fedavg", "fedrs", "fedaws"] | None = None
    """How the selector is trained: 'fga' (federated gradient averaging), 'fedavg' (local steps, then averaged), 'fedrs' or 'fedaws'; none: the profile's."""
    fedrs_alpha: float = 0.5
    """FedRS's alpha in [0, 1] (selector_training = 'fedrs'): scale of the logits of classes a site does not hold."""
    fedaws_nu: float = 2.0
    """FedAwS's nu in (0, 4]: squared distance of class embeddings below which the spread-out step pushes them apart."""
    fedaws_lr: float = 0.01
    """FedAwS's step size (> 0) of the server's spread-out step."""
    fedaws_margin: float = 0.9
    """FedAwS's cosine margin in (0, 1] asked of an image and its own class embedding."""
    share_selector_moments: bool = True
    """'fedavg' selector only: average the selector's Adam moments along with its weights."""
    selector_rounds: int | None = None
    """fedsm-extra / fedsm-ensemble only: how many of the rounds are the extra selector rounds; none = ceil(rounds / 3)."""
    selector_steps: Literal["all"] | int | None = None
    """Selector optimizer steps per round: an integer or 'all' (every local step); none: the profile's."""
    ensemble_objective: Literal["experts", "mix"] | None = None
    """fedsm-ensemble only: selector objective, 'experts' (mixture-of-experts likelihood) or 'mix' (loss of the mixed output); none: the profile's."""
    extra_objective: Literal["oracle", "experts"] = "oracle"
    """fedsm-extra only: selector objective, 'oracle' (cross-entropy with the best model's one-hot label) or 'experts'."""
    ensemble_tau: float = 0.001
    """Temperature tau > 0 of the 'experts' objective, in units of the workload loss."""
    selector_weighting: Weighting | None = None
    """'fedavg' selector only: weights of the selector average, 'samples' or 'even'; none: the profile's."""
    global_training: Literal["fedavg", "fga"] | None = None
    """How the global model is trained: 'fedavg' (local steps, then averaged) or 'fga' (lockstep gradient averaging, SoftPull only); none: 'fedavg'."""
    personalization: PersonalizationName = "softpull"
    """How personalized models are made: 'softpull' (the paper's FedSM) or one of 'ft', 'apfl', 'perfedavg', 'pfedme', 'ditto' (settings from its own section)."""

    def resolved(self, site_labels: bool = True) -> FedSMParams:
        """These settings with every unset one filled in from ``profile``.  ``site_labels``: the selector learns
        Eq. 2's site labels (FedSM); False for FedSM-extra and the ensemble, whose selector targets come from
        the models' losses on the image: no flips there by default (a flip keeps an image's site, not which
        model segments it best; FedSM-extra with flips: docs/results/fedsm-extra.md)."""
        fill = dict(PROFILE_DEFAULTS[self.profile])
        if not site_labels:
            fill["selector_augment"] = "none"
        training = self.selector_training if self.selector_training is not None else fill["selector_training"]
        fill.setdefault("selector_steps", 1 if training == "fedavg" else "all")
        gamma = self.gamma if self.gamma is not None else fill["gamma"]
        per_model = gamma == "auto-per-model" and 1.0 in self.gamma_grid
        fill["gamma_margin"] = DEFAULT_GAMMA_MARGIN if self.profile == "default" and per_model else 0.0
        return dataclasses.replace(self, **{k: v for k, v in fill.items() if getattr(self, k) is None})

    @property
    def max_selector_steps(self) -> int | None:
        """Cap on selector steps per round (None: every local step)."""
        return None if self.selector_steps in (None, "all") else int(self.selector_steps)

    def validate(self) -> None:
        """The ranges of the numeric settings (the string options are ``Literal``s, checked by the
        config loader with the allowed values in the message)."""
        if not (0.0 <= self.lam <= 1.0):
            raise ConfigError(f"fedsm.lam = {self.lam} must be in [0, 1] (FedSM Eq. 11); e.g. --set fedsm.lam=0.7")
        if not isinstance(self.gamma, str) and self.gamma is not None and not (0.0 <= self.gamma <= 1.0):
            raise ConfigError(
                f"fedsm.gamma = {self.gamma} must be in [0, 1] (or 'auto', 'auto-per-model'); the reference uses 0.9"
            )
        if not self.gamma_grid or any(not (0.0 <= g <= 1.0) for g in self.gamma_grid):
            raise ConfigError(
                f"fedsm.gamma_grid = {list(self.gamma_grid)} must be a non-empty list of values in [0, 1]"
            )
        if self.gamma_margin is not None and not (0.0 <= self.gamma_margin <= 1.0):
            raise ConfigError(
                f"fedsm.gamma_margin = {self.gamma_margin} must be in [0, 1] (a gain in mean Dice); e.g. "
                "--set fedsm.gamma_margin=0.01"
            )
        if not (0.0 <= self.fedrs_alpha <= 1.0):
            raise ConfigError(
                f"fedsm.fedrs_alpha = {self.fedrs_alpha} must be in [0, 1] (FedRS's restriction; the paper's 0.5)"
            )
        for key, value, ok, allowed in (
            ("fedaws_nu", self.fedaws_nu, 0.0 < self.fedaws_nu <= 4.0, "in (0, 4] (squared distance of unit vectors)"),
            ("fedaws_lr", self.fedaws_lr, self.fedaws_lr > 0.0, "> 0"),
            ("fedaws_margin", self.fedaws_margin, 0.0 < self.fedaws_margin <= 1.0, "in (0, 1] (a cosine)"),
        ):
            if not ok:
                raise ConfigError(f"fedsm.{key} = {value} must be {allowed} (FedAwS, selector_training = 'fedaws')")
        if not self.ensemble_tau > 0:
            raise ConfigError(
                f"fedsm.ensemble_tau = {self.ensemble_tau} must be > 0 (the experts objective's temperature, "
                "in units of the workload loss); e.g. --set fedsm.ensemble_tau=0.001"
            )
        if not self.selector_width > 0:
            raise ConfigError(f"fedsm.selector_width must be > 0, got {self.selector_width}")
        if self.selector_hidden < 1:
            raise ConfigError(f"fedsm.selector_hidden must be >= 1, got {self.selector_hidden}")
        if self.selector_lr is not None and not self.selector_lr > 0:
            raise ConfigError(f"fedsm.selector_lr must be > 0 (or none for train.lr), got {self.selector_lr}")
        if self.selector_rounds is not None and self.selector_rounds < 1:
            raise ConfigError(f"fedsm.selector_rounds must be >= 1 (or none for rounds/3), got {self.selector_rounds}")
        steps = self.selector_steps
        if isinstance(steps, int) and steps < 1:
            raise ConfigError(f"fedsm.selector_steps = {steps!r}; give an integer >= 1 or 'all' (every local step)")
        super().validate()
        if self.global_training == "fga":
            if self.personalization != "softpull":
                raise ConfigError(
                    f"fedsm.global_training = 'fga' works with fedsm.personalization = 'softpull' only (got "
                    f"{self.personalization!r}, whose personalized models start from each round's averaged global "
                    "model); use --set fedsm.global_training=fedavg"
                )
            if self.aggregation != "mean":
                raise ConfigError(
                    f"fedsm.aggregation = {self.aggregation!r} combines the sites' global models, which "
                    "fedsm.global_training = 'fga' does not send (it averages their gradients at every step); "
                    "use --set fedsm.aggregation=mean or --set fedsm.global_training=fedavg"
                )
