"""``fedseg synth``: write a synthetic multi-site federation."""

from __future__ import annotations

import argparse

from fedseg.data.synth import PRESET_NAMES, synthesize


def cmd_synth(a: argparse.Namespace) -> int:
    spec = synthesize(a.preset, a.out, seed=a.seed, scale=a.scale, size=a.size, progress=True, workers=a.workers)
    print(f"wrote {spec}")
    return 0


def add_synth_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``synth`` verb to the command line's sub-parsers."""
    s = sub.add_parser(
        "synth", help="write a synthetic multi-site federation (PNG images or NIfTI volumes + datalists + spec)"
    )
    s.add_argument(
        "--preset",
        choices=list(PRESET_NAMES),
        required=True,
        help="fundus (2D RGB, 6 sites) imitates the federation 'fedseg prepare fedsm-fundus' builds from the public "
        "datasets, prostate (2D grey, 6 sites) imitates 'fedsm-prostate' (sites 1..6 stand for their sites in order; "
        "docs/datasets.md); ct-lesion (3D CT NIfTI, 3 sites with their own spacing, orientation, field of view and "
        "HU calibration)",
    )
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="fraction of the per-site case counts (the paper's; ct-lesion: 8/3/3, 12/4/4, 6/3/3)",
    )
    s.add_argument(
        "--size",
        type=int,
        default=64,
        help="image side in pixels; ct-lesion: in-plane voxels, slices and anatomy scale with size/64 "
        "(512 gives 512x512x128-384 volumes)",
    )
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes writing cases in parallel (default: min(cores, 8), fewer for a small federation; "
        "1: one process); the files are the same bytes for any number",
    )
    s.set_defaults(func=cmd_synth)
