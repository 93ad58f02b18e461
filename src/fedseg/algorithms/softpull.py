"""FedSM's pure maths (Xu et al., CVPR 2022): SoftPull, selector labels, routing — and SoftPull as a
:class:`fedseg.algorithms.personal.Personalization` (:class:`SoftPull`, FedSM's default).

The functions work on plain tensors / ``dict[str, Tensor]`` and are tested on
hand-computed values without the engine (``tests/unit/algorithms/test_fedsm_maths.py``).

Model-index convention (the paper's h_0, h_1, …, h_K): index 0 is the global
model, index k ≥ 1 is the personalized model of the k-th site (in federation order).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fedseg.algorithms.personal import Combine, PersonalizationBase, PersonalStep
from fedseg.foundation.arrays import (
    Arrays,
    clone,
    normalize_weights,
    prefixed,
    strip_prefix,
    weighted_means,
)
from fedseg.foundation.messages import Reply, Task
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = [
    "LambdaBelowOneOverKWarning",
    "SoftPull",
    "check_lambda",
    "ensemble_mix",
    "experts_loss",
    "image_losses",
    "oracle_labels",
    "route",
    "routing_accuracy",
    "soft_pull",
    "soft_pull_from_sum",
    "soft_pull_matrix",
]


class LambdaBelowOneOverKWarning(UserWarning):
    """SoftPull's λ is below 1/K: a site's own model weighs less than each other site's."""


def check_lambda(lam: float, k: int, where: str = "fedsm.lam") -> None:
    """Raise ``ValueError`` unless K ≥ 2 and λ ∈ [0, 1]; warn when λ < 1/K (SoftPull, Eq. 11).

    In [1/K, 1] a site's own model weighs at least as much as each other site's
    ((1 − λ)/(K − 1) ≤ λ ⇔ λ ≥ 1/K).  Below 1/K the own model weighs *less* than each
    other site's — allowed (the paper's Table 7 runs λ = 0.1 with K = 6) but warned
    (:class:`LambdaBelowOneOverKWarning`).

    Parameters
    ----------
    lam
        SoftPull coefficient λ.
    k
        Number of sites K in the federation.
    where
        Setting name used in the messages.
    """
    if k < 2:
        raise ValueError(
            f"SoftPull needs at least 2 sites (got K = {k}): with one site there are no other "
            "personalized models to pull towards; use method 'local' or 'fedavg' for a single site"
        )
    if not (0.0 <= lam <= 1.0):
        raise ValueError(
            f"{where} = {lam} is outside [0, 1] (FedSM Eq. 11); e.g. {where} = 0.7 (the paper's best on low-similarity data)"
        )
    if lam < 1.0 / k - 1e-12:
        warnings.warn(
            f"{where} = {lam} is below 1/K = {1.0 / k:.4f} for K = {k} sites: each site's own personalized model then weighs "
            f"{lam:g} in its SoftPull average and every other site's {(1.0 - lam) / (k - 1):.4g} — more than its own. "
            f"λ = 1/K is the uniform mean (FedAvg-like), λ = 1 no pulling",
            LambdaBelowOneOverKWarning,
            stacklevel=2,
        )


def soft_pull_matrix(k: int, lam: float) -> torch.Tensor:
    """The K × K SoftPull mixing matrix A (float64): ``A[i, i] = λ``, ``A[i, j] = (1 − λ)/(K − 1)``.

    Row i holds the weights of every site's personalized model in site i's new model
    (Eq. 11); every row sums to 1.  ``k = 1`` gives ``[[1.0]]`` (nothing to pull from).
    """
    if k < 1:
        raise ValueError(f"soft_pull_matrix needs k >= 1, got {k}")
    if k == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    off = (1.0 - lam) / (k - 1)
    a = torch.full((k, k), off, dtype=torch.float64)
    a.fill_diagonal_(lam)
    return a


def soft_pull(
    personal: Mapping[str, Mapping[str, torch.Tensor]], lam: float, replied: Sequence[str] | None = None
) -> dict[str, Arrays]:
    """SoftPull (FedSM Eq. 11, Alg. 1 line 16) over the sites that replied.

    ``w_{p,k} ← λ w_{p,k} + (1 − λ)/(K' − 1) Σ_{k' ≠ k} w_{p,k'}`` for every replying
    site k, where K' is the number of replying sites.

    Parameters
    ----------
    personal
        ``{site: arrays}``: each site's personalized model as trained this round (for
        replying sites) or as last stored (for the others).  Same names/shapes for all.
    lam
        λ; for the validated range see :func:`check_lambda`.
    replied
        Sites that replied this round (default: all).  A site that did not reply keeps
        its model unchanged and is not mixed into the others.  With a single reply
        its model is returned unchanged (the reference code multiplies it by λ alone,
        shrinking the weights — a bug avoided here).

    Returns
    -------
    dict
        ``{site: new arrays}`` for every site of ``personal`` (new tensors).  Floating
        tensors are mixed in float64 and cast back; integer tensors (e.g. batch-norm
        counters) are the site's own.
    """
    names = list(personal) if replied is None else [s for s in personal if s in set(replied)]
    unknown = sorted(set(replied or ()) - set(personal))
    if unknown:
        raise ValueError(f"soft_pull: replied sites {unknown} have no personalized model; known: {sorted(personal)}")
    out: dict[str, Arrays] = {s: clone(a) for s, a in personal.items() if s not in names}
    k = len(names)
    if k == 1:
        out[names[0]] = clone(personal[names[0]])
        return out
    a = soft_pull_matrix(k, lam)
    items = [personal[s] for s in names]
    rows = []
    for i in range(k):
        # own model first so that integer tensors come from the site itself
        order = [i] + [j for j in range(k) if j != i]
        rows.append((order, normalize_weights([float(a[i, j]) for j in order])))
    for s, mixed in zip(names, weighted_means(items, rows)):  # each model cast once, K² foreach sums
        out[s] = mixed
    return {s: out[s] for s in personal}


def route(probs: torch.Tensor, gamma: float | Sequence[float]) -> torch.Tensor:
    """FedSM inference (Alg. 2): model index per image from the selector's softmax.

    Parameters
    ----------
    probs
        (B, K) selector softmax over the K personalized models (Eq. 2 labels).
    gamma
        Confidence threshold γ: ``max(ŷ_s) > γ`` → personalized model argmax + 1,
        otherwise the global model (index 0).  K values: one threshold per
        personalized model, the top class's applies (``fedsm.gamma = "auto-per-model"``).

    Returns
    -------
    torch.Tensor
        (B,) int64 model indices in 0..K.
    """
    conf, idx = probs.max(dim=1)
    threshold: float | torch.Tensor
    if isinstance(gamma, int | float):
        threshold = gamma
    else:
        per_model = torch.as_tensor(gamma, dtype=conf.dtype, device=conf.device)
        if per_model.shape != (probs.shape[1],):
            raise ValueError(
                f"{per_model.numel()} thresholds for a selector of {probs.shape[1]} classes; give one per class"
            )
        threshold = per_model[idx]
    return torch.where(conf > threshold, idx + 1, torch.zeros_like(idx))


def routing_accuracy(probs: torch.Tensor, own: int, first_personal: int = 0) -> float:
    """Fraction of a site's images whose selector argmax over the personalized models is the site itself.

    ``probs`` is (B, C); the personalized-model classes are columns
    ``first_personal … first_personal + K − 1`` (0 for FedSM's Eq. 2 selector, 1 for
    the K + 1-class selectors of FedSM-extra/ensemble whose class 0 is the global
    model); ``own`` is the site's 0-based position among the K sites.
    """
    if probs.shape[0] == 0:
        return float("nan")
    pick = probs[:, first_personal:].argmax(dim=1)
    return float((pick == own).double().mean())


def oracle_labels(
    outputs: Sequence[torch.Tensor], target: torch.Tensor, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """FedSM-extra's selector labels (Eq. 1): per image, the model whose output has the lowest loss.

    Parameters
    ----------
    outputs
        K + 1 tensors (B, C, *spatial): outputs h_0 (global), h_1 … h_K (personalized).
    target
        (B, C, *spatial) ground truth y.
    loss
        Mean-reduced loss ``loss(output, target)``, applied to each image alone.

    Returns
    -------
    torch.Tensor
        (B,) int64 index of argmin_k L(h_k, y) (ties → the lowest index, i.e. the global model).
    """
    return image_losses(outputs, target, loss).argmin(dim=1)


def image_losses(
    outputs: Sequence[torch.Tensor], target: torch.Tensor, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """(B, K + 1) float64 per-image losses L(h_k, y) of each output (no gradient): the mean-reduced ``loss``
    applied to each image alone (Eq. 1's argmin, and the ensemble's ``"experts"`` objective)."""
    b = target.shape[0]
    return torch.stack(
        [torch.stack([loss(h[i : i + 1], target[i : i + 1]).detach().double() for i in range(b)]) for h in outputs],
        dim=1,
    )


def ensemble_mix(weights: torch.Tensor, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ensemble output h = Σ_k ŷ_{s,k} h_k (Section 3.1.1).

    ``weights`` is (B, K + 1) (the selector's softmax), ``outputs`` K + 1 tensors
    (B, C, *spatial); the mix is taken over the model outputs (logits here) as the
    paper writes it.
    """
    stacked = torch.stack(list(outputs), dim=1)  # (B, K+1, C, ...)
    w = weights.reshape(*weights.shape, *([1] * (stacked.dim() - 2)))
    return (w * stacked).sum(dim=1)


def experts_loss(logits: torch.Tensor, losses: torch.Tensor, tau: float) -> torch.Tensor:
    """The ensemble selector's mixture-of-experts objective (``fedsm.ensemble_objective = "experts"``).

    With ŷ = softmax(a) the selector's weights over the K + 1 models and L_k = L(h_k, y) each
    model's per-image workload loss (``losses``, (B, K + 1), no gradient), per image

        ℓ(a) = −log Σ_k ŷ_k exp(−(L_k − min_j L_j) / τ)        (≥ 0; mean over the batch returned)

    — the negative log-likelihood of a mixture of experts whose k-th expert has likelihood
    ∝ exp(−L_k / τ) (Jacobs, Jordan, Nowlan & Hinton, "Adaptive Mixtures of Local Experts", Neural
    Computation 1991: a loss of the *mixed output* makes the experts cooperate, this one makes the
    selector pick one).  Shifting by min L changes no gradient.  Derivation of the gradient: with
    r_k = ŷ_k e^{−L_k/τ} / Σ_j ŷ_j e^{−L_j/τ} (the posterior of expert k given the image),

        ∂ℓ/∂a_k = ŷ_k − r_k,

    because ℓ = logsumexp(a) − logsumexp(a − L/τ) and ∂ logsumexp(v)/∂v_k = softmax(v)_k.  As τ → 0
    the posterior becomes one-hot on argmin_k L_k and ℓ → −log ŷ_{argmin L}: the cross-entropy with
    Eq. 1's labels (FedSM-extra); as τ → ∞, r → ŷ and nothing is learned.  Computed in float32 at
    least (``logits`` may be half precision under autocast).
    """
    a = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    shifted = (losses - losses.min(dim=1, keepdim=True).values).to(a.dtype) / tau
    return (torch.logsumexp(a, dim=1) - torch.logsumexp(a - shifted, dim=1)).mean()


class SoftPull(PersonalizationBase):
    """FedSM's personalization (Alg. 1): each site trains the global model (FedAvg's step) and its
    personalized model w_{p,k} — which the server holds and sends it every round, its Adam moments
    kept at the site — on the same seeded batches; the server averages the global models and applies
    SoftPull (Eq. 11, :func:`soft_pull`) to the personalized models of the sites that replied.

    ``params`` is λ (``fedsm.lam``, FedSM's own section).
    """

    name = "softpull"
    title = "SoftPull"
    server_holds_personal = True

    def __init__(self, params: Any, train_global: bool = True):
        super().__init__(params)
        self.train_global = train_global
        """False under ``fedsm.global_training = "fga"``: the global model is trained by lockstep gradient
        averaging outside this step (FedSM's ``"global_step"`` exchanges), so the site step trains the
        personalized model only and the server step applies SoftPull only."""

    def site_step(self, site: Site, task: Task) -> Asks[PersonalStep]:
        rnd, steps = task.config["round"], task.config.get("steps")
        # the two models are independent within a round: each runs the generic loop over the round's
        # seeded batches (a vectorized simulation then trains every site's global and personal models
        # together: fedseg.simulation.vectorize); with train_global False only the personal one
        metrics: dict[str, Any] = {}
        if self.train_global:
            g = site.load("global", strip_prefix("global", task.arrays))
            opt_g = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
            g.train()
            fit_g = yield from site.fit("global", rnd, stream="train", optimizer=opt_g, steps=steps)
            metrics["loss"] = fit_g["loss"]
        held = strip_prefix(f"personal/{site.name}", task.arrays)
        # under secure aggregation the site holds its personalized model (sent once, on the first round)
        pm = site.load("personal", held) if held else site.model("personal")
        pm.train()
        fit_p = yield from site.fit("personal", rnd, stream="train", optimizer=site.optimizer("personal"), steps=steps)
        return PersonalStep({**metrics, "personal_loss": fit_p["loss"], "steps": fit_p["steps"]})

    def server_step(
        self,
        state: Arrays,
        replies: Mapping[str, Reply],
        sites: Sequence[str],
        weights: Sequence[float],
        combine: Combine,
    ) -> Arrays:
        names = list(replies)
        out: Arrays = {}
        if self.train_global:
            out = prefixed("global", combine([strip_prefix("global", replies[s].arrays) for s in names], weights))
        personal = {s: strip_prefix(f"personal/{s}", state) for s in sites}
        for s in names:
            personal[s] = strip_prefix(f"personal/{s}", replies[s].arrays)
        for s, a in soft_pull(personal, self.params, replied=names).items():
            out.update(prefixed(f"personal/{s}", a))
        return out


def soft_pull_from_sum(
    own: Mapping[str, torch.Tensor], total: Mapping[str, torch.Tensor], k: int, lam: float
) -> Arrays:
    """One site's SoftPull (Eq. 11) from the sum of the personalized models alone: with
    S = Σ_{k'} w_{p,k'} over the K sites that replied (this site's own model included),

        w_{p,k} ← λ w_{p,k} + (1 − λ)/(K − 1) · (S − w_{p,k}),

    which is row k of :func:`soft_pull` because Σ_{k' ≠ k} w_{p,k'} = S − w_{p,k}.  Under secure aggregation
    the server learns only S and each site forms its own model with this.  Floating tensors are mixed in
    float64 and cast back; integer tensors and names not in ``total`` are the site's own; K = 1 returns the
    model unchanged (as :func:`soft_pull`)."""
    out = clone(own)
    if k < 2:
        return out
    off = (1.0 - lam) / (k - 1)
    for name, w in own.items():
        if name in total and w.is_floating_point():
            w64 = w.double()
            out[name] = (lam * w64 + off * (total[name].to(w64) - w64)).to(w.dtype)
    return out
