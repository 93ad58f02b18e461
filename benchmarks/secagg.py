"""Cost of secure aggregation per round of FedAvg, FGA or FedSM: CPU time and bytes, against a plain round of the method.

K in-memory sites of random 3-channel images (``--size``², ``--cases`` training cases each, 2 labels), the
default U-Net (``fedseg.foundation.config.ModelConfig``: channels 16…256, 2 residual units, instance norm),
Adam, ``--steps`` local steps of batch ``--batch-size`` per round, one torch thread.  Each K runs ``--rounds`` + 1 rounds
of ``--method`` (``fedavg``: one secure exchange per round; ``fga``: one per lockstep step, ``--steps`` per round;
``fedsm``: FedSM's defaults (SoftPull, the lockstep ``fga`` selector): one exchange a round for the global and
the personalized models, one per selector step, ``--steps`` per round, and the SoftPull sum sent back) with ``privacy.secure_aggregation`` off and on (the same seeds) after one warm-up run; the
table reports the median of the first ``--rounds`` (validation and the checkpoint come after the last)
for the rounds and the bytes, and the minimum for the protocol's own times (tens of milliseconds, which
other jobs on a shared machine disturb the most).  Per round:

* ``plain round`` / ``secure round``: the process CPU time of the round (every site's training included, as a
  simulation spends it; deployed, each site spends 1/K of the sites' part in parallel);
* ``protocol / plain round``: the protocol's CPU time (every site's and the server's) over the plain round's,
  as a simulation pays it; ``one site's masking / its training``: as a deployed site pays it (its own
  masking against its own local training, 1/K of the plain round's sites' part);
* ``site masking``: CPU time one site spends on the protocol (keys, shares, encoding and masking its update,
  revealing shares), the mean over the sites; ``server unmasking``: the server's (checking the replies,
  rebuilding the secrets, removing the masks, decoding);
* ``bytes``: what crosses the wire per round and site in the deployment's format
  (:mod:`fedseg.deployment.wire`: safetensors + JSON), both directions, plain vs secure.  Masked
  values are 64-bit integers, twice a float32 weight.

    PYTHONPATH=src .venv/bin/python benchmarks/secagg.py --sites 3,6
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/secagg.py --method fga --sites 3 --rounds 3 --steps 5
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python benchmarks/secagg.py --method fedsm --sites 3 --rounds 3 --steps 5
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _report import emit, md_table


def measure(k: int, secure: bool, args: argparse.Namespace) -> dict:
    from torch.utils.data import TensorDataset

    import fedseg.site.secure as site_secure
    from fedseg.deployment.wire import encode_reply, encode_task
    from fedseg.execution.inprocess import InProcessTransport
    from fedseg.foundation.config import EvalConfig, PrivacyConfig, RunConfig, TrainConfig
    from fedseg.privacy.protocol import ServerParty
    from fedseg.simulation.runner import simulate
    from fedseg.site.runtime import SiteData
    from fedseg.site.workload import segmentation_workload

    g = torch.Generator().manual_seed(0)

    def split(n: int) -> TensorDataset:
        x = torch.rand(n, 3, args.size, args.size, generator=g)
        return TensorDataset(x, (x[:, :2] > 0.5).float())

    data = {f"site{i + 1}": SiteData(split(args.cases), split(2), split(2)) for i in range(k)}
    cfg = RunConfig(
        federation="(in memory)",
        method=args.method,
        rounds=args.rounds + 1,
        train=TrainConfig(batch_size=args.batch_size, local_steps=args.steps, local_epochs=None),
        eval=EvalConfig(every=args.rounds + 1),
        checkpoint_every=args.rounds + 1,
        privacy=PrivacyConfig(secure_aggregation=secure),
    )
    workload = segmentation_workload(2, 3, ["a", "b"], cfg.model, cfg.train)
    cost = {"site": 0.0, "server": 0.0, "bytes": 0, "exchanges": 0}
    undo = []

    def timed(owner, name, key):
        real = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.process_time()
            try:
                return real(*a, **kw)
            finally:
                cost[key] += time.process_time() - t0

        setattr(owner, name, wrapper)
        undo.append((owner, name, real))

    for name in ("handle", "mask_reply"):
        timed(site_secure, name, "site")
    for name in (
        "accept_keys",
        "share_request",
        "accept_shares",
        "input_config",
        "accept_input",
        "consistency_config",
        "accept_attestation",
        "reveal_config",
        "unmask",
    ):
        timed(ServerParty, name, "server")
    real_request = ServerParty.share_request

    def share_request(self):
        cost["exchanges"] += 1
        return real_request(self)

    ServerParty.share_request = share_request
    undo.append((ServerParty, "share_request", real_request))
    real_ask = InProcessTransport.ask

    def ask(self, tasks, optional=False):
        replies = real_ask(self, tasks, optional)
        if all(t.kind != "evaluate" for t in tasks.values()):
            cost["bytes"] += sum(len(encode_task(t)) for t in tasks.values())
            cost["bytes"] += sum(len(encode_reply(r)) for r in replies.values())
        return replies

    InProcessTransport.ask = ask
    rounds: list[dict] = []
    mark = {"t": time.process_time()}

    def on_round(entry: dict) -> None:
        now = time.process_time()
        rounds.append({**cost, "cpu": now - mark["t"]})
        cost.update(site=0.0, server=0.0, bytes=0, exchanges=0)
        mark["t"] = time.process_time()

    gc.collect()  # the previous runs' sites and models, so that collecting them does not land in this one's rounds
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mark["t"] = time.process_time()
            simulate(cfg, workload, data, out=Path(tmp), progress=False, log=lambda m: None, on_round=on_round)
    finally:
        InProcessTransport.ask = real_ask
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)
    kept = rounds[: args.rounds]  # the last round also validates and checkpoints
    med = {key: statistics.median(r[key] for r in kept) for key in ("cpu", "bytes", "exchanges")}
    med.update({key: min(r[key] for r in kept) for key in ("site", "server")})  # least disturbed by other jobs
    n_params = sum(p.numel() for p in workload.build_model().parameters())
    return {**med, "site": med["site"] / k, "bytes_per_site": med["bytes"] / k, "params": n_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="fedavg", choices=("fedavg", "fga", "fedsm"))
    parser.add_argument("--sites", default="3,6")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--cases", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds measured (one more validates at the end)")
    parser.add_argument("--md", default=None)
    parser.add_argument("--out", default="runs/bench_secagg")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, summary = [], {}
    for k in [int(x) for x in args.sites.split(",")]:
        # a warm-up run of each K first: without it the first K measured paid about twice the masking time of
        # a later one (46 vs 16 ms per site), whichever K came first
        measure(k, True, argparse.Namespace(**{**vars(args), "rounds": 1}))
        plain, secure = measure(k, False, args), measure(k, True, args)
        summary[k] = {"plain": plain, "secure": secure}
        rows.append(
            [
                str(k),
                f"{plain['cpu']:.2f}",
                f"{secure['cpu']:.2f}",
                f"{secure['site'] * 1e3:.0f}",
                f"{secure['server'] * 1e3:.0f}",
                f"{(secure['site'] * k + secure['server']) / plain['cpu'] * 100:.1f} %",
                f"{secure['site'] / (plain['cpu'] / k) * 100:.1f} %",
                f"{plain['bytes_per_site'] / 2**20:.1f}",
                f"{secure['bytes_per_site'] / 2**20:.1f}",
            ]
        )
    first = next(iter(summary.values()))
    params, exchanges = first["plain"]["params"], first["secure"]["exchanges"]
    title = {"fedavg": "FedAvg", "fga": "FGA", "fedsm": "FedSM"}[args.method]
    md = [
        f"Secure aggregation per {title} round ({exchanges:.0f} secure exchanges a round): default U-Net ({params / 1e6:.2f} M parameters), {args.size}² × 3 "
        f"channels, {args.steps} local steps of batch {args.batch_size}, 1 torch thread, {platform.processor() or 'CPU'} "
        f"({platform.machine()}); rounds: median of {args.rounds}; protocol times: minimum of {args.rounds}.",
        "",
        *md_table(
            [
                "sites",
                "plain round CPU s",
                "secure round CPU s",
                "site masking ms (each)",
                "server unmasking ms",
                "protocol / plain round",
                "one site's masking / its training",
                "MiB per site, plain",
                "MiB per site, secure",
            ],
            rows,
        ),
    ]
    emit(
        md,
        args.md,
        Path(args.out),
        {str(k): v for k, v in summary.items()}
        | {"args": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)},
    )


if __name__ == "__main__":
    main()
