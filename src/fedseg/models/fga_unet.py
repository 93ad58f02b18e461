"""FGA's reduced U-Net (Remedios et al., MICCAI DART 2020, Section 3.2), 2D and 3D.

The paper replaces the U-Net's double convolutions and max pooling by "single convolution layers
of kernel size 5 and stride 2 on the down-sampling arc and transpose convolution layers with the
same kernel and stride settings ... on the up-sampling arc", and points to its code for the exact
network (``models/reduced_unet.py`` of sremedios/federated_gradient_averaging, built there with
``ds=16``). That network, for a one-channel 2D patch:

====================  =============================  ===========================  ==========
layer                 operation                      channels                     parameters
====================  =============================  ===========================  ==========
conv1                 5x5 conv, stride 2, ReLU       1 -> 4                       104
conv2                 5x5 conv, stride 2, ReLU       4 -> 8                       808
conv3                 5x5 conv, stride 2, ReLU       8 -> 16                      3,216
conv4                 5x5 conv, stride 2, ReLU       16 -> 32                     12,832
bottleneck            3x3 conv, stride 2, ReLU       32 -> 64                     18,496
up4 (+ conv4)         5x5 transposed, stride 2       64 -> 32, concat -> 64       51,232
up3 (+ conv3)         5x5 transposed, stride 2       64 -> 16, concat -> 32       25,616
up2 (+ conv2)         5x5 transposed, stride 2       32 -> 8, concat -> 16        6,408
up1 (+ conv1)         5x5 transposed, stride 2       16 -> 4, concat -> 8         1,604
final up              5x5 transposed, stride 2       8 -> 2                       402
head                  1x1 conv                       2 -> 1                       3
====================  =============================  ===========================  ==========

120,721 parameters in all (a k^d kernel from c to c' channels has k^d c c' + c' parameters). In
``ModelConfig`` terms the levels are ``channels = (2, 4, 8, 16, 32, 64)`` (the full-resolution
level, whose channels are the last transposed convolution's, then the output of each strided
convolution) and ``strides = (2, 2, 2, 2, 2)``; any channels/strides of that shape build the same
pattern. The head gives logits (fedseg's losses apply the sigmoid; the paper's network ends in a
sigmoid). Weights start Glorot-uniform with zero biases, Keras's defaults that the paper's code
uses. No normalization and no dropout, so the network trains under the vectorized executor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from fedseg.foundation.config import ModelConfig
from fedseg.foundation.errors import ConfigError

#: The paper's network as ``ModelConfig`` channels and strides (its code's ``reduced_unet(ds=16)``).
PAPER_CHANNELS = (2, 4, 8, 16, 32, 64)
PAPER_STRIDES = (2, 2, 2, 2, 2)
KERNEL, BOTTLENECK_KERNEL = 5, 3


class FGAUNet(nn.Module):
    """Single strided convolutions down, transposed convolutions up, skips by concatenation.

    Parameters
    ----------
    spatial_dims
        2 (input B, C, H, W) or 3 (B, C, D, H, W).
    in_channels, out_channels
        Image channels; label channels (logits).
    channels
        Channels per level: ``channels[0]`` at full resolution (the last transposed convolution's
        output), ``channels[i]`` for ``i >= 1`` the output of the ``i``-th strided convolution.
    strides
        Stride of each down convolution (and of the matching transposed one); one fewer than
        ``channels``. Every input side must be a multiple of the strides' product.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_channels: int,
        out_channels: int,
        channels: Sequence[int] = PAPER_CHANNELS,
        strides: Sequence[int] = PAPER_STRIDES,
    ):
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ConfigError(f"fga-unet: spatial_dims must be 2 or 3, got {spatial_dims}")
        if len(channels) < 2 or len(strides) != len(channels) - 1:
            raise ConfigError(
                f"fga-unet: need at least 2 channels and one stride fewer, got channels {tuple(channels)}, "
                f"strides {tuple(strides)} -> e.g. model.channels = {list(PAPER_CHANNELS)}, "
                f"model.strides = {list(PAPER_STRIDES)}"
            )
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv3d
        up = nn.ConvTranspose2d if spatial_dims == 2 else nn.ConvTranspose3d
        n = len(strides)
        self.factor = 1
        for s in strides:
            self.factor *= s
        self.down = nn.ModuleList()
        for i, s in enumerate(strides):
            k = BOTTLENECK_KERNEL if i == n - 1 else KERNEL
            self.down.append(conv(in_channels if i == 0 else channels[i], channels[i + 1], k, s, padding=k // 2))
        self.up = nn.ModuleList()
        for i, s in enumerate(strides):  # up[i]: level i + 1 -> level i
            c_in = channels[n] if i == n - 1 else 2 * channels[i + 1]
            self.up.append(up(c_in, channels[i], KERNEL, s, padding=KERNEL // 2, output_padding=s - 1))
        self.head = conv(channels[0], out_channels, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
                nn.init.xavier_uniform_(m.weight)
                assert m.bias is not None  # every convolution above is built with its bias
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(side % self.factor for side in x.shape[2:]):
            raise ConfigError(
                f"fga-unet: input size {tuple(x.shape[2:])} is not a multiple of {self.factor} (the product "
                "of model.strides) -> crop or pad the cases (data.image_size, model.roi_size) to a multiple"
            )
        skips = []
        for conv in self.down:
            x = torch.relu(conv(x))
            skips.append(x)
        x = skips.pop()
        for i in range(len(self.up) - 1, -1, -1):
            x = torch.relu(self.up[i](x))
            if i > 0:
                x = torch.cat([skips[i - 1], x], dim=1)
        return self.head(x)


def build_fga_unet(spatial_dims: int, in_channels: int, out_channels: int, cfg: ModelConfig | None = None) -> FGAUNet:
    """:class:`FGAUNet` with ``cfg.channels`` and ``cfg.strides`` (the paper's: :data:`PAPER_CHANNELS`,
    :data:`PAPER_STRIDES`); ``num_res_units``, ``norm`` and ``dropout`` do not apply to it."""
    cfg = cfg or ModelConfig(name="fga-unet", channels=PAPER_CHANNELS, strides=PAPER_STRIDES)
    cfg.validate()
    channels, strides = cfg.levels()
    # one integer stride per level (the network's strides are isotropic; ``s - 1`` is its output padding)
    return FGAUNet(spatial_dims, in_channels, out_channels, channels, cast(Sequence[int], strides))
