"""A finished run's results on disk, written the same way by a simulation and by a deployed server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedseg.evaluation.tables import table3
from fedseg.seams.checkpoint import save_json

__all__ = ["write_results"]


def write_results(results: dict[str, Any], out: str | Path) -> None:
    """Write ``results.json`` and ``results.md`` (Table 3 layout) to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(results, out / "results.json")  # atomic: a reader never sees half a results.json
    md = [f"# {results['method']} — seed {results['seed']}\n", table3([results])]
    priv = results.get("privacy")
    if priv:  # ε per site at δ under privacy.dp (docs/privacy.md)
        eps = ", ".join(f"{s} {v['epsilon']:.3g}" for s, v in priv["sites"].items())
        line = f"\nDifferential privacy ({priv['dp']} level, {priv['accountant']} accountant, δ = {priv['delta']:g}): ε per site: {eps}"
        if priv.get("stopped_after_round") is not None:
            line += f"; training stopped after round {priv['stopped_after_round']} at the budget privacy.epsilon = {priv['epsilon_budget']:g}"
        md.append(line + "\n")
    (out / "results.md").write_text("\n".join(md))
