"""How close a reconstruction is to the images a site used: PSNR and SSIM (scikit-image), each
reconstruction matched to one true image by the assignment of highest total PSNR (SciPy's
``linear_sum_assignment``), since a batch's gradient does not say which image is which."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["match_scores", "psnr", "ssim"]


def _channels_last(x: torch.Tensor) -> tuple[np.ndarray, int | None]:
    """A (C, *spatial) image as a numpy array for scikit-image: (*spatial, C) with ``channel_axis=-1``
    when C > 1, (*spatial) otherwise."""
    a = x.detach().to("cpu", torch.float64).clamp(0, 1).numpy()
    if a.shape[0] == 1:
        return a[0], None
    return np.moveaxis(a, 0, -1), -1


def psnr(recon: torch.Tensor, truth: torch.Tensor) -> float:
    """Peak signal-to-noise ratio (dB, data range 1) of one image (C, *spatial) against another; capped at
    100 dB for identical images."""
    from skimage.metrics import peak_signal_noise_ratio

    a, _ = _channels_last(recon)
    b, _ = _channels_last(truth)
    if np.array_equal(a, b):
        return 100.0
    return float(min(100.0, peak_signal_noise_ratio(b, a, data_range=1.0)))


def ssim(recon: torch.Tensor, truth: torch.Tensor) -> float:
    """Structural similarity of one image (C, *spatial) against another (data range 1; the window shrinks
    to the image's smallest odd side below 7 pixels)."""
    from skimage.metrics import structural_similarity

    a, axis = _channels_last(recon)
    b, _ = _channels_last(truth)
    side = min(a.shape[:-1] if axis is not None else a.shape)
    win = min(7, side if side % 2 else side - 1)
    if win < 3:
        raise ValueError(f"SSIM needs images of at least 3 pixels a side, got {tuple(truth.shape)}")
    return float(structural_similarity(b, a, data_range=1.0, channel_axis=axis, win_size=win))


def match_scores(recon: torch.Tensor, truth: torch.Tensor) -> dict[str, Any]:
    """Scores of reconstructions ``recon`` (N, C, *spatial) against true images ``truth`` (M, C, *spatial):
    each reconstruction is assigned to a different true image (min(N, M) pairs) so that the total PSNR is
    highest; returns the pairs, their PSNR and SSIM, and their means and maxima."""
    from scipy.optimize import linear_sum_assignment

    if recon.shape[1:] != truth.shape[1:]:
        raise ValueError(f"reconstructions {tuple(recon.shape)} and true images {tuple(truth.shape)} differ in shape")
    table = np.array([[psnr(r, t) for t in truth] for r in recon])
    rows, cols = linear_sum_assignment(-table)
    p = [float(table[i, j]) for i, j in zip(rows, cols)]
    s = [ssim(recon[i], truth[j]) for i, j in zip(rows, cols)]
    return {
        "pairs": [[int(i), int(j)] for i, j in zip(rows, cols)],
        "psnr": p,
        "ssim": s,
        "psnr_mean": float(np.mean(p)),
        "psnr_max": float(np.max(p)),
        "ssim_mean": float(np.mean(s)),
        "ssim_max": float(np.max(s)),
    }
