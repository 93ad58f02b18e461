"""Auto-FedAvg's learned aggregation weights (Xia et al., 2021; :mod:`fedseg.algorithms.autofedavg`): α from
its parameters β (softmax, Eq. 4; a Dirichlet's sample or mode, Eq. 5–6), per layer or for the whole network,
which α each tensor uses, and the mix Σ_k α_k w_k, differentiable in α while learning and FedAvg's weighted
mean when aggregating.  Pure functions on tensors that tests check by hand; the method's halves are in
:mod:`fedseg.algorithms.autofedavg`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch

from fedseg.foundation.arrays import Arrays, check_compatible, is_float, weighted_mean

__all__ = [
    "NETWORK",
    "aggregate",
    "alpha_eval",
    "alpha_per_tensor",
    "alpha_train",
    "dirichlet_mode",
    "mean_alpha",
    "mix",
    "sample_dirichlet",
    "softmax_alpha",
    "tensor_layers",
]

NETWORK = "*"
"""The single β entry of network-wise aggregation."""


def softmax_alpha(beta: torch.Tensor) -> torch.Tensor:
    """α = softmax(β) over sites (paper Eq. 4).  ``beta``: (K,) or (K, P); softmax over dim 0."""
    return torch.softmax(beta, dim=0)


def dirichlet_mode(beta: torch.Tensor) -> torch.Tensor:
    """Mode of Dir(β): α_k = (β_k − 1) / (Σ_i β_i − K) (paper Eq. 6).

    ``beta``: (K,) or (K, P) with every β_k > 1 (sites along dim 0).
    """
    if bool((beta <= 1.0).any()):
        raise ValueError(f"the Dirichlet mode needs every concentration > 1, got min {float(beta.min())}")
    return (beta - 1.0) / (beta.sum(dim=0, keepdim=True) - beta.shape[0])


def sample_dirichlet(beta: torch.Tensor, seed: int) -> torch.Tensor:
    """α ~ Dir(β) with implicit reparameterized gradients, from a stream seeded by ``seed``.

    ``beta``: (K,) or (K, P) (one distribution per column); returns the same shape.
    ``rsample`` draws from the global RNG, so the draw runs inside ``fork_rng`` with
    ``torch.manual_seed(seed)`` and leaves the global stream untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Dirichlet(beta.transpose(0, -1)).rsample().transpose(0, -1)


def _stack(beta: Mapping[str, torch.Tensor]) -> tuple[list[str], torch.Tensor]:
    names = sorted(beta)
    return names, torch.stack([beta[n] for n in names], dim=1)  # (K, P)


def alpha_eval(beta: Mapping[str, torch.Tensor], param: str) -> dict[str, torch.Tensor]:
    """α per layer used at aggregation: softmax(β) or the Dirichlet mode (Eq. 4 / Eq. 6)."""
    names, b = _stack(beta)
    a = softmax_alpha(b) if param == "softmax" else dirichlet_mode(b)
    return {n: a[:, i] for i, n in enumerate(names)}


def alpha_train(beta: Mapping[str, torch.Tensor], param: str, seed: int) -> dict[str, torch.Tensor]:
    """α per layer used in a weight-learning step (differentiable in β): softmax(β) or α ~ Dir(β)."""
    names, b = _stack(beta)
    a = softmax_alpha(b) if param == "softmax" else sample_dirichlet(b, seed)
    return {n: a[:, i] for i, n in enumerate(names)}


def tensor_layers(names: Sequence[str], layers: Sequence[str]) -> dict[str, str | None]:
    """Which layer's α each tensor uses.

    Parameters
    ----------
    names
        Tensor names of the exchanged arrays (floating ones are mixed).
    layers
        β's keys: ``["*"]`` (network-wise) or the model's parameter names (layer-wise).

    Returns
    -------
    dict
        ``name -> layer``: the network entry, the tensor itself when it is a
        parameter, else the first parameter of the same module (a buffer such as
        ``bn.running_mean`` follows ``bn.weight``), else None (mean of all layers).
    """
    layer_set = set(layers)
    if NETWORK in layer_set:
        return {n: NETWORK for n in names}
    by_module: dict[str, str] = {}
    for layer in layers:
        by_module.setdefault(layer.rpartition(".")[0], layer)
    return {n: (n if n in layer_set else by_module.get(n.rpartition(".")[0])) for n in names}


def alpha_per_tensor(alpha: Mapping[str, torch.Tensor], groups: Mapping[str, str | None]) -> dict[str, torch.Tensor]:
    """α (K,) for every tensor name, from α per layer and :func:`tensor_layers`."""
    mean = None
    out = {}
    for name, layer in groups.items():
        if layer is None:
            if mean is None:
                mean = torch.stack(list(alpha.values())).mean(dim=0)
            out[name] = mean
        else:
            out[name] = alpha[layer]
    return out


def mix(models: Sequence[Mapping[str, torch.Tensor]], alpha: Mapping[str, torch.Tensor]) -> Arrays:
    """w = Σ_k α_k w_k per tensor, differentiable in α (the w_k are treated as constants).

    Parameters
    ----------
    models
        K arrays with equal names, shapes and dtypes.
    alpha
        ``name -> (K,)`` weights for every floating tensor (float64; cast to the tensor's dtype).

    Returns
    -------
    Arrays
        Floating tensors mixed; integer tensors from ``models[0]``.
    """
    first = models[0]
    for other in models[1:]:
        check_compatible(first, other)
    out: Arrays = {}
    for name, ref in first.items():
        if not is_float(ref):
            out[name] = ref
            continue
        a = alpha[name].to(ref.dtype)
        out[name] = cast(torch.Tensor, sum(a[k] * m[name].detach() for k, m in enumerate(models)))  # models: >= 1
    return out


def aggregate(models: Sequence[Mapping[str, torch.Tensor]], alpha: Mapping[str, torch.Tensor]) -> Arrays:
    """The new global model Σ_k α_k w_k (no gradient), per tensor through :func:`fedseg.foundation.arrays.weighted_mean`.

    With α_k = 1/K for every tensor the result is bitwise FedAvg-even's (same function, same weights).
    """
    out: Arrays = {}
    for name, ref in models[0].items():
        w = alpha[name].tolist() if is_float(ref) else None
        out.update(weighted_mean([{name: m[name]} for m in models], w))
    return out


def mean_alpha(alpha: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The mean over layers of α (or β) per layer: (K,), one value per site (the history's summary)."""
    return torch.stack(list(alpha.values())).mean(dim=0)
