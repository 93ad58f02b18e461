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

With ``privacy.secure_aggregation = true`` the server learns only the sums: the global model's
n_k-weighted sum and the personalized models' sum S, from which each site forms its own SoftPull model
(:mod:`fedseg.algorithms.fedsm.secure`).

Inference (Alg. 2): per image, the selector's softmax; ``max > γ`` → that site's
personalized model, else the global model (predictor ``"fedsm"``).

* **fedsm-extra** (Section 3.1.2): the first ``rounds − S`` rounds train global and
  personalized models only; the last S rounds (``fedsm.selector_rounds``) train a
  K + 1-class selector with labels from Eq. 1 (the model whose output has the lowest
  loss); inference takes the selector's argmax, no γ.
* **fedsm-ensemble** (Section 3.1.1): same schedule, inference outputs the
  softmax-weighted output mix h = Σ ŷ_{s,k} h_k; the selector is trained on the
  mixture-of-experts likelihood of the models' per-image losses
  (``fedsm.ensemble_objective = "experts"``, default) or, as the paper writes it,
  through the loss of the mix (``"mix"``), which collapses to the global model.

Personalization ablation (Section 4.3, Table 6): the personalized models are made by a
:class:`~fedseg.algorithms.personal.Personalization` (a site step and a server step), chosen by
``fedsm.personalization`` through :data:`PERSONALIZATIONS`: SoftPull (the paper's,
:class:`fedseg.algorithms.softpull.SoftPull`) or another method's (``ft``, ``apfl``,
``perfedavg``, ``pfedme``, ``ditto``; settings from that method's own section, e.g.
``ditto.lam``).  The site then makes its personalized model with that method's site step from the
global model w_r it received, the server stores it as ``personal/<site>`` with *no*
SoftPull, and the selector routes to it exactly as to a SoftPull model:

* ``ft``: global = FedAvg step; personal = w_r fine-tuned ``ft.steps`` steps
  (:class:`fedseg.algorithms.ft.FineTuning`, fresh optimizer each round).
* ``perfedavg``: global = Per-FedAvg's meta step (:func:`fedseg.algorithms.perfedavg.local_round`);
  personal = w_r adapted by ``perfedavg.personal_steps`` gradient steps of size α
  (:class:`fedseg.algorithms.perfedavg.MetaAdaptation`).
* ``pfedme``: global = pFedMe's Moreau-envelope local round, server
  ``(1 − β) w + β Σ p_k w_k``; personal = θ̂ of the round's last batch
  (:class:`fedseg.algorithms.pfedme.MoreauEnvelope`).
* ``ditto``: global = FedAvg step; personal = the site's persistent v_k trained on
  F_k(v) + λ/2 ||v − w_r||² (:class:`fedseg.algorithms.ditto.DittoPersonalization`).
* ``apfl``: global = APFL's w step (= FedAvg's); the site sends v_k and α_k and the
  server stores the mixture α_k v_k + (1 − α_k) w_{r+1} with the new global model
  (``apfl.mix = "parameters"`` only: an output mixture is not one model;
  :class:`fedseg.algorithms.apfl.AdaptiveMixture`).

Modules: :mod:`.params` (settings, profiles), :mod:`.method` (server half, site half), :mod:`.selection` (Alg. 2 routing,
composite inference, routing statistics, γ choice, selector roles), :mod:`.selector`
(selector training); the maths is in :mod:`fedseg.algorithms.softpull`.

Server state (flat arrays): ``global/…``, ``personal/<site>/…``, ``selector/…`` and
``selector_optim/<param>/<exp_avg|exp_avg_sq|step>``.
"""

from fedseg.algorithms.fedsm.method import PERSONALIZATIONS, FedSM, FedSMEnsemble, FedSMExtra
from fedseg.algorithms.fedsm.params import DEFAULT_GAMMA_GRID, DEFAULT_GAMMA_MARGIN, PROFILE_DEFAULTS, FedSMParams
from fedseg.algorithms.fedsm.selection import oracle_accuracy, pick_gamma, route_task, selector_role
from fedseg.algorithms.fedsm.selector import keep_best_selector

__all__ = [
    "DEFAULT_GAMMA_GRID",
    "DEFAULT_GAMMA_MARGIN",
    "PERSONALIZATIONS",
    "PROFILE_DEFAULTS",
    "FedSM",
    "FedSMEnsemble",
    "FedSMExtra",
    "FedSMParams",
    "keep_best_selector",
    "oracle_accuracy",
    "pick_gamma",
    "route_task",
    "selector_role",
]
