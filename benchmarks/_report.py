"""Output shared by the benchmark scripts: print the Markdown fragment, write it to ``--md`` and a summary JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(md: list[str], md_path: str | None, out: Path, summary: dict[str, Any]) -> str:
    """Join ``md``, print it, write it to ``md_path`` (if given) and ``summary`` to ``out/summary.json``."""
    text = "\n".join(md)
    print(text)
    if md_path:
        Path(md_path).parent.mkdir(parents=True, exist_ok=True)
        Path(md_path).write_text(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return text


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]
