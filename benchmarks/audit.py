"""Leakage audit benchmark: what a gradient-inversion attack reconstructs from each method's messages on the
synthetic fundus federation, plain, under secure aggregation and under DP.

A synthetic fundus federation (``fedseg synth --preset fundus``, 64² RGB, the default U-Net with instance
norm and FedSM's default selector); the first three sites take part and site 1 is attacked; one image per
batch (the attacker's best case).  Rows: FGA's first step, FedSM's first selector step, FedAvg's update after
one local step and after the configured local work (one epoch, or ``--local-steps``; the steps unrolled),
each observed plain, as the sum over the three sites (secure aggregation), with DP (C = 1, σ = 1:
sample-level for gradients, client-level for updates), both, DP less the noise regenerated from the run seed
(``dp-known-seed``) and by an active server that isolates site 1 under secure aggregation
(``malicious-server``); the attack (Geiping et al. 2020) with ``--iterations`` × ``--restarts``.  With
``--strong`` > 0, stronger attacks on the plain messages, each with ``--strong`` × the iterations: the
selector; FGA's U-Net gradient with all layers, with a 100× stronger total-variation prior, and with the
U-Net's first block only (``model.0.``, the full-resolution convolutions).
Every number is the mean PSNR/SSIM over the reconstructions against the images they were computed from, with
the site's mean image and unrelated images of the same site (its validation cases) as baselines, the top-1
re-identification rate among the sites' images beside chance, and the verdict.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audit.py --out runs/bench-audit --md runs/bench-audit/audit.md
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.algorithms import known_sections
from fedseg.apps.audit import AttackConfig, AuditOptions, run_audit, write_audit
from fedseg.apps.audit.run import budget_line
from fedseg.data.synth import synthesize
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.config import load_run_config
from fedseg.site.workload import workload_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-audit")
    ap.add_argument("--md")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--scale", type=float, default=0.08, help="fraction of the paper's fundus case counts")
    ap.add_argument("--iterations", type=int, default=120, help="attack iterations on the U-Net's messages")
    ap.add_argument("--selector-iterations", type=int, default=300)
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--strong", type=int, default=5, help="iteration multiplier of the stronger attacks (0: none)")
    ap.add_argument("--local-steps", type=int, help="FedAvg's local steps (train.local_steps; default one epoch)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out)
    t0 = time.perf_counter()
    spec = synthesize("fundus", out / "fed", seed=a.seed, scale=a.scale, size=a.size)
    overrides = [] if a.local_steps is None else [f"train.local_steps={a.local_steps}"]
    cfg = load_run_config(spec, overrides, known_sections(), seed=a.seed, device="cpu")
    fed, data = load_federation_data(cfg.federation)
    workload = workload_for(fed, cfg)
    log = print
    base = AttackConfig(iterations=a.iterations, restarts=a.restarts)
    strong = [] if a.strong <= 0 else None
    groups = [
        ("U-Net messages", AuditOptions(messages=("fga", "fedavg-1step", "fedavg-local"), attack=base), None),
        (
            "selector",
            AuditOptions(
                messages=("fedsm-selector",), attack=dataclasses.replace(base, iterations=a.selector_iterations)
            ),
            None,
        ),
        (
            "stronger: selector, more iterations",
            AuditOptions(
                messages=("fedsm-selector",),
                protections=("plain",),
                attack=dataclasses.replace(base, iterations=a.strong * a.selector_iterations),
            ),
            f"{a.strong * a.selector_iterations} iterations",
        ),
        (
            "stronger: U-Net, more iterations",
            AuditOptions(
                messages=("fga",),
                protections=("plain",),
                attack=dataclasses.replace(base, iterations=a.strong * a.iterations),
            ),
            f"{a.strong * a.iterations} iterations",
        ),
        (
            "stronger: U-Net, more iterations and a stronger TV prior",
            AuditOptions(
                messages=("fga",),
                protections=("plain",),
                attack=dataclasses.replace(base, iterations=a.strong * a.iterations, tv=1e-2),
            ),
            f"{a.strong * a.iterations} iterations, TV weight 0.01",
        ),
        (
            "stronger: U-Net first block only",
            AuditOptions(
                messages=("fga",),
                protections=("plain",),
                attack=dataclasses.replace(base, iterations=a.strong * a.iterations, layers=("model.0.",)),
            ),
            f"only model.0.* matched, {a.strong * a.iterations} iterations",
        ),
    ]
    if strong is not None:
        groups = groups[:2]
    all_rows, docs, table_rows = [], [], []
    for title, opts, label in groups:
        print(f"== {title}")
        doc, rows = run_audit(cfg, workload, data, opts, log=log)
        docs.append({"group": title, **doc})
        all_rows += rows
        for r in rows:
            table_rows.append(
                [
                    r.message + (f" ({label})" if label else ""),
                    r.protection,
                    f"{r.scores['psnr_mean']:.2f}",
                    f"{r.scores['ssim_mean']:.3f}",
                    f"{r.mean_image['psnr_mean']:.2f}",
                    f"{r.baseline['psnr_mean']:.2f}",
                    f"{r.reid['rate']:.2f}",
                    f"{r.reid['chance']:.2f}",
                    r.verdict,
                    f"{r.seconds:.0f}",
                ]
            )
    write_audit({**docs[0], "rows": [r.summary() for r in all_rows]}, all_rows, out / "report")
    wall = time.perf_counter() - t0
    md = [
        f"Leakage audit, synthetic fundus {a.size}² (scale {a.scale}), default U-Net (instance norm) and selector, "
        f"sites {', '.join(docs[0]['sites'])} (attacked: {docs[0]['attacked_site']}), 1 image per batch, "
        f"{a.iterations} iterations ({a.selector_iterations} on the selector) × {a.restarts} restart(s); "
        f"DP C = 1, σ = 1; CPU, 1 thread ({platform.processor() or platform.machine()}), {wall:.0f} s in all.",
        f"FedAvg local work: {'one epoch' if a.local_steps is None else f'{a.local_steps} steps'} (unrolled); "
        + budget_line(base)
        + ".",
        "",
        *md_table(
            [
                "message",
                "observed",
                "PSNR (dB)",
                "SSIM",
                "mean image PSNR",
                "unrelated PSNR",
                "re-identified",
                "chance",
                "verdict",
                "attack s",
            ],
            table_rows,
        ),
        "",
        *[
            f"- {r.message}, {r.protection}: {n}"
            for r in all_rows
            for n in r.notes
            if "known weights" in n or "seed" in n or "asked" in n or "refused" in n
        ],
    ]
    emit(md, a.md, out, {"groups": docs, "wall_s": wall})


if __name__ == "__main__":
    main()
