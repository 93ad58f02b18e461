"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Round r: each site k starts from the global model w_r and minimizes (paper Eq. 2)

    h_k(w; w_r) = F_k(w) + μ/2 ||w − w_r||²

for one round of local work, so each local gradient is g + μ (w − w_r); the server
averages as FedAvg does (w_{r+1} = Σ_k p_k w^{(k)}, p_k = n_k / n).

Convention: the proximal gradient is added to the loss gradient *before* the site's
optimizer step, so with the papers' Adam the proximal pull is preconditioned by
Adam like the rest of the gradient (FLamby's and Flower's FedProx do the same);
with ``train.optimizer = "sgd"`` and momentum 0 it is the paper's inexact solver
exactly.  The sum runs over the trainable parameters (not buffers).  μ = 0 is
FedAvg bitwise.  Default μ = 0.01, one of the paper's grid {0.001, 0.01, 0.1, 1}
(Section 5.2) and the value the FedSM comparison's example uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import nn

from fedseg.algorithms.fedavg import FedAvg, FedAvgParams, sent_update
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["FedProx", "FedProxParams", "proximal_loss", "proximal_term"]


def proximal_term(params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """μ/2 Σ_k ||params_k − anchor_k||² (FedProx Eq. 2), differentiable in ``params``.

    Parameters
    ----------
    params
        Current weights (typically ``dict(model.named_parameters())``).
    anchor
        Detached reference weights w_r with the same names and shapes.
    mu
        Proximal coefficient μ ≥ 0.

    Returns
    -------
    torch.Tensor
        A scalar whose gradient with respect to ``params_k`` is μ (params_k − anchor_k).
    """
    total = None
    for k, p in params.items():
        d = (p - anchor[k]).pow(2).sum()
        total = d if total is None else total + d
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total


def proximal_loss(anchor: Mapping[str, torch.Tensor], mu: float) -> Callable[[nn.Module], torch.Tensor]:
    """``extra_loss`` for :meth:`Site.fit`: μ/2 ||w − anchor||² over the model's parameters."""
    anchor = {k: v.detach().clone() for k, v in anchor.items()}

    def extra(model: nn.Module) -> torch.Tensor:
        return proximal_term(dict(model.named_parameters()), anchor, mu)

    return extra


@dataclass(frozen=True)
class FedProxParams(FedAvgParams):
    """Settings of FedProx (``[fedprox]``).

    FedAvg's settings (:class:`~fedseg.algorithms.fedavg.FedAvgParams`: weighting, aggregation, trim) and:

    mu
        Proximal coefficient μ ≥ 0 (paper Eq. 2); 0 gives FedAvg.
    """

    section: ClassVar[str] = "fedprox"
    mu: float = 0.01
    """Proximal coefficient mu >= 0; 0 gives FedAvg."""

    def validate(self) -> None:
        if not (self.mu >= 0.0 and self.mu < float("inf")):
            raise ConfigError(
                f"fedprox.mu = {self.mu}; it must be a finite number >= 0 (e.g. --set fedprox.mu=0.01; 0 gives FedAvg)"
            )
        super().validate()


def train_prox(site: Site, task: Task) -> Asks[Reply]:
    """Site half: load w_r, train one round on F_k(w) + μ/2 ||w − w_r||², send w back (μ from the
    site's own parse of the run config, ``site.algorithm.params``)."""
    params: FedProxParams = cast(Algorithm, site.algorithm).params
    mu = float(params.mu)
    start = strip_prefix("global", task.arrays)
    model = site.load("global", start)
    anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
    metrics = yield from site.fit(
        "global",
        task.config["round"],
        stream="train",
        optimizer=opt,
        extra_loss=proximal_loss(anchor, mu),
        steps=task.config.get("steps"),
    )
    return Reply(arrays=sent_update(site, task, "global", start), metrics=metrics, num_samples=site.num_train)


class FedProx(FedAvg):
    name = "fedprox"
    title = "FedProx"
    section = "fedprox"
    Params = FedProxParams

    def site_handlers(self):
        return {"train": train_prox}
