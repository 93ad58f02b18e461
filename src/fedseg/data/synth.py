"""Synthetic multi-site federations that mimic the FedSM benchmarks.

``synthesize("fundus", out)`` writes a six-site retinal disc/cup federation
with LOW similarity between sites (each site has its own appearance *and* its
own annotation style); ``synthesize("prostate", out)`` writes a six-site
prostate federation with HIGH similarity (sites differ mainly in intensity).
Split sizes follow Tables 1 and 2 of FedSM (Xu et al., CVPR 2022) times
``scale``. Every random draw comes from
``numpy.random.default_rng([seed, site_index, split_index, case_index])``, so
one seed gives byte-identical files. The per-site parameters are the tables
``FUNDUS_SITES`` and ``PROSTATE_SITES`` below (documented in docs/data.md).
``synthesize("ct-lesion", out)`` writes the 3D CT federation of :mod:`fedseg.data.synth3d`.

Each preset imitates a federation ``fedseg prepare`` builds from the public datasets
(docs/datasets.md): ``fundus`` imitates ``fedsm-fundus`` (sites 1..6 stand for its six sites in
its order; the same labels ``disc = [1, 2]``, ``cup = [2]``, RGB), ``prostate`` imitates
``fedsm-prostate`` (``prostate = [1]``, grey slices).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fedseg.data.datalist import SPLITS, write_datalist
from fedseg.data.parallel import pool_size, run_jobs
from fedseg.data.synth3d import ct_split_sizes, synthesize_ct
from fedseg.foundation.errors import ConfigError

#: FedSM Table 1 (retinal): per-site (train, val, test) counts for sites 1..6.
FUNDUS_COUNTS = ((50, 25, 26), (98, 49, 48), (47, 24, 23), (230, 115, 115), (80, 40, 39), (400, 200, 200))
#: FedSM Table 2 (prostate, 2D slices): per-site (train, val, test) counts.
PROSTATE_COUNTS = ((153, 77, 61), (404, 215, 245), (464, 219, 198), (361, 162, 150), (609, 289, 329), (1179, 582, 532))
_FILE_SPLIT = {"training": "train", "validation": "val", "testing": "test"}


@dataclass(frozen=True)
class FundusSite:
    """Appearance and annotation style of one synthetic fundus site.

    Lengths are fractions of the image side; ranges are (low, high) of a
    uniform draw per image.
    """

    tint: tuple[float, float, float]  # retina RGB colour cast
    brightness: float  # multiplicative gain
    contrast: float  # (x - mean) * contrast + mean
    gamma: float  # x ** gamma after contrast
    blur: float  # Gaussian sigma, pixels at 64 px (scales with size)
    noise: float  # Gaussian noise std (0-1 intensity)
    fov_center: tuple[float, float]  # (x, y) of the circular field of view
    fov_radius: float  # > 0.71 means no dark border (disc-centred crop)
    disc_radius: tuple[float, float]  # visible disc radius (horizontal)
    disc_offset: tuple[float, float]  # |horizontal offset| of disc from FOV centre; side random
    cup_ratio: tuple[float, float]  # visible cup radius / disc radius
    disc_boost: float  # how far the disc is blended towards pale yellow
    vessels: tuple[int, int]  # number of vessels (low, high inclusive)
    ann_disc: float  # annotators' disc radius / visible disc radius
    ann_cup: float  # annotators' cup radius / visible cup radius


@dataclass(frozen=True)
class ProstateSite:
    """Intensity profile of one synthetic prostate site (grey MR-like slices)."""

    gain: float  # multiplicative gain
    offset: float  # additive offset
    gamma: float  # x ** gamma
    noise: float  # Gaussian noise std
    blur: float  # Gaussian sigma, pixels at 64 px


# Sites 1..6 loosely after Drishti-GS1, RIGA BinRushed, RIGA Magrabia, RIGA MESSIDOR, RIM-ONE, REFUGE.
FUNDUS_SITES = (
    FundusSite(
        (0.85, 0.42, 0.20),
        1.00,
        1.00,
        1.0,
        0.3,
        0.02,
        (0.50, 0.50),
        0.80,
        (0.14, 0.18),
        (0.00, 0.04),
        (0.45, 0.65),
        0.75,
        (6, 9),
        1.00,
        1.00,
    ),
    FundusSite(
        (0.55, 0.28, 0.22),
        0.85,
        1.20,
        1.1,
        0.6,
        0.03,
        (0.50, 0.50),
        0.46,
        (0.10, 0.12),
        (0.12, 0.18),
        (0.35, 0.55),
        0.60,
        (8, 12),
        1.20,
        1.30,
    ),
    FundusSite(
        (0.80, 0.50, 0.42),
        1.15,
        0.80,
        0.8,
        0.4,
        0.02,
        (0.55, 0.48),
        0.40,
        (0.10, 0.12),
        (0.08, 0.14),
        (0.40, 0.60),
        0.50,
        (6, 10),
        0.88,
        0.85,
    ),
    FundusSite(
        (0.72, 0.30, 0.08),
        1.00,
        1.10,
        1.0,
        0.3,
        0.015,
        (0.50, 0.52),
        0.48,
        (0.09, 0.11),
        (0.18, 0.24),
        (0.35, 0.55),
        0.70,
        (8, 12),
        1.05,
        1.15,
    ),
    FundusSite(
        (0.45, 0.30, 0.32),
        0.80,
        0.85,
        1.2,
        0.7,
        0.035,
        (0.50, 0.50),
        0.90,
        (0.18, 0.24),
        (0.00, 0.06),
        (0.45, 0.70),
        0.45,
        (4, 7),
        1.25,
        1.40,
    ),
    FundusSite(
        (0.62, 0.38, 0.14),
        1.05,
        1.00,
        0.9,
        0.5,
        0.025,
        (0.46, 0.50),
        0.44,
        (0.10, 0.12),
        (0.10, 0.16),
        (0.35, 0.55),
        0.65,
        (6, 10),
        0.95,
        0.90,
    ),
)

# Sites 1..6 loosely after I2CVB, MSD, NCI-ISBI 3T, NCI-ISBI Dx, PROMISE12, ProstateX.
PROSTATE_SITES = (
    ProstateSite(0.80, 0.05, 1.20, 0.03, 0.5),
    ProstateSite(1.00, 0.00, 1.00, 0.04, 0.4),
    ProstateSite(0.90, 0.08, 0.85, 0.03, 0.6),
    ProstateSite(1.10, -0.05, 1.10, 0.05, 0.4),
    ProstateSite(0.70, 0.12, 1.00, 0.06, 0.7),
    ProstateSite(1.00, 0.02, 0.90, 0.03, 0.5),
)

PRESETS = {
    "fundus": (FUNDUS_COUNTS, {"disc": [1, 2], "cup": [2]}, 3),
    "prostate": (PROSTATE_COUNTS, {"prostate": [1]}, 1),
}
#: Every preset ``synthesize`` writes: the 2D ones above and the 3D ``ct-lesion``.
PRESET_NAMES = (*PRESETS, "ct-lesion")


def split_sizes(preset: str, scale: float) -> list[tuple[int, int, int]]:
    """Per-site (train, val, test) sizes: the paper's counts (ct-lesion: its own) x ``scale``, rounded, at least 2."""
    if preset == "ct-lesion":
        return ct_split_sizes(scale)
    if preset not in PRESETS:
        raise ConfigError(f"unknown synthetic preset {preset!r} -> use one of {sorted(PRESET_NAMES)}")
    return [
        (max(2, round(a * scale)), max(2, round(b * scale)), max(2, round(c * scale))) for a, b, c in PRESETS[preset][0]
    ]


@functools.lru_cache(maxsize=4)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates (y, x), each (size, size), in fractions of the side (read-only, shared by cases)."""
    c = (np.arange(size, dtype=np.float64) + 0.5) / size
    y, x = np.meshgrid(c, c, indexing="ij")
    y.flags.writeable = x.flags.writeable = False
    return y, x


def _vessels(y, x, dcy, dcx, dr, theta, kappa, length, width) -> np.ndarray:
    """Vessel darkening (size, size) in [0, 1]: the strongest of K curves leaving the disc centre.

    Curve k's centreline has angle ``theta_k + kappa_k * rho`` at distance ``rho`` from the disc centre,
    ends at ``length_k`` and has the profile ``exp(-(dist / w)^2)``. It is evaluated only where it can
    matter: where ``rho < length_k`` (beyond, its term is 0 exactly) and within 6.7 ``w`` of its centreline
    (a bound from a cheap angle wrap; beyond, the term is below 1e-19 and left at 0). The image is
    multiplied by ``1 - v * c`` with ``c < 1``, which rounds to exactly 1 for any ``v`` below 2^-54, so the
    image is the same bit for bit as with every term evaluated everywhere.
    """
    rho = np.hypot(x - dcx, y - dcy).ravel()
    phi = np.arctan2(y - dcy, x - dcx).ravel()
    v = np.zeros(rho.size)
    for t, kap, ln, wd in zip(theta, kappa, length, width):
        near = np.flatnonzero(rho < ln)
        r, a = rho[near], phi[near]
        a = a - t - kap * r
        w = wd * (1.0 - 0.5 * np.clip(r / ln, 0, 1))
        wrapped = a - np.rint(a * (0.5 / np.pi)) * (2 * np.pi)  # a bound only: the profile uses np.angle's
        band = np.flatnonzero(np.abs(wrapped) * r < 6.7 * w)
        r, a, w, idx = r[band], a[band], w[band], near[band]
        dist = np.abs(np.angle(np.exp(1j * a))) * r
        vk = np.exp(-((dist / w) ** 2)) * np.clip((ln - r) / 0.05, 0, 1) * np.clip(r / (0.5 * dr), 0, 1)
        v[idx] = np.maximum(v[idx], vk)
    return v.reshape(x.shape)


def _soft_inside(e: np.ndarray, radius: float, size: int) -> np.ndarray:
    """Antialiased indicator of ``e < 1`` (e: normalized elliptic radius), ~1 px edge."""
    return np.clip((1.0 - e) * radius * size + 0.5, 0.0, 1.0)


def _ellipse(y, x, cy, cx, ry, rx, angle=0.0):
    """Normalized elliptic radius of every pixel (1 on the boundary)."""
    ca, sa = np.cos(angle), np.sin(angle)
    dx, dy = x - cx, y - cy
    u, v = ca * dx + sa * dy, -sa * dx + ca * dy
    return np.sqrt((u / rx) ** 2 + (v / ry) ** 2)


def _gaussian_filter(image: np.ndarray, sigma: Any, **kwargs: Any) -> np.ndarray:
    """:func:`scipy.ndimage.gaussian_filter`, imported when first used (``fedseg --help`` never loads scipy)."""
    from scipy.ndimage import gaussian_filter as scipy_gaussian_filter

    return scipy_gaussian_filter(image, sigma=sigma, **kwargs)


def _smooth_noise(rng, size: int, sigma_frac: float) -> np.ndarray:
    """Low-frequency noise (size, size), zero mean, unit std."""
    n = _gaussian_filter(rng.standard_normal((size, size)), sigma=max(sigma_frac * size, 0.5), mode="wrap")
    return (n - n.mean()) / (n.std() + 1e-8)


def fundus_case(site: FundusSite, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw one synthetic fundus image and its label.

    Returns
    -------
    image : np.ndarray
        uint8 (size, size, 3) RGB.
    label : np.ndarray
        uint8 (size, size): 0 background, 1 disc-not-cup, 2 cup (as annotated
        by this site: radii scaled by ``ann_disc``/``ann_cup``).
    """
    y, x = _grid(size)
    fx, fy = site.fov_center
    fx, fy = fx + rng.uniform(-0.02, 0.02), fy + rng.uniform(-0.02, 0.02)
    side = rng.choice((-1.0, 1.0))  # left or right eye
    dr = rng.uniform(*site.disc_radius)
    dcx = fx + side * rng.uniform(*site.disc_offset) + rng.uniform(-0.02, 0.02)
    dcy = fy + rng.uniform(-0.04, 0.04)
    aspect = rng.uniform(1.0, 1.15)  # discs are slightly taller than wide
    angle = rng.uniform(-0.2, 0.2)
    cr = rng.uniform(*site.cup_ratio)
    ccx, ccy = dcx + side * rng.uniform(0.0, 0.15) * dr * (1 - cr), dcy  # cup shifted temporally

    tint = np.array(site.tint) * rng.uniform(0.92, 1.08, 3)
    r_fov = np.hypot(x - fx, y - fy) / site.fov_radius
    shade = (1.0 - 0.35 * np.clip(r_fov, 0, 1) ** 2) * (1.0 + 0.08 * _smooth_noise(rng, size, 0.12))
    img = shade[..., None] * tint

    e_disc = _ellipse(y, x, dcy, dcx, dr * aspect, dr, angle)
    e_cup = _ellipse(y, x, ccy, ccx, dr * cr * aspect, dr * cr, angle)
    disc = _soft_inside(e_disc, dr, size)[..., None]
    cup = _soft_inside(e_cup, dr * cr, size)[..., None]
    pale = np.array([1.0, 0.92, 0.62])
    img = img * (1 - disc * site.disc_boost) + disc * site.disc_boost * pale
    img = img * (1 - cup * 0.6) + cup * 0.6 * np.array([1.0, 0.98, 0.9])

    # Vessels: K curves leaving the disc centre, centreline angle theta_k + kappa_k * rho.
    k = rng.integers(site.vessels[0], site.vessels[1] + 1)
    theta = rng.uniform(-np.pi, np.pi, k)
    kappa = rng.uniform(-3.0, 3.0, k)
    length = rng.uniform(0.3, 0.8, k)
    width = rng.uniform(0.010, 0.018, k) * max(1.0, 64 / size) ** 0.5
    img = img * (1 - _vessels(y, x, dcy, dcx, dr, theta, kappa, length, width)[..., None] * np.array([0.35, 0.6, 0.6]))

    img = img * site.brightness
    mean = img.mean()
    img = np.clip((img - mean) * site.contrast + mean, 0, 1) ** site.gamma
    fov = _soft_inside(r_fov, site.fov_radius, size)[..., None]
    img = img * fov + 0.02 * (1 - fov)  # dark outside the field of view
    sigma = site.blur * size / 64
    if sigma > 0:
        img = _gaussian_filter(img, sigma=(sigma, sigma, 0))
    img = img + rng.normal(0.0, site.noise, img.shape)
    image = np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)

    # Annotation: this site's annotators draw the disc and cup with their own scale.
    ld = dr * site.ann_disc
    lc = min(dr * cr * site.ann_cup, 0.85 * ld)
    disc_lab = _ellipse(y, x, dcy, dcx, ld * aspect, ld, angle) < 1
    cup_lab = (_ellipse(y, x, ccy, ccx, lc * aspect, lc, angle) < 1) & disc_lab
    label = disc_lab.astype(np.uint8) + cup_lab.astype(np.uint8)
    return image, label


def prostate_case(site: ProstateSite, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draw one synthetic grey prostate MR-like slice and its label.

    Returns
    -------
    image : np.ndarray
        uint8 (size, size) grey.
    label : np.ndarray
        uint8 (size, size): 0 background, 1 prostate.
    """
    y, x = _grid(size)
    tex = _smooth_noise(rng, size, 0.04)
    bcx, bcy = 0.5 + rng.uniform(-0.02, 0.02), 0.55 + rng.uniform(-0.02, 0.02)
    brx, bry = rng.uniform(0.42, 0.48), rng.uniform(0.32, 0.38)
    e_body = _ellipse(y, x, bcy, bcx, bry, brx)
    body = _soft_inside(e_body, bry, size)
    img = 0.02 + body * (0.40 + 0.05 * tex) + 0.25 * body * np.clip((e_body - 0.8) / 0.2, 0, 1)  # fat rim
    for sx in (-1, 1):  # femoral heads: dark cortex, grey marrow
        hx, hy, hr = bcx + sx * rng.uniform(0.27, 0.32), bcy + rng.uniform(0.0, 0.05), rng.uniform(0.06, 0.08)
        e = _ellipse(y, x, hy, hx, hr, hr)
        img = img * (1 - _soft_inside(e, hr, size)) + _soft_inside(e, hr, size) * (0.12 + 0.4 * (e < 0.75))
    pcx, pcy = bcx + rng.uniform(-0.03, 0.03), bcy + rng.uniform(-0.04, 0.02)
    r0 = rng.uniform(0.06, 0.14)
    if rng.random() < 0.7:  # bladder: bright fluid above the prostate
        blr = rng.uniform(0.06, 0.12)
        e = _ellipse(y, x, pcy - r0 - blr * 0.9, pcx, blr * 0.8, blr * 1.2)
        img = img * (1 - _soft_inside(e, blr, size)) + 0.85 * _soft_inside(e, blr, size)
    e = _ellipse(y, x, pcy + r0 + 0.05, pcx, 0.035, 0.045)  # rectum: dark, below
    img = img * (1 - _soft_inside(e, 0.035, size)) + 0.1 * _soft_inside(e, 0.035, size)

    phi = np.arctan2(y - pcy, x - pcx)
    harm = rng.uniform(-0.08, 0.08, 3)
    phase = rng.uniform(0, 2 * np.pi, 3)
    r_phi = r0 * (1 + sum(h * np.cos((i + 2) * phi + p) for i, (h, p) in enumerate(zip(harm, phase))))
    e_pro = np.hypot(x - pcx, (y - pcy) * 1.15) / r_phi
    pro = _soft_inside(e_pro, r0, size)
    inner = 0.32 + 0.06 * _smooth_noise(rng, size, 0.02) + 0.30 * np.clip((e_pro - 0.6) / 0.4, 0, 1)
    img = img * (1 - pro) + pro * inner

    img = np.clip(img * site.gain + site.offset, 0, 1) ** site.gamma
    sigma = site.blur * size / 64
    if sigma > 0:
        img = _gaussian_filter(img, sigma)
    img = img + rng.normal(0.0, site.noise, img.shape)
    image = np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)
    return image, (e_pro < 1).astype(np.uint8)


def _spec_toml(preset: str, size: int, n_sites: int) -> str:
    _, labels, channels = PRESETS[preset]
    lines = [
        f'name = "{preset}-synth"',
        "",
        "[data]",
        'mode = "2d"',
        "spatial_dims = 2",
        f"in_channels = {channels}",
        f"image_size = [{size}, {size}]",
        "foreground_only = false",
        "",
        "[data.labels]",
    ]
    lines += [f"{k} = {json.dumps(v)}" for k, v in labels.items()]
    for i in range(n_sites):
        lines += ["", "[[sites]]", f'name = "site{i + 1}"', f'datalist = "site{i + 1}/datalist.json"']
    return "\n".join(lines) + "\n"


#: Estimated serial seconds per pixel of one case (CPU, one thread), to size the pool of processes.
_SECONDS_PER_PIXEL = {"fundus": 5e-7, "prostate": 3e-7}


def _write_case(job: tuple[str, int, int, int, int, int, str, str]) -> None:
    """Draw case ``i`` of split ``j`` at site ``s`` from its own generator and write its two PNG files."""
    from PIL import Image  # deferred: only writing the files needs it

    preset, s, j, i, seed, size, root, name = job
    rng = np.random.default_rng([seed, s, j, i])
    if preset == "fundus":
        image, label = fundus_case(FUNDUS_SITES[s], rng, size)
    else:
        image, label = prostate_case(PROSTATE_SITES[s], rng, size)
    Image.fromarray(image).save(Path(root) / "images" / name)
    Image.fromarray(label).save(Path(root) / "labels" / name)


def synthesize(
    preset: str,
    out: str | Path,
    seed: int = 0,
    scale: float = 1.0,
    size: int = 64,
    progress: bool = False,
    workers: int | None = None,
) -> Path:
    """Write a synthetic six-site federation (three-site 3D CT for ``"ct-lesion"``).

    Parameters
    ----------
    preset : {"fundus", "prostate", "ct-lesion"}
        "fundus": RGB disc/cup, low similarity between sites (labels
        disc = [1, 2], cup = [2]). "prostate": grey slices, high similarity
        (label prostate = [1]). "ct-lesion": NIfTI CT volumes with per-site
        geometry (labels organ = [1, 2], lesion = [2]; see
        :func:`fedseg.data.synth3d.synthesize_ct`, where ``size`` is the in-plane voxels).
    out : str or Path
        Output folder. Writes ``<site>/images/<split>_<i>.png``,
        ``<site>/labels/<split>_<i>.png``, ``<site>/datalist.json`` and
        ``federation.toml``; split is train, val or test.
    seed : int
        Non-negative seed; the same seed gives byte-identical files.
    scale : float
        Multiplies FedSM's per-site split sizes (Tables 1 and 2); at least 2 per split.
    size : int
        Image side in pixels (images are size x size).
    progress : bool
        Show a tqdm bar; otherwise print nothing.
    workers : int or None
        Processes writing cases in parallel (1: this process only). ``None``: ``min(cores, 8)``, fewer for
        a small federation (:func:`fedseg.data.parallel.pool_size`). The files do not depend on it: every
        case draws from its own generator, seeded by (seed, site, split, case).

    Returns
    -------
    Path
        The spec file ``out/federation.toml``.
    """
    if preset == "ct-lesion":
        return synthesize_ct(out, seed=seed, scale=scale, size=size, progress=progress, workers=workers)
    sizes = split_sizes(preset, scale)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"synth: seed must be a non-negative integer, got {seed!r} -> pass e.g. seed=0")
    if not scale > 0 or size < 8:
        raise ConfigError(
            f"synth: need scale > 0 and size >= 8, got scale={scale}, size={size} -> pass e.g. scale=0.1, size=64"
        )
    out = Path(out).expanduser().resolve()
    jobs, datalists = [], {}
    for s, counts in enumerate(sizes):
        root = out / f"site{s + 1}"
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "labels").mkdir(parents=True, exist_ok=True)
        splits: dict[str, list[dict[str, str | Path]]] = {}
        for j, (split, n) in enumerate(zip(SPLITS, counts)):
            splits[split] = []
            for i in range(n):
                name = f"{_FILE_SPLIT[split]}_{i}.png"
                jobs.append((preset, s, j, i, int(seed), size, str(root), name))
                splits[split].append({"image": root / "images" / name, "label": root / "labels" / name})
        datalists[root / "datalist.json"] = splits
    n_workers = pool_size(workers, len(jobs), len(jobs) * size * size * _SECONDS_PER_PIXEL[preset])
    with tqdm(total=len(jobs), desc=f"synth {preset}", disable=not progress) as bar:
        run_jobs(_write_case, jobs, n_workers, bar.update)
    for path, splits in datalists.items():
        write_datalist(path, splits)
    spec = out / "federation.toml"
    spec.write_text(_spec_toml(preset, size, len(sizes)), encoding="utf-8")
    return spec
