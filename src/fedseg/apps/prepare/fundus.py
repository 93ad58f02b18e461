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
* **RIM-ONE r3**: the stereo pair is cut to the annotated view: the left half of every pair
  (``-L`` and ``-R`` name the eye, not the view), or the half holding the disc of a full-width
  mask; the experts' average masks (0/255) give disc and cup.
* **REFUGE**: one mask per image, 0 = cup, 128 = disc rim, 255 = background.

All but RIM-ONE r3 (already disc-centred) are then cropped to a square around the optic disc
(:func:`crop_to_disc`); images are resized to 256² when loaded (the spec's ``image_size``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.apps.prepare.base import Case, Dataset, Unit, check_values, files, note, safe_id
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


def _open(path: Path, mode: str | None) -> np.ndarray:
    """The pixels of image ``path`` (converted to ``mode`` unless it is already ``mode`` or None), or one
    DataError naming the file when it is missing, truncated or not an image."""
    from PIL import Image

    if not path.is_file():
        raise DataError(f"{path}: file missing -> unpack the dataset's archives as docs/datasets.md lays out")
    try:
        with Image.open(path) as im:
            im.load()
            return np.asarray(im if mode is None or im.mode == mode else im.convert(mode), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:  # PIL: truncated, corrupt or unknown format
        raise DataError(f"{path}: cannot be read ({e}) -> download or extract the file again") from None


def _read_rgb(path: Path) -> np.ndarray:
    return _open(path, "RGB")


def _read_grey(path: Path) -> np.ndarray:
    return _open(path, "L")


def _resize_nearest(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(mask).resize((shape[1], shape[0]), Image.Resampling.NEAREST))


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


def crop_to_disc(
    image: np.ndarray, label: np.ndarray, fraction: float = CROP_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
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

_RIGA_NAME = re.compile(r"^(image\d+)(prime|-([1-6]))?$", re.IGNORECASE)
#: RIGA's annotators: six ophthalmologists, ``imageN-1`` .. ``imageN-6``.
RIGA_ANNOTATORS = 6


def _riga_base(root: Path, part: str) -> Path | None:
    """``root/part``, or the shallowest folder (three levels at most) named ``part`` or starting with it
    (``BinRushedcorrected/BinRushed``, as one of the archives unpacks), case-insensitively."""
    if (root / part).is_dir():
        return root / part
    for depth in ("*", "*/*", "*/*/*"):
        dirs = sorted(p for p in root.glob(depth) if p.is_dir() and p.name.lower() == part.lower())
        if dirs:
            return dirs[0]
    for depth in ("*", "*/*"):
        dirs = sorted(p for p in root.glob(depth) if p.is_dir() and p.name.lower().startswith(part.lower()))
        if dirs:
            return dirs[0]
    return None


def _riga_discover(root: Path, ds: Dataset, part: str) -> list[Case]:
    base = _riga_base(root, part)
    if base is None:
        raise ds.missing(root, root / part)
    groups: dict[tuple[Path, str], dict] = {}  # (folder, imageN lower case) -> originals and annotators
    for path in sorted(p for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")):
        m = _RIGA_NAME.match(path.stem)
        if m is None or path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        g = groups.setdefault((path.parent, m.group(1).lower()), {"stem": m.group(1), "annotators": {}})
        if m.group(3):
            g["annotators"].setdefault(int(m.group(3)), path)
        else:
            g.setdefault("prime" if m.group(2) else "plain", path)
            if m.group(2):
                g["stem"] = m.group(1)
    cases = []
    for (folder, _), g in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), len(kv[0][1]), kv[0][1])):
        annotators = [g["annotators"][k] for k in sorted(g["annotators"])]
        if not annotators and "prime" not in g:
            continue  # an image without annotations is no case
        rel = folder.relative_to(base).as_posix()
        case_id = safe_id(f"{rel}_{g['stem']}" if rel != "." else g["stem"])
        original = g.get("prime") or g.get("plain")
        info: dict = {}
        if original is None:
            ext = annotators[0].suffix
            original = folder / f"{g['stem']}prime{ext}"
            info["missing"] = f"{original}: the original image (neither {g['stem']}prime nor {g['stem']}) is missing"
        case = Case(case_id, case_id, (original, *annotators), info)
        if "prime" not in g and "plain" in g:
            note(case, f"{original.name}: original named without 'prime'; read as {g['stem']}prime")
        missing = [k for k in range(1, RIGA_ANNOTATORS + 1) if k not in g["annotators"]]
        if annotators and missing:
            names = ", ".join(f"{g['stem']}-{k}" for k in missing)
            note(
                case,
                f"{len(annotators)} of {RIGA_ANNOTATORS} annotators ({names} missing); fused by strict majority of "
                f"the {len(annotators)}",
            )
        cases.append(case)
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
    if "missing" in case.info:
        raise DataError(f"{case.info['missing']} -> unpack it beside its annotated copies")
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
    if disc.shape == (h, half) and cup.shape == disc.shape:  # a half-width mask: the left view, -L and -R alike
        return [("", image[:, :half], nested_label(disc, cup))]
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
        seen = set()
        for path in sorted(p for p in (root / images).rglob("*") if p.suffix.lower() in (".jpg", ".png")):
            if path.name.startswith("._"):
                continue
            sub = path.parent.relative_to(root / images)
            mask = root / masks / sub / f"{path.stem}.bmp"
            seen.add(mask)
            cases.append(Case(safe_id(path.stem), safe_id(path.stem), (path, mask)))
        for mask in sorted(p for p in (root / masks).rglob("*") if p.suffix.lower() == ".bmp"):
            if mask not in seen and not mask.name.startswith("._"):  # a mask whose image is missing: reported
                image = root / images / mask.parent.relative_to(root / masks) / f"{mask.stem}.jpg"
                cases.append(Case(safe_id(mask.stem), safe_id(mask.stem), (image, mask)))
    return sorted(cases, key=lambda c: c.case_id)


def _refuge_convert(case: Case) -> list[Unit]:
    image_path, mask_path = case.sources
    if not image_path.is_file():
        raise DataError(
            f"{image_path}: image missing beside its mask {mask_path.name} -> unpack the images of the "
            "training and validation archives as docs/datasets.md lays out, or remove the mask"
        )
    if not mask_path.is_file():
        raise DataError(f"{mask_path}: mask missing -> unpack the annotation archive (docs/datasets.md)")
    image, mask = _read_rgb(image_path), _read_grey(mask_path)
    _same_shape(image, mask, mask_path)
    check_values(mask, (0, 128, 255), mask_path, "0 cup, 128 disc rim, 255 background")
    return [("", *crop_to_disc(image, nested_label(mask <= 128, mask == 0)))]


# --- the datasets ------------------------------------------------------------------------------

_RIGA: dict[str, Any] = dict(
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
    steps="stereo pair cut to the annotated view (left half; full-width masks: the disc's half); "
    "average masks > 0; no crop (already disc-centred); patient = name without -L/-R",
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
