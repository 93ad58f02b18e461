"""Deployed (NVFlare rehearsal: separate processes, mutual TLS, loopback) vs simulated runs.

For each method: wall time per round (median over rounds 2..R, round 1 carries
first-call warm-up and is reported apart), tensor bytes per round, total wall time
of the job (provisioning, process start, data loading included), and whether the
deployed final weights equal the simulation's bitwise.

    python benchmarks/deploy.py --methods fedavg,fedsm --rounds 4 --sites 2 --scale 0.05 --size 32 --out runs/bench-deploy
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedseg.data.synth import synthesize
from fedseg.deploy.run import rehearse, subset_spec
from fedseg.deploy.server import load_deploy_config
from fedseg.runner import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="fedavg,fedsm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--channels", default="[4,8,16]")
    ap.add_argument("--out", default="runs/bench-deploy")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(a.out).resolve()
    spec = synthesize("fundus", out / "fed", scale=a.scale, size=a.size)
    run_toml = out / "run.toml"
    run_toml.write_text(f'federation = "{spec}"\nseed = 0\n')
    strides = "[" + ",".join(["2"] * (len(json.loads(a.channels)) - 1)) + "]"
    ov = [f"model.channels={a.channels}", f"model.strides={strides}", "model.num_res_units=1", "train.batch_size=4", f"rounds={a.rounds}"]
    names = [f"site{i + 1}" for i in range(a.sites)]
    sim_spec = subset_spec(spec, names, out / "sim-fed" / "federation.toml")
    rows = []
    for m in a.methods.split(","):
        t0 = time.perf_counter()
        dep = rehearse(run_toml, a.sites, out / f"dep-{m}", overrides=ov, method=m)
        dep_wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        sim = run(load_deploy_config(run_toml, ov, method=m, federation=str(sim_spec)), out=out / f"sim-{m}", progress=False)
        sim_wall = time.perf_counter() - t0
        wa = load_file(str(out / f"dep-{m}" / "checkpoints" / "server.safetensors"))
        wb = load_file(str(out / f"sim-{m}" / "checkpoints" / "server.safetensors"))
        same = set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)

        def per_round(r):
            return statistics.median(h["time_s"] for h in r["history"][1:]) if len(r["history"]) > 1 else r["history"][0]["time_s"]

        def bytes_round(r):
            h = r["history"][-1]
            return sum(v["sent"] + v["received"] for v in h["bytes"].values())

        rows.append({
            "method": m, "dep_round_s": per_round(dep), "sim_round_s": per_round(sim), "dep_round1_s": dep["history"][0]["time_s"],
            "bytes_round": bytes_round(dep), "wire_bytes": dep["deploy"]["wire_bytes"], "dep_job_wall_s": dep_wall,
            "dep_engine_s": dep["wall_time_s"], "sim_wall_s": sim_wall, "bitwise_equal": same, "dice_dep": dep["client_avg_dice"], "dice_sim": sim["client_avg_dice"],
        })
        print(json.dumps(rows[-1]))
    md = [f"Sites: {a.sites}, rounds: {a.rounds}, fundus synth scale {a.scale}, {a.size}px, channels {a.channels}; "
          f"machine: {platform.machine()} {torch.get_num_threads()}-thread torch, `{platform.node()}`.\n",
          "| method | deployed s/round (median r≥2) | simulated s/round | deployed round 1 s | tensor bytes/round | job wall s (incl. provisioning, process start) | engine wall s deployed | sim wall s | bitwise equal | Client Avg Dice dep / sim |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['method']} | {r['dep_round_s']:.3f} | {r['sim_round_s']:.3f} | {r['dep_round1_s']:.2f} | {r['bytes_round']:,} | {r['dep_job_wall_s']:.1f} | "
                  f"{r['dep_engine_s']:.2f} | {r['sim_wall_s']:.2f} | {r['bitwise_equal']} | {r['dice_dep']:.4f} / {r['dice_sim']:.4f} |")
    (out / "deploy.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
