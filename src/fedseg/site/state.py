"""A site's saved state: everything it must remember between rounds — its models, optimizer moments, fp16 loss
scales and algorithm state (``site.store``, e.g. control variates) — as flat host arrays + JSON and back.
:mod:`fedseg.seams.checkpoint` writes and reads them (safetensors + JSON), so a restarted site resumes exactly."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fedseg.foundation.arrays import Arrays, strip_prefix
from fedseg.foundation.device import to_device
from fedseg.site.models import SiteModels

__all__ = ["SavedSite", "load_state_arrays", "state_arrays"]


class SavedSite(Protocol):
    """What a site's saved state is made of (:class:`~fedseg.site.runtime.Site`, which imports this module): its
    models, optimizers and fp16 scalers by role (:class:`~fedseg.site.models.SiteModels`, which also creates a
    role's model and optimizer), its store, and the site half that says how a role is built."""

    name: str
    algorithm: Any  # the site half: model_factory(site, role), optimizer_params(site, role)
    roles: SiteModels
    store: Arrays
    device: torch.device


def state_arrays(site: SavedSite, copy: bool = True) -> tuple[Arrays, dict[str, Any]]:
    """Everything the site must remember, as flat host arrays + JSON metadata (device-independent:
    a state saved on a GPU loads on the CPU and back).  ``copy=False`` returns the live tensors
    (detached, on the run's device) for a caller that copies them at once (the checkpoint writer)."""
    take = (lambda v: v.detach().to("cpu", copy=True)) if copy else (lambda v: v.detach())
    arrays: Arrays = {}
    roles = site.roles
    meta: dict[str, Any] = {
        "site": site.name,
        "models": sorted(roles.models),
        "optimizers": {},
        "template_role": roles.template_role,
    }
    if roles.scalers:
        meta["scalers"] = {role: sc.state_dict() for role, sc in roles.scalers.items()}
    for role, m in roles.models.items():
        for k, v in m.state_dict().items():
            arrays[f"model/{role}/{k}"] = take(v)
    for role, opt in roles.optimizers.items():
        sd = opt.state_dict()
        meta["optimizers"][role] = {"param_groups": sd["param_groups"], "type": type(opt).__name__}
        for idx, st in sd["state"].items():
            for key, v in st.items():
                t = v if torch.is_tensor(v) else torch.tensor(v)
                arrays[f"optim/{role}/{idx}/{key}"] = take(t)
    for k, v in site.store.items():
        arrays[f"store/{k}"] = take(v)
    return arrays, meta


def load_state_arrays(site: SavedSite, arrays: Arrays, meta: dict[str, Any]) -> None:
    """Restore :meth:`state_arrays` output.  Models must be creatable by the workload or already exist."""
    roles = site.roles
    template = meta.get("template_role")
    for role in sorted(meta["models"], key=lambda r: r != template):  # the template first, as when it was built
        sd = strip_prefix(f"model/{role}", arrays)
        if role not in roles.models:
            roles.model(role, site.algorithm.model_factory(site, role))
        roles.models[role].load_state_dict(sd)
    for role, info in meta["optimizers"].items():
        opt = roles.optimizer(role, reset=True, params=site.algorithm.optimizer_params(site, role))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in strip_prefix(f"optim/{role}", arrays).items():
            idx, key = k.split("/", 1)
            state.setdefault(int(idx), {})[key] = v
        opt.load_state_dict(
            {"state": state, "param_groups": info["param_groups"]}
        )  # moves moments to the params' device
    for role, sd in meta.get("scalers", {}).items():
        sc = roles.scaler(role)
        if sc is not None:
            sc.load_state_dict(sd)
    site.store = to_device(strip_prefix("store", arrays), site.device)
