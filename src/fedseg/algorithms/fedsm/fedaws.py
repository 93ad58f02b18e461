"""FedAwS for FedSM's selector (``fedsm.selector_training = "fedaws"``): Federated Averaging with
Spread-out (Yu, Rawat, Menon & Kumar, "Federated Learning with Only Positive Labels", ICML 2020).

The setting is the paper's: under Eq. 2 every site holds the images of exactly one selector
class, its own position o, and nothing of the others.  The selector is read as an embedding
classifier: the weight rows w_1 … w_K of its last linear layer (:func:`class_head`) are the class
embeddings, that layer's input h = g_θ(x) is the image's embedding, and a class is scored by the
cosine s_c(x) = ⟨ĥ, ŵ_c⟩ with ĥ = h / ‖h‖, ŵ_c = w_c / ‖w_c‖ (the paper's normalized embeddings).

**Site (positive labels only).**  The squared hinge on the positive class's score:

    ℓ_pos(x) = max(0, m − s_o(x))²,     m = ``fedsm.fedaws_margin`` (0.9),

averaged over the batch (:func:`positive_loss`).  It depends on W only through w_o, so
∂ℓ_pos / ∂w_c = 0 for every c ≠ o: a site neither needs nor moves the other sites' embeddings.
Alone it is minimized by a trivial selector — all ŵ_c equal and g_θ mapping every image onto them
(the collapse the paper starts from, and what the averaged selector does here).

**Server.**  The feature layers θ are averaged as in FedAvg; row o of W is taken from the site
whose class it is (the only one that trains it; the paper's server receives w_o from that user);
then one gradient step of the spread-out regularizer on W (:func:`spreadout_step`):

    reg_sp(W) = Σ_c Σ_{c'≠c} max(0, ν − d_cc')²,   d_cc' = ‖ŵ_c − ŵ_c'‖² = 2 − 2 ⟨ŵ_c, ŵ_c'⟩ ∈ [0, 4],
    W ← W − η_sp ∇_W reg_sp(W)       (ν = ``fedsm.fedaws_nu``, η_sp = ``fedsm.fedaws_lr``: the paper's λη).

By hand (each unordered pair appears twice in the double sum, ∂d_cc'/∂ŵ_c = 2 (ŵ_c − ŵ_c')):

    ∂reg/∂ŵ_c = −8 Σ_{c'≠c} max(0, ν − d_cc') (ŵ_c − ŵ_c'),
    ∂reg/∂w_c = (I − ŵ_c ŵ_cᵀ) / ‖w_c‖ · ∂reg/∂ŵ_c          (through the normalization),

so pairs already ν or more apart contribute nothing, and with no pair closer than ν the step
leaves W unchanged; a class pushed equally from both sides stays.  The paper's top-k variant
(each class only against its k nearest) is for very many classes; with K sites every pair is used.

**Routing.**  The selector routes by its ordinary logits z_c = ⟨w_c, h⟩ + b_c (Alg. 2).  After its
step the server gives every row of W the same norm (the rows' mean norm) and sets the layer's bias
to zero (:func:`equal_rows`; the positive loss never trains the bias), so z_c = ‖w‖ ‖h‖ s_c(x) and
argmax_c z_c = argmax_c s_c(x): the selector routes by the cosine FedAwS trains.

Only Eq. 2's selector (FedSM's joint phase) has one class per site; the K + 1-class selectors of
FedSM-extra and the ensemble train as ``"fedavg"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.errors import ConfigError, PayloadError

__all__ = [
    "class_head",
    "equal_rows",
    "positive_loss",
    "selector_positive_loss",
    "server_step",
    "spreadout",
    "spreadout_step",
]


def class_head(model: nn.Module, num_classes: int | None = None) -> str:
    """Name of the selector's last ``nn.Linear`` (checked to have ``num_classes`` outputs when given): its
    weight rows are the class embeddings, its input the image embedding."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = model.get_submodule(names[-1]) if names else None
    if last is None or (num_classes is not None and last.out_features != num_classes):
        raise ConfigError(
            f"fedsm.selector_training = 'fedaws' needs a selector whose last layer is an nn.Linear with "
            f"{num_classes} outputs (the class embeddings); {type(model).__name__} has none — use 'fga'"
        )
    return names[-1]


def positive_loss(h: torch.Tensor, w: torch.Tensor, own: int, margin: float) -> torch.Tensor:
    """Mean over the batch of max(0, m − ⟨ĥ, ŵ_own⟩)²: the embeddings ``h`` (B, F) against the class
    embeddings ``w`` (K, F); only row ``own`` of ``w`` enters."""
    cos = F.normalize(h, dim=1) @ F.normalize(w[own], dim=0)
    return F.relu(margin - cos).pow(2).mean()


def selector_positive_loss(sel: nn.Module, x: torch.Tensor, own: int, margin: float) -> torch.Tensor:
    """:func:`positive_loss` of the selector ``sel`` on images ``x``: h is the input of its :func:`class_head`
    (captured by a forward pre-hook), w that layer's weight."""
    head = cast(nn.Linear, sel.get_submodule(class_head(sel)))  # class_head names an nn.Linear
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        sel(x)
    finally:
        handle.remove()
    return positive_loss(seen[-1], head.weight, own, margin)


def spreadout(w: torch.Tensor, nu: float) -> torch.Tensor:
    """reg_sp(W) = Σ_c Σ_{c'≠c} max(0, ν − ‖ŵ_c − ŵ_c'‖²)² of the rows of ``w`` (K, F)."""
    u = F.normalize(w, dim=1)
    d = 2.0 - 2.0 * (u @ u.T)
    off = ~torch.eye(w.shape[0], dtype=torch.bool, device=w.device)
    return F.relu(nu - d[off]).pow(2).sum()


def spreadout_step(w: torch.Tensor, nu: float, lr: float) -> torch.Tensor:
    """W − η ∇_W reg_sp(W): one gradient step of the spread-out regularizer (a new tensor)."""
    with torch.enable_grad():
        v = w.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(spreadout(v, nu), v)
    return (w - lr * grad).detach()


def equal_rows(w: torch.Tensor) -> torch.Tensor:
    """The rows of ``w`` rescaled to their mean norm (directions kept)."""
    norms = w.norm(dim=1, keepdim=True)
    return w / norms.clamp_min(torch.finfo(w.dtype).tiny) * norms.mean()


def server_step(
    averaged: Arrays, own: Mapping[int, Arrays], head: str, nu: float, lr: float, prefix: str = "selector"
) -> Arrays:
    """The server's FedAwS step on the averaged selector ``averaged`` (``<prefix>/…``, with or without its
    Adam moments ``<prefix>_optim/…``): row c of the class embeddings ``<prefix>/<head>.weight`` (and of its
    Adam moments) from ``own[c]``, the reply of the site whose class c is (classes without a reply keep the
    average); then :func:`spreadout_step`, :func:`equal_rows` and the head's bias set to zero.  Returns
    the changed entries."""
    key = f"{prefix}/{head}.weight"
    keys = [key, *(f"{prefix}_optim/{head}.weight/{m}" for m in ("exp_avg", "exp_avg_sq"))]
    if key not in averaged:
        raise PayloadError(f"fedaws: the averaged selector has no class embeddings {key!r}")
    out: Arrays = {}
    for k in keys:
        if k not in averaged:
            continue
        t = averaged[k].clone()
        for c, arrays in own.items():
            if k in arrays:
                t[c] = arrays[k][c]
        out[k] = t
    w = out[key]
    out[key] = equal_rows(spreadout_step(w.double(), nu, lr)).to(w.dtype)
    bias = f"{prefix}/{head}.bias"
    if bias in averaged:
        out[bias] = torch.zeros_like(averaged[bias])
    return out
