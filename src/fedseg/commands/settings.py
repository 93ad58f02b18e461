"""``fedseg settings``: every setting of a run: section, type or allowed values, default, description."""

from __future__ import annotations

import argparse

from fedseg.apps.settings import markdown, table
from fedseg.foundation.errors import ConfigError


def cmd_settings(a: argparse.Namespace) -> int:
    if a.markdown and a.section:
        raise ConfigError("--markdown writes every section; give no SECTION with it")
    print(markdown() if a.markdown else table(a.section), end="")
    return 0


def add_settings_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``settings`` verb to the command line's sub-parsers."""
    st = sub.add_parser(
        "settings", help="every setting of a run: section, type or allowed values, default, description"
    )
    st.add_argument("section", nargs="?", help="one section only (run = the top-level keys, train, fedsm, deploy…)")
    st.add_argument(
        "--markdown", action="store_true", help="print docs/settings.md (fedseg settings --markdown > docs/settings.md)"
    )
    st.set_defaults(func=cmd_settings)
