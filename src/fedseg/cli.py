"""``fedseg <verb>``: thin wrappers over library functions (no logic here).

Every import is at the top: the modules it names defer their heavy dependencies (MONAI,
matplotlib, scipy, scikit-learn, TensorBoard, NVFlare) into the functions that use them,
so ``fedseg --help`` and ``fedseg validate`` load none of matplotlib, NVFlare or TensorBoard.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedseg.algorithms import REGISTRY
from fedseg.apps.audit.command import add_audit_parser
from fedseg.apps.clean import add_clean_parser
from fedseg.apps.deploy import run as dep
from fedseg.apps.deploy.site import read_site_config
from fedseg.apps.predict import load_predictor, predict_files
from fedseg.apps.predict.export import export_run
from fedseg.apps.predict.run import EXIT_SKIPPED
from fedseg.apps.prepare import FEDERATIONS, list_text, prepare
from fedseg.apps.report import ReportOptions, build_report
from fedseg.apps.report.tensorboard import TensorBoardLogger
from fedseg.apps.settings import markdown, table
from fedseg.apps.studies.compare import compare, demo, evaluate_run, split_method_entries
from fedseg.apps.studies.fedsm import sweep, unseen
from fedseg.apps.studies.fedsm_seeds import over_seeds, tabulate
from fedseg.apps.studies.grid import sweep as grid_sweep
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.apps.studies.launchers import LAUNCHERS, LaunchOptions
from fedseg.apps.tracking import LiveRun, tracker_for
from fedseg.data.spec import load_federation
from fedseg.data.synth import PRESET_NAMES, synthesize
from fedseg.data.validate import raise_if_invalid, validate_federation
from fedseg.data.volumes.budget import CPU_STEP_SECONDS, device_budget
from fedseg.data.volumes.load import plan_federation, plan_path
from fedseg.data.volumes.plan import describe_budget, save_plan
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import ConfigError, FedsegError
from fedseg.simulation.runner import run


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_demo(a: argparse.Namespace) -> int:
    table, report = demo(out=a.out, rounds=a.rounds, scale=a.scale, size=a.size, seed=a.seed, overrides=a.set)
    print("\n" + table)
    print(f"results, resolved configs and checkpoints: {Path(a.out).resolve()}")
    print(f"HTML report: {Path(report).resolve()}")
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    spec = synthesize(a.preset, a.out, seed=a.seed, scale=a.scale, size=a.size, progress=True, workers=a.workers)
    print(f"wrote {spec}")
    return 0


def cmd_prepare(a: argparse.Namespace) -> int:
    if a.list:
        print(list_text())
        return 0
    if not (a.name and a.raw and a.out):
        raise ConfigError(
            "give a federation, --raw and --out (e.g. fedseg prepare fedsm-fundus --raw DIR --out DIR), or --list"
        )
    summary = prepare(
        a.name, a.raw, a.out, force=a.force, strict=a.strict, seed=a.seed, sites=_csv(a.sites) if a.sites else None
    )
    print("\n" + summary.table())
    print(f"\nwrote {summary.spec}; check it with: fedseg validate {summary.spec}")
    return 0


def cmd_validate(a: argparse.Namespace) -> int:
    problems = validate_federation(a.spec)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) in {a.spec}; a run refuses to start until they are fixed")
        return 1
    print(f"{a.spec}: OK")
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    raise_if_invalid(a.spec)
    fed = load_federation(a.spec)
    if not fed.volumes:
        raise FedsegError(
            f'{a.spec}: data.mode = "{fed.mode}"; a plan is made for volumes (mode = "3d" or "patches2d")'
        )
    budget = device_budget(a.device, gpu_memory=a.gpu_memory, batch=a.batch_size, step_seconds=a.step_seconds)
    plan = plan_federation(fed, patch_voxels=a.patch_voxels, weighting=a.weighting, budget=budget)
    path = plan_path(fed)
    save_plan(plan, path)
    print(json.dumps(plan.to_json(), indent=2))
    print(describe_budget(plan))
    print(f"wrote {path} (edit any field to override it; runs on this federation read it)")
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    if a.resume is None and a.config is None:
        raise FedsegError("give a run config or federation spec, or --resume OUT to continue a run")
    out = a.resume or a.out
    tracker = tracker_for(a.track, out, a.config or Path(out) / "config.toml", a.set)
    logger = None
    if getattr(a, "tensorboard", False):
        logger = TensorBoardLogger(a.tensorboard_dir or Path(out) / "tensorboard")
        print(f"TensorBoard scalars: {logger.logdir.resolve()} (view with: tensorboard --logdir {logger.logdir})")
    live = LiveRun(tracker.target(), out) if tracker is not None else None  # each round as it ends
    hooks = [h for h in (logger, live) if h is not None]

    def on_round(entry: dict) -> None:
        for h in hooks:
            h(entry)

    try:
        res = run(
            a.config,
            out=out,
            overrides=a.set,
            resume=a.resume is not None,
            method=a.method,
            rounds=a.rounds,
            seed=a.seed,
            device=a.device,
            on_round=on_round if hooks else None,
        )
    finally:
        if logger is not None:
            logger.close()
    print(Path(out, "results.md").read_text())
    print(f"results: {Path(out).resolve() / 'results.json'}")
    if logger is not None:
        print(f"tensorboard: tensorboard --logdir {logger.logdir.resolve()}")
    if tracker is not None and res is not None:
        print(f"MLflow run {tracker.log_run(out)} in {tracker.uri}")
    return 0 if res is not None else 1


def cmd_report(a: argparse.Namespace) -> int:
    opts = ReportOptions(
        models=not a.no_models,
        loss_site=a.loss_site,
        directions=a.directions,
        steps=a.steps,
        radius=a.radius,
        normalize=a.normalize,
        loss_cases=a.loss_cases,
        cases=a.cases,
        tsne_cases=a.tsne_cases,
        seed=a.seed,
    )
    path = build_report(a.runs, a.html, opts, title=a.title)
    print(f"report: {path.resolve()} ({path.stat().st_size / 1e6:.1f} MB, self-contained: open it in any browser)")
    return 0


def cmd_evaluate(a: argparse.Namespace) -> int:
    res = evaluate_run(a.run, federation=a.spec, split=a.split)
    print(res["table"])
    return 0


def cmd_predict(a: argparse.Namespace) -> int:
    loaded = load_predictor(a.run, site=a.site, model=a.model, device=a.device, precision=a.precision, spec=a.spec)
    res = predict_files(
        loaded,
        a.input,
        a.out,
        tta=a.tta,
        postprocess=a.postprocess,
        probabilities=a.probabilities,
        force=a.force,
        strict=a.strict,
        split=a.split,
        nan_to_num=a.nan_to_num,
        progress=not a.quiet,
    )
    return EXIT_SKIPPED if res["skipped"] else 0


def cmd_export(a: argparse.Namespace) -> int:
    for path in export_run(a.run, a.format, a.out, site=a.site, model=a.model, force=a.force, spec=a.spec):
        print(f"wrote {path}")
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    overrides = a.set + ([f"device={a.device}"] if a.device else [])
    _, table = compare(a.config, split_method_entries(a.methods), a.out, _study_options(a, overrides), tune=a.tune)
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / 'comparison.md'}")
    if a.tune:
        print(f"tuning record: {Path(a.out).resolve() / 'tuning.json'}; report: fedseg report {a.out}")
    return 0


def _study_options(a: argparse.Namespace, overrides: list[str]) -> StudyOptions:
    return StudyOptions(
        seeds=tuple(int(s) for s in _csv(a.seeds)),
        rounds=a.rounds,
        overrides=tuple(overrides),
        jobs=a.jobs,
        devices=tuple(_csv(a.devices)) if a.devices else None,
        track=a.track,
        track_uri=a.track_uri,
        launch=_launch_options(a),
    )


def _launch_options(a: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(
        launcher=a.launcher,
        cpus_per_run=a.cpus_per_run,
        gpus_per_run=a.gpus_per_run,
        ray_address=a.ray_address,
        slurm_partition=a.slurm_partition,
        slurm_time=a.slurm_time,
        slurm_folder=a.slurm_folder,
        slurm_parallelism=a.slurm_parallelism,
    )


def cmd_sweep(a: argparse.Namespace) -> int:
    overrides = a.set + ([f"device={a.device}"] if a.device else [])
    _, table = grid_sweep(a.config, a.method, a.grid, a.out, _study_options(a, overrides))
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / 'sweep.md'}, figure: {Path(a.out).resolve() / 'sweep.png'}")
    return 0


def cmd_fedsm(a: argparse.Namespace) -> int:
    if a.fedsm_verb == "table":
        _, table = tabulate(a.folders, a.md)
        print("\n" + table)
        if a.md:
            print(f"table: {Path(a.md).resolve()}")
        return 0
    gammas = [float(g) for g in _csv(a.gamma)] if a.gamma else None
    fields = {k: v for k, v in (("rounds", a.rounds), ("seed", a.seed)) if v is not None}
    if a.fedsm_verb == "unseen":
        kwargs: dict = {"sites": _csv(a.sites) if a.sites else None}
        name = "unseen.md"
    else:
        kwargs = {"lams": [float(x) for x in _csv(a.lam)]}
        name = "sweep.md"
    kwargs.update(overrides=a.set, gammas=gammas, progress=True)
    devices = tuple(_csv(a.devices)) if a.devices else None
    if a.seeds:
        if a.seed is not None:
            raise ConfigError("give --seed (one run) or --seeds (one run per seed), not both")
        fields.pop("seed", None)
        seeds = [int(s) for s in _csv(a.seeds)]
        launch = _launch_options(a)
        _, table = over_seeds(
            a.fedsm_verb, a.config, a.out, seeds, jobs=a.jobs, devices=devices, launch=launch, **kwargs, **fields
        )
    else:
        study = unseen if a.fedsm_verb == "unseen" else sweep
        _, table = study(a.config, a.out, jobs=a.jobs, devices=devices, launch=_launch_options(a), **kwargs, **fields)
    print("\n" + table)
    print(f"table: {Path(a.out).resolve() / name}")
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    if a.deploy_verb == "provision":
        kits = dep.provision(_csv(a.sites), a.server, a.out)
        for name, path in kits.items():
            print(f"{name}: {path}")
        print(
            "give each site its own kit folder (it holds that site's private key); keep 'admin' with the run submitter"
        )
        return 0
    if a.deploy_verb == "site":
        cfg = dep.configure_site(a.kit, a.datalist, a.workdir, a.name, device=a.device, policy=a.policy)
        print(f"site policy: {read_site_config(cfg).policy} (edit it to change what this site accepts)")
        print(f"wrote {cfg}; starting the site (it connects out to the server; Ctrl-C stops it)")
        return dep.foreground(dep.start_site(a.kit, log=Path(a.workdir) / "fedseg-site.log"))
    if a.deploy_verb == "roster":
        for line in dep.show_roster(a.kit):
            print(line)
        print(
            "compare these lines with every other site's over another channel (phone, signed mail): they must be equal"
        )
        return 0
    if a.deploy_verb == "server":
        print("starting the server (sites connect to it; Ctrl-C stops it)")
        return dep.foreground(dep.start_server(a.kit))
    out = (a.resume or a.out) if a.deploy_verb == "run" else a.out
    tracker = tracker_for(a.track, out, a.config or Path(out) / "config.toml", a.set)
    if a.deploy_verb == "run":
        res = dep.deploy_run(
            a.config,
            a.kits,
            out,
            overrides=a.set,
            resume=a.resume is not None,
            progress=True,
            method=a.method,
            rounds=a.rounds,
            seed=a.seed,
        )
    else:
        res = dep.rehearse(
            a.config, a.sites, out, overrides=a.set, progress=True, method=a.method, rounds=a.rounds, seed=a.seed
        )
    if res is None:
        print(
            f"the run did not finish; see {Path(out).resolve()} and resume with: fedseg deploy run --kits KITS --resume {out}"
        )
        return 1
    print(Path(out, "results.md").read_text())
    print(f"results: {Path(out).resolve() / 'results.json'}")
    if tracker is not None:  # the server's results, checkpoints and config, logged where the run was submitted
        print(f"MLflow run {tracker.log_run(out)} in {tracker.uri}")
    return 0


def cmd_settings(a: argparse.Namespace) -> int:
    if a.markdown and a.section:
        raise ConfigError("--markdown writes every section; give no SECTION with it")
    print(markdown() if a.markdown else table(a.section), end="")
    return 0


def _device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        metavar="DEVICE",
        help="auto (the config's default: CUDA when available, else cpu), cpu, cuda or cuda:N (same as --set device=...); "
        "mixed precision: --set train.precision=bf16 or fp16 (default fp32). The device and precision used are "
        "printed at the start and recorded in results.json and config.toml",
    )


def _track_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track",
        choices=["mlflow", "off"],
        help="log runs to MLflow (parameters, per-round metrics, results, best checkpoints; a compare or sweep "
        "nests its runs under one parent run): a SQLite store OUT/mlflow.db, or MLFLOW_TRACKING_URI when set; "
        "default: the config's [tracking] section (off)",
    )


def _jobs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="independent runs in N processes with one torch thread each (1: one after another; the same "
        "results either way)",
    )
    p.add_argument(
        "--devices",
        metavar="D1,D2",
        help="one process per device, e.g. cuda:0,cuda:1 (or cpu,cpu); each run on its process's device, the "
        "same results as one after another. Default (neither --jobs nor --devices): every visible CUDA device "
        "where there are several, else one run after another",
    )


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the runs run (docs/studies.md)")
    g.add_argument(
        "--launcher",
        choices=list(LAUNCHERS),
        default="local",
        help="local: this machine (--jobs, --devices; default); ray: one Ray task per run (a local cluster, or "
        "--ray-address); slurm: one Slurm array task per run (submitit). The same results whichever runs them; "
        "OUT must be a folder every worker sees; run the command again to keep finished runs and resume the rest",
    )
    g.add_argument(
        "--cpus-per-run",
        type=int,
        default=1,
        metavar="N",
        help="ray/slurm: CPUs (and torch threads) per run (default 1)",
    )
    g.add_argument(
        "--gpus-per-run",
        type=float,
        default=0.0,
        metavar="G",
        help="ray/slurm: GPUs per run (default 0; Ray takes fractions)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="ray: a running cluster (head:6379 or ray://head:10001); default: a local one",
    )
    g.add_argument("--slurm-partition", metavar="NAME", help="slurm: the partition the runs go to")
    g.add_argument(
        "--slurm-time", type=int, default=60, metavar="MIN", help="slurm: minutes a run may take (default 60)"
    )
    g.add_argument("--slurm-folder", metavar="DIR", help="slurm: submitit's job files and logs (default: OUT/slurm)")
    g.add_argument("--slurm-parallelism", type=int, metavar="N", help="slurm: most array tasks running at once")


def _track_uri_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track-uri",
        metavar="URI",
        help="MLflow tracking store every run logs to as it goes (e.g. http://host:5000, one the workers reach); "
        "turns --track mlflow on; default: the config's tracking.uri, MLFLOW_TRACKING_URI, else OUT/mlflow.db",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedseg", description="Cross-silo federated learning of medical image segmentation."
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    d = sub.add_parser(
        "demo",
        help="synthesize a small federation, train local/centralized/FedAvg/FedSM, print a Dice table, write an HTML report",
    )
    d.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    d.add_argument("--rounds", type=int, default=40)
    d.add_argument("--scale", type=float, default=0.15, help="fraction of the paper's Table 1 case counts")
    d.add_argument("--size", type=int, default=64, help="image side in pixels")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of every run, after the demo's own (repeatable); --set train.lr=1e-3: the papers' learning "
        "rate instead of the demo's 1e-2",
    )
    d.set_defaults(func=cmd_demo)

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

    pr = sub.add_parser(
        "prepare",
        help="turn the papers' public datasets, as downloaded, into a federation (spec, datalists, PNG files)",
        description="Build a paper's federation from the archives unpacked under --raw in their expected layouts "
        "(docs/datasets.md; fedseg prepare --list says what each needs). Splits by patient; a second run skips "
        "the cases already converted; --raw is only read.",
    )
    pr.add_argument("name", nargs="?", choices=sorted(FEDERATIONS), help="the federation to build")
    pr.add_argument("--list", action="store_true", help="what each federation needs, where to get it, its licence")
    pr.add_argument("--raw", help="folder holding the downloaded datasets (only read)")
    pr.add_argument("--out", help="output folder: federation.toml, <site>/datalist.json, images, labels")
    pr.add_argument("--force", action="store_true", help="convert every case again")
    pr.add_argument("--strict", action="store_true", help="stop at the first bad case instead of skipping it")
    pr.add_argument("--seed", type=int, default=0, help="seed of the patient splits (default 0)")
    pr.add_argument("--sites", help="comma-separated sites to prepare (default: all)")
    pr.set_defaults(func=cmd_prepare)

    v = sub.add_parser("validate", help="check a federation spec and every file it names")
    v.add_argument("spec")
    v.set_defaults(func=cmd_validate)

    pl = sub.add_parser(
        "plan", help="volumes: fingerprint every site (aggregate numbers only) and write the federation's plan"
    )
    pl.add_argument("spec")
    pl.add_argument(
        "--patch-voxels", type=int, default=None, help="most voxels in one training patch beside the memory budget"
    )
    pl.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="plan for a GPU of this memory (GiB) as nnU-Net plans (8: its reference plan); default: the device "
        "at hand (a CUDA GPU's memory, or on a CPU the time of a training step, measured)",
    )
    pl.add_argument(
        "--device",
        default="auto",
        help="the device the plan is for without --gpu-memory: auto (a CUDA GPU if there is one), cpu, cuda, cuda:N",
    )
    pl.add_argument(
        "--step-seconds",
        type=float,
        default=CPU_STEP_SECONDS,
        help=f"on a CPU: the target seconds of one training step (default {CPU_STEP_SECONDS})",
    )
    pl.add_argument(
        "--batch-size",
        type=int,
        default=TrainConfig.batch_size,
        help="on a CPU: the patches of one training step the target is for (default: train.batch_size's default)",
    )
    pl.add_argument(
        "--weighting",
        choices=("case", "voxel"),
        default="case",
        help="how the CT percentiles, mean and sd weigh the foreground: every case equally (nnU-Net) or every voxel",
    )
    pl.set_defaults(func=cmd_plan)

    r = sub.add_parser("run", help="train one method in simulation and test it on every site")
    r.add_argument("config", nargs="?", help="run config TOML or federation spec")
    r.add_argument("--method", choices=sorted(REGISTRY), help="method (default: the config's, else fedavg)")
    r.add_argument("--rounds", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--out", default="runs/run", help="output folder (default: runs/run)")
    r.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.lr=1e-4 (repeatable)"
    )
    r.add_argument("--resume", metavar="OUT", help="continue the interrupted run in OUT")
    _device_argument(r)
    r.add_argument(
        "--tensorboard",
        action="store_true",
        help="write per-round TensorBoard scalars (losses, Dice, bytes, alpha) to OUT/tensorboard",
    )
    r.add_argument("--tensorboard-dir", metavar="DIR", help="with --tensorboard: write the scalars to DIR instead")
    _track_argument(r)
    r.set_defaults(func=cmd_run)

    rp = sub.add_parser(
        "report",
        help="one self-contained HTML report (tables, training curves, loss surface, t-SNE, predictions) of finished runs",
    )
    rp.add_argument(
        "runs", nargs="+", metavar="OUT", help="run output folders (or folders holding runs, e.g. a compare output)"
    )
    rp.add_argument("--html", default="report.html", help="HTML file to write (default: report.html)")
    rp.add_argument("--title", help="report title (default: the methods)")
    rp.add_argument(
        "--no-models",
        action="store_true",
        help="tables and history figures only: skip loss surface, t-SNE and predictions",
    )
    rp.add_argument(
        "--loss-site",
        help="site whose training data the loss surface uses (default: the one with the fewest training cases)",
    )
    rp.add_argument(
        "--directions", type=int, default=10, help="random directions of the loss surface (FedSM Fig. 4: 10)"
    )
    rp.add_argument("--steps", type=int, default=21, help="points along each direction (odd; default 21)")
    rp.add_argument(
        "--radius",
        type=float,
        help="loss-surface range ±R (default: mean parameter norm for unit directions, 1 for filter)",
    )
    rp.add_argument(
        "--normalize",
        choices=["unit", "filter"],
        default="unit",
        help="unit directions in parameter space (the paper) or filter-normalized (Li et al.)",
    )
    rp.add_argument(
        "--loss-cases", type=int, default=32, help="at most this many training cases for the loss surface (default 32)"
    )
    rp.add_argument("--cases", type=int, default=2, help="sample predictions per site (default 2)")
    rp.add_argument("--tsne-cases", type=int, default=40, help="test images per site in the t-SNE map (default 40)")
    rp.add_argument("--seed", type=int, default=0, help="seed of the loss-surface directions and t-SNE")
    rp.set_defaults(func=cmd_report)

    e = sub.add_parser("evaluate", help="test a finished run's best models (optionally on another federation)")
    e.add_argument("run", help="output folder of a finished run")
    e.add_argument("--spec", help="federation spec to test on (default: the run's own)")
    e.add_argument("--split", default="testing", choices=["validation", "testing"])
    e.set_defaults(func=cmd_evaluate)

    pr = sub.add_parser(
        "predict",
        help="segment new scans with a finished run's best model, in each scan's own grid",
        epilog=f"exit status: 0 every input written; {EXIT_SKIPPED} some inputs skipped (listed), the others "
        "written; 2 refused (nothing written)",
    )
    pr.add_argument("run", help="output folder of a finished run (or a folder holding exactly one)")
    pr.add_argument(
        "--input", nargs="+", required=True, help="image files, folders (DICOM series folders too) or datalists"
    )
    pr.add_argument("--out", required=True, help="folder for the masks (and routing.csv for FedSM)")
    pr.add_argument("--site", help="the site whose model to use (personalized and local methods)")
    pr.add_argument("--model", choices=["global", "personal", "ensemble"], help="which of the method's models")
    pr.add_argument("--tta", action="store_true", help="test-time mirroring over every spatial axis")
    pr.add_argument("--postprocess", action="store_true", help="keep the largest connected component per label")
    pr.add_argument("--probabilities", action="store_true", help="also write per-label probabilities (float16 .npy)")
    pr.add_argument("--split", help="with a datalist: only this split's images")
    pr.add_argument("--force", action="store_true", help="overwrite masks already in --out")
    pr.add_argument(
        "--strict", action="store_true", help="refuse the whole batch when a file cannot be read (default: skip it)"
    )
    pr.add_argument("--device", help="cpu, cuda, cuda:N (default: the run's)")
    pr.add_argument("--precision", choices=["fp32", "bf16"], help="inference precision (default: the run's)")
    pr.add_argument(
        "--nan-to-num",
        type=float,
        metavar="VALUE",
        help="replace NaN and infinite voxels with VALUE, with a warning (default: refuse such a scan)",
    )
    pr.add_argument("--spec", help="federation spec whose data layout to use (default: the run folder's data.json)")
    pr.add_argument("--quiet", action="store_true", help="no progress bar")
    pr.set_defaults(func=cmd_predict)

    ex = sub.add_parser("export", help="export a finished run's model: MONAI bundle, TorchScript or ONNX")
    ex.add_argument("run", help="output folder of a finished run (or a folder holding exactly one)")
    ex.add_argument("--format", required=True, choices=["bundle", "torchscript", "onnx"])
    ex.add_argument("--out", required=True, help="folder to write")
    ex.add_argument("--site", help="the site whose model to export (personalized and local methods)")
    ex.add_argument("--model", choices=["global", "personal", "ensemble"], help="which of the method's models")
    ex.add_argument("--force", action="store_true", help="overwrite files already in --out")
    ex.add_argument("--spec", help="federation spec whose data layout to use (default: the run folder's data.json)")
    ex.set_defaults(func=cmd_export)

    c = sub.add_parser("compare", help="run several methods over seeds and print one table (mean ± sd)")
    c.add_argument("config", help="run config TOML or federation spec")
    c.add_argument(
        "--methods",
        required=True,
        help="comma-separated, e.g. local,centralized,fedavg; a variant with settings of its own section: fedsm:personalization=ft",
    )
    c.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    c.add_argument("--rounds", type=int)
    c.add_argument("--out", required=True)
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="tune a setting per method on validation, e.g. train.lr=3e-4,1e-3,3e-3 (repeatable: a grid; "
        "fedsm:lam=0.3,0.5 for one method's); each method's row is its setting with the best mean validation "
        "score over the seeds, reported on test",
    )
    _jobs_arguments(c)
    _launch_arguments(c)
    _track_argument(c)
    _track_uri_argument(c)
    _device_argument(c)
    c.set_defaults(func=cmd_compare)
    sw = sub.add_parser(
        "sweep",
        help="one method over a grid of any settings: one run per point (resumable), a table and a plot of "
        "validation Dice over the grid",
    )
    sw.add_argument("config", help="run config TOML or federation spec")
    sw.add_argument("--method", required=True, choices=sorted(REGISTRY))
    sw.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="KEY=V1,V2",
        help="a setting and its values, e.g. train.lr=3e-4,1e-3 (repeatable: the product of all)",
    )
    sw.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    sw.add_argument("--rounds", type=int)
    sw.add_argument("--out", required=True, help="output folder: one subfolder per grid point, seed<k> below it")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    _jobs_arguments(sw)
    _launch_arguments(sw)
    _track_argument(sw)
    _track_uri_argument(sw)
    _device_argument(sw)
    sw.set_defaults(func=cmd_sweep)
    f = sub.add_parser("fedsm", help="FedSM studies: unseen-site selection (Table 5), lambda/gamma sweep (Table 7)")
    fsub = f.add_subparsers(dest="fedsm_verb", required=True, metavar="STUDY")
    for study, text in (
        ("unseen", "leave each site out, train FedSM on the rest, test the composite on it (Table 5)"),
        ("sweep", "one FedSM run per lambda; Client Avg / Global Dice and test Dice per gamma (Table 7)"),
    ):
        x = fsub.add_parser(study, help=text)
        x.add_argument("config", help="run config TOML or federation spec")
        x.add_argument("--out", required=True)
        x.add_argument("--rounds", type=int)
        x.add_argument("--seed", type=int)
        x.add_argument(
            "--seeds", help="comma-separated seeds: one study per seed in OUT/seed<N>, then one table (mean ± sd)"
        )
        x.add_argument("--gamma", help="comma-separated gamma grid (default: fedsm.gamma_grid)")
        _jobs_arguments(x)
        _launch_arguments(x)
        x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        if study == "unseen":
            x.add_argument("--sites", help="comma-separated sites to hold out (default: each site)")
        else:
            x.add_argument("--lam", required=True, help="comma-separated lambdas, e.g. 0.1,0.3,0.5,0.7,0.9")
        x.set_defaults(func=cmd_fedsm)
    x = fsub.add_parser(
        "table", help="one table (mean ± sd over seeds) from the output folders of one study run with several seeds"
    )
    x.add_argument("folders", nargs="+", help="output folders of 'fedseg fedsm sweep' or 'unseen', one per seed")
    x.add_argument("--md", help="also write the table here")
    x.set_defaults(func=cmd_fedsm)
    dp = sub.add_parser(
        "deploy", help="run across real sites on NVIDIA FLARE (mutual TLS), or rehearse it on this machine"
    )
    dsub = dp.add_subparsers(dest="deploy_verb", required=True, metavar="STEP")
    x = dsub.add_parser("provision", help="root CA + server, site and admin startup kits (mutual TLS)")
    x.add_argument("--sites", required=True, help="comma-separated site names, as in the federation spec")
    x.add_argument("--server", required=True, help="HOST:PORT the sites connect to (admin port = PORT+1)")
    x.add_argument("--out", required=True, help="folder for the kits")
    x = dsub.add_parser("site", help="configure this site's data (kept local) and start it")
    x.add_argument("--kit", required=True)
    x.add_argument("--datalist", required=True, help="this site's datalist JSON (never sent to the server)")
    x.add_argument("--workdir", required=True, help="where the site keeps its checkpoints")
    x.add_argument("--name", help="site name in the federation (default: the kit's)")
    x.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="where this site trains: auto (CUDA when available, else cpu), cpu, cuda or cuda:N; each site picks its own",
    )
    x.add_argument(
        "--policy",
        metavar="FILE",
        help="this site's privacy policy (JSON; docs/deploy.md 'Site policy'): the floors it enforces whatever the "
        "server's job says (default: KIT/local/fedseg_policy.json, written with the defaults when absent)",
    )
    x = dsub.add_parser(
        "roster", help="print the federation's sites and certificate fingerprints a kit holds, to compare out of band"
    )
    x.add_argument("kit", help="a site kit (KIT/local/fedseg_roster.json) or the folder `provision --out` wrote")
    x = dsub.add_parser("server", help="start the server from its kit")
    x.add_argument("--kit", required=True)
    for verb, text in (
        ("run", "submit a run to the deployment and wait for results.json"),
        ("rehearse", "one machine: server + site processes, real mutual TLS, 127.0.0.1"),
    ):
        x = dsub.add_parser(verb, help=text)
        x.add_argument(
            "config", nargs="?" if verb == "run" else None, help="run config TOML (may hold a [deploy] section)"
        )
        x.add_argument("--out", default="runs/deploy")
        x.add_argument("--method", choices=sorted(REGISTRY))
        x.add_argument("--rounds", type=int)
        x.add_argument("--seed", type=int)
        x.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        _track_argument(x)
        if verb == "run":
            x.add_argument(
                "--kits", required=True, help="folder written by `fedseg deploy provision` (uses kits/admin)"
            )
            x.add_argument(
                "--resume", metavar="OUT", help="continue the deployed run in OUT after a server crash, as a new job"
            )
        else:
            x.add_argument(
                "--sites",
                type=int,
                default=3,
                help="use the first N sites of the federation (a site's default policy joins runs of at least 3)",
            )
    for x in dsub.choices.values():
        x.set_defaults(func=cmd_deploy)
    add_audit_parser(sub, _device_argument)
    add_clean_parser(sub)
    st = sub.add_parser(
        "settings", help="every setting of a run: section, type or allowed values, default, description"
    )
    st.add_argument("section", nargs="?", help="one section only (run = the top-level keys, train, fedsm, deploy…)")
    st.add_argument(
        "--markdown", action="store_true", help="print docs/settings.md (fedseg settings --markdown > docs/settings.md)"
    )
    st.set_defaults(func=cmd_settings)
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
