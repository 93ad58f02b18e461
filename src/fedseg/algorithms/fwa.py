"""Federated weight averaging (FWA): FedAvg with epoch-long local training (Remedios et al. 2020, Sections 1 and 3).

Round r: every site trains the global weights Θ_r for ``train.local_epochs``
(the paper: one epoch) with its own Adam, and the server averages

    Θ_{r+1} = Σ_k p_k Θ_{r+1}^{(k)},   p_k = n_k / n  ("samples", default)  or  1/K  ("even").

Between rounds each site either keeps its Adam moments (the paper's MNIST script,
``RESET_MOMENTUM = False``) or resets them (its CT script; the paper's motivation
for FGA: weight averaging "sacrifices" momentum).  ``fwa.reset_optimizer`` chooses;
unset, it follows ``train.reset_optimizer`` (default: keep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from fedseg.algorithms.fedavg import FedAvg
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import prefixed, strip_prefix
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["FWA", "FWAParams", "train_fwa"]


@dataclass(frozen=True)
class FWAParams:
    """Settings of FWA.

    weighting
        ``"samples"`` (p_k = n_k / n) or ``"even"`` (p_k = 1/K; the reference code's
        mean of two sites).
    reset_optimizer
        True: a fresh Adam at every round (CT script); False: keep each site's moments
        (MNIST script); None: ``train.reset_optimizer``.
    """

    weighting: Weighting = "samples"
    reset_optimizer: bool | None = None
    """true: a fresh Adam every round; false: keep each site's moments; none: follow train.reset_optimizer."""


def train_fwa(site: Site, task: Task) -> Asks[Reply]:
    """Load Θ_r, train one round of local work with the kept or reset optimizer, send Θ_{r+1}^{(k)} back."""
    params: FWAParams = cast(Algorithm, site.algorithm).params
    reset = site.cfg.train.reset_optimizer if params.reset_optimizer is None else params.reset_optimizer
    site.load("global", strip_prefix("global", task.arrays))
    opt = site.optimizer("global", reset=reset)
    metrics = yield from site.fit("global", task.config["round"], stream="train", optimizer=opt)
    return Reply(arrays=prefixed("global", site.arrays("global")), metrics=metrics, num_samples=site.num_train)


class FWA(FedAvg):
    name = "fwa"
    title = "FWA"
    section = "fwa"
    Params = FWAParams
    sends_clipped_update = False

    def site_handlers(self):
        return {"train": train_fwa}
