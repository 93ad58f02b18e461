"""The six fundus datasets of FedSM's retinal federation (Table 1): readers and preprocessing.

Every reader turns a case into one RGB image and one label of nested values: 0 background,
1 disc rim (disc but not cup), 2 cup, so that ``disc = [1, 2]`` and ``cup = [2]`` give a disc
channel containing the cup channel. The per-dataset steps (docs/datasets.md):

* **Drishti-GS1**: the four experts' soft maps (0..255, the share of experts marking a pixel)
  are thresholded at :data:`DRISHTI_THRESHOLD` (at least half of the experts); a soft map whose
  size differs from its image is resized to it (nearest neighbour).
* **RIGA** (BinRushed, Magrabia, MESSIDOR): each of the six ophthalmologists drew the disc and
  cup outlines on a copy of the image (``imageNprime`` is the original, ``imageN-k`` annotator
  k's copy). :func:`riga_annotation` finds each annotator's outlines as the pixels that differ
  from the original, fills them, and the masks are fused by strict majority of the annotators
  whose outlines could be filled (4 of 6).
* **RIM-ONE r3**: the stereo pair is cut to the half that holds the annotated disc; the
  experts' average masks (0/255) give disc and cup.
* **REFUGE**: one mask per image, 0 = cup, 128 = disc rim, 255 = background.

All but RIM-ONE r3 (already disc-centred) are then cropped to a square around the optic disc
(:func:`crop_to_disc`); images are resized to 256² when loaded (the spec's ``image_size``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fedseg.apps.prepare.base import Case, Dataset, Unit, check_values, files, safe_id
from fedseg.foundation.errors import DataError

#: Drishti-GS1 soft maps: a pixel is disc (cup) where its soft value is >= this (of 255): at least
#: two of the four experts marked it, the threshold most public loaders use.
DRISHTI_THRESHOLD = 128
#: RIGA: a pixel belongs to an annotator's outline where some colour channel differs from the
#: original image by more than this (of 255); JPEG noise stays below it.
OUTLINE_THRESHOLD = 40
#: Side of the square crop around the optic disc, as a share of the image's shorter side
#: (800 px of REFUGE's 2056, the disc ROI of the public fundus segmentation preparations);
#: never less than twice the disc's extent.
CROP_FRACTION = 0.4
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")


def _read_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def _read_grey(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im if im.mode == "L" else im.convert("L"), dtype=np.uint8)


def _resize_nearest(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(mask).resize((shape[1], shape[0]), Image.NEAREST))


def nested_label(disc: np.ndarray, cup: np.ndarray) -> np.ndarray:
    """0 background, 1 disc rim, 2 cup (the cup is taken inside the disc: disc ⊇ cup)."""
    label = np.zeros(disc.shape, np.uint8)
    label[disc | cup] = 1
    label[cup] = 2
    return label


def _same_shape(image: np.ndarray, mask: np.ndarray, path: Path) -> None:
    if image.shape[:2] != mask.shape[:2]:
        raise DataError(
            f"{path}: mask is {mask.shape[1]}x{mask.shape[0]} but its image is {image.shape[1]}x{image.shape[0]} "
            "-> check that the mask belongs to the image"
        )


def crop_to_disc(image: np.ndarray, label: np.ndarray, fraction: float = CROP_FRACTION) -> tuple[np.ndarray, ...]:
    """Crop a square centred on the disc's bounding box: side ``fraction`` × the shorter image side,
    at least twice the disc's larger extent, at most the shorter side; shifted to stay inside."""
    h, w = label.shape
    ys, xs = np.nonzero(label)
    if ys.size == 0:
        raise DataError("the label has no optic disc -> check the mask (an empty annotation cannot be cropped)")
    extent = max(ys.max() - ys.min() + 1, xs.max() - xs.min() + 1)
    side = int(min(min(h, w), max(round(fraction * min(h, w)), 2 * extent)))
    cy, cx = (ys.min() + ys.max() + 1) / 2, (xs.min() + xs.max() + 1) / 2
    top = int(min(max(round(cy - side / 2), 0), h - side))
    left = int(min(max(round(cx - side / 2), 0), w - side))
    return image[top : top + side, left : left + side], label[top : top + side, left : left + side]


# --- Drishti-GS1 -------------------------------------------------------------------------------


def _drishti_discover(root: Path, ds: Dataset) -> list[Case]:
    cases = []
    for part, gt in (("Training", "GT"), ("Test", "Test_GT")):
        images, truth = root / part / "Images", root / part / gt
        for folder in (images, truth):
            if not folder.is_dir():
                raise ds.missing(root, folder)
        for path in files(images, (".png",)):
            soft = truth / path.stem / "SoftMap"
            maps = (soft / f"{path.stem}_ODsegSoftmap.png", soft / f"{path.stem}_cupsegSoftmap.png")
            cases.append(Case(safe_id(path.stem), safe_id(path.stem), (path, *maps)))
    return cases


def _drishti_convert(case: Case) -> list[Unit]:
    image_path, disc_path, cup_path = case.sources
    for p in (disc_path, cup_path):
        if not p.is_file():
            raise DataError(f"{p}: soft map missing -> unpack the ground truth next to the images (docs/datasets.md)")
    image = _read_rgb(image_path)
    masks = []
    for p in (disc_path, cup_path):
        soft = _read_grey(p)
        if soft.shape != image.shape[:2]:
            soft = _resize_nearest(soft, image.shape[:2])
        masks.append(soft >= DRISHTI_THRESHOLD)
    return [("", *crop_to_disc(image, nested_label(*masks)))]


# --- RIGA --------------------------------------------------------------------------------------

_PRIME = re.compile(r"^(image\d+)prime$", re.IGNORECASE)


def _riga_discover(root: Path, ds: Dataset, part: str) -> list[Case]:
    base = root / part
    if not base.is_dir():
        raise ds.missing(root, base)
    cases, listings = [], {}
    for prime in sorted(p for p in base.rglob("*") if p.is_file() and _PRIME.match(p.stem)):
        if prime.suffix.lower() not in IMAGE_SUFFIXES or prime.name.startswith("._"):
            continue
        stem = _PRIME.match(prime.stem).group(1)
        if prime.parent not in listings:  # stem (lower case) -> file, one listing per folder
            listings[prime.parent] = {p.stem.lower(): p for p in reversed(files(prime.parent, IMAGE_SUFFIXES))}
        names = listings[prime.parent]
        annotators = [names[f"{stem}-{k}".lower()] for k in range(1, 7) if f"{stem}-{k}".lower() in names]
        rel = prime.parent.relative_to(base).as_posix()
        case_id = safe_id(f"{rel}_{stem}" if rel != "." else stem)
        cases.append(Case(case_id, case_id, (prime, *annotators)))
    return cases


def riga_annotation(original: np.ndarray, annotated: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """One RIGA annotator's (disc, cup) masks from the outlines drawn on a copy of the image.

    The outlines are the pixels whose colour differs from the original by more than
    :data:`OUTLINE_THRESHOLD`. Filling them (``scipy.ndimage.binary_fill_holes``) and keeping the
    largest region gives the outer disc; inside it, the outlines enclose the rim and the cup, and
    the cup is the enclosed region that lies deepest inside the disc (the largest distance to its
    border). Each outline pixel goes to the region nearest to it (outside, rim or cup), so a
    boundary runs along the middle of its drawn line whatever the line's width (JPEG ringing
    widens it). None where the outlines do not enclose two regions (unclosed or missing).
    """
    from scipy import ndimage

    diff = np.abs(annotated.astype(np.int16) - original.astype(np.int16))
    outline = (diff.max(axis=-1) if diff.ndim == 3 else diff) > OUTLINE_THRESHOLD
    filled = ndimage.binary_fill_holes(outline)
    regions, n = ndimage.label(filled)
    if n == 0:
        return None
    full = regions == (1 + int(np.argmax(ndimage.sum(filled, regions, range(1, n + 1)))))
    inside, m = ndimage.label(full & ~outline)
    if m < 2:
        return None
    deepest = ndimage.maximum(ndimage.distance_transform_edt(full), inside, range(1, m + 1))
    cup_core = inside == 1 + int(np.argmax(deepest))
    rim = (inside > 0) & ~cup_core
    line = full & (inside == 0)
    d_out, d_rim, d_cup = (ndimage.distance_transform_edt(~r) for r in (~full, rim, cup_core))
    disc = full & ~(line & (d_out < np.minimum(d_rim, d_cup)))
    cup = cup_core | (line & (d_cup < np.minimum(d_rim, d_out)))
    return disc, cup


def _riga_convert(case: Case) -> list[Unit]:
    prime, *annotators = case.sources
    image = _read_rgb(prime)
    masks = []
    for path in annotators:
        drawn = _read_rgb(path)
        _same_shape(image, drawn, path)
        found = riga_annotation(image, drawn)
        if found is not None:
            masks.append(found)
    if not masks:
        raise DataError(
            f"{prime}: none of the {len(annotators)} annotator images holds a closed disc and cup outline "
            "-> check that imageN-1..6 are the annotated copies of this image"
        )
    votes = len(masks)
    disc = np.sum([d for d, _ in masks], axis=0) * 2 > votes
    cup = np.sum([c for _, c in masks], axis=0) * 2 > votes
    return [("", *crop_to_disc(image, nested_label(disc, cup)))]


# --- RIM-ONE r3 --------------------------------------------------------------------------------


def _rimone_discover(root: Path, ds: Dataset) -> list[Case]:
    cases = []
    for group in ("Healthy", "Glaucoma and suspects"):
        images, masks = root / group / "Stereo Images", root / group / "Average_masks"
        for folder in (images, masks):
            if not folder.is_dir():
                raise ds.missing(root, folder)
        for path in files(images, (".jpg", ".jpeg", ".png")):
            stem = path.stem
            patient = re.sub(r"-[LR]$", "", stem)
            maps = (masks / f"{stem}-Disc-Avg.png", masks / f"{stem}-Cup-Avg.png")
            cases.append(Case(safe_id(stem), safe_id(patient), (path, *maps)))
    return cases


def _rimone_convert(case: Case) -> list[Unit]:
    image_path, disc_path, cup_path = case.sources
    image = _read_rgb(image_path)
    masks = []
    for p in (disc_path, cup_path):
        if not p.is_file():
            raise DataError(f"{p}: average mask missing -> unpack Average_masks next to Stereo Images")
        m = _read_grey(p)
        check_values(m, (0, 1, 255), p, "0 background, 255 (or 1) foreground")
        masks.append(m > 0)
    disc, cup = masks
    h, w = image.shape[:2]
    half = w // 2
    if disc.shape == (h, w):  # a full-width mask: keep the half holding the disc
        xs = np.nonzero(disc)[1]
        if xs.size == 0:
            raise DataError(f"{disc_path}: empty disc mask -> check the file")
        left = (xs.min() + xs.max()) / 2 < half
        sl = slice(0, half) if left else slice(half, 2 * half)
        return [("", image[:, sl], nested_label(disc[:, sl], cup[:, sl]))]
    if disc.shape == (h, half) and cup.shape == disc.shape:  # a half-width mask: the half its name says
        sl = slice(half, 2 * half) if case.case_id.endswith("R") else slice(0, half)
        return [("", image[:, sl], nested_label(disc, cup))]
    raise DataError(
        f"{disc_path}: mask is {disc.shape[1]}x{disc.shape[0]}, neither the stereo image ({w}x{h}) nor one half "
        "-> check that the mask belongs to the image"
    )


# --- REFUGE ------------------------------------------------------------------------------------

_REFUGE_LAYOUTS = (  # (images, masks): the challenge's archives, or the reorganized train/val release
    (
        ("Training400", "Annotation-Training400/Disc_Cup_Masks"),
        ("REFUGE-Validation400", "REFUGE-Validation400-GT/Disc_Cup_Masks"),
    ),
    (("train/Images", "train/gts"), ("val/Images", "val/gts")),
)


def _refuge_discover(root: Path, ds: Dataset) -> list[Case]:
    for layout in _REFUGE_LAYOUTS:
        if all((root / a).is_dir() and (root / b).is_dir() for a, b in layout):
            break
    else:
        wanted = [root / p for pair in _REFUGE_LAYOUTS[0] for p in pair]
        raise ds.missing(root, next((p for p in wanted if not p.is_dir()), root))
    cases = []
    for images, masks in layout:
        for path in sorted(p for p in (root / images).rglob("*") if p.suffix.lower() in (".jpg", ".png")):
            if path.name.startswith("._"):
                continue
            sub = path.parent.relative_to(root / images)
            mask = root / masks / sub / f"{path.stem}.bmp"
            cases.append(Case(safe_id(path.stem), safe_id(path.stem), (path, mask)))
    return cases


def _refuge_convert(case: Case) -> list[Unit]:
    image_path, mask_path = case.sources
    if not mask_path.is_file():
        raise DataError(f"{mask_path}: mask missing -> unpack the annotation archive (docs/datasets.md)")
    image, mask = _read_rgb(image_path), _read_grey(mask_path)
    _same_shape(image, mask, mask_path)
    check_values(mask, (0, 128, 255), mask_path, "0 cup, 128 disc rim, 255 background")
    return [("", *crop_to_disc(image, nested_label(mask <= 128, mask == 0)))]


# --- the datasets ------------------------------------------------------------------------------

_RIGA = dict(
    folder="RIGA",
    source="https://deepblue.lib.umich.edu/data/concern/data_sets/3b591905z",
    licence="as stated on the Deep Blue page",
    citation="Almazroa et al., Retinal fundus images for glaucoma analysis: the RIGA dataset, SPIE Medical Imaging 2018",
    convert=_riga_convert,
    steps="outlines of 6 annotators (annotated copy minus original) filled, fused by strict majority; "
    "crop around the disc",
)


def _riga(site: str, part: str, title: str, layout: str) -> Dataset:
    def discover(root: Path) -> list[Case]:
        return _riga_discover(root, ds, part)

    ds = Dataset(site=site, title=title, layout=layout, discover=discover, **_RIGA)
    return ds


def _make(site: str, discover, **kw) -> Dataset:
    def bound(root: Path) -> list[Case]:
        return discover(root, ds)

    ds = Dataset(site=site, discover=bound, **kw)
    return ds


DRISHTI = _make(
    "drishti-gs1",
    _drishti_discover,
    title="Drishti-GS1",
    folder="Drishti-GS1_files",
    source="https://cvit.iiit.ac.in/projects/mip/drishti-gs/mip-dataset2/Home.php",
    licence="research use, on request (IIIT Hyderabad's terms)",
    citation="Sivaswamy et al., Drishti-GS: retinal image dataset for optic nerve head segmentation, ISBI 2014",
    layout="Drishti-GS1_files/Training/Images/drishtiGS_NNN.png\n"
    "Drishti-GS1_files/Training/GT/drishtiGS_NNN/SoftMap/drishtiGS_NNN_{ODsegSoftmap,cupsegSoftmap}.png\n"
    "Drishti-GS1_files/Test/Images/drishtiGS_NNN.png\n"
    "Drishti-GS1_files/Test/Test_GT/drishtiGS_NNN/SoftMap/drishtiGS_NNN_{ODsegSoftmap,cupsegSoftmap}.png",
    convert=_drishti_convert,
    steps=f"soft maps >= {DRISHTI_THRESHOLD}/255 (at least 2 of 4 experts); crop around the disc",
)
BINRUSHED = _riga(
    "riga-binrushed",
    "BinRushed",
    "RIGA BinRushed",
    "RIGA/BinRushed/BinRushed{1-Corrected,2,3,4}/imageNprime.jpg + imageN-{1..6}.{jpg,tif}",
)
MAGRABIA = _riga(
    "riga-magrabia",
    "Magrabia",
    "RIGA Magrabia",
    "RIGA/Magrabia/Magrabia/{MagrabiaMale,MagrabiFemale}/imageNprime.tif + imageN-{1..6}.tif",
)
MESSIDOR = _riga("riga-messidor", "MESSIDOR", "RIGA MESSIDOR", "RIGA/MESSIDOR/imageNprime.tif + imageN-{1..6}.tif")
RIMONE = _make(
    "rim-one-r3",
    _rimone_discover,
    title="RIM-ONE r3",
    folder="RIM-ONE r3",
    source="https://github.com/miag-ull/rim-one-dl (the r3 release: medimrg.webs.ull.es)",
    licence="research use, as stated by the authors (MIAG, Universidad de La Laguna)",
    citation="Fumero et al., Interactive tool and database for optic disc and cup segmentation of stereo "
    "and monocular retinal fundus images, WSCG 2015",
    layout="RIM-ONE r3/{Healthy,Glaucoma and suspects}/Stereo Images/{N,G}-K-{L,R}.jpg\n"
    "RIM-ONE r3/{Healthy,Glaucoma and suspects}/Average_masks/{N,G}-K-{L,R}-{Disc,Cup}-Avg.png",
    convert=_rimone_convert,
    steps="stereo pair cut to the annotated half; average masks > 0; no crop (already disc-centred); "
    "patient = name without -L/-R",
)
REFUGE = _make(
    "refuge",
    _refuge_discover,
    title="REFUGE",
    folder="REFUGE",
    source="https://refuge.grand-challenge.org (training and validation sets with their annotations)",
    licence="registration on grand-challenge.org; the challenge's terms",
    citation="Orlando et al., REFUGE Challenge: a unified framework for evaluating automated methods for "
    "glaucoma assessment from fundus photographs, Medical Image Analysis 2020",
    layout="REFUGE/Training400/{Glaucoma,Non-Glaucoma}/{g,n}NNNN.jpg\n"
    "REFUGE/Annotation-Training400/Disc_Cup_Masks/{Glaucoma,Non-Glaucoma}/{g,n}NNNN.bmp\n"
    "REFUGE/REFUGE-Validation400/VNNNN.jpg\n"
    "REFUGE/REFUGE-Validation400-GT/Disc_Cup_Masks/VNNNN.bmp\n"
    "(or REFUGE/{train,val}/Images/*.jpg with REFUGE/{train,val}/gts/*.bmp)",
    convert=_refuge_convert,
    steps="masks 0 cup / 128 rim / 255 background; crop around the disc; training + validation sets (800)",
)
DATASETS = (DRISHTI, BINRUSHED, MAGRABIA, MESSIDOR, RIMONE, REFUGE)
