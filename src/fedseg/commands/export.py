"""``fedseg export``: a run's model as a MONAI bundle, TorchScript or ONNX."""

from __future__ import annotations

import argparse

from fedseg.apps.predict.export import export_run


def cmd_export(a: argparse.Namespace) -> int:
    for path in export_run(a.run, a.format, a.out, site=a.site, model=a.model, force=a.force, spec=a.spec):
        print(f"wrote {path}")
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` verb to the command line's sub-parsers."""
    ex = sub.add_parser("export", help="export a finished run's model: MONAI bundle, TorchScript or ONNX")
    ex.add_argument("run", help="output folder of a finished run (or a folder holding exactly one)")
    ex.add_argument("--format", required=True, choices=["bundle", "torchscript", "onnx"])
    ex.add_argument("--out", required=True, help="folder to write")
    ex.add_argument("--site", help="the site whose model to export (personalized and local methods)")
    ex.add_argument("--model", choices=["global", "personal", "ensemble"], help="which of the method's models")
    ex.add_argument("--force", action="store_true", help="overwrite files already in --out")
    ex.add_argument("--spec", help="federation spec whose data layout to use (default: the run folder's data.json)")
    ex.set_defaults(func=cmd_export)
