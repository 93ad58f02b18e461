"""Networks: the segmentation U-Nets (MONAI's, FGA's reduced one) and the FedSM model selector."""

from torch import nn

from fedseg.foundation.config import ModelConfig
from fedseg.models.fga_unet import FGAUNet, build_fga_unet
from fedseg.models.selector import Selector
from fedseg.models.unet import build_unet

__all__ = ["FGAUNet", "Selector", "build_fga_unet", "build_model", "build_unet"]


def build_model(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig | None = None) -> nn.Module:
    """The segmentation network ``cfg.name`` names: ``"unet"`` (:func:`build_unet`) or ``"fga-unet"``
    (:func:`build_fga_unet`)."""
    cfg = cfg or ModelConfig()
    cfg.validate()
    if cfg.name == "fga-unet":
        return build_fga_unet(spatial_dims, in_channels, out_channels, cfg)
    return build_unet(spatial_dims, in_channels, out_channels, cfg)
