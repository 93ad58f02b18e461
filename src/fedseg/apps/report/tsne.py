"""t-SNE map of the FedSM model selector's features, coloured by site (FedSM Section 4.2, Fig. 3).

FedSM shows that its selector separates the sites' data distributions by a t-SNE
map of "the features extracted from the model selector".  We take the selector's
pooled convolutional features (:meth:`fedseg.models.Selector.embed`, the input of
its classifier head) for a few test images per site and embed them in 2-D with
scikit-learn's :class:`~sklearn.manifold.TSNE` (optional dependency: ``pip install
'fedseg[report]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from fedseg.site.batches import batch_of, dataset_len

__all__ = ["selector_features", "tsne_embed"]


@torch.no_grad()
def selector_features(
    selector: nn.Module,
    datasets: Mapping[str, Dataset | None],
    max_per_site: int | None = 50,
    batch_size: int = 16,
) -> tuple[np.ndarray, list[str]]:
    """Features of the first ``max_per_site`` images of each site's dataset.

    Parameters
    ----------
    selector
        A model with ``embed(x) -> (B, F)`` (:class:`fedseg.models.Selector`).
    datasets
        ``{site: dataset of (image, label)}``; empty or missing datasets are skipped.

    Returns
    -------
    features, sites
        ``(N, F)`` float64 array and the site of each row.
    """
    if not hasattr(selector, "embed"):
        raise TypeError(f"{type(selector).__name__} has no embed(x); pass a fedseg.models.Selector")
    selector.eval()
    dtype = next(selector.parameters()).dtype
    embed = cast(
        Callable[[torch.Tensor], torch.Tensor], selector.embed
    )  # nn.Module's attributes type as Tensor | Module
    feats: list[np.ndarray] = []
    labels: list[str] = []
    for site, ds in datasets.items():
        if ds is None:
            continue
        n = dataset_len(ds)
        if max_per_site is not None:
            n = min(n, max_per_site)
        for start in range(0, n, batch_size):
            x, _ = batch_of(ds, torch.arange(start, min(n, start + batch_size)))
            f = embed(x.to(dtype)).double().cpu().numpy()
            feats.append(f.reshape(f.shape[0], -1))
            labels += [site] * f.shape[0]
    if not feats:
        raise ValueError("no images to embed: every site's dataset is empty")
    return np.concatenate(feats), labels


def tsne_embed(features: np.ndarray, seed: int = 0, perplexity: float | None = None) -> np.ndarray:
    """2-D t-SNE embedding (N, 2) of ``features`` (N, F) with scikit-learn.

    ``perplexity`` defaults to min(30, (N − 1) / 3) (scikit-learn's 30, lowered for
    small N: it must stay below N).  PCA initialisation and ``random_state = seed``
    make the map deterministic.
    """
    try:
        from sklearn.manifold import TSNE
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("the t-SNE map needs scikit-learn: pip install 'fedseg[report]' (or scikit-learn)") from None
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must be a 2-D array (N, F), got shape {x.shape}")
    n = x.shape[0]
    if n < 3:
        raise ValueError(f"t-SNE needs at least 3 points, got {n}; embed more images per site")
    if perplexity is None:
        perplexity = min(30.0, (n - 1) / 3.0)
    if not 0 < perplexity < n:
        raise ValueError(f"perplexity = {perplexity} must be in (0, N = {n})")
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
    return tsne.fit_transform(x)
