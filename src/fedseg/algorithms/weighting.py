"""How a server weights the sites in an average: the two vocabularies of the ``weighting`` settings.

Both take the words ``"samples"`` and ``"even"``; they differ in whose samples count.

* :data:`Weighting`: an average of the sites' *models* (or of any per-site value, such as Auto-FedAvg's β
  or FedSM's selector) over the sites that replied: p_k = n_k / n with n_k the training samples site k
  declares (FedAvg, McMahan et al. 2017), or p_k = 1 / K.  The ``weighting`` setting of FedAvg, FedProx,
  FedSM, FT, FWA, Ditto, APFL, Per-FedAvg, pFedMe and SCAFFOLD, Auto-FedAvg's ``beta_weighting`` and
  FedSM's ``selector_weighting``; :func:`fedseg.algorithms.fedavg.aggregation_weights` turns it into the p_k.
* :data:`GradientWeighting`: FGA's average of the sites' *batch gradients* at one lockstep step:
  p_k = b_k / Σ_j b_j with b_k the samples of site k's batch (then the average is the gradient of the
  pooled batch), or p_k = 1 / K (Remedios et al. 2020, Alg. 1 line 14).  The ``weighting`` setting of FGA
  (:func:`fedseg.algorithms.gradients.average_gradients`).

Each vocabulary carries its description (:class:`fedseg.foundation.settings.Doc`): a setting of that type
without a docstring of its own is described by it in ``fedseg settings``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fedseg.foundation.settings import Doc

__all__ = ["GradientWeighting", "Weighting"]

Weighting = Annotated[
    Literal["samples", "even"],
    Doc(
        "Weights of the average of the sites' models: 'samples' (p_k = n_k / n, n_k the site's training "
        "samples) or 'even' (p_k = 1 / K)."
    ),
]
"""The weights of an average over the sites (module docstring)."""

GradientWeighting = Annotated[
    Literal["samples", "even"],
    Doc(
        "Weights of the average of the sites' batch gradients at each lockstep step: 'samples' (p_k = b_k / "
        "sum of b_j, b_k the samples of the site's batch: the pooled batch's gradient) or 'even' (p_k = 1 / K)."
    ),
]
"""The weights of FGA's gradient average (module docstring)."""
