"""1D loss surface around a trained model (FedSM, Xu et al. CVPR 2022, Section 4.2, Fig. 4).

FedSM plots "the loss along 10 randomly sampled unit vector directions" near the
trained model, on one site's training data, following its references [18] (He et
al., "Asymmetric valleys", 2019) and [23] (Izmailov et al., "Averaging weights leads
to wider optima", 2018), who draw directions uniformly on the unit sphere of
parameter space:

    L_k(α) = L(θ + α d_k),   ‖d_k‖₂ = 1,   k = 1 … 10,   α ∈ [−r, r]

where θ are the model's trainable parameters (buffers such as batch-norm running
statistics stay fixed) and L is the workload's training loss averaged over the
site's training cases.  A sharp minimum (local training) rises fast with |α|, a
flat one (FedAvg) slowly.

Directions (``normalize``):

* ``"unit"`` (default, the paper's convention): d_k ~ N(0, I) over *all* trainable
  parameters jointly, scaled to ‖d_k‖₂ = 1 (a uniform draw on the unit sphere) — α
  is a Euclidean distance in parameter space, the same for every model of one
  architecture, so the methods' curves are directly comparable.  The useful range
  of α grows with the network (‖θ‖ ≈ 6 for the tests' 3 k-parameter U-Net); the
  report uses r = ‖θ‖ averaged over the compared models unless told otherwise.
* ``"filter"`` (Li et al., "Visualizing the loss landscape of neural nets", 2018):
  per output filter i of every weight with ≥ 2 dimensions, d_{k,i} ← d_{k,i}
  ‖θ_i‖ / ‖d_{k,i}‖; 1-D parameters (biases, norm scales, PReLU slopes) get
  direction 0.  α is then relative to the filters' own norms (α = 1 moves each
  filter by its own length), which removes the scale invariance of normalized
  networks; r = 1 is the usual range.

Every direction k is drawn from ``fedseg.foundation.seeding.generator(seed, "loss-surface", k)``
in parameter-name order, so the same seed gives the same directions for every model
of one architecture (the methods are compared along the same directions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from fedseg.foundation.arrays import Arrays, flatten
from fedseg.foundation.seeding import generator
from fedseg.site.batches import batch_of, dataset_len

__all__ = ["LossSurface", "dataset_loss", "loss_surface", "perturbed", "random_directions", "trainable_arrays"]

NORMALIZATIONS = ("unit", "filter")


def trainable_arrays(model: nn.Module) -> Arrays:
    """Detached copies of the model's trainable floating-point parameters (name → tensor)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()}


def random_directions(params: Arrays, n: int = 10, seed: int = 0, normalize: str = "unit") -> list[Arrays]:
    """``n`` seeded random directions in the space of ``params``.

    Parameters
    ----------
    params
        Trainable parameters θ (name → tensor), e.g. :func:`trainable_arrays`.
    n
        Number of directions (FedSM Fig. 4: 10).
    seed
        Direction k is drawn from ``generator(seed, "loss-surface", k)``.
    normalize
        ``"unit"``: ‖d‖₂ = 1 over all parameters; ``"filter"``: Li et al.'s filter
        normalization (module docstring).

    Returns
    -------
    list of dict
        One ``{name: tensor}`` per direction, shaped like ``params`` (float64).
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(
            f"normalize = {normalize!r}; use 'unit' (‖d‖ = 1, the paper's wording) or 'filter' (Li et al. 2018)"
        )
    if n < 1:
        raise ValueError(f"need at least one direction, got n = {n}")
    names = sorted(k for k, v in params.items() if v.is_floating_point())
    if not names:
        raise ValueError("the model has no trainable floating-point parameters to perturb")
    out = []
    for k in range(n):
        g = generator(seed, "loss-surface", k)
        d = {name: torch.randn(params[name].shape, generator=g, dtype=torch.float64) for name in names}
        if normalize == "unit":
            norm = float(flatten(d).norm())
            d = {name: v / norm for name, v in d.items()}
        else:
            for name in names:
                theta = params[name].detach().double()
                if theta.dim() <= 1:
                    d[name] = torch.zeros_like(d[name])
                    continue
                dn = d[name].reshape(theta.shape[0], -1).norm(dim=1).clamp_min(1e-12)
                tn = theta.reshape(theta.shape[0], -1).norm(dim=1)
                d[name] = d[name] * (tn / dn).reshape(-1, *([1] * (theta.dim() - 1)))
        out.append(d)
    return out


def perturbed(params: Arrays, direction: Arrays, alpha: float) -> Arrays:
    """θ + α d (in θ's dtype); names of θ missing from ``d`` stay unchanged."""
    return {k: (v + alpha * direction[k].to(v.dtype)) if k in direction else v.clone() for k, v in params.items()}


@torch.no_grad()
def _set(model: nn.Module, arrays: Arrays) -> None:
    named = dict(model.named_parameters())
    for k, v in arrays.items():
        named[k].copy_(v)


def _batches(dataset: Dataset, batch_size: int, max_cases: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = dataset_len(dataset)
    if max_cases is not None:
        n = min(n, max_cases)
    if n == 0:
        raise ValueError("the loss surface needs training cases, but the dataset is empty")
    return [batch_of(dataset, torch.arange(s, min(n, s + batch_size))) for s in range(0, n, batch_size)]


@torch.no_grad()
def dataset_loss(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Case-weighted mean of the (batch-mean) loss over ``batches``, model in eval mode."""
    model.eval()
    dtype = next(model.parameters()).dtype
    total, count = 0.0, 0
    for x, y in batches:
        out = forward(model, x.to(dtype)) if forward is not None else model(x.to(dtype))
        total += float(loss_fn(out, y)) * x.shape[0]
        count += x.shape[0]
    return total / count


@dataclass
class LossSurface:
    """Loss along each direction: ``losses[k, j]`` = L(θ + alphas[j] d_k)."""

    alphas: np.ndarray
    losses: np.ndarray
    center: float
    normalize: str
    seed: int

    @property
    def sharpness(self) -> float:
        """Mean over directions of max_α L − L(θ): a one-number summary of the curves (larger = sharper)."""
        return float(np.mean(self.losses.max(axis=1) - self.center))


def loss_surface(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dataset: Dataset,
    directions: int = 10,
    radius: float = 1.0,
    steps: int = 21,
    seed: int = 0,
    normalize: str = "unit",
    batch_size: int = 16,
    max_cases: int | None = None,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
    desc: str = "loss surface",
) -> LossSurface:
    """The 1D loss surface of ``model`` on ``dataset`` along seeded random directions (FedSM Fig. 4).

    Parameters
    ----------
    model
        The trained model; its parameters are restored before returning.
    loss_fn
        ``loss(output, target)`` (the workload's training loss, mean over the batch).
    dataset
        One site's training split (items ``(x, y)``); cases in dataset order.
    directions, seed, normalize
        See :func:`random_directions` (FedSM: 10 directions).
    radius, steps
        α runs over ``steps`` evenly spaced values in [−radius, radius]; ``steps`` is
        odd so that α = 0 (the trained model itself) is one of them.
    max_cases
        Use only the first ``max_cases`` training cases (bounded cost).
    forward
        ``forward(model, x) -> output`` (default ``model(x)``).

    Returns
    -------
    LossSurface
        ``alphas`` (S,), ``losses`` (directions, S), ``center`` = L(θ).
    """
    if steps < 3 or steps % 2 == 0:
        raise ValueError(f"steps = {steps}: use an odd number >= 3 so that α = 0 (the trained model) is on the grid")
    if not radius > 0:
        raise ValueError(f"radius must be > 0, got {radius}")
    batches = _batches(dataset, batch_size, max_cases)
    theta = trainable_arrays(model)
    dirs = random_directions(theta, directions, seed, normalize)
    half = steps // 2
    alphas = radius * np.arange(-half, half + 1, dtype=np.float64) / half
    losses = np.zeros((directions, steps))
    was_training = model.training
    try:
        center = dataset_loss(model, loss_fn, batches, forward)
        for k, d in enumerate(tqdm(dirs, desc=desc, unit="direction", disable=not progress, leave=False)):
            for j, a in enumerate(alphas):
                if j == half:
                    losses[k, j] = center
                    continue
                _set(model, perturbed(theta, d, float(a)))
                losses[k, j] = dataset_loss(model, loss_fn, batches, forward)
    finally:
        _set(model, theta)
        model.train(was_training)
    return LossSurface(alphas=alphas, losses=losses, center=center, normalize=normalize, seed=seed)
