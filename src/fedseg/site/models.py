"""A site's models by role: the models themselves, the batch-norm policy of what they share with the server, their
optimizers (SGD or Adam from ``train``), their fp16 gradient scalers, and the training step and autocast that use
them.  :class:`~fedseg.site.runtime.Site` holds one :class:`SiteModels` (``site.roles``) and asks through it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fedseg.foundation.arrays import Arrays, check_compatible
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.device import DTYPES, autocast, grad_scaler
from fedseg.site.calls import Hook, backward_step
from fedseg.site.workload import Workload

__all__ = ["SiteModels", "bn_buffers"]


def bn_buffers(model: nn.Module) -> set[str]:
    """The state-dict names of ``model``'s batch-norm buffers (running statistics, batch counts)."""
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            for b, _ in mod.named_buffers(recurse=False):
                names.add(f"{mod_name}.{b}" if mod_name else b)
    return names


class SiteModels:
    """One site's models, optimizers and fp16 scalers by role.

    Parameters
    ----------
    site
        The site's name (for messages).
    workload
        Builds the workload model (a role created without its own factory).
    train
        The run's training settings: ``dtype``, ``precision``, ``bn_policy`` and the optimizer's.
    device
        Where the models live.
    """

    def __init__(self, site: str, workload: Workload, train: TrainConfig, device: torch.device):
        self.site = site
        self.workload = workload
        self.train = train
        self.device = device
        self.dtype = DTYPES[train.dtype]
        self.precision = train.precision
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.scalers: dict[str, torch.amp.GradScaler] = {}
        self.template_role: str | None = None
        """The role of the first workload model built (the others are copies of it; its batch-norm
        statistics are those an evaluation copy takes under ``train.bn_policy = "local"``)."""
        self._template: nn.Module | None = None

    def model(self, role: str, factory: Callable[[], nn.Module] | None = None) -> nn.Module:
        """The model for ``role`` (created on first use from ``factory`` or the workload)."""
        m = self.models.get(role)
        if m is None:
            template = self._template if factory is None else None
            # another instance of the workload model: copy it (its weights are replaced
            # on load) instead of building and randomly initializing a new one
            m = (
                copy.deepcopy(template)
                if template is not None
                else (factory or self.workload.build_model)().to(device=self.device, dtype=self.dtype)
            )
            if factory is None and self._template is None:
                self._template = m
                self.template_role = role
            self.models[role] = m
        return m

    def role_of(self, model: nn.Module) -> str:
        """The role ``model`` is held under (``"?"``: none)."""
        return next((r for r, m in self.models.items() if m is model), "?")

    def shared_names(self, model: nn.Module) -> set[str] | None:
        """Names exchanged with the server (None = all); 'local' BN policy keeps running stats at the site."""
        if self.train.bn_policy == "local":
            bn = bn_buffers(model)
            if bn:
                return set(model.state_dict()) - bn
        return None

    def load(
        self, role: str, arrays: Arrays, factory: Callable[[], nn.Module] | None = None, bn_from: str | None = None
    ) -> nn.Module:
        """Copy ``arrays`` into the role's model (validated: names, shapes, dtypes) and return the model.

        With ``train.bn_policy = "local"`` the arrays carry no batch-norm running statistics;
        a role the site trains keeps its own, and a role that only evaluates (``bn_from``
        given) takes the current ones of the site's role ``bn_from`` — otherwise an
        evaluation copy would keep the statistics it had when it was first built.
        """
        model = self.model(role, factory)
        own = model.state_dict()
        shared = self.shared_names(model)
        expected = {k: v for k, v in own.items() if shared is None or k in shared}
        incoming = {k: v for k, v in arrays.items() if k in expected} if shared is not None else arrays
        check_compatible(expected, incoming, what=f"site {self.site}: model '{role}'")
        with torch.no_grad():
            for k, v in incoming.items():
                own[k].copy_(v)
            source = self.models.get(bn_from) if bn_from is not None and bn_from != role else None
            if shared is not None and source is not None:
                theirs = source.state_dict()
                for k in set(own) - shared:
                    if k in theirs and theirs[k].shape == own[k].shape:
                        own[k].copy_(theirs[k])
        return model

    def arrays(self, role: str) -> Arrays:
        """Detached copies of the role's model weights that are shared with the server."""
        model = self.models[role]
        shared = self.shared_names(model)
        return {k: v.detach().clone() for k, v in model.state_dict().items() if shared is None or k in shared}

    def optimizer(
        self, role: str, reset: bool = False, params: list[torch.Tensor] | None = None, lr: float | None = None
    ) -> torch.optim.Optimizer:
        """The role's optimizer, created on first use (Adam by default) and kept across rounds unless ``reset``."""
        opt = self.optimizers.get(role)
        if opt is None or reset:
            t = self.train
            ps = params if params is not None else list(self.model(role).parameters())
            if t.optimizer == "adam":
                opt = torch.optim.Adam(ps, lr=lr or t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
            else:
                opt = torch.optim.SGD(
                    ps, lr=lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay, nesterov=t.nesterov
                )
            self.optimizers[role] = opt
        return opt

    def scaler(self, role: str) -> torch.amp.GradScaler | None:
        """The role's fp16 gradient scaler (None unless ``train.precision = "fp16"``)."""
        if role not in self.scalers:
            sc = grad_scaler(self.device, self.precision)
            if sc is None:
                return None
            self.scalers[role] = sc
        return self.scalers[role]

    def autocast(self) -> AbstractContextManager[Any]:
        """``train.precision``'s autocast on the site's device (a no-op context for fp32): the
        forward pass of every local loop runs under it."""
        return autocast(self.device, self.precision)

    def step(
        self,
        role: str,
        opt: torch.optim.Optimizer,
        loss: torch.Tensor,
        model: nn.Module | None = None,
        after_backward: Hook | None = None,
    ) -> None:
        """``loss.backward()`` and one step of ``opt``; under fp16 through the role's gradient
        scaler (:func:`fedseg.site.calls.backward_step`).  fp32 and bf16: the plain step."""
        backward_step(opt, loss, self.scaler(role), model, after_backward)
