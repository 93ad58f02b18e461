"""U-Net builder over MONAI's ``UNet``."""

from __future__ import annotations

from typing import Any, cast

from monai.networks.nets import UNet
from torch import nn

from fedseg.foundation.config import ModelConfig

_NORMS = {"instance": "INSTANCE", "batch": "BATCH", "none": None}


def build_unet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig | None = None) -> nn.Module:
    """MONAI ``UNet`` as configured by ``cfg`` (FedSM reference defaults).

    Parameters
    ----------
    spatial_dims
        2 for images/slices (input B, C, H, W), 3 for volumes (B, C, D, H, W).
    in_channels
        Image channels (3 for RGB fundus, 1 for MR slices).
    out_channels
        Label channels; outputs are logits, one sigmoid per channel (channels may
        overlap, e.g. the cup lies inside the disc).
    cfg
        Architecture; defaults to channels (16, 32, 64, 128, 256), strides 2,
        2 residual units, instance norm.
    """
    cfg = cfg or ModelConfig()
    cfg.validate()
    norm = _NORMS[cfg.norm]
    return UNet(
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        out_channels=out_channels,
        channels=cfg.levels()[0],
        # MONAI passes each stride to Convolution, which takes an int or one per axis (its UNet hint says int)
        strides=cast(Any, cfg.levels()[1]),
        num_res_units=cfg.num_res_units,
        norm=norm,  # type: ignore[arg-type]  # MONAI's hint omits None, which its ADN layers take as "no norm"
        dropout=cfg.dropout,
    )
