"""FedSM benchmark: FedSM Tables 3/4 layout on the synthetic fundus (low similarity)
and prostate (high similarity) presets — centralized, local (each site), FedAvg,
FedSM, FedSM-extra — with the selector's routing accuracy on each site's test set,
validation curves (to check each method has plateaued) and bytes per round.

    .venv/bin/python benchmarks/fedsm.py --out runs/bench-fedsm --md runs/bench-fedsm/fedsm.md

Local work is counted in steps (``train.local_steps``) so that tiny sites get as
many optimizer steps per round as large ones.  Defaults are sized for a shared
2-core CPU; the paper's setting is 150 rounds × 1 epoch at 256², 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from _report import emit, unet_overrides

from fedseg.apps.studies.fedsm import load_spec, routing_markdown, run_fedsm
from fedseg.data.synth import synthesize
from fedseg.evaluation.tables import table3
from fedseg.simulation.runner import simulate

BASELINES = ("centralized", "local", "fedavg")
EXTRA_BASELINES = ("fga",)
"""Run only when named in ``--methods``: federated gradient averaging (the third paper), whose global model is
centralized training's on the pooled batches of all sites."""
FEDSM = ("fedsm", "fedsm-extra", "fedsm-ensemble")
ON_TOP = ("fedsm-extra+", "fedsm-ensemble+")
"""``fedsm-extra+`` / ``fedsm-ensemble+``: the selector rounds come *on top of* ``--rounds`` (models train
as many rounds as FedSM's; the paper's "extra" rounds), instead of being the last third of them."""


def late_gain(res: dict) -> float:
    """How much the reported validation score still rose in the last quarter of the run:
    best score over all evaluations minus the best before 3/4 of the rounds.  A method has
    plateaued when this is small (the tables flag > 0.01)."""
    pts = [(int(p.split(":")[0]), float(p.split(":")[1])) for p in curve(res, 1).split()]
    if not pts:
        return float("nan")
    cut = 0.75 * max(r for r, _ in pts)
    early = [v for r, v in pts if r <= cut]
    return max(v for _, v in pts) - (max(early) if early else 0.0)


def curve(res: dict, every: int) -> str:
    """Validation score of the method's candidate(s) per round, every ``every`` rounds."""
    pts = []
    for e in res["history"]:
        vs = e.get("val_score") or {}
        if not vs or e["round"] % every:
            continue
        if res["method"] in ("local",):
            v = sum(vs.values()) / len(vs)
        elif "fedsm" in vs:
            v = vs["fedsm"]
        elif "global" in vs:
            v = vs["global"]
        else:
            v = max(vs.values())
        pts.append(f"{e['round']}:{v:.3f}")
    return " ".join(pts)


def oracle_line(res: dict) -> str:
    """Where the composite's Dice is lost: client-average test Dice of the composite, of the global model
    alone, of perfect routing (each site's images to its own personalized model) and of the better of the
    two per site (an upper bound for any γ with a perfect selector)."""
    rows = {r["name"]: r for r in res.get("rows", [])}
    sites = res["sites"]
    if "global" not in rows or not all(f"personal/{s}" in rows for s in sites):
        return ""
    own = [rows[f"personal/{s}"]["per_site_dice"][s] for s in sites]
    glob = [rows["global"]["per_site_dice"][s] for s in sites]
    comp = [res["per_site_dice"][s] for s in sites]

    def avg(xs):
        return sum(xs) / len(xs)

    val = validation_own_vs_global(res)
    n = len(sites)
    on_val = "—" if val is None else f"{sum(v > 0 for v in val)}/{n}"
    agree = "—" if val is None else f"{sum((v > 0) == (o > g) for v, o, g in zip(val, own, glob))}/{n}"
    return (
        f"| {res.get('label', res['method'])} | {res['seed']} | {avg(comp):.4f} | {avg(glob):.4f} | {avg(own):.4f} | "
        f"{avg([max(a, b) for a, b in zip(own, glob)]):.4f} | {sum(o > g for o, g in zip(own, glob))}/{n} | {on_val} | {agree} |"
    )


def validation_own_vs_global(res: dict) -> list[float] | None:
    """Per site, own personalized model's validation Dice minus the global model's, each at the round the
    composite took it from (its row's ``best_round``; the history's per-site ``val_dice``): what the
    per-model thresholds (``gamma = "auto-per-model"``) choose on.  None where the history lacks them."""
    rows = {r["name"]: r for r in res.get("rows", [])}
    by_round = {e["round"]: e.get("val_dice", {}) for e in res.get("history", []) if e.get("val_dice")}
    out = []
    for s in res["sites"]:
        g = by_round.get(rows["global"].get("best_round"), {}).get("global", {}).get(s)
        p = by_round.get(rows[f"personal/{s}"].get("best_round"), {}).get(f"personal/{s}", {}).get(s)
        if g is None or p is None:
            return None
        out.append(p - g)
    return out


def bytes_per_round(res: dict) -> float:
    """Mean per-site bytes (sent + received) of a training round, from round 2 on (round 1 also carries
    the initial selector to the sites with the ``fga`` selector, a one-time cost)."""
    per = [
        sum(b["sent"] + b["received"] for b in e["bytes"].values()) / max(len(e["bytes"]), 1)
        for e in res["history"]
        if e.get("bytes") and e["round"] > 1
    ]
    return sum(per) / len(per) if per else float("nan")


STUDY_ROWS = (
    (5, "samples", 0.0625, "fedavg"),
    (5, "even", 0.0625, "fedavg"),
    (1, "samples", 0.0625, "fedavg"),
    (1, "even", 0.0625, "fedavg"),
    (1, "even", 0.125, "fedavg"),
    (5, "even", 0.0625, "fga"),
    (5, "even", 0.0625, "fedrs"),
    (5, "even", 0.0625, "fedaws"),
    (1, "even", 0.0625, "fedaws"),
)
"""``--selector-study`` rows: (selector steps per round, selector weighting, width, ``fedsm.selector_training``)."""


def selector_study(
    spec: Path,
    rounds: int,
    configs: list[tuple[int, str, float, str]],
    batch: int,
    report_every: int,
    params: dict | None = None,
    seed: int = 0,
) -> str:
    """Alg. 1's selector part alone (lines 6, 11, 15 + shared Adam moments), with fedseg's own
    functions: routing accuracy (mean over sites, validation) per round for (steps per round,
    selector weighting, width, selector training) configurations.  In FedSM the selector's training does not
    depend on the U-Nets, so this measures exactly how much selector training is needed.

    Trainings (``fedsm.selector_training``): ``fedavg`` — local steps of Eq. 2's cross-entropy, then the
    weighted average of selectors and Adam moments; ``fedrs`` — the same with FedRS's restricted softmax
    (α = ``fedsm.fedrs_alpha``); ``fedaws`` — the same with FedAwS's positive-only loss and the server's
    spread-out step (:mod:`fedseg.algorithms.fedsm.fedaws`); ``fga`` — one selector, one Adam, each step on
    the mean of the sites' batch losses, i.e. the pooled batch's gradient that federated gradient
    averaging's lockstep computes (equal batches; ``tests/runs/test_fedsm_selector_fga.py`` checks the lockstep
    equals this).  ``params``: ``FedSMParams`` overrides (e.g. ``fedaws_nu``); ``seed``: the initial selector's
    and the batches' seed."""
    import torch.nn.functional as F

    from fedseg.algorithms.fedavg import aggregation_weights
    from fedseg.algorithms.fedsm import FedSMParams
    from fedseg.algorithms.fedsm import fedaws as aws
    from fedseg.algorithms.fedsm.selector import restricted_logits
    from fedseg.algorithms.gradients import optimizer_moments, set_optimizer_moments
    from fedseg.algorithms.softpull import routing_accuracy
    from fedseg.execution.federation import load_federation_data
    from fedseg.foundation.arrays import prefixed, strip_prefix, weighted_mean
    from fedseg.foundation.seeding import generator
    from fedseg.models import Selector
    from fedseg.site.batches import batch_of

    fp = FedSMParams(**(params or {}))
    fp.validate()
    fed, data = load_federation_data(spec)
    names = list(data)
    k = len(names)
    lines = [
        "| selector training | steps / round | selector weighting | width | seed | "
        + " | ".join(f"r{r}" for r in range(report_every, rounds + 1, report_every))
        + " | first report ≥ 0.9 |",
        "|" + "---|" * (6 + rounds // report_every),
    ]

    def loss_of(m, x, i: int, training: str):
        if training == "fedaws":
            return aws.selector_positive_loss(m, x, i, fp.fedaws_margin)
        logits = m(x)
        if training == "fedrs":
            logits = restricted_logits(logits, [i], fp.fedrs_alpha)
        return F.cross_entropy(logits, torch.full((x.shape[0],), i))

    for steps, weighting, width, training in configs:
        torch.manual_seed(seed)
        make = lambda: Selector(fed.spatial_dims, fed.in_channels, k, width=width)  # noqa: E731, B023 (called in this iteration)
        state = make().state_dict()
        head = aws.class_head(make(), k)
        models = {s: make() for s in names}
        opts = {s: torch.optim.Adam(models[s].parameters(), lr=1e-3) for s in names}
        moments = None
        p = aggregation_weights([len(data[s].train) for s in names], weighting)
        accs = []
        for r in range(1, rounds + 1):
            if training == "fga":  # one selector (the first site's), one Adam, the pooled batches
                m, opt = models[names[0]], opts[names[0]]
                gens = [generator(seed, i, r, "selector-study") for i in range(k)]
                for _ in range(steps):
                    opt.zero_grad()
                    losses = []
                    for i, s in enumerate(names):
                        x, _ = batch_of(
                            data[s].train, torch.randint(0, len(data[s].train), (batch,), generator=gens[i])
                        )
                        losses.append(loss_of(m, x, i, "fedavg"))
                    torch.stack(losses).mean().backward()
                    opt.step()
                state = {n: v.detach().clone() for n, v in m.state_dict().items()}
            else:
                states, moms = [], []
                for i, s in enumerate(names):
                    m, opt = models[s], opts[s]
                    m.load_state_dict(state)
                    if moments is not None:
                        set_optimizer_moments(opt, m, moments)
                    g = generator(seed, i, r, "selector-study")
                    for _ in range(steps):
                        x, _ = batch_of(data[s].train, torch.randint(0, len(data[s].train), (batch,), generator=g))
                        opt.zero_grad()
                        loss_of(m, x, i, training).backward()
                        opt.step()
                    states.append({n: v.detach().clone() for n, v in m.state_dict().items()})
                    moms.append(optimizer_moments(opt, m))
                state, moments = weighted_mean(states, p), weighted_mean(moms, p)
                if training == "fedaws":
                    averaged = {**prefixed("selector", state), **prefixed("selector_optim", moments)}
                    own = {
                        i: {**prefixed("selector", states[i]), **prefixed("selector_optim", moms[i])} for i in range(k)
                    }
                    averaged.update(aws.server_step(averaged, own, head, fp.fedaws_nu, fp.fedaws_lr))
                    state, moments = strip_prefix("selector", averaged), strip_prefix("selector_optim", averaged)
            if r % report_every == 0:
                ev = make()
                ev.load_state_dict(state)
                with torch.no_grad():
                    a = [
                        routing_accuracy(
                            torch.softmax(ev(batch_of(data[s].val, torch.arange(len(data[s].val)))[0]), 1), i
                        )
                        for i, s in enumerate(names)
                    ]
                accs.append(sum(a) / k)
        first = next(((i + 1) * report_every for i, a in enumerate(accs) if a >= 0.9), None)
        lines.append(
            f"| {training} | {steps} | {weighting} | {width} | {seed} | "
            + " | ".join(f"{a:.2f}" for a in accs)
            + f" | {'never' if first is None else first} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-fedsm")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--presets", default="fundus,prostate")
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the paper's per-site case counts (fundus)")
    ap.add_argument(
        "--prostate-scale", type=float, default=0.03, help="same for prostate (its paper counts are 3.5x larger)"
    )
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=160)
    ap.add_argument("--steps", type=int, default=5, help="local steps per round (train.local_steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--channels", default="8,16,32,64")
    ap.add_argument("--selector-width", type=float, default=0.0625)
    ap.add_argument(
        "--selector-steps", default=None, help="fedsm.selector_steps (an integer or 'all'; default: the profile's)"
    )
    ap.add_argument(
        "--selector-training",
        default=None,
        help="fedsm.selector_training ('fga', 'fedavg', 'fedrs' or 'fedaws'; default: the profile's)",
    )
    ap.add_argument("--profile", default=None, help="fedsm.profile ('default' or 'reference')")
    ap.add_argument("--selector-rounds", type=int, default=None, help="fedsm-extra extra rounds (default rounds/3)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument(
        "--gamma",
        default=None,
        help="fedsm.gamma (a number, 'auto' or 'auto-per-model'; default: the profile's, 'auto-per-model')",
    )
    ap.add_argument("--seeds", default="0")
    ap.add_argument(
        "--methods",
        default=",".join(BASELINES + FEDSM),
        help="subset of " + ",".join(BASELINES + EXTRA_BASELINES + FEDSM + ON_TOP),
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override for every run (e.g. simulation.vectorize=on); repeatable",
    )
    ap.add_argument(
        "--selector-study", action="store_true", help="only the selector-training study (routing accuracy vs rounds)"
    )
    ap.add_argument("--study-rounds", type=int, default=200)
    ap.add_argument(
        "--study-trainings",
        default="fedavg,fga,fedrs,fedaws",
        help="--selector-study: the selector trainings whose rows to run (fedavg, fga, fedrs, fedaws)",
    )
    ap.add_argument(
        "--study-widths",
        default=None,
        help="--selector-study: instead of the study's rows, the fga selector (5 steps, --steps) at each of these "
        "widths, on each of --presets and each of --study-seeds",
    )
    ap.add_argument("--study-seeds", default="0", help="--selector-study --study-widths: seeds")
    ap.add_argument("--study-report-every", type=int, default=None, help="--selector-study: rounds between reports")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chans = [int(c) for c in args.channels.split(",")]
    common = [
        *unet_overrides(chans, args.steps, args.batch, args.eval_every, args.rounds),
        f"fedsm.selector_width={args.selector_width}",
    ]
    for key in ("selector_steps", "selector_training", "profile"):
        if getattr(args, key) is not None:
            common.append(f"fedsm.{key}={getattr(args, key)}")
    if args.gamma is not None:
        common.append(f"fedsm.gamma={args.gamma}")
    common.extend(args.set)
    if args.selector_rounds is not None:
        common.append(f"fedsm.selector_rounds={args.selector_rounds}")
    out = Path(args.out)
    if args.selector_study:
        t0 = time.perf_counter()
        # fedsm.fedrs_alpha / fedsm.fedaws_* from --set
        params = {
            key.removeprefix("fedsm."): float(v)
            for key, v in (o.split("=", 1) for o in args.set)
            if key.startswith(("fedsm.fedaws_", "fedsm.fedrs_"))
        }
        every = args.study_report_every or args.study_rounds // 10
        if args.study_widths:
            configs = [(args.steps, "even", float(w), "fga") for w in args.study_widths.split(",")]
            presets, study_seeds = args.presets.split(","), [int(x) for x in args.study_seeds.split(",")]
        else:
            trainings = args.study_trainings.split(",")
            configs = [row for row in STUDY_ROWS if row[3] in trainings]
            presets, study_seeds = ["fundus"], [0]
        parts = []
        for preset in presets:
            scale = args.scale if preset == "fundus" else args.prostate_scale
            spec = synthesize(preset, out / "data" / preset, seed=0, scale=scale, size=args.size)
            tables = [
                selector_study(spec, args.study_rounds, configs, args.batch, every, params, seed)
                for seed in study_seeds
            ]
            body = tables[0] + "".join(t.split("\n", 2)[2] for t in tables[1:])
            parts.append((f"**{preset}** (scale {scale})\n\n" if args.study_widths else "") + body)
        text = (
            f"Command: `.venv/bin/python benchmarks/fedsm.py {' '.join(__import__('sys').argv[1:])}`\n\n"
            f"Selector-only federated training on {', '.join(presets)} ({args.size} px, batch {args.batch}, Adam lr 1e-3, shared moments; settings {params or 'default'}); "
            f"mean routing accuracy over the 6 sites' validation splits after round r; wall {time.perf_counter() - t0:.0f} s.\n\n"
            + "\n".join(parts)
        )
        emit([text], args.md, out, {"args": vars(args)})
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    known = BASELINES + EXTRA_BASELINES + FEDSM + ON_TOP
    unknown = set(methods) - set(known)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}; choose from {', '.join(known)}")
    t_all = time.perf_counter()
    md = [
        f"Command: `.venv/bin/python benchmarks/fedsm.py {' '.join(__import__('sys').argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host.\n",
    ]
    for preset in args.presets.split(","):
        scale = args.scale if preset == "fundus" else args.prostate_scale
        spec = synthesize(preset, out / "data" / preset, seed=0, scale=scale, size=args.size)
        runs, extras = [], []
        t_preset = time.perf_counter()
        for seed in seeds:
            cfg, workload, data = load_spec(spec, common, seed=seed, rounds=args.rounds, method="fedavg")
            for method in methods:
                run_dir = out / preset / method / f"seed{seed}"
                done = run_dir / "results.json"
                t0 = time.perf_counter()
                rounds, label = args.rounds, None
                if method in ON_TOP:
                    sel = args.selector_rounds or math.ceil(args.rounds / 3)
                    rounds, label = args.rounds + sel, f"{method[:-1]} ({args.rounds} model + {sel} selector rounds)"
                if done.is_file():  # finished earlier (e.g. by a parallel process for other seeds): reuse
                    res = json.loads(done.read_text())
                    if res.get("config", {}).get("rounds") != rounds:
                        raise SystemExit(f"{done} was made with other settings; remove it or use another --out")
                else:
                    c = cfg.__class__(**{**cfg.__dict__, "method": method.rstrip("+"), "rounds": rounds})
                    if method in FEDSM + ON_TOP:
                        if method in ON_TOP:
                            c = c.__class__(
                                **{
                                    **c.__dict__,
                                    "params": {
                                        **c.params,
                                        "fedsm": {**c.params.get("fedsm", {}), "selector_rounds": sel},
                                    },
                                }
                            )
                        res = run_fedsm(c, workload, data, out=run_dir, log=lambda m: None)
                    else:
                        res = simulate(c, workload, data, out=run_dir, progress=False, log=lambda m: None)
                    if label:
                        res["label"] = label
                        done.write_text(json.dumps(res))
                print(
                    f"{preset} {method} seed {seed}: client avg {res['client_avg_dice']:.4f} in {time.perf_counter() - t0:.0f}s",
                    flush=True,
                )
                runs.append(res)
                if method in FEDSM + ON_TOP:
                    extras.append(res)
        sizes = {s: (len(d.train), len(d.val), len(d.test)) for s, d in data.items()}
        md.append(
            f"\n### {preset} ({'low' if preset == 'fundus' else 'high'} similarity) — {args.size}×{args.size} px, scale {scale}, "
            f"{args.rounds} rounds × {args.steps} steps × batch {args.batch}, seeds {seeds}, wall {time.perf_counter() - t_preset:.0f} s\n"
        )
        md.append(f"Sites (train, val, test): {sizes}\n")
        md.append(table3(runs))
        for res in extras:
            md.append(routing_markdown(res))
            rep = res["fedsm"]
            if rep["dice_by_gamma"]:
                md.append(
                    "Test Dice (pooled) of the composite per γ: "
                    + ", ".join(f"γ={float(g):g}: {d:.4f}" for g, d in rep["dice_by_gamma"].items())
                    + "\n"
                )
        by_label: dict[str, list[float]] = {}
        for res in extras:  # test routing accuracy, mean over the sites, one number per seed
            per_site = res["fedsm"]["per_site"].values()
            acc = sum(v["routing_acc"] for v in per_site) / len(per_site)
            by_label.setdefault(res.get("label", res["method"]), []).append(acc)
        for label, accs in by_label.items():
            md.append(
                f"Test routing accuracy of {label} (mean over sites), seeds {seeds}: "
                + " / ".join(f"{x:.2f}" for x in accs)
                + f" (mean {sum(accs) / len(accs):.2f})\n"
            )
        diag = [oracle_line(r) for r in extras]
        if any(diag):
            md.append(
                "\nWhere FedSM's Dice comes from (client-average test Dice; 'own PM' = every site's images sent to its own "
                "personalized model, i.e. a perfect selector with γ = 0; 'best of' = per site the better of own PM and global; "
                "'on validation': the same comparison on the validation cases, each model at the round the composite took it "
                "from — what the per-model thresholds choose on; 'agree': sites where validation and test prefer the same model):\n"
            )
            md.append(
                "| method | seed | composite | global model | own PM (perfect routing) | best of own PM / global | sites where own PM > global "
                "| … on validation | sites where validation and test agree |\n|---|---|---|---|---|---|---|---|---|"
            )
            md.extend(d for d in diag if d)
        md.append("\nValidation curves (round:score of the reported candidate; best-so-far is what is reported):\n")
        every = max(args.eval_every, args.rounds // 10 // args.eval_every * args.eval_every)
        for res in runs:
            gain = late_gain(res)
            flag = "plateaued" if gain <= 0.01 else "**still rising**"
            md.append(
                f"- {res.get('label', res['method'])} (seed {res['seed']}): {curve(res, every)} — last-quarter gain {gain:+.3f} ({flag})"
            )
        md.append(
            "\nRouting accuracy of the selector (mean over sites) on each site's validation split, per round (from history):\n"
        )
        for res in extras:
            pts = []
            for e in res["history"]:
                ra = e.get("routing_acc")
                if ra and e["round"] % every == 0:
                    pts.append(f"{e['round'] - 1}:{sum(ra.values()) / len(ra):.2f}")
            md.append(
                f"- {res.get('label', res['method'])}: "
                + " ".join(pts)
                + "  (round r reports the selector after round r−1)"
            )
        first = [r for r in runs if r["seed"] == seeds[0]]
        fedavg_bytes = next((bytes_per_round(r) for r in first if r["method"] == "fedavg"), None)
        md.append(
            "\nMean bytes per site per training round from round 2 on (sent + received): "
            + ", ".join(
                f"{r.get('label', r['method'])} {bytes_per_round(r) / 1e3:.0f} kB"
                + (f" ({bytes_per_round(r) / fedavg_bytes:.2f}× FedAvg)" if fedavg_bytes else "")
                for r in first
            )
            + "\n"
        )
    md.append(f"\nTotal wall time: {time.perf_counter() - t_all:.0f} s\n")
    emit(md, args.md, out, {"args": vars(args)})


if __name__ == "__main__":
    main()
