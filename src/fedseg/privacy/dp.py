"""DP-SGD's privatized gradient (sample level) and the clipped, noised update of a site (client level).

**Sample level** (``privacy.dp = "sample"``; Abadi et al., "Deep Learning with Differential Privacy",
CCS 2016, Alg. 1).  For a batch of B cases with per-sample losses ℓ_i:

    g̃ = ( Σ_i g_i · min(1, C / ||g_i||) + N(0, σ² C² I) ) / B,     g_i = ∇_w ℓ_i(w),

where ||g_i|| is the L2 norm of sample i's whole gradient (all parameters together), C = ``privacy.clip``
and σ = the noise multiplier.  The per-sample gradients come from ``torch.func``:
``vmap(grad_and_value(loss ∘ functional_call))`` over the batch, each sample run through the model as a
batch of one.  This serves any model whose forward pass treats the samples of a batch independently —
MONAI's U-Net with instance norm (or none) does; batch norm mixes the samples of a batch and is refused
(:func:`refuse_batch_norm`).  Opacus' ``GradSampleModule`` is not used: it needs a per-layer rule for every
module type (MONAI's U-Net has ``InstanceNorm`` layers without affine weights, PReLU and transposed
convolutions), while ``torch.func`` differentiates whatever the model computes, the way fedseg's vectorized
simulation already runs the workload loss.

The noise of a step is drawn by the caller's ``normal(count, std)`` (on the device of the step):
a site's :class:`fedseg.privacy.randomness.Randomness`, keyed by the operating system's CSPRNG so that no
other party can regenerate it (or, in the test mode ``privacy.dp_randomness = "seeded"``, by the run seed).

Under Poisson sampling (each case enters the batch independently with probability q = B / n) the batch
size varies and itself depends on whether a case is present; the privatized sum is therefore divided by
the *expected* batch size B (``batch_size``), as Opacus does (``expected_batch_size``), not by the size drawn.

**Client level** (``privacy.dp = "client"``; McMahan et al., "Learning Differentially Private Recurrent
Language Models", ICLR 2018): see :func:`clip_update` and :func:`noise_like`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from fedseg.foundation.errors import ConfigError

__all__ = [
    "clip_per_sample",
    "clip_update",
    "noise_like",
    "per_sample_gradients",
    "privatized_gradient",
    "refuse_batch_norm",
]

Loss = Callable[[torch.Tensor, Any], torch.Tensor]


def refuse_batch_norm(model: nn.Module, what: str = "the model") -> None:
    """One :class:`ConfigError` naming ``model.norm = "instance"`` if ``model`` has a batch-norm layer: its
    output for one sample depends on the other samples of the batch, so a per-sample gradient (and its
    clipping) is not defined."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(
                f"privacy.dp = 'sample': {what} has a batch-norm layer ({name or type(mod).__name__}), which mixes "
                'the samples of a batch so that no per-sample gradient exists; use model.norm = "instance" '
                "(--set model.norm=instance)"
            )


def _batched(target: Any) -> Any:
    """A target of one sample (vmap strips the batch dimension) as a batch of one."""
    if isinstance(target, (tuple, list)):
        return type(target)(t.unsqueeze(0) for t in target)
    return target.unsqueeze(0)


def per_sample_gradients(
    model: nn.Module,
    loss: Loss,
    x: torch.Tensor,
    target: Any,
    params: Mapping[str, torch.Tensor] | None = None,
    autocast: Callable[[], Any] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each sample's gradient of ``loss(model(x_i), target_i)`` (x_i as a batch of one) at the model's
    trainable parameters (or at ``params``): ``({name: (B, *shape)}, per-sample losses (B,))``.

    ``target`` is a tensor or a tuple/list of tensors with the batch as their first dimension.  The forward
    pass runs under ``autocast()`` when given (the site's ``train.precision``).  Dropout draws differ per
    sample (``randomness="different"``), from torch's global generator as in the plain loop."""
    refuse_batch_norm(model)
    if params is None:
        params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    else:
        params = {k: p.detach() for k, p in params.items()}
    buffers = {k: b.detach() for k, b in model.named_buffers()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, ti: Any) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss(out, _batched(ti)).float()

    fn = vmap(grad_and_value(one), in_dims=(None, 0, 0), randomness="different")
    if autocast is None:
        grads, losses = fn(params, x, target)
    else:
        with autocast():
            grads, losses = fn(params, x, target)
    return dict(grads), losses


def clip_per_sample(grads: Mapping[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Σ_i g_i · min(1, C / ||g_i||) over the batch (dimension 0 of every tensor of ``grads``), with ||g_i|| the
    L2 norm of sample i's gradient over all parameters; returns ``(summed clipped gradient, norms (B,))``."""
    names = list(grads)
    b = grads[names[0]].shape[0]
    sq = torch.zeros(b, dtype=torch.float64, device=grads[names[0]].device)
    for k in names:
        sq += grads[k].reshape(b, -1).double().pow(2).sum(1)
    norms = sq.sqrt()
    factor = (clip / (norms + 1e-12)).clamp(max=1.0)
    out = {}
    for k in names:
        g = grads[k]
        out[k] = torch.einsum("b,b...->...", factor.to(g.dtype), g)
    return out, norms


Normal = Callable[[int, float], torch.Tensor]
"""``normal(count, std)``: ``count`` draws of N(0, std²) as one float64 vector, on any device
(:meth:`fedseg.privacy.randomness.Randomness.normal` with its key bound)."""


def noise_like(tensors: Mapping[str, torch.Tensor], std: float, normal: Normal) -> dict[str, torch.Tensor]:
    """N(0, std²) for every element of ``tensors`` (same names, shapes, dtypes and devices), drawn by
    ``normal`` as one vector in the order of the names."""
    total = sum(t.numel() for t in tensors.values())
    flat = normal(total, std)
    out, start = {}, 0
    for k, t in tensors.items():
        n = t.numel()
        out[k] = flat[start : start + n].reshape(t.shape).to(device=t.device, dtype=t.dtype)
        start += n
    return out


def privatized_gradient(
    model: nn.Module,
    loss: Loss,
    x: torch.Tensor,
    target: Any,
    clip: float,
    sigma: float,
    normal: Normal,
    params: Mapping[str, torch.Tensor] | None = None,
    autocast: Callable[[], Any] | None = None,
    batch_size: int | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DP-SGD's gradient of one batch: ``(Σ_i clip(g_i) + N(0, σ²C²)) / B`` and the mean per-sample loss
    (detached; 0 for an empty batch).  B is ``batch_size`` (the expected batch size under Poisson sampling)
    or else the batch's own size.  An empty batch (Poisson sampling may draw one) gives the noise alone, over
    every trainable parameter.  See the module docstring."""
    b = int(batch_size) if batch_size is not None else int(x.shape[0])
    if x.shape[0] == 0:
        source = params if params is not None else {k: p for k, p in model.named_parameters() if p.requires_grad}
        summed = {k: torch.zeros_like(p.detach()) for k, p in source.items()}
        value = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        grads, losses = per_sample_gradients(model, loss, x, target, params, autocast)
        summed, _ = clip_per_sample(grads, clip)
        value = losses.detach().mean()
    noise = noise_like(summed, sigma * clip, normal)
    return {k: (summed[k] + noise[k]) / max(b, 1) for k in summed}, value


def clip_update(update: Mapping[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """A site's update Δ = w_k − w scaled to L2 norm at most ``clip`` (over all its floating-point tensors
    together): ``(Δ · min(1, C / ||Δ||), ||Δ||)``.  Integer tensors (counters) pass unchanged."""
    sq = 0.0
    for t in update.values():
        if t.is_floating_point():
            sq += float(t.double().pow(2).sum())
    norm = sq**0.5
    factor = min(1.0, clip / (norm + 1e-12))
    return {k: (t * factor if t.is_floating_point() else t) for k, t in update.items()}, norm
