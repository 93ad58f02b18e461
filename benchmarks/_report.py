"""Pieces shared by the benchmark scripts: the small-U-Net overrides, and the output (print the Markdown
fragment, write it to ``--md`` and a summary JSON)."""

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


def unet_overrides(
    channels: list[int], steps: int, batch: int, eval_every: int, rounds: int, lr: float | None = None
) -> list[str]:
    """``--set`` overrides of the benchmarks' small runs: ``steps`` local steps of batch ``batch`` (no epochs),
    a U-Net with ``channels`` (stride 2, one residual unit), validation every ``eval_every`` rounds and one
    checkpoint at the end (``rounds``); ``lr`` when given."""
    out = [f"train.local_steps={steps}", "train.local_epochs=none", f"train.batch_size={batch}"]
    if lr is not None:
        out.append(f"train.lr={lr}")
    return [
        *out,
        f"model.channels={channels}",
        f"model.strides={[2] * (len(channels) - 1)}",
        "model.num_res_units=1",
        f"eval.every={eval_every}",
        f"checkpoint_every={rounds}",
        "checkpoint_keep=final",  # benchmarks/fedsm_ensemble.py reads the last round's server state
    ]
