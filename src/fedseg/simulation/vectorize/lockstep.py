"""Lockstep steps: K sites' batch gradients without a step (:meth:`Site.gradient`) in one ``vmap``, and K sites'
Adam steps with given gradients (:meth:`Site.step_with_gradient`) in one fused Adam call.

The sites of a lockstep round (FGA, FedSM's ``"fga"`` selector) hold the same weights and gradient; the
fused kernel updates each site's own parameters, moments and step counts with the same arithmetic, so they
stay bitwise identical to each other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call, vmap

from fedseg.foundation.device import autocast
from fedseg.simulation.vectorize.eligibility import is_tree, tree_key
from fedseg.simulation.vectorize.layout import stack_tree
from fedseg.simulation.vectorize.optimizer import adam_, scalar_dtype
from fedseg.simulation.vectorize.scheduler import ApplyCall, ExecutorState, GradientCall


def gradient_reason(ex: ExecutorState, call: GradientCall) -> tuple[tuple, str | None]:
    """The call's model signature, and why its gradient cannot be stacked (None when it can)."""
    st = ex.structure(call.model)
    signature, reason = st.signature, st.reason
    if call.precision == "fp16":
        return signature, "fp16 loss scaling (a GradScaler per site)"
    if not is_tree(call.x) or not is_tree(call.target):
        return signature, "its batch or target is not a tensor or a tuple/list of tensors"
    if reason is None and len({p.dtype for p in st.params}) > 1:
        reason = "its parameters have several dtypes"
    if reason is None and not all(p.requires_grad for p in st.params):
        reason = "the model has frozen parameters"
    if reason is None and call.at is not None:
        names = st.pnames
        if not isinstance(call.at, dict) or sorted(call.at) != sorted(names):
            reason = "the weights it is asked at do not name exactly the model's parameters"
        elif any(call.at[n].shape != p.shape for n, p in zip(st.pnames, st.params)):
            reason = "the weights it is asked at do not have the model's shapes"
    return signature, reason


def gradient_group(
    ex: ExecutorState, calls: list[GradientCall], loss: Any
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The gradients of K sites' losses in one ``vmap`` over their stacked weights (the sites of a lockstep
    round hold the same weights, but nothing here relies on it): each site's loss depends only on its
    row, so the gradient of their sum with respect to the stacked ``K × shape`` weights is, row by row,
    each site's own gradient.  Parameters the loss does not reach get no gradient, as sequentially."""
    dev, precision = calls[0].device, calls[0].precision
    models = [c.model for c in calls]
    template = models[0]
    sts = [ex.structure(m) for m in models]
    pnames, tied = sts[0].pnames, sts[0].tied
    plist = [st.params for st in sts]
    blist = [st.buffers() for st in sts]
    own = calls[0].at is None  # at the models' own weights (else at each call's ``at``, as a group)
    for st in sts:
        st.train()
        if own:
            st.zero_grad()

    def site_loss(params: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor], x: torch.Tensor, t: Any):
        with autocast(dev, precision):
            return loss(functional_call(template, (params, bufs), (x,), tie_weights=tied), t)

    losses_of = vmap(site_loss, randomness="error")
    by_shape: dict[tuple, list[int]] = {}  # the last, smaller batch of an epoch: its own vmap
    for i, c in enumerate(calls):
        by_shape.setdefault((tree_key(c.x), tree_key(c.target)), []).append(i)
    results: list[Any] = [None] * len(calls)
    for idx in by_shape.values():
        with torch.no_grad():
            ats = [calls[i].at or {} for i in idx]
            weights = [
                torch.stack([plist[i][j] if own else ats[r][n] for r, i in enumerate(idx)])
                for j, n in enumerate(pnames)
            ]
            bufs = {n: torch.stack([blist[i][n] for i in idx]) for n in blist[0]}
        for w in weights:
            w.requires_grad_(True)
        out = losses_of(
            dict(zip(pnames, weights)),
            bufs,
            torch.stack([calls[i].x for i in idx]),
            stack_tree([calls[i].target for i in idx]),
        )
        gs = torch.autograd.grad(out.sum(), weights, allow_unused=True)
        for j, i in enumerate(idx):
            # each site its own row (views: rows are disjoint, and the replies are copied on the way out)
            results[i] = ({n: g[j] for n, g in zip(pnames, gs) if g is not None}, out[j].detach())
    for st in sts:
        st.stacked_gradient = True
    ex.vectorized_gradients += len(calls)
    return results


def apply_group(ex: ExecutorState, calls: list[ApplyCall], settings: tuple) -> None:
    """``apply_gradient``'s step for every call: each parameter's ``.grad`` set to its gradient, then
    ``torch.optim.Adam``'s step (lazy state, parameters without a gradient skipped) in one kernel call."""
    _, lr, (b1, b2), eps, wd = settings
    params, grads, m, v, steps, own = [], [], [], [], [], []
    with torch.no_grad():
        for c in calls:
            opt, st = c.optimizer, ex.structure(c.model)
            for n, p in zip(st.pnames, st.params):
                g = c.grad.get(n)
                if g is None:
                    p.grad = None
                    continue
                p.grad = g.to(device=p.device, dtype=p.dtype).clone()
                state = opt.state[p]
                if not state:  # as torch.optim.Adam initializes a parameter's state
                    state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                step = state["step"]
                own.append(step)
                steps.append(step if step.device == p.device else step.to(p.device))  # the kernel reads it there
        if params:
            adam_(params, grads, m, v, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, steps=steps)
            for mine, used in zip(own, steps):
                if mine is not used:
                    mine.copy_(used)
    ex.vectorized_applies += len(calls)
