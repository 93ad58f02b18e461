"""Why the FedSM ensemble's selector collapses: a diagnosis on the frozen models of a finished run.

    .venv/bin/python benchmarks/fedsm_ensemble.py RUN_DIR [RUN_DIR ...] [--split training] [--md out.md]

``RUN_DIR`` is a finished ``fedsm-ensemble`` (or ``fedsm-extra``) run directory (``config.toml``,
``checkpoints/server.safetensors``), e.g. one of ``benchmarks/fedsm.py``'s.  For every image of
the split, with the frozen global model h_0 and personalized models h_1 … h_K of the checkpoint:

* the per-image workload losses L_k = L(h_k, y) and Eq. 1's label argmin_k L_k;
* the paper's ensemble loss (Section 3.1.1) L(Σ_k ŷ_k h_k, y), ŷ = softmax(a): which class its
  gradient pushes up most at the uniform start (a = 0) and at the run's trained selector, and the
  size of that gradient;
* the per-image optimum of the mix loss over the simplex (a optimized per image, Adam), its
  argmax and weight on the global model;
* the mixture-of-experts objective −log Σ_k ŷ_k exp(−(L_k − min L)/τ) (``ensemble_objective =
  "experts"``): its gradient ŷ − posterior at a = 0 for a few τ.

Only numbers computed here are printed; nothing is trained except the per-image mixture weights.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from _report import emit
from safetensors.torch import load_file

from fedseg.algorithms.softpull import ensemble_mix, experts_loss, image_losses
from fedseg.apps.studies.fedsm import load_spec
from fedseg.foundation.arrays import strip_prefix
from fedseg.seams.checkpoint import load_best
from fedseg.site.batches import batch_of, dataset_len


def _frozen(run: Path, workload, sites):
    server = load_file(str(run / "checkpoints" / "server.safetensors"))
    models = []
    for name in ["global", *(f"personal/{s}" for s in sites)]:
        m = workload.build_model()
        m.load_state_dict(strip_prefix(name, server), strict=False)
        models.append(m.eval())
    sel = None
    if any(k.startswith("selector/") for k in server):
        sel = workload.selector(len(sites) + 1, width=_width(run), hidden=_hidden(run))
        sel.load_state_dict(strip_prefix("selector", server))
        sel.eval()
    return models, sel


def _setting(run: Path, key: str, default: float) -> float:
    import tomllib

    fedsm = tomllib.loads((run / "config.toml").read_text()).get("fedsm", {})
    return float(fedsm.get(key, default))


def _width(run: Path) -> float:
    return _setting(run, "selector_width", 0.125)


def _hidden(run: Path) -> int:
    return int(_setting(run, "selector_hidden", 128))


def mix_grad(a: torch.Tensor, outputs: torch.Tensor, y: torch.Tensor, loss) -> torch.Tensor:
    """∂ L(Σ_k softmax(a)_k h_k, y) / ∂a for one image (a: (K+1,), outputs: (K+1, C, ...), y: (1, C, ...))."""
    a = a.clone().requires_grad_(True)
    out = ensemble_mix(torch.softmax(a, 0)[None], list(outputs[:, None]))
    (g,) = torch.autograd.grad(loss(out, y), a)
    return g


def best_mix(outputs: torch.Tensor, y: torch.Tensor, loss, steps: int = 150) -> tuple[torch.Tensor, float]:
    """The per-image minimizer of the mix loss over the simplex (softmax of free logits, Adam lr 0.1, from 0)."""
    a = torch.zeros(outputs.shape[0], requires_grad=True)
    opt = torch.optim.Adam([a], lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        out = ensemble_mix(torch.softmax(a, 0)[None], list(outputs[:, None]))
        v = loss(out, y)
        v.backward()
        opt.step()
    with torch.no_grad():
        w = torch.softmax(a, 0)
        return w, float(loss(ensemble_mix(w[None], list(outputs[:, None])), y))


def diagnose(run: Path, split: str, taus: list[float]) -> str:
    cfg, workload, data = load_spec(run / "config.toml")
    sites = list(data)
    models, sel = _frozen(run, workload, sites)
    loss = workload.loss
    rows = []
    agg = {
        "n": 0,
        "eq1_global": 0,
        "eq1_own": 0,
        "gap": 0.0,
        "push0_global": 0,
        "push0_eq1": 0,
        "gnorm0": 0.0,
        "pushsel_global": 0,
        "pushsel_eq1": 0,
        "gnormsel": 0.0,
        "selw_global": 0.0,
        "opt_global": 0,
        "opt_eq1": 0,
        "optw_global": 0.0,
        "opt_minus_min": 0.0,
        **{f"tau{t}": 0 for t in taus},
    }
    pooled_g = torch.zeros(len(models))
    pooled_l = torch.zeros(len(models), dtype=torch.float64)
    eq1_counts = torch.zeros(len(models), dtype=torch.long)
    for j, s in enumerate(sites):
        ds = data[s].split(split)
        n = dataset_len(ds)
        x, y = batch_of(ds, torch.arange(n))
        with torch.no_grad():
            outs = torch.stack([m(x) for m in models], dim=1)  # (N, K+1, C, ...)
            L = image_losses(list(outs.unbind(1)), y, loss)  # (N, K+1)
            a_sel = sel(x) if sel is not None else None
        eq1 = L.argmin(1)
        pooled_l += L.sum(0)
        eq1_counts += torch.bincount(eq1, minlength=len(models))
        site = {k: 0.0 for k in agg}
        for i in range(n):
            yi = y[i : i + 1]
            site["n"] += 1
            site["eq1_global"] += int(eq1[i] == 0)
            site["eq1_own"] += int(eq1[i] == j + 1)
            site["gap"] += float(L[i, 0] - L[i].min())
            g0 = mix_grad(torch.zeros(len(models)), outs[i], yi, loss)
            pooled_g += g0
            site["push0_global"] += int(g0.argmin() == 0)
            site["push0_eq1"] += int(g0.argmin() == eq1[i])
            site["gnorm0"] += float(g0.abs().max())
            if a_sel is not None:
                gs = mix_grad(a_sel[i].detach(), outs[i], yi, loss)
                site["pushsel_global"] += int(gs.argmin() == 0)
                site["pushsel_eq1"] += int(gs.argmin() == eq1[i])
                site["gnormsel"] += float(gs.abs().max())
                site["selw_global"] += float(torch.softmax(a_sel[i], 0)[0])
            w, v = best_mix(outs[i], yi, loss)
            site["opt_global"] += int(w.argmax() == 0)
            site["opt_eq1"] += int(w.argmax() == eq1[i])
            site["optw_global"] += float(w[0])
            site["opt_minus_min"] += v - float(L[i].min())
            for t in taus:
                # gradient of −log Σ ŷ_k exp(−L_k/τ) at ŷ uniform: ŷ − posterior; the class pushed up most
                post = torch.softmax(-L[i] / t, 0)
                site[f"tau{t}"] += int((1.0 / len(models) - post).argmin() == eq1[i])
        for k in agg:
            agg[k] += site[k]
        m = max(site["n"], 1)
        rows.append(
            f"| {s} | {n} | {site['eq1_global'] / m:.2f} | {site['eq1_own'] / m:.2f} | {site['gap'] / m:.4f} | "
            f"{site['push0_global'] / m:.2f} | {site['gnorm0'] / m:.2e} | "
            + (f"{site['selw_global'] / m:.3f} | {site['gnormsel'] / m:.2e} | " if sel is not None else "– | – | ")
            + f"{site['opt_global'] / m:.2f} | {site['opt_eq1'] / m:.2f} | {site['optw_global'] / m:.2f} | "
            f"{site['opt_minus_min'] / m:+.4f} |"
        )
    n = max(agg["n"], 1)
    head = (
        "| site | images | Eq. 1 = global | Eq. 1 = own PM | L_global − min L | mix grad at ŷ uniform pushes global "
        "| max abs grad (uniform) | trained selector's weight on global | max abs grad (trained) "
        "| per-image optimal mix: argmax global | = Eq. 1 | its weight on global | its loss − min L |\n"
        + "|---" * 13
        + "|"
    )
    total = (
        f"| all | {agg['n']} | {agg['eq1_global'] / n:.2f} | {agg['eq1_own'] / n:.2f} | {agg['gap'] / n:.4f} | "
        f"{agg['push0_global'] / n:.2f} | {agg['gnorm0'] / n:.2e} | "
        + (f"{agg['selw_global'] / n:.3f} | {agg['gnormsel'] / n:.2e} | " if sel is not None else "– | – | ")
        + f"{agg['opt_global'] / n:.2f} | {agg['opt_eq1'] / n:.2f} | {agg['optw_global'] / n:.2f} | "
        f"{agg['opt_minus_min'] / n:+.4f} |"
    )
    extra = (
        f"\nMix gradient at ŷ uniform pushes Eq. 1's class up most on {agg['push0_eq1'] / n:.2f} of the images"
        + (f", at the trained selector on {agg['pushsel_eq1'] / n:.2f}" if sel is not None else "")
        + ". Mixture-of-experts gradient at ŷ uniform pushes Eq. 1's class up most: "
        + ", ".join(f"τ = {t:g}: {agg[f'tau{t}'] / n:.2f}" for t in taus)
        + ".\n"
        + "\nPooled over all images — what the selector's input-independent part (its last bias) follows: mean mix "
        + "gradient at ŷ uniform (negative = pushed up; global first) "
        + ", ".join(f"{v:+.2e}" for v in (pooled_g / n).tolist())
        + "; mean loss per model "
        + ", ".join(f"{v:.4f}" for v in (pooled_l / n).tolist())
        + f" (lowest: model {int(pooled_l.argmin())}, 0 = global); Eq. 1 label counts {eq1_counts.tolist()}.\n"
    )
    return (
        f"Run `{run}` ({cfg.method}, {split} split, {len(sites)} sites, loss {cfg.train.loss}):\n\n{head}\n"
        + "\n".join([*rows, total])
        + "\n"
        + extra
    )


def central(run: Path, objectives: list[str], steps: int, batch: int, lr: float) -> str:
    """Selectors trained centrally (what ``fga`` is) on the pooled training images against the run's frozen
    models, one per objective (``mix``, ``experts:τ``, ``eq1``); each from the same seeded init, on the same
    seeded pooled batches (``batch`` per site per step).  Reported on the validation and test splits:
    agreement of the argmax with Eq. 1's labels, mean weight on the global model, and client-average Dice
    of the mixed output (the ensemble's inference) and of the argmax model (FedSM-extra's)."""
    import torch.nn.functional as F

    _cfg, workload, data = load_spec(run / "config.toml")
    sites = list(data)
    models, _ = _frozen(run, workload, sites)
    loss = workload.loss
    cache = {}
    for s in sites:
        for split in ("training", "validation", "testing"):
            ds = data[s].split(split)
            x, y = batch_of(ds, torch.arange(dataset_len(ds)))
            with torch.no_grad():
                outs = torch.stack([m(x) for m in models], dim=1)
            cache[s, split] = (x, y, outs, image_losses(list(outs.unbind(1)), y, loss))
    lines = [
        "| objective | split | agreement with Eq. 1 | weight on global | Dice of the mix | Dice of the argmax model |",
        "|---|---|---|---|---|---|",
    ]
    for obj in objectives:
        torch.manual_seed(0)
        sel = workload.selector(len(sites) + 1, width=_width(run), hidden=_hidden(run))
        opt = torch.optim.Adam(sel.parameters(), lr=lr)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            idx = {s: torch.randint(0, len(cache[s, "training"][0]), (batch,), generator=g) for s in sites}
            x = torch.cat([cache[s, "training"][0][idx[s]] for s in sites])
            y = torch.cat([cache[s, "training"][1][idx[s]] for s in sites])
            outs = torch.cat([cache[s, "training"][2][idx[s]] for s in sites])
            L = torch.cat([cache[s, "training"][3][idx[s]] for s in sites])
            a = sel(x)
            if obj == "mix":
                v = loss(ensemble_mix(torch.softmax(a, 1), list(outs.unbind(1))), y)
            elif obj == "eq1":
                v = F.cross_entropy(a, L.argmin(1))
            else:
                v = experts_loss(a, L, float(obj.split(":")[1]))
            opt.zero_grad()
            v.backward()
            opt.step()
        sel.eval()
        for split in ("validation", "testing"):
            agree, wg, dmix, darg = [], [], [], []
            for s in sites:
                x, y, outs, L = cache[s, split]
                if not len(x):
                    continue
                with torch.no_grad():
                    w = torch.softmax(sel(x), 1)
                    mix = ensemble_mix(w, list(outs.unbind(1)))
                    pick = outs[torch.arange(len(x)), w.argmax(1)]
                agree.append(float((w.argmax(1) == L.argmin(1)).double().mean()))
                wg.append(float(w[:, 0].mean()))
                dmix.append(float(workload.metric(mix, y).mean(1).mean()))
                darg.append(float(workload.metric(pick, y).mean(1).mean()))
            m = len(agree)
            lines.append(
                f"| {obj} | {split} | {sum(agree) / m:.2f} | {sum(wg) / m:.3f} | {sum(dmix) / m:.4f} | {sum(darg) / m:.4f} |"
            )
    return (
        f"\nSelectors trained centrally against the frozen models of `{run}` ({steps} Adam steps, lr {lr}, "
        f"{batch} images per site per step; means over sites):\n\n" + "\n".join(lines) + "\n"
    )


def composite(run: Path) -> str:
    """The tested composite (``checkpoints/best.safetensors``, ``fedsm/…``: the assembled best models and the
    chosen selector) against the same models with the run's final selector, and both selectors with the
    frozen models they were trained against (``server.safetensors``): client-average test Dice of the mix and
    the mean weight on the global model."""
    import json

    _cfg, workload, data = load_spec(run / "config.toml")
    sites = list(data)
    best = load_best(run / "checkpoints")["fedsm"].candidate.arrays  # (a finished run stores shared tensors once)
    server = load_file(str(run / "checkpoints" / "server.safetensors"))
    meta = json.loads((run / "checkpoints" / "best.json").read_text())["fedsm"]["config"].get("assembled", {})

    def build(name: str, arrays) -> torch.nn.Module:
        m = workload.build_model()
        m.load_state_dict(strip_prefix(name, arrays))
        return m.eval()

    names = ["global", *(f"personal/{s}" for s in sites)]
    sets = {
        "assembled best models": [build(n, best) for n in names],
        "frozen models": [build(n, server) for n in names],
    }
    lines = ["| selector | models | test Dice of the mix | weight on global |", "|---|---|---|---|"]
    for label, arrays in (
        (f"chosen (round {meta.get('selector')})", strip_prefix("selector", best)),
        ("final", strip_prefix("selector", server)),
    ):
        sel = workload.selector(len(sites) + 1, width=_width(run), hidden=_hidden(run))
        sel.load_state_dict(arrays)
        sel.eval()
        for mlabel, models in sets.items():
            dice, wg = [], []
            for s in sites:
                x, y = batch_of(data[s].test, torch.arange(dataset_len(data[s].test)))
                with torch.no_grad():
                    w = torch.softmax(sel(x), 1)
                    dice.append(float(workload.metric(ensemble_mix(w, [m(x) for m in models]), y).mean(1).mean()))
                wg.append(float(w[:, 0].mean()))
            lines.append(f"| {label} | {mlabel} | {sum(dice) / len(dice):.4f} | {sum(wg) / len(wg):.3f} |")
    return f"\nThe tested composite of `{run}` (assembled rounds {meta}):\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--split", default="training")
    ap.add_argument("--taus", default="0.01,0.05,0.2")
    ap.add_argument("--md", default=None)
    ap.add_argument("--out", default="runs/ens-diag", type=Path, help="summary.json goes here")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--central",
        default="",
        help="comma-separated objectives to train a selector centrally on: mix, eq1, experts:<tau> (e.g. experts:0.01)",
    )
    ap.add_argument("--steps", type=int, default=135, help="--central: Adam steps")
    ap.add_argument("--batch", type=int, default=4, help="--central: images per site per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="--central: learning rate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    taus = [float(t) for t in args.taus.split(",")]
    parts = [
        f"Command: `.venv/bin/python benchmarks/fedsm_ensemble.py {' '.join(__import__('sys').argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host.\n",
    ]
    for run in args.runs:
        parts.append(diagnose(run, args.split, taus))
        if (run / "checkpoints" / "best.json").is_file():
            parts.append(composite(run))
        if args.central:
            parts.append(central(run, args.central.split(","), args.steps, args.batch, args.lr))
    parts.append(f"\nwall {time.perf_counter() - t0:.0f} s\n")
    emit(parts, args.md, args.out, {"args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
