"""Deployed (NVFlare rehearsal: separate processes, mutual TLS, loopback) vs simulated runs.

For each method: wall time per round (median over rounds 2..R, round 1 carries
first-call warm-up and is reported apart), tensor bytes per round, total wall time
of the job (provisioning, process start, data loading included), and whether the
deployed final weights equal the simulation's bitwise.

    python benchmarks/deploy.py --methods fedavg,fedsm --rounds 4 --sites 2 --scale 0.05 --size 32 --out runs/bench-deploy

``--fga-mb 1,6,25`` instead measures FGA's per-step cost against payload size: for
each size a U-Net whose float32 parameters take about that many MB (channels
c, 2c, 4c, 8c with c chosen to match), FGA deployed and simulated, and the
per-step overhead = deployed − simulated median step time (one gradient each way
per site per step).

``--faults`` runs a fault drill on real FLARE processes (FedAvg, 2 sites): site1
frozen (SIGSTOP) past the round deadline, site2 killed and restarted 3 s later
(the supervisor restarts the job so it rejoins), then the server killed and the
run resumed with ``deploy_run(resume=True)``; it reports the round times around
each fault, the supervisor's ``recover_s`` and the time from the server restart
to the end of the run.

``--dead-site`` (FedAvg, 3 sites): site3 killed for good after round 2; reports the time
from the complete ``results.json`` to the return of the supervised submission (what
``fedseg deploy run`` / ``rehearse`` wait on), and the cluster's shutdown after it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from _report import md_table
from safetensors.torch import load_file

from fedseg.data.synth import synthesize
from fedseg.deployment.run import rehearse, subset_spec
from fedseg.deployment.server import load_deploy_config
from fedseg.simulation.runner import run

CLEAR = {"secure_aggregation": False, "min_sites": 2, "reproducible": True, "evaluation": "per_case"}
"""The sites' policy in these benchmarks: they join runs without secure aggregation (what they measure), of two
sites, let the run seed drive their randomness (no site salt: the deployment is compared with the simulation
bitwise) and send per-case scores."""


def unet_for_mb(mb: float, out_channels: int = 2) -> tuple[list[int], int]:
    """Channels (c, 2c, 4c, 8c) whose MONAI U-Net (1 residual unit) has float32 parameters closest to ``mb`` MB."""
    from fedseg.foundation.config import ModelConfig
    from fedseg.models.unet import build_unet

    best = None
    for c in range(2, 129):
        ch = [c, 2 * c, 4 * c, 8 * c]
        m = build_unet(2, 1, out_channels, ModelConfig(channels=tuple(ch), strides=(2, 2, 2), num_res_units=1))
        nbytes = sum(p.numel() * 4 for p in m.parameters())
        if best is None or abs(nbytes - mb * 1e6) < abs(best[1] - mb * 1e6):
            best = (ch, nbytes)
        if nbytes > mb * 1e6:
            break
    return best


def fga_payloads(a, spec, run_toml, sim_spec, out) -> None:
    """FGA per-step time deployed vs simulated for models of about each size in ``a.fga_mb``."""
    rows = []
    for mb in [float(x) for x in a.fga_mb.split(",")]:
        ch, nbytes = unet_for_mb(mb)
        ov = [
            f"model.channels={ch}",
            "model.strides=[2,2,2]",
            "model.num_res_units=1",
            "privacy.secure_aggregation=false",  # measured in the clear (a deployment's default is secure aggregation)
            "train.batch_size=4",
            f"rounds={a.rounds}",
            "eval.every=1000",
            f"checkpoint_every={a.rounds}",
        ]
        tag = f"fga-{mb:g}mb"
        t0 = time.perf_counter()
        dep = rehearse(run_toml, a.sites, out / f"dep-{tag}", overrides=ov, method="fga", policy=CLEAR)
        dep_wall = time.perf_counter() - t0
        sim = run(
            load_deploy_config(run_toml, [*ov, "checkpoint_keep=final"], method="fga", federation=str(sim_spec)),
            out=out / f"sim-{tag}",
            progress=False,
        )

        def step_s(r):  # median over rounds 2..R of round time / steps (round 1 carries warm-up)
            hs = r["history"][1:] or r["history"]
            return statistics.median(h["time_s"] / h["steps"] for h in hs)

        steps = sum(h["steps"] for h in dep["history"])
        per_step_bytes = (
            sum(sum(v["sent"] + v["received"] for v in h["bytes"].values()) for h in dep["history"]) / steps / a.sites
        )
        wa = load_file(str(out / f"dep-{tag}" / "checkpoints" / "server.safetensors"))
        wb = load_file(str(out / f"sim-{tag}" / "checkpoints" / "server.safetensors"))
        rows.append(
            {
                "mb": mb,
                "channels": ch,
                "param_mb": nbytes / 1e6,
                "steps": steps,
                "dep_step_s": step_s(dep),
                "sim_step_s": step_s(sim),
                "bytes_per_step_site": per_step_bytes,
                "job_wall_s": dep_wall,
                "bitwise_equal": set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    md = [
        f"FGA per-step overhead vs payload. Sites: {a.sites}, rounds: {a.rounds}, fundus synth scale {a.scale}, {a.size}px, batch 4; "
        f"machine: {platform.machine()}, 1-thread torch per process, `{platform.node()}`.\n"
    ]
    md += md_table(
        [
            "target MB",
            "U-Net channels",
            "parameters MB (float32)",
            "steps",
            "deployed s/step",
            "simulated s/step",
            "overhead s/step",
            "tensor bytes/step/site (both ways)",
            "bitwise equal",
        ],
        [
            [
                f"{r['mb']:g}",
                str(r["channels"]),
                f"{r['param_mb']:.2f}",
                str(r["steps"]),
                f"{r['dep_step_s']:.3f}",
                f"{r['sim_step_s']:.3f}",
                f"{r['dep_step_s'] - r['sim_step_s']:.3f}",
                f"{r['bytes_per_step_site'] / 1e6:.1f} MB",
                str(r["bitwise_equal"]),
            ]
            for r in rows
        ],
    )
    (out / "deploy-fga.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def _round_reached(out: Path, rnd: int, timeout: float = 300.0) -> float:
    from fedseg.deployment.supervise import completed_round

    t0 = time.monotonic()
    while completed_round(out) < rnd:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"round {rnd} not reached")
        time.sleep(0.1)
    return time.monotonic()


def _rejoined(run_dir: Path, timeout: float = 300.0) -> float:
    """Wait until the supervisor records the rejoin restart as recovered (first round of the new job done)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        p = run_dir / "supervisor.json"
        if p.is_file():
            try:
                rec = json.loads(p.read_text())["recoveries"]
            except (json.JSONDecodeError, KeyError):
                rec = []
            if any(r["reason"].startswith("rejoin") and r.get("recover_s") is not None for r in rec):
                return time.monotonic()
        time.sleep(0.1)
    raise TimeoutError("no rejoin recorded")


def fault_drill(a, spec: Path, run_toml: Path, out: Path) -> None:
    """Hang, kill + rejoin, server crash + resume on one FLARE rehearsal cluster; timings to Markdown."""
    import threading

    from fedseg.data.spec import load_federation
    from fedseg.deployment.run import LocalCluster, deploy_run, submit_run
    from fedseg.deployment.server import prepare_run
    from fedseg.deployment.supervise import completed_round

    deadline = 6.0
    ov = [
        f"model.channels={a.channels}",
        "model.strides=[2,2]",
        "model.num_res_units=1",
        "privacy.secure_aggregation=false",  # measured in the clear (a deployment's default is secure aggregation)
        "train.batch_size=4",
        f"rounds={a.rounds}",
        "train.local_steps=20",
        "train.local_epochs=none",
        f"deploy.round_deadline_s={deadline}",
        "deploy.probe_timeout_s=2",
        "deploy.rejoin_wait_s=20",
        "eval.every=5",
    ]
    names = ["site1", "site2"]
    fed = load_federation(spec)
    run_dir = out / "drill"
    prepare_run(load_deploy_config(run_toml, ov, method="fedavg"), run_dir, sites=names)
    events: dict[str, float] = {}
    with LocalCluster(
        out / "drill-nv", {n: fed.site(n).datalist for n in names}, out / "drill-sites", policy=CLEAR
    ) as cl:
        first = threading.Thread(
            target=lambda: _quiet(submit_run, cl.kits["admin"], run_dir, names, 600, None, lambda m: None), daemon=True
        )
        first.start()
        _round_reached(run_dir, 2)
        cl.pause("site1")
        time.sleep(deadline + 2)
        cl.resume("site1")
        _round_reached(run_dir, completed_round(run_dir) + 1)
        cl.kill("site2")
        events["kill"] = time.monotonic()
        time.sleep(3)
        cl.start_site("site2")
        events["rejoined_round_done"] = _rejoined(run_dir)
        _round_reached(run_dir, completed_round(run_dir) + 2)
        cl.kill("server")
        killed_round = completed_round(run_dir)
        first.join(120)
        cl.start_server()
        events["server_restarted"] = time.monotonic()
        res = deploy_run(None, cl.root / "kits", run_dir, resume=True, timeout=600)
        events["end"] = time.monotonic()
    drops = res["deploy"]["dropouts"]
    rec = res["deploy"].get("recoveries", [])
    times = [round(h["time_s"], 2) for h in res["history"]]
    md = [
        f"Fault drill (FedAvg, 2 sites, {a.rounds} rounds × 20 local steps, U-Net {a.channels}, deadline {deadline:g} s, "
        f"probe 2 s; machine {platform.machine()}, 1 torch thread per process).\n",
        f"- round times (s): {times}",
        "- dropouts: " + "; ".join(f"round {d['round']} {d['site']} {d['task']}: {d['reason'][:80]}" for d in drops),
        "- supervisor recoveries: "
        + "; ".join(
            f"{r['reason']} from round {r['from_round']} → first new round after {r.get('recover_s')} s" for r in rec
        ),
        f"- site2 killed → restarted 3 s later → first round of the new job (with site2) done {events['rejoined_round_done'] - events['kill']:.1f} s after the kill",
        f"- server killed after round {killed_round}; server restart → end of the resumed run ({a.rounds - killed_round} rounds + test): "
        f"{events['end'] - events['server_restarted']:.1f} s",
        "- jobs: "
        + "; ".join(
            f"{j['job'][:8]} sites {j['sites']} rounds {j['from_round']}→{j.get('to_round', '(server killed)')} {j.get('status', '')}"
            for j in res["deploy"].get("jobs", [])
        )
        + f"; final history {len(res['history'])} rounds",
    ]
    (out / "deploy-faults.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def dead_site_drill(a, spec: Path, run_toml: Path, out: Path) -> None:
    """3 sites; the last one killed for good after round 2 (no restart).  Measures how long the command
    (``submit_run``, what ``deploy run`` / ``rehearse`` run) takes to return once results.json is complete,
    and how long stopping the local cluster takes after that."""
    import threading

    from fedseg.data.spec import load_federation
    from fedseg.deployment.params import deploy_params
    from fedseg.deployment.run import LocalCluster, submit_run
    from fedseg.deployment.server import prepare_run

    deadline = 6.0
    ov = [
        f"model.channels={a.channels}",
        "model.strides=[2,2]",
        "model.num_res_units=1",
        "privacy.secure_aggregation=false",  # measured in the clear (a deployment's default is secure aggregation)
        "train.batch_size=4",
        f"rounds={a.rounds}",
        "train.local_steps=20",
        "train.local_epochs=none",
        f"deploy.round_deadline_s={deadline}",
        "deploy.probe_timeout_s=2",
        "eval.every=5",
    ]
    names = ["site1", "site2", "site3"]
    fed = load_federation(spec)
    run_dir = out / "dead"
    prepare_run(load_deploy_config(run_toml, ov, method="fedavg"), run_dir, sites=names)
    grace = deploy_params(load_deploy_config(run_toml, ov)).shutdown_grace_s
    ev: dict[str, float] = {}
    with LocalCluster(
        out / "dead-nv", {n: fed.site(n).datalist for n in names}, out / "dead-sites", policy=CLEAR
    ) as cl:

        def supervised():
            submit_run(cl.kits["admin"], run_dir, names, 900, None, lambda m: print(m, flush=True))
            ev["returned"] = time.time()

        worker = threading.Thread(target=supervised, daemon=True)
        worker.start()
        _round_reached(run_dir, 2, 600)
        cl.kill("site3")
        ev["killed"] = time.time()
        worker.join(900)
        t_exit0 = time.monotonic()
    ev["cluster_stopped_s"] = time.monotonic() - t_exit0
    res = json.loads((run_dir / "results.json").read_text())
    ev["results"] = (run_dir / "results.md").stat().st_mtime
    md = [
        f"Dead-site drill (FedAvg, 3 sites, {a.rounds} rounds × 20 local steps, U-Net {a.channels}, deadline {deadline:g} s, probe 2 s, "
        f"deploy.shutdown_grace_s {grace:g} s; machine {platform.machine()}, 1 torch thread per process): site3 killed after round 2, never restarted.\n",
        f"- rounds in results: {len(res['history'])}; sites in the last round: {sorted(res['history'][-1]['train_loss'])}",
        f"- kill → results.json complete: {ev['results'] - ev['killed']:.1f} s",
        f"- results.json complete → command returned: {ev['returned'] - ev['results']:.1f} s",
        f"- then stopping the server and site processes (rehearse's cluster exit): {ev['cluster_stopped_s']:.1f} s",
        "- jobs: "
        + "; ".join(
            f"{j['job'][:8]} rounds {j['from_round']}→{j.get('to_round')} {j.get('status', '')}"
            for j in res["deploy"].get("jobs", [])
        ),
    ]
    (out / "deploy-dead-site.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        print(f"(first submission ended: {type(e).__name__})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="fedavg,fedsm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--channels", default="[4,8,16]")
    ap.add_argument("--out", default="runs/bench-deploy")
    ap.add_argument(
        "--fga-mb", default=None, help="measure FGA per-step overhead for models of these sizes (MB), e.g. 1,6,25"
    )
    ap.add_argument(
        "--faults", action="store_true", help="fault drill: hang, kill + rejoin, server crash + resume (timings)"
    )
    ap.add_argument(
        "--dead-site",
        action="store_true",
        help="3 sites, one killed for good: time from complete results to the command's return",
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out).resolve()
    spec = synthesize("fundus", out / "fed", scale=a.scale, size=a.size)
    run_toml = out / "run.toml"
    run_toml.write_text(f'federation = "{spec}"\nseed = 0\n')
    strides = "[" + ",".join(["2"] * (len(json.loads(a.channels)) - 1)) + "]"
    ov = [
        f"model.channels={a.channels}",
        f"model.strides={strides}",
        "model.num_res_units=1",
        "privacy.secure_aggregation=false",  # measured in the clear (a deployment's default is secure aggregation)
        "train.batch_size=4",
        f"rounds={a.rounds}",
    ]
    names = [f"site{i + 1}" for i in range(a.sites)]
    sim_spec = subset_spec(spec, names, out / "sim-fed" / "federation.toml")
    if a.fga_mb:
        return fga_payloads(a, spec, run_toml, sim_spec, out)
    if a.faults:
        return fault_drill(a, spec, run_toml, out)
    if a.dead_site:
        return dead_site_drill(a, spec, run_toml, out)
    rows = []
    for m in a.methods.split(","):
        t0 = time.perf_counter()
        dep = rehearse(run_toml, a.sites, out / f"dep-{m}", overrides=ov, method=m, policy=CLEAR)
        dep_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        sim = run(
            load_deploy_config(run_toml, [*ov, "checkpoint_keep=final"], method=m, federation=str(sim_spec)),
            out=out / f"sim-{m}",
            progress=False,
        )
        sim_wall = time.perf_counter() - t0
        wa = load_file(str(out / f"dep-{m}" / "checkpoints" / "server.safetensors"))
        wb = load_file(str(out / f"sim-{m}" / "checkpoints" / "server.safetensors"))
        same = set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)

        def per_round(r):
            return (
                statistics.median(h["time_s"] for h in r["history"][1:])
                if len(r["history"]) > 1
                else r["history"][0]["time_s"]
            )

        def bytes_round(r):
            h = r["history"][-1]
            return sum(v["sent"] + v["received"] for v in h["bytes"].values())

        rows.append(
            {
                "method": m,
                "dep_round_s": per_round(dep),
                "sim_round_s": per_round(sim),
                "dep_round1_s": dep["history"][0]["time_s"],
                "bytes_round": bytes_round(dep),
                "wire_bytes": dep["deploy"]["wire_bytes"],
                "dep_job_wall_s": dep_wall,
                "dep_engine_s": dep["wall_time_s"],
                "sim_wall_s": sim_wall,
                "bitwise_equal": same,
                "dice_dep": dep["client_avg_dice"],
                "dice_sim": sim["client_avg_dice"],
            }
        )
        print(json.dumps(rows[-1]))
    md = [
        f"Sites: {a.sites}, rounds: {a.rounds}, fundus synth scale {a.scale}, {a.size}px, channels {a.channels}; "
        f"machine: {platform.machine()} {torch.get_num_threads()}-thread torch, `{platform.node()}`.\n"
    ]
    md += md_table(
        [
            "method",
            "deployed s/round (median r≥2)",
            "simulated s/round",
            "deployed round 1 s",
            "tensor bytes/round",
            "job wall s (incl. provisioning, process start)",
            "engine wall s deployed",
            "sim wall s",
            "bitwise equal",
            "Client Avg Dice dep / sim",
        ],
        [
            [
                r["method"],
                f"{r['dep_round_s']:.3f}",
                f"{r['sim_round_s']:.3f}",
                f"{r['dep_round1_s']:.2f}",
                f"{r['bytes_round']:,}",
                f"{r['dep_job_wall_s']:.1f}",
                f"{r['dep_engine_s']:.2f}",
                f"{r['sim_wall_s']:.2f}",
                str(r["bitwise_equal"]),
                f"{r['dice_dep']:.4f} / {r['dice_sim']:.4f}",
            ]
            for r in rows
        ],
    )
    (out / "deploy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
