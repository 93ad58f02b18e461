"""The arithmetic of lockstep gradient averaging (:mod:`fedseg.algorithms.lockstep`): the server's average of
the sites' batch gradients, the steps of a round, applying and checking an averaged gradient, what breaks its
equivalence with centralized training, a digest of a site's weights and optimizer state, and that state as
arrays.  Small functions on tensors and modules that tests check by hand; nothing here asks a site."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedseg.algorithms.weighting import GradientWeighting
from fedseg.foundation.arrays import Arrays, strip_prefix, weighted_mean
from fedseg.foundation.errors import PayloadError
from fedseg.site.calls import step_with_gradient

__all__ = [
    "FP16_GRADIENT_AVERAGING",
    "FGAEquivalenceWarning",
    "apply_gradient",
    "average_gradients",
    "check_gradient",
    "equivalence_problems",
    "federation_steps",
    "optimizer_moments",
    "set_optimizer_moments",
    "state_digest",
]


class FGAEquivalenceWarning(UserWarning):
    """FGA will not equal centralized training for this model or loss."""


# ---------------------------------------------------------------------------- maths
def average_gradients(
    grads: Sequence[Mapping[str, torch.Tensor]], batch_sizes: Sequence[int], weighting: GradientWeighting = "samples"
) -> Arrays:
    """The server's averaged gradient g = Σ_k p_k g_k.

    Parameters
    ----------
    grads
        K gradients (parameter name → tensor of the parameter's shape), each of a
        site's mean-reduced batch loss.  A parameter missing from a site's gradient
        (no gradient there) counts as zeros; one missing everywhere stays missing.
    batch_sizes
        b_k, the number of samples in each site's batch.
    weighting
        ``"samples"``: p_k = b_k / Σ b_j (then g is the gradient of the mean loss over
        the pooled batch); ``"even"``: p_k = 1 / K (Remedios et al., Alg. 1 line 14).

    Returns
    -------
    Arrays
        The average, in the gradients' dtype (float32 accumulated in float64).
    """
    if len(grads) != len(batch_sizes):
        raise ValueError(f"{len(grads)} gradients but {len(batch_sizes)} batch sizes; give one batch size per gradient")
    if not grads:
        raise ValueError("no gradients to average: FGA needs every site's reply")
    if any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if weighting == "samples":
        weights = [float(b) for b in batch_sizes]
    elif weighting == "even":
        weights = [1.0] * len(grads)
    else:
        raise ValueError(f"unknown weighting {weighting!r}; use 'samples' or 'even'")
    ref: dict[str, torch.Tensor] = {}
    for g in grads:
        for k, v in g.items():
            ref.setdefault(k, v)
    filled = [{k: (g[k] if k in g else torch.zeros_like(v)) for k, v in ref.items()} for g in grads]
    return weighted_mean(filled, weights)


def federation_steps(steps_per_site: Sequence[int], rule: str = "max") -> int:
    """Lockstep steps in one round from each site's own steps per round (``"max"`` or ``"min"``)."""
    if not steps_per_site:
        raise ValueError("no sites reported their steps per round")
    if rule == "max":
        return max(int(s) for s in steps_per_site)
    if rule == "min":
        return min(int(s) for s in steps_per_site)
    raise ValueError(f"unknown rule {rule!r}; use 'max' or 'min'")


FP16_GRADIENT_AVERAGING = (
    "gradient averaging (FGA; FedSM's selector_training = 'fga'), whose sites send raw batch gradients "
    "to be averaged (per-site loss scales would weight the sites unequally)"
)
"""Why fp16 is refused where gradients are averaged; bf16 (no loss scaling) runs as is."""


def apply_gradient(model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]) -> None:
    """One optimizer step with ``grad`` as every parameter's gradient (None where ``grad`` has no entry), here,
    the payload validated first (:func:`check_gradient`).  A site handler asks for the step instead
    (``yield from site.step_with_gradient(...)``: one stacked step of all sites in a vectorized simulation)."""
    check_gradient(model, grad)
    step_with_gradient(model, optimizer, grad)


def check_gradient(model: nn.Module, grad: Mapping[str, torch.Tensor]) -> None:
    """An averaged gradient names only the model's parameters, each at its shape (:class:`PayloadError`)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(grad) - set(params))
    if unknown:
        raise PayloadError(
            f"averaged gradient names parameters the model does not have: {unknown[:5]}; every site must build the same model"
        )
    for name, p in params.items():
        g = grad.get(name)
        if g is not None and g.shape != p.shape:
            raise PayloadError(f"averaged gradient '{name}' has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}")


def _batch_reducing(mod: Any) -> bool:
    return getattr(mod, "batch", None) is True or getattr(mod, "reduction", None) == "sum"


def equivalence_problems(model: nn.Module, loss: Any) -> list[str]:
    """Reasons why gradient averaging will not equal centralized training (empty when none found).

    Checks: batch-norm layers in training mode (their batch statistics mix a site's
    samples, so a split batch normalizes differently from the pooled batch), and a
    loss — or a loss module inside it — that reduces over the batch (MONAI's
    ``batch=True`` Dice losses) or sums instead of averaging (``reduction="sum"``).
    """
    problems = []
    bn = [
        name or type(m).__name__
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]
    if bn:
        problems.append(
            f"the model has batch-norm layers in training mode ({', '.join(bn[:3])}{'…' if len(bn) > 3 else ''}): batch statistics "
            "of a site's batch differ from those of the pooled batch, so FGA will not equal centralized training; "
            "use instance/group norm or no norm (e.g. --set model.norm=instance)"
        )
    mods = list(loss.modules()) if isinstance(loss, nn.Module) else [loss]
    bad = [type(m).__name__ for m in mods if _batch_reducing(m)]
    if bad:
        problems.append(
            f"the loss reduces over the batch ({', '.join(bad[:3])} with batch=True or reduction='sum'): the gradient of a pooled "
            "batch is then not the sample-weighted mean of the sites' gradients, so FGA will not equal centralized training; "
            "use a per-sample loss averaged over the batch (e.g. MONAI DiceLoss(batch=False))"
        )
    return problems


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """SHA-256 of a model's parameters and an optimizer's state tensors (bitwise-identity check).

    Buffers are left out: batch-norm running statistics are computed from each
    site's own batches and are not synchronized by FGA (nor should they match).
    """
    h = hashlib.sha256()
    for k, v in sorted(model.named_parameters()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    if optimizer is not None:
        for idx, st in sorted(optimizer.state_dict()["state"].items()):
            for key, v in sorted(st.items()):
                h.update(f"{idx}/{key}".encode())
                t = v if torch.is_tensor(v) else torch.tensor(v)
                h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------- optimizer state as arrays
def optimizer_moments(opt: torch.optim.Optimizer, model: nn.Module) -> Arrays:
    """An optimizer's per-parameter state as arrays ``<param name>/<key>`` (Adam: exp_avg, exp_avg_sq, step)."""
    out: Arrays = {}
    for name, p in model.named_parameters():
        for key, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v):
                out[f"{name}/{key}"] = v.detach().clone()
    return out


def set_optimizer_moments(opt: torch.optim.Optimizer, model: nn.Module, moments: Mapping[str, torch.Tensor]) -> None:
    """Overwrite the optimizer's per-parameter state with ``moments`` (from :func:`optimizer_moments`)."""
    for name, p in model.named_parameters():
        entry = strip_prefix(name, {k: v for k, v in moments.items() if k.rpartition("/")[0] == name})
        if entry:
            opt.state[p] = {k: v.detach().clone() for k, v in entry.items()}
