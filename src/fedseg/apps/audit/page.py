"""The audit's HTML page: the table, and each attack's reconstructions drawn beside the true images
they were matched to (PNG, inlined as base64 by the report's markup helpers)."""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedseg.apps.report.markup import Doc, figure, markdown_html, note, para

__all__ = ["audit_page", "pair_strip"]

_SIDE = 128
"""Least pixels a side of each drawn image (enlarged by a whole factor, nearest neighbour: the pixels stay visible)."""


def _rgb(x: torch.Tensor) -> np.ndarray:
    """An image (C, *spatial) as uint8 (H, W, 3); a volume's middle slice; one channel as grey; two as red/green."""
    a = x.detach().to("cpu", torch.float32).clamp(0, 1)
    while a.dim() > 3:
        a = a[..., a.shape[-1] // 2]
    c = a.shape[0]
    if c == 1:
        a = a.expand(3, *a.shape[1:])
    elif c == 2:
        a = torch.cat([a, torch.zeros_like(a[:1])])
    else:
        a = a[:3]
    return (a.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def pair_strip(truth: torch.Tensor, recon: torch.Tensor, pairs: Sequence[Sequence[int]]) -> bytes:
    """A PNG of two rows: the true images (top) and the reconstructions matched to them (bottom)."""
    from PIL import Image

    tiles = []
    for i, j in pairs:
        top, bottom = _rgb(truth[j]), _rgb(recon[i])
        tiles.append(np.concatenate([top, np.full((2, *top.shape[1:]), 255, np.uint8), bottom], axis=0))
    sep = np.full((tiles[0].shape[0], 2, 3), 255, np.uint8)
    strip = np.concatenate([t for tile in tiles for t in (tile, sep)][:-1], axis=1)
    scale = max(1, -(-_SIDE // max(1, truth.shape[-1])))
    img = Image.fromarray(strip).resize((strip.shape[1] * scale, strip.shape[0] * scale), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="png", optimize=True)
    return buf.getvalue()


def audit_page(doc: Mapping[str, Any], rows: Sequence[Any], table_md: str) -> str:
    """The self-contained page of an audit (``doc``: ``audit.json``; ``rows``: :class:`.run.AuditRow`)."""
    page = Doc("fedseg leakage audit")
    attack = doc["attack"]
    intro = para(
        f"Gradient inversion (cosine gradient matching with a total-variation prior, Geiping et al. 2020) "
        f"from an honest-but-curious server's point of view, on {', '.join(doc['sites'])} "
        f"(attacked site: {doc['attacked_site']}; {doc['images_per_batch']} image(s) per batch; "
        f"{attack['iterations']} iterations × {attack['restarts']} restarts, TV weight {attack['tv']}"
        f"{', layers ' + ', '.join(attack['layers']) if attack.get('layers') else ''}; device {doc['device']}). "
        + (
            f"Budget: {100 * doc['budget']['fraction_of_reference']:.2g}% of the reference attack's "
            f"{doc['budget']['reference_iterations']:,} iterations × {doc['budget']['reference_restarts']} restart(s)."
            if "budget" in doc
            else ""
        )
    )
    assumptions = "".join(f"<li>{html.escape(a)}</li>" for a in doc["assumptions"])
    page.add(
        "table",
        "PSNR and SSIM per message and protection",
        markdown_html(table_md)
        + para(
            "PSNR/SSIM: mean over the reconstructions, each matched to a different true image (best assignment). "
            "Mean image: the per-pixel mean of the site's training images, scored the same way — what an attacker "
            "who knows what the site's images look like has without any message. Unrelated: other images of the "
            "same sites. Re-identified: the fraction of reconstructions whose nearest neighbour among the sites' "
            "images (normalized cross-correlation) is an attacked image, beside chance. "
            f"Verdict: {doc.get('verdict_rule', '')}."
        )
        + f"<ul>{assumptions}</ul>",
    )
    body = []
    for r in rows:
        caption = (
            f"{r.message}, {r.protection}: true images (top), reconstructions (bottom); PSNR "
            f"{r.scores['psnr_mean']:.2f} dB, SSIM {r.scores['ssim_mean']:.3f} "
            f"(mean image {r.mean_image.get('psnr_mean', float('nan')):.2f} dB, unrelated image "
            f"{r.baseline['psnr_mean']:.2f} dB); re-identified {r.reid.get('rate', float('nan')):.2f} "
            f"(chance {r.reid.get('chance', float('nan')):.2f}): {r.verdict}"
        )
        body.append(
            figure(f"{r.message}-{r.protection}", pair_strip(r.truth, r.reconstructions, r.scores["pairs"]), caption)
        )
        for n in r.notes:
            body.append(note(n))
    page.add("images", "Reconstructions beside the originals", "\n".join(body))
    return page.render(intro)
