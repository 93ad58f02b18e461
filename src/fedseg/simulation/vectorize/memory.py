"""How many sites fit in one stacked group: the device's free memory and an estimate of the bytes per site."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedseg.foundation.config.schema import Precision
from fedseg.foundation.device import autocast
from fedseg.site.calls import GradientCall


def free_memory(device: torch.device) -> int | None:
    """Bytes a stacked group may take on ``device``: CUDA's free memory plus what torch's caching allocator
    holds unused; None where it is not known (the CPU: no grouping by memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def group_size_for(free_bytes: int, site_bytes: int, k: int, headroom: float = 0.8) -> int:
    """Most sites per group so that a group's ``site_bytes`` each fit in ``headroom · free_bytes``, the number
    of groups the least that fit (``ceil(k / fits)``) and their sizes as even as slicing allows (at least 1
    site, at most ``k``).  E.g. 10 sites of which 4 fit: 3 groups of at most 4 → groups of 4, 4, 2."""
    if k <= 1 or site_bytes <= 0:
        return max(k, 1)
    fits = int(free_bytes * headroom) // site_bytes
    if fits >= k:
        return k
    groups = -(-k // max(fits, 1))
    return -(-k // groups)


def activation_bytes(
    model: nn.Module, x: Any, target: Any, loss: Callable, device: torch.device, precision: Precision
) -> int:
    """Bytes autograd keeps for the backward pass of ``loss(model(x), target)`` — the tensors saved for
    backward, each storage counted once — from one forward pass on one site's batch (the model and its
    parameters are not changed: they are read through detached copies)."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        kept[st.data_ptr()] = st.nbytes()
        return t

    params = {n: p.detach().requires_grad_(True) for n, p in model.named_parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, precision):
        loss(functional_call(model, params, (x,)), target)
    return sum(kept.values())


def fit_site_bytes(item: Any) -> int:
    """Bytes one site adds to a stacked training group: its weights six times (the stacked weights, their
    gradients as autograd returns them and in the flat buffer, two Adam moments, the step's scratch) and
    twice the activations of one batch (those saved for backward, and the gradients flowing back)."""
    c = item.call
    x, y = next(iter(c.batches))  # the site's first batch (a fresh seeded stream)
    params = sum(p.numel() * p.element_size() for p in item.params)
    return 6 * params + 2 * activation_bytes(item.model, x, y, c.loss, c.device, c.precision)


def gradient_site_bytes(call: GradientCall, loss: Callable) -> int:
    """Bytes one site adds to a stacked lockstep-gradient group: its weights three times (stacked, their
    gradients, the gradients handed back) and twice the activations of its batch."""
    model = call.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params + 2 * activation_bytes(model, call.x, call.target, loss, call.device, call.precision)
