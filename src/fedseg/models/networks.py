"""Networks by name: MONAI's segmentation networks, FGA's reduced U-Net and a user's own factory, with
pretrained weights and nnU-Net's deep supervision.

``model.name`` picks the builder of :data:`NETWORKS`; ``[model.kwargs]`` go to the MONAI constructor and
override what fedseg derives from ``channels``, ``strides`` and ``kernels``.  ``model.module =
"package.module:factory"`` calls a user's factory instead.  ``model.init`` loads a safetensors state dict
into the built network, key by key and shape by shape (:func:`load_pretrained`): every builder — the
server's and every site's, simulated or deployed — starts from the same weights.

``"dynunet"`` is nnU-Net's architecture (MONAI's ``DynUNet``): one level per entry of ``channels``, the
first convolution at stride 1, then ``strides`` (one per level below the first, per axis), ``kernels``
(3 unless the plan makes a thick-slice axis 1), transposed convolutions with the strides as kernels,
instance norm and leaky ReLU.  With ``deep_supervision`` and at least 4 levels it returns, in training,
the full-resolution output and the outputs of the ``levels - 3`` decoder levels below it, each upsampled
to full resolution and stacked on a new axis 1 — the outputs nnU-Net's loss weighs (nnU-Net computes one
per decoder level, ``levels - 1``, and gives the lowest weight 0; the second lowest is the last that
counts): :func:`deep_supervision_loss` weighs them ``2^-i``, normalized to sum 1.  In evaluation it
returns the full-resolution output only.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from fedseg.foundation.config import ModelConfig
from fedseg.foundation.errors import ConfigError
from fedseg.models.fga_unet import build_fga_unet
from fedseg.models.unet import build_unet

__all__ = [
    "NETWORKS",
    "build_model",
    "deep_supervision_loss",
    "deep_supervision_weights",
    "load_pretrained",
    "supervision_outputs",
]

Builder = Callable[[int, int, int, ModelConfig], nn.Module]


def _per_axis(v: int | Sequence[int], dims: int) -> list[int]:
    return [int(v)] * dims if isinstance(v, int) else [int(x) for x in v]


def supervision_outputs(levels: int) -> int:
    """Lower-resolution outputs a ``levels``-level DynUNet adds under deep supervision (module docstring):
    ``levels - 3``, none below 4 levels."""
    return max(0, levels - 3)


def _dynunet_class() -> type[nn.Module]:
    from monai.networks.nets import DynUNet

    class SupervisedDynUNet(DynUNet):
        """MONAI's ``DynUNet`` with each layer under one name, letting go of its deep-supervision outputs
        after each forward pass.

        ``DynUNet`` registers its layers twice (``input_block``, ``downsamples``, … and again inside the
        ``skip_layers`` chain its forward pass runs): here the chain is kept as a plain attribute, so the
        state dict names each tensor once (what is exchanged, and what ``torch.func.functional_call`` swaps
        under the vectorized executor).  It keeps its deep-supervision outputs in a list its decoder levels
        write into; left there they would hold the autograd graph, and a model holding graph tensors can
        neither be deep-copied (as FedSM's and the personalized methods' copies are) nor frees them."""

        unregistered_prefixes = ("skip_layers.",)
        """State-dict names of MONAI's ``DynUNet`` that this one does not register (the second names of
        its layers): :func:`load_pretrained` ignores them in a file saved from MONAI's ``DynUNet``."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            object.__setattr__(self, "skip_layers", self._modules.pop("skip_layers"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            for i in range(len(self.heads)):  # in place: the decoder levels hold the same list
                self.heads[i] = torch.empty(0)
            return out

    return SupervisedDynUNet


def build_dynunet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``DynUNet`` from ``cfg.channels``, ``strides``, ``kernels`` and ``deep_supervision``."""
    channels, strides = cfg.levels()
    if len(channels) < 3:
        raise ConfigError(
            f"model.name = 'dynunet' needs at least 3 levels, got channels {list(channels)} -> give 3 or more "
            "channels (one stride fewer), or use model.name = 'unet'"
        )
    kernels = cfg.kernels or (3,) * len(channels)
    supr = supervision_outputs(len(channels)) if cfg.deep_supervision else 0
    kw: dict[str, Any] = {
        "kernel_size": [_per_axis(k, spatial_dims) for k in kernels],
        "strides": [[1] * spatial_dims, *[_per_axis(s, spatial_dims) for s in strides]],
        "upsample_kernel_size": [_per_axis(s, spatial_dims) for s in strides],
        "filters": list(channels),
        "deep_supervision": supr > 0,
        "deep_supr_num": max(1, supr),
        "res_block": False,
    }
    kw.update(cfg.kwargs)
    return _dynunet_class()(spatial_dims, in_channels, out_channels, **kw)


def build_segresnet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``SegResNet`` (its defaults; ``[model.kwargs]`` e.g. ``init_filters``)."""
    from monai.networks.nets import SegResNet

    return SegResNet(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, **cfg.kwargs)


def _needs(package: str, name: str) -> None:
    """Refuse a network whose MONAI implementation imports ``package`` when it is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"model.name = {name!r} needs the {package!r} package -> pip install {package}")


def build_swinunetr(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``SwinUNETR`` (its defaults; every patch side a multiple of 32)."""
    from monai.networks.nets import SwinUNETR

    _needs("einops", "swinunetr")

    return SwinUNETR(in_channels=in_channels, out_channels=out_channels, spatial_dims=spatial_dims, **cfg.kwargs)


def build_unetr(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``UNETR``; its ``img_size`` is ``model.roi_size`` (the plan's patch for volumes) unless
    ``[model.kwargs]`` gives one."""
    from monai.networks.nets import UNETR

    _needs("einops", "unetr")

    kw = dict(cfg.kwargs)
    if "img_size" not in kw:
        if cfg.roi_size is None:
            raise ConfigError("model.name = 'unetr' needs its input size: set model.roi_size or model.kwargs.img_size")
        kw["img_size"] = tuple(cfg.roi_size)
    return UNETR(in_channels=in_channels, out_channels=out_channels, spatial_dims=spatial_dims, **kw)


def build_basicunet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``BasicUNet`` (its defaults; ``[model.kwargs]`` e.g. ``features``)."""
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, **cfg.kwargs)


def build_attentionunet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    """MONAI's ``AttentionUnet`` with ``model.channels`` and ``strides``."""
    from monai.networks.nets import AttentionUnet

    channels, strides = cfg.levels()
    kw: dict[str, Any] = {"channels": list(channels), "strides": list(strides), **cfg.kwargs}
    return AttentionUnet(spatial_dims, in_channels, out_channels, **kw)


def _unet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    return build_unet(spatial_dims, in_channels, out_channels, cfg)


def _fga(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    return build_fga_unet(spatial_dims, in_channels, out_channels, cfg)


NETWORKS: dict[str, Builder] = {
    "unet": _unet,
    "fga-unet": _fga,
    "dynunet": build_dynunet,
    "segresnet": build_segresnet,
    "swinunetr": build_swinunetr,
    "unetr": build_unetr,
    "basicunet": build_basicunet,
    "attentionunet": build_attentionunet,
}
"""``model.name`` → builder ``(spatial_dims, in_channels, out_channels, cfg) -> nn.Module``."""


def _user_network(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig) -> nn.Module:
    assert cfg.module is not None
    mod_name, _, attr = cfg.module.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"model.module = {cfg.module!r}: cannot import {mod_name!r} ({e}) -> install it or add its folder "
            "to PYTHONPATH at the server and every site"
        ) from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.module = {cfg.module!r}: {mod_name} has no callable {attr!r}")
    net = factory(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, **cfg.kwargs)
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.module = {cfg.module!r} returned {type(net).__name__}, not a torch nn.Module")
    return net


def load_pretrained(model: nn.Module, path: str | Path) -> nn.Module:
    """Load the safetensors state dict at ``path`` into ``model`` (in place, cast to its dtypes).

    Raises
    ------
    ConfigError
        The file is missing, or its keys or shapes differ from the network's (the message names the
        missing, unexpected and mis-shaped keys).  A network's ``unregistered_prefixes`` (the second
        names MONAI's DynUNet gives its layers) are ignored in the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"model.init = {str(path)!r}: no such file -> give a .safetensors file of the network's weights"
        )
    try:
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise ConfigError(f"model.init = {str(path)!r}: not a safetensors file ({e})") from None
    ignored = tuple(getattr(model, "unregistered_prefixes", ()))
    weights = {k: v for k, v in weights.items() if not k.startswith(ignored)} if ignored else weights
    own = model.state_dict(keep_vars=True)
    # names of one tensor (DynUNet reaches its layers by two paths): any one of them in the file loads it
    aliases: dict[int, list[str]] = {}
    for k, t in own.items():
        aliases.setdefault(id(t), []).append(k)
    missing = sorted(k for k, t in own.items() if not any(a in weights for a in aliases[id(t)]))
    unexpected = sorted(set(weights) - set(own))
    shapes = sorted(
        f"{k} {tuple(weights[k].shape)} (network: {tuple(own[k].shape)})"
        for k in set(own) & set(weights)
        if tuple(weights[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or shapes:

        def few(xs: list[str]) -> str:
            return ", ".join(xs[:5]) + (f" and {len(xs) - 5} more" if len(xs) > 5 else "")

        parts = [
            f"{label} {len(xs)}: {few(xs)}"
            for label, xs in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
            if xs
        ]
        raise ConfigError(
            f"model.init = {str(path)!r} does not fit the network ({'; '.join(parts)}) -> use weights saved from "
            "the same model.name, channels, strides, kernels and [model.kwargs]"
        )
    with torch.no_grad():
        for t in own.values():
            source = next(weights[a] for a in aliases[id(t)] if a in weights)
            t.copy_(source.to(dtype=t.dtype))
    return model


def build_model(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig | None = None) -> nn.Module:
    """The segmentation network ``cfg`` names (module docstring): ``cfg.module``'s factory, else
    :data:`NETWORKS` ``[cfg.name]`` (``"auto"`` builds ``"unet"``; a volume run's plan makes it
    the plan's ``network``: ``"dynunet"`` on a GPU plan, ``"unet"`` on a CPU plan), loaded from ``cfg.init`` when set."""
    cfg = cfg or ModelConfig()
    cfg.validate()
    if cfg.module is not None:
        net = _user_network(spatial_dims, in_channels, out_channels, cfg)
    else:
        name = "unet" if cfg.name == "auto" else cfg.name
        if name not in NETWORKS:
            raise ConfigError(f"model.name = {cfg.name!r}; use one of {', '.join(map(repr, NETWORKS))}")
        net = NETWORKS[name](spatial_dims, in_channels, out_channels, cfg)
    if cfg.init is not None:
        load_pretrained(net, cfg.init)
    return net


def deep_supervision_weights(outputs: int) -> list[float]:
    """nnU-Net's deep-supervision weights: ``2^-i`` for output ``i`` (0 = full resolution), summing to 1."""
    w = [0.5**i for i in range(outputs)]
    total = sum(w)
    return [x / total for x in w]


def deep_supervision_loss(loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``loss`` that also takes a deep-supervised output: logits ``(B, K, C, *spatial)`` of one target
    ``(B, C, *spatial)`` (``K`` outputs at full resolution, DynUNet's training output) give
    ``Σ_i w_i loss(logits[:, i], target)`` with :func:`deep_supervision_weights`; plain logits pass through."""

    def wrapped(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if pred.dim() != target.dim() + 1:
            return loss(pred, target)
        weights = deep_supervision_weights(pred.shape[1])
        return sum((w * loss(pred[:, i], target) for i, w in enumerate(weights)), torch.zeros((), device=pred.device))

    return wrapped
