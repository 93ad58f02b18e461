"""Which models, optimizers and batches can be stacked, and what the executor reads of a model (:class:`Structure`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class Structure:
    """What the executor reads of a model, walked once per model object (a site's model keeps its
    architecture and its parameter objects: loads copy into them): its signature (who can be stacked
    together), why it cannot run under vmap, whether it ties tensors, its parameters and buffers."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.signature = _model_signature(model)
        self.reason = vectorize_reason(model)
        self.tied = _tied(model)
        named = list(model.named_parameters())
        self.pnames = [n for n, _ in named]
        self.params: list[torch.Tensor] = [p for _, p in named]
        self._owners = []  # (name, owning module, attribute): a buffer is read where it lives now
        for name, _ in model.named_buffers():
            path, _, attr = name.rpartition(".")
            self._owners.append((name, model.get_submodule(path), attr))
        self.bnames = [n for n, _, _ in self._owners]
        self.modules = list(model.modules())
        self.stacked_gradient = False  # its gradient was computed stacked (then its lockstep step is too)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: getattr(owner, attr) for n, owner, attr in self._owners}

    def train(self) -> None:
        """``model.train()``, unless every module is in training mode already (its walk costs per call)."""
        if not all(m.training for m in self.modules):
            self.model.train()

    def zero_grad(self) -> None:
        """``model.zero_grad(set_to_none=True)``."""
        for p in self.params:
            p.grad = None


def _model_signature(model: nn.Module) -> tuple:
    return (
        tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in model.state_dict().items()),
        tuple(type(m).__qualname__ for m in model.modules()),
    )


def vectorize_reason(model: nn.Module) -> str | None:
    """Why a model cannot train under ``vmap`` (None when it can)."""
    for name, m in model.named_modules():
        # torch's private base classes: the only ones every batch norm (lazy, sync) and every dropout share
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return f"batch norm with running statistics ({name or type(m).__name__}: its in-place buffer updates do not vectorize)"
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"dropout ({name}: it draws from the global random stream)"
    return None


_ADAM_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "fused", "decoupled_weight_decay")
_SGD_FLAGS = ("maximize", "differentiable", "fused")


def optimizer_reason(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> tuple[str | None, tuple]:
    """Why the optimizer cannot be stacked (None when it can) and its settings (the group key)."""
    if type(opt) not in (torch.optim.Adam, torch.optim.SGD):
        return f"optimizer {type(opt).__name__} (only plain Adam and SGD are stacked)", ()
    if len(opt.param_groups) != 1:
        return "its optimizer has several parameter groups", ()
    g = opt.param_groups[0]
    if [id(p) for p in g["params"]] != [id(p) for p in params]:
        return "its optimizer does not update exactly the model's parameters", ()
    if not all(p.requires_grad for p in params):
        return "the model has frozen parameters", ()
    flags = _ADAM_FLAGS if type(opt) is torch.optim.Adam else _SGD_FLAGS
    on = [f for f in flags if g.get(f)]
    if on:
        return f"optimizer option(s) {', '.join(on)}", ()
    states = [opt.state.get(p) for p in params]
    if any(states) and not all(states):
        return "its optimizer holds state for some parameters only", ()
    if type(opt) is torch.optim.Adam:
        if all(states) and len({float(s["step"]) for s in states}) != 1:  # type: ignore[index]
            return "its Adam step counts differ between parameters", ()
        return None, ("adam", float(g["lr"]), tuple(g["betas"]), float(g["eps"]), float(g["weight_decay"]))
    return None, (
        "sgd",
        float(g["lr"]),
        float(g["momentum"]),
        float(g["dampening"]),
        float(g["weight_decay"]),
        bool(g["nesterov"]),
    )


def _tied(model: nn.Module) -> bool:
    """Whether the model holds one tensor under several names: only then must ``functional_call`` tie
    the names (its untying walks the model at every call)."""
    seen: set[int] = set()
    for _, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        if id(t) in seen:
            return True
        seen.add(id(t))
    return False


def is_tree(t: Any) -> bool:
    return torch.is_tensor(t) or (isinstance(t, (tuple, list)) and all(is_tree(e) for e in t))


def tree_key(t: Any) -> tuple:
    if torch.is_tensor(t):
        return (tuple(t.shape), t.dtype)
    return (type(t).__name__, *(tree_key(e) for e in t))
