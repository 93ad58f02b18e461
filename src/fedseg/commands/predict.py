"""``fedseg predict``: segment new scans with a finished run's model."""

from __future__ import annotations

import argparse

from fedseg.apps.predict import load_predictor, predict_files
from fedseg.apps.predict.run import EXIT_SKIPPED


def cmd_predict(a: argparse.Namespace) -> int:
    loaded = load_predictor(a.run, site=a.site, model=a.model, device=a.device, precision=a.precision, spec=a.spec)
    res = predict_files(
        loaded,
        a.input,
        a.out,
        tta=a.tta,
        postprocess=a.postprocess,
        probabilities=a.probabilities,
        force=a.force,
        strict=a.strict,
        split=a.split,
        nan_to_num=a.nan_to_num,
        progress=not a.quiet,
    )
    return EXIT_SKIPPED if res["skipped"] else 0


def add_predict_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``predict`` verb to the command line's sub-parsers."""
    pr = sub.add_parser(
        "predict",
        help="segment new scans with a finished run's best model, in each scan's own grid",
        epilog=f"exit status: 0 every input written; {EXIT_SKIPPED} some inputs skipped (listed), the others "
        "written; 2 refused (nothing written)",
    )
    pr.add_argument("run", help="output folder of a finished run (or a folder holding exactly one)")
    pr.add_argument(
        "--input", nargs="+", required=True, help="image files, folders (DICOM series folders too) or datalists"
    )
    pr.add_argument("--out", required=True, help="folder for the masks (and routing.csv for FedSM)")
    pr.add_argument("--site", help="the site whose model to use (personalized and local methods)")
    pr.add_argument("--model", choices=["global", "personal", "ensemble"], help="which of the method's models")
    pr.add_argument("--tta", action="store_true", help="test-time mirroring over every spatial axis")
    pr.add_argument("--postprocess", action="store_true", help="keep the largest connected component per label")
    pr.add_argument("--probabilities", action="store_true", help="also write per-label probabilities (float16 .npy)")
    pr.add_argument("--split", help="with a datalist: only this split's images")
    pr.add_argument("--force", action="store_true", help="overwrite masks already in --out")
    pr.add_argument(
        "--strict", action="store_true", help="refuse the whole batch when a file cannot be read (default: skip it)"
    )
    pr.add_argument("--device", help="cpu, cuda, cuda:N (default: the run's)")
    pr.add_argument("--precision", choices=["fp32", "bf16"], help="inference precision (default: the run's)")
    pr.add_argument(
        "--nan-to-num",
        type=float,
        metavar="VALUE",
        help="replace NaN and infinite voxels with VALUE, with a warning (default: refuse such a scan)",
    )
    pr.add_argument("--spec", help="federation spec whose data layout to use (default: the run folder's data.json)")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_predict)
