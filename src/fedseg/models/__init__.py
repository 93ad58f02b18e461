"""Networks: the segmentation U-Net (over MONAI) and the FedSM model selector."""

from fedseg.models.selector import Selector
from fedseg.models.unet import build_unet

__all__ = ["Selector", "build_unet"]
