"""How close a reconstruction is to the images a site used: PSNR and SSIM (scikit-image), each
reconstruction matched to one true image by the assignment of highest total PSNR (SciPy's
``linear_sum_assignment``), since a batch's gradient does not say which image is which; re-identification
(each reconstruction's nearest neighbour among the site's images under normalized cross-correlation: is it
the attacked image?); and the audit's verdict, which needs both (:func:`verdict`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["VERDICTS", "match_scores", "ncc", "psnr", "reidentification", "ssim", "standardized", "verdict"]


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


def standardized(images: torch.Tensor) -> torch.Tensor:
    """Each image of ``images`` (N, C, *spatial) flattened and standardized to mean 0 and standard deviation 1
    (float64; a constant image stays 0): what is left of an image after its brightness and contrast."""
    flat = images.detach().to("cpu", torch.float64).reshape(images.shape[0], -1)
    flat = flat - flat.mean(dim=1, keepdim=True)
    return flat / flat.std(dim=1, unbiased=False, keepdim=True).clamp_min(1e-12)


def ncc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Normalized cross-correlation of every image of ``a`` (N, C, *spatial) with every image of ``b``
    (M, C, *spatial): the (N, M) matrix of the mean product of the standardized images, in [-1, 1] (1: the same
    image up to brightness and a positive contrast factor, -1: its negative, 0 for a constant image)."""
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"images {tuple(a.shape)} and {tuple(b.shape)} differ in shape")
    sa, sb = standardized(a), standardized(b)
    return sa @ sb.T / sa.shape[1]


def reidentification(recon: torch.Tensor, pool: torch.Tensor, true: Sequence[int]) -> dict[str, Any]:
    """Re-identification of the attacked images: each reconstruction's nearest neighbour in ``pool`` (M, C,
    *spatial; the site's images: those the message was computed from and every other) under normalized
    cross-correlation (:func:`ncc`: brightness and contrast do not count), and whether it is one of the true
    images (the indices ``true`` into ``pool``).  The rate is the fraction of reconstructions whose nearest
    neighbour is a true image; chance is the rate of a guess uniform over the pool, len(true) / M (1/M for one
    attacked image)."""
    m = int(pool.shape[0])
    truth = {int(i) for i in true}
    if not truth or min(truth) < 0 or max(truth) >= m:
        raise ValueError(f"the true images' indices {sorted(truth)} must be among the pool's {m} images")
    scores = ncc(recon, pool)
    nearest = scores.argmax(dim=1).tolist()
    hits = [int(j) in truth for j in nearest]
    return {
        "nearest": [int(j) for j in nearest],
        "ncc_nearest": [float(scores[i, j]) for i, j in enumerate(nearest)],
        "ncc_true_best": [float(scores[i, sorted(truth)].max()) for i in range(scores.shape[0])],
        "hits": hits,
        "rate": float(np.mean(hits)) if hits else 0.0,
        "chance": len(truth) / m,
        "pool": m,
    }


VERDICTS = ("leaks", "no leak shown")
"""The audit's verdicts: :func:`verdict`."""


def verdict(psnr_mean: float, mean_image_psnr: float, reid_rate: float, chance: float) -> str:
    """``"leaks"`` when the reconstructions are closer to the attacked images than the site's mean image is
    (mean PSNR above the mean image's: more than knowing what the site's images look like) AND they re-identify
    the attacked images above chance (top-1 rate of :func:`reidentification` above len(true) / pool size: they
    point at *these* images, not at a typical one); ``"no leak shown"`` otherwise.  Either alone is not enough:
    the mean image beats unrelated images in PSNR without any message, and a reconstruction with the right
    structure but the wrong contrast re-identifies its image at a PSNR no higher than noise."""
    return VERDICTS[0] if psnr_mean > mean_image_psnr and reid_rate > chance else VERDICTS[1]
