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
it may be a model difference after local steps rather than a gradient.  An update w_0 − w_T after T
local steps is modelled by unrolling the site's optimizer on one dummy batch per step (:class:`Update`,
:func:`unrolled_update`; Geiping et al. 2020, §6 "multiple local steps"): w_{t+1} = step(w_t,
∇_w L(x̂_t)) with the site's Adam (moments and bias correction) or SGD (momentum), differentiated
through all T steps with respect to every x̂_t.  For the true batches the unrolled update is the
site's own (``tests/runs/test_audit.py``), so the attack's optimum is the true data.  ``AttackConfig.unroll =
False`` attacks the update as one gradient of the first batch instead (exact only for one SGD step).

The reference budget is that of Geiping et al.'s released code (:data:`REFERENCE_ATTACK`): 24,000
iterations per restart; the audit states its own budget against it.

Every random draw comes from the ``torch.Generator`` handed in.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedseg.foundation.config import OPTIMIZERS, OptimizerName

__all__ = [
    "REFERENCE_ATTACK",
    "AttackConfig",
    "Inversion",
    "LocalOptimizer",
    "Part",
    "Update",
    "fc_inversion",
    "gradient_cost",
    "invert",
    "matched_names",
    "total_variation",
    "unrolled_update",
]

REFERENCE_ATTACK: dict[str, Any] = {
    "iterations": 24_000,
    "restarts": 1,
    "source": "Geiping et al. 2020, 'Inverting Gradients' (NeurIPS), released code JonasGeiping/invertinggradients: "
    "reconstruct_image.py (max_iterations=24_000, --restarts default 1, --tv default 1e-4)",
}
"""The reference attack's budget per reconstruction, against which the audit states its own."""


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
    unroll
        Model an update after local steps by unrolling the site's optimizer (:class:`Update`); False: as one
        gradient of its first batch.
    """

    iterations: int = 200
    restarts: int = 2
    lr: float = 0.1
    tv: float = 1e-4
    signed: bool = True
    per_layer: bool = False
    layers: tuple[str, ...] | None = None
    unroll: bool = True

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


@dataclass(frozen=True)
class LocalOptimizer:
    """A site's local optimizer as the attacker models it: ``train.optimizer`` (``"adam"`` or ``"sgd"``) with
    ``train.lr``, ``train.betas``, ``train.momentum`` and ``train.weight_decay`` (torch's Adam and SGD, fresh
    state: the first round, or ``train.reset_optimizer``)."""

    kind: OptimizerName
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(
                f"the attack unrolls train.optimizer {' or '.join(map(repr, OPTIMIZERS))}, got {self.kind!r}"
            )


@dataclass
class Update:
    """A site's update w_0 − w_T after ``len(steps)`` local steps of ``optimizer``, one batch per step (each
    :class:`Part` gives the step's batch shape, target and loss; its weight is unused); the message is modelled
    as ``weight`` · (w_0 − w_T) (:func:`unrolled_update`)."""

    steps: list[Part]
    optimizer: LocalOptimizer
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
    dot = functools.reduce(operator.add, ((a * b).sum() for a, b in zip(dummy, observed, strict=True)))
    na = functools.reduce(operator.add, (a.pow(2).sum() for a in dummy))
    nb = functools.reduce(operator.add, (b.pow(2).sum() for b in observed))
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


def unrolled_update(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    xs: Sequence[torch.Tensor],
    steps: Sequence[Part],
    opt: LocalOptimizer,
    create_graph: bool = True,
) -> dict[str, torch.Tensor]:
    """w_0 − w_T after one local step of ``opt`` per batch ``xs[t]`` (with ``steps[t]``'s target and loss) from
    ``weights`` (every trainable parameter of ``model``; its buffers are the model's own), as torch's
    optimizers compute it: Adam with m_t = β₁m + (1 − β₁)g, v_t = β₂v + (1 − β₂)g², w −= lr/(1 − β₁ᵗ) ·
    m_t / (√v_t / √(1 − β₂ᵗ) + ε); SGD with a momentum buffer (the first step's is g); weight decay added to g.
    A parameter the loss does not reach is not stepped (torch skips a None gradient).  With ``create_graph``
    the result is differentiable with respect to ``xs`` through every step."""
    if len(xs) != len(steps):
        raise ValueError(f"{len(xs)} batches for {len(steps)} local steps; give one batch per step")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    w0 = {n: weights[n].detach() for n in names}
    w = {n: w0[n].clone().requires_grad_(True) for n in names}
    state: dict[str, dict[str, Any]] = {n: {"t": 0} for n in names}
    b1, b2 = opt.betas
    for x, part in zip(xs, steps):
        if not create_graph:
            w = {n: v.detach().requires_grad_(True) for n, v in w.items()}
        value = part.loss(functional_call(model, w, (x,)), part.target)
        grads = torch.autograd.grad(value, [w[n] for n in names], create_graph=create_graph, allow_unused=True)
        new = {}
        for n, g in zip(names, grads):
            p = w[n]
            if g is None:
                new[n] = p
                continue
            if opt.weight_decay:
                g = g + opt.weight_decay * p
            st = state[n]
            st["t"] += 1
            if opt.kind == "adam":
                st["m"] = (1 - b1) * g if "m" not in st else b1 * st["m"] + (1 - b1) * g
                st["v"] = (1 - b2) * g * g if "v" not in st else b2 * st["v"] + (1 - b2) * g * g
                bc1, bc2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
                # √ clamped away from 0: its derivative there is infinite (times a zero gradient: NaN)
                denom = st["v"].clamp_min(1e-30).sqrt() / bc2**0.5 + opt.eps
                new[n] = p - (opt.lr / bc1) * st["m"] / denom
            else:
                if opt.momentum:
                    st["b"] = g if "b" not in st else opt.momentum * st["b"] + g
                    g = st["b"]
                new[n] = p - opt.lr * g
        w = new
    return {n: w0[n] - w[n] for n in names}


def invert(
    model: nn.Module,
    weights: Mapping[str, torch.Tensor],
    observed: Mapping[str, torch.Tensor],
    parts: Sequence[Part | Update],
    cfg: AttackConfig,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> Inversion:
    """Reconstruct the images of ``parts`` from the ``observed`` message (parameter name → gradient or
    update) of ``model`` at ``weights`` (parameter name → tensor; buffers are the model's own): a
    :class:`Part` is one batch whose gradient the message (partly) is, an :class:`Update` one site's local
    steps (one batch per step), unrolled.

    The model runs in training mode, as at the site.  Returns the best restart's images (on the CPU,
    in [0, 1]; one tensor per part, or per local step of an update) and the matching costs.
    """
    cfg.validate()
    device = torch.device(device)
    model = model.to(device).train()
    names = matched_names(observed, model, cfg.layers)
    params = {n: weights[n].detach().to(device) for n, _ in model.named_parameters()}
    leaves = {n: params[n].clone().requires_grad_(True) for n in names}
    full = {**params, **leaves}
    target_grad = [observed[n].detach().to(device=device, dtype=params[n].dtype) for n in names]
    batches: list[Part] = []  # every dummy batch, in order: a part's, or each local step's of an update
    for p in parts:
        batches += p.steps if isinstance(p, Update) else [p]
    moved = [dataclasses.replace(b, target=_to(b.target, device)) for b in batches]

    def cost_of(xs: Sequence[torch.Tensor], create_graph: bool) -> torch.Tensor:
        total = None
        modelled: list[torch.Tensor] | None = None
        i = 0
        for part in parts:
            if isinstance(part, Update):
                k = len(part.steps)
                upd = unrolled_update(model, params, xs[i : i + k], moved[i : i + k], part.optimizer, create_graph)
                contrib = [part.weight * upd[n] for n in names]
                modelled = contrib if modelled is None else [a + b for a, b in zip(modelled, contrib)]
                i += k
                continue
            value = part.weight * part.loss(functional_call(model, full, (xs[i],)), moved[i].target)
            total = value if total is None else total + value
            i += 1
        if total is not None:
            grads = list(torch.autograd.grad(total, [leaves[n] for n in names], create_graph=create_graph))
            modelled = grads if modelled is None else [a + b for a, b in zip(modelled, grads)]
        assert modelled is not None
        return gradient_cost(modelled, target_grad, cfg.per_layer)

    best: list[torch.Tensor] | None = None
    best_cost = float("inf")
    costs: list[float] = []
    for _ in range(cfg.restarts):
        xs = [torch.rand(b.shape, generator=generator).to(device).requires_grad_(True) for b in batches]
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
        final = float(cost_of([x.detach() for x in xs], create_graph=False).detach())
        costs.append(final)
        if final < best_cost or best is None:
            best_cost, best = final, [x.detach().cpu() for x in xs]
    assert best is not None  # cfg.restarts >= 1 (InversionConfig.validate)
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
