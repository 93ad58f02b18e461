"""Networks: any of MONAI's segmentation networks by name, FGA's reduced U-Net, a user's own, and the
FedSM model selector."""

from fedseg.models.fga_unet import FGAUNet, build_fga_unet
from fedseg.models.networks import (
    NETWORKS,
    build_model,
    deep_supervision_loss,
    deep_supervision_weights,
    load_pretrained,
)
from fedseg.models.selector import Selector
from fedseg.models.unet import build_unet

__all__ = [
    "NETWORKS",
    "FGAUNet",
    "Selector",
    "build_fga_unet",
    "build_model",
    "build_unet",
    "deep_supervision_loss",
    "deep_supervision_weights",
    "load_pretrained",
]
