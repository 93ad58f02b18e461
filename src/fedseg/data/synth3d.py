"""A synthetic multi-site CT federation with real geometry: the ``ct-lesion`` preset.

``synthesize_ct(out)`` writes three sites of abdominal-CT-like volumes as NIfTI files whose
affines carry each site's voxel spacing, orientation and field of view. One anatomy is
defined in physical space (RAS millimetres): a body ellipsoid of soft tissue (40 HU) with a
subcutaneous fat layer (-100 HU) in air (-1000 HU), a spine (cortical rim 700 HU, marrow
250 HU, discs 80 HU), a liver-like organ and a lesion inside it. A volume is that function
sampled on the site's voxel grid (voxel -> world through the affine), averaged over the slice
thickness (partial volume), plus the site's calibration offset and noise, stored as int16 HU.
So the geometry differs per site and the anatomy is the same once each volume is reoriented
to RAS and resampled.

Labels: 0 background, 1 organ not lesion, 2 lesion (the spec maps ``organ = [1, 2]``,
``lesion = [2]``: the lesion channel lies inside the organ channel).

Sizes: ``size`` voxels in-plane (default 64) and the site's slice count times ``size / 64``.
The anatomy and the covered length scale with ``u = size / 64`` (spacings do not), so the
phantom fills the same share of every field of view at any size: about 1/8 of an adult
abdomen at 64, adult-sized at 512 (512 x 512 x 128-384 voxels). Every random draw of case
``i`` of split ``j`` at site ``s`` comes from ``numpy.random.default_rng([seed, s, j, i])``.
The per-site table is :data:`CT_SITES` (documented in docs/data.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fedseg.data.datalist import SPLITS, write_datalist
from fedseg.data.parallel import pool_size, run_jobs
from fedseg.foundation.errors import ConfigError

#: Per-site (train, val, test) cases at ``scale = 1``.
CT_COUNTS = ((8, 3, 3), (12, 4, 4), (6, 3, 3))
CT_LABELS = {"organ": [1, 2], "lesion": [2]}
_FILE_SPLIT = {"training": "train", "validation": "val", "testing": "test"}
_AXES = {"R": (0, 1.0), "L": (0, -1.0), "A": (1, 1.0), "P": (1, -1.0), "S": (2, 1.0), "I": (2, -1.0)}
AIR, FAT, SOFT, MARROW, CORTEX, DISC, METAL = -1000.0, -100.0, 40.0, 250.0, 700.0, 80.0, 3000.0


@dataclass(frozen=True)
class CTSite:
    """Scanner, protocol and population of one synthetic CT site.

    Lengths marked "x u" are millimetres at ``size = 64`` and scale with ``u = size / 64``;
    spacings are millimetres at every size.
    """

    axcodes: str  # direction of each voxel axis (nibabel's aff2axcodes letters), e.g. "RAS", "LPS", "IAL"
    inplane: float  # in-plane voxel spacing, mm
    slice: float  # slice spacing (and thickness), mm
    slices: int  # slices at size 64 (x u)
    fov_center: tuple[float, float, float]  # centre of the voxel grid in RAS mm (x u): table position
    hu_offset: float  # calibration offset added to every voxel, HU
    noise: float  # noise std, HU (in-plane correlated, sigma 0.6 voxel)
    organ_hu: float  # organ attenuation (contrast phase), HU
    lesion_hu: float  # lesion attenuation, HU (+- 5 per case)
    lesion_radius: tuple[float, float]  # lesion radius range, mm (x u)
    implant: bool = False  # two titanium spinal rods (3000 HU) in every case
    outside: int | None = None  # value stored outside the circular reconstruction field (None: no circle)
    intercept: float = 0.0  # NIfTI scl_inter: stored integer = HU - intercept (slope 1)

    @property
    def slice_axis(self) -> int:
        """The voxel axis that runs along the body (S or I): the slice direction."""
        return next(a for a, c in enumerate(self.axcodes) if c in "SI")


CT_SITES = (
    # thin-slice, RAS as dcm2niix writes it, non-contrast organ with a hypodense lesion
    CTSite("RAS", 0.70, 1.0, 48, (0.0, 0.0, 0.0), 0.0, 10.0, 65.0, 20.0, (2.0, 3.0)),
    # LPS (ITK/DICOM order), 3 mm slices, contrast-enhanced organ, +20 HU calibration, spinal rods
    CTSite("LPS", 0.90, 3.0, 20, (0.0, -1.5, 5.0), 20.0, 18.0, 100.0, 55.0, (2.5, 3.5), implant=True),
    # axes permuted and flipped (slice axis first, pointing inferior), 5 mm slices, hyperdense lesion,
    # -2048 outside the reconstruction circle and stored as HU + 1024 with scl_inter = -1024
    CTSite(
        "IAL", 0.74, 5.0, 16, (0.5, 1.0, -5.0), -15.0, 25.0, 60.0, 95.0, (3.0, 4.0), outside=-2048, intercept=-1024.0
    ),
)


@dataclass(frozen=True)
class Anatomy:
    """One patient in RAS millimetres: ellipsoids as (centre, semi-axes, 3x3 rotation to world)."""

    body: tuple[np.ndarray, np.ndarray]  # centre, semi-axes (axis-aligned)
    fat: float  # subcutaneous fat thickness
    spine: tuple[float, float, float]  # x, y of the spinal axis, radius
    disc_phase: float  # z of the first intervertebral disc
    organ: tuple[np.ndarray, np.ndarray, np.ndarray]
    lesion: tuple[np.ndarray, np.ndarray, np.ndarray]
    rods: tuple[tuple[float, float], ...]  # (x, y) of each spinal rod (empty without implant)
    rod_radius: float  # 0.6 + 0.27 u mm: a 5.5 mm rod at size 512, never narrower than a 0.9 mm voxel grid can miss
    u: float  # length unit (size / 64)


def ct_split_sizes(scale: float) -> list[tuple[int, int, int]]:
    """Per-site (train, val, test) cases: :data:`CT_COUNTS` x ``scale``, rounded, at least 2."""
    return [(max(2, round(a * scale)), max(2, round(b * scale)), max(2, round(c * scale))) for a, b, c in CT_COUNTS]


def _rot_z(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random 3D rotation (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    return q if np.linalg.det(q) > 0 else -q


def draw_anatomy(site: CTSite, rng: np.random.Generator, size: int = 64) -> Anatomy:
    """Draw one patient: body size and position, organ, lesion (radius from ``site``), implant."""
    u = size / 64
    bc = np.array([rng.uniform(-0.5, 0.5), rng.uniform(-0.5, 0.5), 0.0]) * u
    bs = np.array([19.0 * rng.uniform(0.92, 1.08), 13.5 * rng.uniform(0.92, 1.08), 150.0]) * u
    fat = rng.uniform(1.2, 2.2) * u
    spine = (float(bc[0]), float(bc[1] - 0.55 * bs[1]), float(0.2 * bs[1]))
    disc_phase = rng.uniform(0.0, 6.0) * u
    oc = bc + np.array([0.3 * bs[0] + rng.uniform(-0.5, 0.5) * u, 0.15 * bs[1] + rng.uniform(-0.5, 0.5) * u, 0.0])
    oc[2] = rng.uniform(-1.0, 1.0) * u
    osemi = np.array([7.0, 5.5, 10.0]) * rng.uniform(0.9, 1.1, 3) * u
    orot = _rot_z(rng.uniform(-0.3, 0.3))
    # lesion centre within 0.45 of the organ's normalized radius, so most of it lies inside the organ
    d = rng.standard_normal(3)
    lc = oc + orot @ (osemi * d / np.linalg.norm(d) * 0.45 * rng.uniform() ** (1 / 3))
    lsemi = rng.uniform(*site.lesion_radius) * rng.uniform(0.8, 1.2, 3) * u
    rods: tuple[tuple[float, float], ...] = ()
    if site.implant:
        sx, sy, sr = spine
        rods = ((sx - 1.2 * sr, sy - 0.9 * sr), (sx + 1.2 * sr, sy - 0.9 * sr))
    organ, lesion = (oc, osemi, orot), (lc, lsemi, _rotation(rng))
    return Anatomy((bc, bs), fat, spine, disc_phase, organ, lesion, rods, 0.6 + 0.27 * u, u)


def _columns_minus(p: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """``p - centre`` for points (N, 3), C-contiguous, one coordinate at a time (the same numbers, fewer loops)."""
    d = np.empty(p.shape)
    for i in range(3):
        np.subtract(p[:, i], centre[i], out=d[:, i])
    return d


def _inside(p: np.ndarray, ellipsoid: tuple[np.ndarray, ...]) -> np.ndarray:
    """Whether each point (N, 3) lies inside the ellipsoid (centre, semi-axes[, rotation]).

    ``sum_i (d_i / semi_i)^2`` goes through :func:`numpy.einsum` over a C-contiguous (N, 3) array, whose
    summation order decides the boundary points (the files' bytes depend on it); the subtraction and the
    division run one coordinate at a time, which gives the same numbers as broadcasting.
    """
    d = _columns_minus(p, ellipsoid[0])
    if len(ellipsoid) == 3:
        d = d @ ellipsoid[2]  # world -> ellipsoid frame (the rotation's columns are its axes)
    q = np.empty(d.shape)
    for i in range(3):
        np.divide(d[:, i], ellipsoid[1][i], out=q[:, i])
    return np.einsum("ni,ni->n", q, q) < 1.0


def _may_meet(p: np.ndarray, ellipsoid: tuple[np.ndarray, ...]) -> bool:
    """False when no point (N, 3) can lie inside the ellipsoid: all are beyond its bounding sphere along z.

    The margin (1e-6 relative) dwarfs rounding, so a False never hides a point :func:`_inside` would accept.
    """
    reach = float(np.max(ellipsoid[1])) * (1.0 + 1e-6) + 1e-9
    z = p[:, 2]
    return bool(z.min() - ellipsoid[0][2] < reach and ellipsoid[0][2] - z.max() < reach)


def labels_at(anat: Anatomy, p: np.ndarray) -> np.ndarray:
    """Label of each world point (N, 3): 0 background, 1 organ, 2 lesion (always inside the organ)."""
    if not _may_meet(p, anat.organ):
        return np.zeros(len(p), np.uint8)
    organ = _inside(p, anat.organ)
    if not _may_meet(p, anat.lesion):
        return organ.astype(np.uint8)
    return (organ.astype(np.uint8) + (organ & _inside(p, anat.lesion))).astype(np.uint8)


def _within(p: np.ndarray, centre: Any, half: Any) -> np.ndarray:
    """Indices of the points (N, 3) within the box ``|p_i - centre_i| < half_i (1 + 1e-6)`` (i < len(half)).

    A shape whose bounding box this is can hold no point outside it, rounding included: the tests below
    run on these points only, and the rest keep what they had.
    """
    keep = np.ones(len(p), bool)
    for i in range(len(half)):
        keep &= np.abs(p[:, i] - centre[i]) < half[i] * (1.0 + 1e-6)
    return np.flatnonzero(keep)


def tissue_at(anat: Anatomy, site: CTSite, p: np.ndarray, lesion_hu: float) -> tuple[np.ndarray, np.ndarray]:
    """Noise-free, uncalibrated attenuation (HU) and label of each world point (N, 3).

    Each structure is tested on the points of its bounding box only (same values as testing every point).
    """
    u = anat.u
    hu = np.full(len(p), AIR)
    bc, bs = anat.body
    box = _within(p, bc, bs)
    pb = p[box]
    hu[box[_inside(pb, anat.body)]] = FAT
    hu[box[_inside(pb, (bc, np.maximum(bs - anat.fat, u)))]] = SOFT
    sx, sy, sr = anat.spine
    box = _within(p, (sx, sy), (sr, sr))  # outside it r >= sr: the spine leaves hu as it is
    r = np.hypot(p[box, 0] - sx, p[box, 1] - sy)
    disc = np.mod(p[box, 2] - anat.disc_phase, 6.0 * u) < 1.0 * u
    hu[box] = np.where(r < sr, np.where(disc, DISC, np.where(r > 0.7 * sr, CORTEX, MARROW)), hu[box])
    lab = labels_at(anat, p)
    hu[lab == 1] = site.organ_hu
    hu[lab == 2] = lesion_hu
    for rx, ry in anat.rods:
        box = _within(p, (rx, ry), (anat.rod_radius, anat.rod_radius))
        hu[box[np.hypot(p[box, 0] - rx, p[box, 1] - ry) < anat.rod_radius]] = METAL
    return hu, lab


def ct_grid(site: CTSite, size: int = 64) -> tuple[tuple[int, int, int], np.ndarray]:
    """The voxel grid of ``site`` at ``size``: its shape and its 4x4 voxel -> RAS mm affine.

    Voxel axis ``a`` points along ``site.axcodes[a]`` with the slice spacing along S/I and the
    in-plane spacing otherwise; the grid's centre lies at ``site.fov_center`` x u.
    """
    u = size / 64
    shape = [0, 0, 0]
    affine = np.zeros((4, 4))
    affine[3, 3] = 1.0
    for a, code in enumerate(site.axcodes):
        world, sign = _AXES[code]
        along = world == 2
        shape[a] = max(1, round(site.slices * u)) if along else size
        affine[world, a] = sign * (site.slice if along else site.inplane)
    centre = (np.array(shape) - 1) / 2
    affine[:3, 3] = np.array(site.fov_center) * u - affine[:3, :3] @ centre
    return (shape[0], shape[1], shape[2]), affine


def _noise_norm(sigma: float) -> float:
    """Std of unit white noise after the in-plane Gaussian filter (to rescale it back to 1)."""
    from scipy.ndimage import gaussian_filter

    delta = np.zeros((33, 33))
    delta[16, 16] = 1.0
    return float(np.sqrt((gaussian_filter(delta, sigma) ** 2).sum()))


def render_ct(anat: Anatomy, site: CTSite, size: int, rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray]:
    """Sample ``anat`` on ``site``'s grid, one slice at a time.

    Returns
    -------
    stored : np.ndarray
        int16, the file's integers (HU - ``site.intercept``).
    label : np.ndarray
        uint8 label at the voxel centres.
    affine : np.ndarray
        4x4 voxel -> RAS mm.
    """
    from scipy.ndimage import gaussian_filter

    shape, affine = ct_grid(site, size)
    ax = site.slice_axis
    plane = [a for a in range(3) if a != ax]
    n_sub = min(5, 2 * int(site.slice / site.inplane / 2) + 1)  # odd, so the middle sample is the centre
    subs = (np.arange(n_sub) + 0.5) / n_sub - 0.5
    lesion_hu = site.lesion_hu + rng.uniform(-5.0, 5.0)
    ii, jj = np.meshgrid(np.arange(shape[plane[0]]), np.arange(shape[plane[1]]), indexing="ij")
    circle = None
    if site.outside is not None:  # the reconstruction circle: in-plane, centred, as wide as the grid
        c0, c1 = (shape[plane[0]] - 1) / 2, (shape[plane[1]] - 1) / 2
        circle = np.hypot(ii - c0, jj - c1) > size / 2
    sigma, norm = 0.6, _noise_norm(0.6)
    stored = np.empty(shape, np.int16)
    label = np.empty(shape, np.uint8)
    vox = np.empty((ii.size, 3))
    vox[:, plane[0]], vox[:, plane[1]] = ii.ravel(), jj.ravel()
    for k in range(shape[ax]):
        hu = np.zeros(ii.shape)
        for m, t in enumerate(subs):
            vox[:, ax] = k + t
            world = vox @ affine[:3, :3].T
            for i in range(3):  # + affine[:3, 3], one coordinate at a time
                world[:, i] += affine[i, 3]
            hu_sub, lab_sub = tissue_at(anat, site, world, lesion_hu)
            hu += hu_sub.reshape(ii.shape) / n_sub
            if m == n_sub // 2:  # the voxel centre
                lab = lab_sub.reshape(ii.shape)
        noise = gaussian_filter(rng.standard_normal(ii.shape), sigma) / norm
        value = np.clip(np.rint(hu + site.hu_offset + site.noise * noise), -1024, 3071)
        if circle is not None:
            value[circle] = site.outside
        index: list[Any] = [slice(None)] * 3
        index[ax] = k
        stored[tuple(index)] = (value - site.intercept).astype(np.int16)
        label[tuple(index)] = lab
    return stored, label, affine


def ct_case(site: CTSite, rng: np.random.Generator, size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw one patient and render it on ``site``'s grid: ``(stored int16, label uint8, affine)``."""
    return render_ct(draw_anatomy(site, rng, size), site, size, rng)


def _save(path: Path, data: np.ndarray, affine: np.ndarray, intercept: float = 0.0) -> None:
    import nibabel as nib

    img = nib.Nifti1Image(data, affine)
    img.set_qform(affine, code=1)  # scanner coordinates
    img.set_sform(affine, code=1)
    img.header.set_xyzt_units("mm")
    if intercept:
        img.header.set_slope_inter(1.0, intercept)
    img.to_filename(path)  # nibabel writes gzip without a time stamp: same bytes for the same arrays


def _spec_toml(n_sites: int) -> str:
    lines = ['name = "ct-lesion-synth"', "", "[data]", 'mode = "3d"', "spatial_dims = 3", "in_channels = 1", ""]
    lines += ["[data.labels]"] + [f"{k} = {json.dumps(v)}" for k, v in CT_LABELS.items()]
    for i in range(n_sites):
        lines += ["", "[[sites]]", f'name = "site{i + 1}"', f'datalist = "site{i + 1}/datalist.json"']
    return "\n".join(lines) + "\n"


#: Estimated serial seconds per voxel of one case (CPU, one thread), to size the pool of processes.
_SECONDS_PER_VOXEL = 1e-7


def _write_case(job: tuple[int, int, int, int, int, str, str]) -> None:
    """Draw case ``i`` of split ``j`` at site ``s`` from its own generator and write its two NIfTI files."""
    s, j, i, seed, size, root, name = job
    site = CT_SITES[s]
    stored, label, affine = ct_case(site, np.random.default_rng([seed, s, j, i]), size)
    _save(Path(root) / "images" / name, stored, affine, site.intercept)
    _save(Path(root) / "labels" / name, label, affine)


def synthesize_ct(
    out: str | Path,
    seed: int = 0,
    scale: float = 1.0,
    size: int = 64,
    progress: bool = False,
    workers: int | None = None,
) -> Path:
    """Write the ``ct-lesion`` federation: three sites of NIfTI CT volumes with their own geometry.

    Parameters
    ----------
    out : str or Path
        Output folder: ``<site>/images/<split>_<i>.nii.gz`` (int16), ``<site>/labels/<split>_<i>.nii.gz``
        (uint8, same affine), ``<site>/datalist.json`` and ``federation.toml``.
    seed : int
        Non-negative; the same seed gives byte-identical files.
    scale : float
        Multiplies :data:`CT_COUNTS` (8/3/3, 12/4/4, 6/3/3 cases); at least 2 per split.
    size : int
        In-plane voxels (>= 16); slices, anatomy and coverage scale with ``size / 64``.
    progress : bool
        Show a tqdm bar; otherwise print nothing.
    workers : int or None
        Processes writing cases in parallel (1: this process only); ``None``: ``min(cores, 8)``, fewer for
        a small federation. The files do not depend on it (each case has its own generator).

    Returns
    -------
    Path
        The spec file ``out/federation.toml`` (``mode = "3d"``, no ``image_size``).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"synth: seed must be a non-negative integer, got {seed!r} -> pass e.g. seed=0")
    if not scale > 0 or size < 16:
        raise ConfigError(
            f"synth ct-lesion: need scale > 0 and size >= 16, got scale={scale}, size={size} "
            "-> pass e.g. scale=1, size=64"
        )
    sizes = ct_split_sizes(scale)
    out = Path(out).expanduser().resolve()
    jobs, datalists, voxels = [], {}, 0
    for s, (site, counts) in enumerate(zip(CT_SITES, sizes)):
        root = out / f"site{s + 1}"
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "labels").mkdir(parents=True, exist_ok=True)
        splits: dict[str, list[dict[str, str | Path]]] = {}
        for j, (split, n) in enumerate(zip(SPLITS, counts)):
            splits[split] = []
            for i in range(n):
                name = f"{_FILE_SPLIT[split]}_{i}.nii.gz"
                jobs.append((s, j, i, int(seed), size, str(root), name))
                splits[split].append({"image": root / "images" / name, "label": root / "labels" / name})
                voxels += int(np.prod(ct_grid(site, size)[0]))
        datalists[root / "datalist.json"] = splits
    n_workers = pool_size(workers, len(jobs), voxels * _SECONDS_PER_VOXEL)
    with tqdm(total=len(jobs), desc="synth ct-lesion", disable=not progress) as bar:
        run_jobs(_write_case, jobs, n_workers, bar.update)
    for path, splits in datalists.items():
        write_datalist(path, splits)
    spec = out / "federation.toml"
    spec.write_text(_spec_toml(len(CT_SITES)), encoding="utf-8")
    return spec
