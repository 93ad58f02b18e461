"""FedSM model selector: a VGG-11-layout classifier written with ``torch.nn``.

The FedSM reference uses torchvision's VGG-11 (129 M parameters, ~80x the U-Net),
whose 4096-wide fully-connected layers dominate a round's traffic.  This version
keeps VGG-11's convolution layout (8 conv layers, 5 max-pools) with a width
multiplier, no batch norm (so it averages like any other model), global average
pooling instead of the 7x7 flatten, and a small classifier head.
"""

from __future__ import annotations

import torch
from torch import nn

# VGG-11 ("configuration A"): conv widths, "M" = 2x2 max-pool.
VGG11_LAYOUT: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class GlobalAvgPool(nn.Module):
    """(B, C, *spatial) → (B, C): the mean over the spatial positions.  What ``AdaptiveAvgPool(1)`` +
    ``Flatten`` compute, written as a mean so that it runs under ``torch.func.vmap`` without its slow
    per-sample fallback (the adaptive pooling's backward has no batching rule: torch warns
    "performance drop … aten::as_strided_" in a vectorized simulation).  No parameters, so
    checkpoints are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).mean(dim=2)


class Selector(nn.Module):
    """Image → K site logits (K = number of candidate models or sites).

    Parameters
    ----------
    spatial_dims
        2 (input B, C, H, W) or 3 (B, C, D, H, W).
    in_channels
        Image channels.
    num_classes
        Number of outputs (sites for FedSM's Eq. 2 labels; K + 1 with the global model for Eq. 1).
    width
        Multiplier on VGG-11's channel widths (1.0 = VGG-11; default 0.25 keeps the
        selector smaller than the default U-Net).
    hidden
        Width of the hidden fully-connected layer.
    """

    def __init__(self, spatial_dims: int, in_channels: int, num_classes: int, width: float = 0.25, hidden: int = 128):
        super().__init__()
        if spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv3d
        pool = nn.MaxPool2d if spatial_dims == 2 else nn.MaxPool3d
        layers: list[nn.Module] = []
        c = in_channels
        for item in VGG11_LAYOUT:
            if item == "M":
                layers.append(pool(kernel_size=2, stride=2, ceil_mode=True))
            else:
                out = max(4, round(int(item) * width))
                layers += [conv(c, out, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                c = out
        self.features = nn.Sequential(*layers, GlobalAvgPool())
        self.classifier = nn.Sequential(nn.Linear(c, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled features (B, F), e.g. for a t-SNE map of the sites."""
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes)."""
        return self.classifier(self.features(x))
