r"""Gradient inversion: what an honest-but-curious server reconstructs from a gradient it receives.

The attack is "Inverting Gradients" (Geiping, Bauermeister, Dröge and Moeller, NeurIPS 2020). The
attacker knows the model and the weights θ at which a site computed its message (the server sent
them), the loss, the batch size, and — the strongest honest-but-curious setting, assumed here — the
labels of the batch (a segmentation model's masks, the selector's site index; the server really
knows the latter).  It optimizes dummy images x̂ so that their gradient matches the observed one
under cosine distance, with a total-variation prior::

    x̂* = argmin_{x̂ ∈ [0, 1]}  1 − ⟨∇_θ L(x̂), g⟩ / (‖∇_θ L(x̂)‖ ‖g‖)  +  α_TV · TV(x̂)

(the inner products and norms summed over the matched layers: the cosine of the concatenated
gradient, as in the paper; ``per_layer`` averages one cosine per layer instead), by Adam on x̂ with
signed gradients (optional), a step decay of the learning rate at 3/8, 5/8 and 7/8 of the
iterations, x̂ clamped to the image range [0, 1] after every step, and several restarts from seeded
uniform noise of which the one with the lowest matching cost is kept.

A message may be a sum of several batches' gradients (``parts``: secure aggregation shows the
server only the weighted sum over the sites, and the attacker then models every site's batch) and
it may be a model difference after local steps rather than a gradient: the attacker treats an
update w_before − w_after as a (scaled) gradient, the standard "update as gradient" approximation
— exact for one SGD step (Δ = η g, and the cosine ignores η), approximate for Adam (whose first
step is η g / (|g| + ε), close to η · sign(g)) and for several steps (Δ is then a sum of gradients at
different weights).

Every random draw comes from the ``torch.Generator`` handed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = [
    "AttackConfig",
    "Inversion",
    "Part",
    "fc_inversion",
    "gradient_cost",
    "invert",
    "matched_names",
    "total_variation",
]


@dataclass(frozen=True)
class AttackConfig:
    """Settings of the gradient-inversion attack.

    iterations
        Adam steps on the dummy images per restart.
    restarts
        Independent starts from seeded noise; the one with the lowest matching cost is kept.
    lr
        Adam's learning rate on the images (decayed ×0.1 at 3/8, 5/8 and 7/8 of the iterations).
    tv
        Weight α_TV of the total-variation prior.
    signed
        Step with the sign of the image gradient (the paper's choice), else the gradient itself.
    per_layer
        Average one cosine distance per matched layer instead of the cosine of the concatenated gradient.
    layers
        Match only the parameters whose names start with one of these prefixes (None: every parameter
        the message carries), e.g. the first convolutions of a U-Net.
    """

    iterations: int = 200
    restarts: int = 2
    lr: float = 0.1
    tv: float = 1e-4
    signed: bool = True
    per_layer: bool = False
    layers: tuple[str, ...] | None = None

    def validate(self) -> None:
        if self.iterations < 1 or self.restarts < 1:
            raise ValueError(
                f"the attack needs iterations >= 1 and restarts >= 1, got {self.iterations} and {self.restarts}"
            )
        if self.lr <= 0 or self.tv < 0:
            raise ValueError(f"the attack needs lr > 0 and tv >= 0, got lr={self.lr}, tv={self.tv}")


@dataclass
class Part:
    """One batch the observed message is (partly) the gradient of: the attacker reconstructs
    ``shape[0]`` images of this ``shape`` with the known ``target``; the message is modelled as
    Σ_parts ``weight`` · ∇_θ ``loss(model(x̂), target)``."""

    shape: tuple[int, ...]
    target: Any
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    weight: float = 1.0


@dataclass
class Inversion:
    """The attack's result: the reconstructed images of each part (the best restart's) and the matching
    cost of every restart."""

    images: list[torch.Tensor]
    cost: float
    costs: list[float] = field(default_factory=list)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels along every spatial axis of ``x`` (B, C, *spatial)."""
    tv = x.new_zeros(())
    for d in range(2, x.dim()):
        tv = tv + (x.narrow(d, 1, x.shape[d] - 1) - x.narrow(d, 0, x.shape[d] - 1)).abs().mean()
    return tv


def gradient_cost(
    dummy: Sequence[torch.Tensor], observed: Sequence[torch.Tensor], per_layer: bool = False
) -> torch.Tensor:
    """1 − cosine similarity of two gradients given as matching lists of tensors (concatenated, or one
    cosine per layer averaged with ``per_layer``); 0 for parallel gradients, 2 for opposite ones."""
    if per_layer:
        costs = [
            1 - (a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12) for a, b in zip(dummy, observed, strict=True)
        ]
        return torch.stack(costs).mean()
    dot = sum((a * b).sum() for a, b in zip(dummy, observed, strict=True))
    na = sum(a.pow(2).sum() for a in dummy)
    nb = sum(b.pow(2).sum() for b in observed)
    return 1 - dot / (na.sqrt() * nb.sqrt()).clamp_min(1e-12)


def matched_names(observed: Mapping[str, torch.Tensor], model: nn.Module, layers: Sequence[str] | None) -> list[str]:
    """The model's parameter names the attack matches: those the message carries (and, with ``layers``,
    that start with one of its prefixes), in the model's order."""
    names = [n for n, _ in model.named_parameters() if n in observed]
    if layers is not None:
        names = [n for n in names if any(n.startswith(p) for p in layers)]
    if not names:
        raise ValueError(
            f"no parameter of the model is in the observed message{' under ' + str(list(layers)) if layers else ''}; "
            f"model parameters start with {[n for n, _ in model.named_parameters()][:3]}"
        )
    return names


def _milestones(iterations: int) -> list[int]:
    return sorted({max(1, int(iterations * f)) for f in (3 / 8, 5 / 8, 7 / 8)})


def invert(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    observed: Mapping[str, torch.Tensor],
    parts: Sequence[Part],
    cfg: AttackConfig,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> Inversion:
    """Reconstruct the images of ``parts`` from the ``observed`` message (parameter name → gradient or
    update) of ``model`` at ``weights`` (parameter name → tensor; buffers are the model's own).

    The model runs in training mode, as at the site.  Returns the best restart's images (on the CPU,
    in [0, 1]) and the matching costs.
    """
    cfg.validate()
    device = torch.device(device)
    model = model.to(device).train()
    names = matched_names(observed, model, cfg.layers)
    params = {n: weights[n].detach().to(device) for n, _ in model.named_parameters()}
    leaves = {n: params[n].clone().requires_grad_(True) for n in names}
    full = {**params, **leaves}
    target_grad = [observed[n].detach().to(device=device, dtype=params[n].dtype) for n in names]
    targets = [_to(p.target, device) for p in parts]

    def cost_of(xs: Sequence[torch.Tensor], create_graph: bool) -> torch.Tensor:
        total = None
        for x, part, target in zip(xs, parts, targets):
            value = part.weight * part.loss(functional_call(model, full, (x,)), target)
            total = value if total is None else total + value
        grads = torch.autograd.grad(total, [leaves[n] for n in names], create_graph=create_graph)
        return gradient_cost(grads, target_grad, cfg.per_layer)

    best: list[torch.Tensor] | None = None
    best_cost = float("inf")
    costs: list[float] = []
    for _ in range(cfg.restarts):
        xs = [torch.rand(p.shape, generator=generator).to(device).requires_grad_(True) for p in parts]
        opt = torch.optim.Adam(xs, lr=cfg.lr)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=_milestones(cfg.iterations), gamma=0.1)
        for _ in range(cfg.iterations):
            opt.zero_grad(set_to_none=True)
            loss = cost_of(xs, create_graph=True)
            if cfg.tv > 0:
                loss = loss + cfg.tv * sum(total_variation(x) for x in xs)
            grads = torch.autograd.grad(loss, xs)
            for x, g in zip(xs, grads):
                x.grad = g.sign() if cfg.signed else g
            opt.step()
            sched.step()
            with torch.no_grad():
                for x in xs:
                    x.clamp_(0, 1)
        final = float(cost_of([x.detach() for x in xs], create_graph=False))
        costs.append(final)
        if final < best_cost or best is None:
            best_cost, best = final, [x.detach().cpu() for x in xs]
    return Inversion(images=best, cost=best_cost, costs=costs)


def _to(target: Any, device: torch.device) -> Any:
    if isinstance(target, torch.Tensor):
        return target.to(device)
    if isinstance(target, (tuple, list)):
        return type(target)(_to(t, device) for t in target)
    return target


def fc_inversion(grad_weight: torch.Tensor, grad_bias: torch.Tensor) -> torch.Tensor:
    r"""The input of a fully connected layer recovered exactly from the gradient of one sample.

    For y = W x + b and any loss L(y): ∂L/∂W = (∂L/∂y) xᵀ and ∂L/∂b = ∂L/∂y, so row i of ∂L/∂W is
    (∂L/∂y_i) · x and, wherever ∂L/∂b_i ≠ 0,

        x = (∂L/∂W)_i / (∂L/∂b)_i .

    (Phong et al. 2017; Geiping et al. 2020, Prop. 1.)  The row with the largest |∂L/∂b_i| is used.
    The same holds for one SGD step's update (Δ = η ∇, the η cancels).  For a batch, the rows give
    mixtures of the batch's inputs instead.
    """
    if grad_weight.dim() != 2 or grad_bias.dim() != 1 or grad_weight.shape[0] != grad_bias.shape[0]:
        raise ValueError(
            f"expected a weight gradient (out, in) and a bias gradient (out,), got {tuple(grad_weight.shape)} "
            f"and {tuple(grad_bias.shape)}"
        )
    i = int(grad_bias.abs().argmax())
    if float(grad_bias[i]) == 0.0:
        raise ValueError("the bias gradient is zero everywhere: the message carries nothing of the input")
    return grad_weight[i] / grad_bias[i]
