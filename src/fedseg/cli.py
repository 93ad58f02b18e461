"""``fedseg <verb>``: the dispatcher.  Each verb's parser and command live in its own module of
:mod:`fedseg.commands` (``audit`` in :mod:`fedseg.apps.audit.command`, ``clean`` in
:mod:`fedseg.apps.clean`); this module puts them in one parser and runs the one asked for.

Every import is at the top: the modules it names defer their heavy dependencies (MONAI,
matplotlib, scipy, scikit-learn, TensorBoard, NVFlare) into the functions that use them,
so ``fedseg --help`` and ``fedseg validate`` load none of matplotlib, NVFlare or TensorBoard.
"""

from __future__ import annotations

import argparse
import sys

from fedseg.apps.audit.command import add_audit_parser
from fedseg.apps.clean import add_clean_parser
from fedseg.commands.compare import add_compare_parser
from fedseg.commands.demo import add_demo_parser
from fedseg.commands.deploy import add_deploy_parser
from fedseg.commands.evaluate import add_evaluate_parser
from fedseg.commands.export import add_export_parser
from fedseg.commands.fedsm import add_fedsm_parser
from fedseg.commands.options import device_argument
from fedseg.commands.plan import add_plan_parser
from fedseg.commands.predict import add_predict_parser
from fedseg.commands.prepare import add_prepare_parser
from fedseg.commands.report import add_report_parser
from fedseg.commands.run import add_run_parser
from fedseg.commands.settings import add_settings_parser
from fedseg.commands.sweep import add_sweep_parser
from fedseg.commands.synth import add_synth_parser
from fedseg.commands.validate import add_validate_parser
from fedseg.foundation.errors import FedsegError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedseg", description="Cross-silo federated learning of medical image segmentation."
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (
        add_demo_parser,
        add_synth_parser,
        add_prepare_parser,
        add_validate_parser,
        add_plan_parser,
        add_run_parser,
        add_report_parser,
        add_evaluate_parser,
        add_predict_parser,
        add_export_parser,
        add_compare_parser,
        add_sweep_parser,
        add_fedsm_parser,
        add_deploy_parser,
    ):
        add(sub)
    add_audit_parser(sub, device_argument)
    add_clean_parser(sub)
    add_settings_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FedsegError as e:
        print(f"fedseg {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; continue a run with: fedseg run --resume OUT", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
