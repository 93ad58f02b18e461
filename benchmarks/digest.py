"""A digest of tiny runs: the SHA-256 of every tensor each run saves, to show that a change of the code keeps
every number.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/digest.py --out /tmp/digest.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/digest.py --check benchmarks/digest_reference.json

Writes the synthetic ``fundus`` federation (scale 0.05, 32²) and the 3D ``ct-lesion`` one (scale 0.2, 16³-ish)
into a temporary folder and runs, on the CPU with one thread, 2 rounds of each of the runs in ``RUNS`` (FedSM
sequential and vectorized, FedAvg in epoch mode over the unequal sites, FGA vectorized, SCAFFOLD, Auto-FedAvg,
Ditto, sample-level DP with seeded noise, secure aggregation, FedAvg on volumes).  For each run it hashes every
tensor of every ``.safetensors`` file the run saved (checkpoints, models) — name, dtype, shape and bytes, in
sorted order — and prints (``--out``: writes) ``{run: {file: sha256 over its tensors' names and digests}}``
(``--tensors``: ``{run: {file: {tensor: sha256}}}``); ``--check`` compares with a saved digest of either form and
names every file (or, against a per-tensor digest, every tensor) that differs.  benchmarks/digest_reference.json
is the per-file digest of the tree that last changed a run's numbers on purpose; rewrite it (``--out``) with such a change.
The volume run's plan is made for a CPU of :data:`CPU_GFLOPS` (``FEDSEG_CPU_GFLOPS``, unless set) instead of a
timed probe, so a loaded machine's slower probe does not choose a smaller plan: the digest depends on the code only.  About 1–2 minutes on this machine (2-core CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

CPU_GFLOPS = "50"
"""The CPU throughput the volume run's plan is made for (any value from 5 to 500 gives the reference's plan; a
probe at 0.5, as on a machine busy with other work, a smaller one)."""

SMALL = [
    "model.channels=[4,8,16]",
    "model.strides=[2,2]",
    "model.num_res_units=1",
    "train.batch_size=4",
    "rounds=2",
    "seed=0",
    "device=cpu",
    "checkpoint_keep=all",  # every saved tensor is hashed, the sites' states included
]
STEPS = ["train.local_steps=2"]

#: (name, preset, overrides): each a 2-round run.
RUNS: list[tuple[str, str, list[str]]] = [
    ("fedsm-sequential", "fundus", ["method=fedsm", "simulation.vectorize=off", *STEPS]),
    ("fedsm-vectorized", "fundus", ["method=fedsm", "simulation.vectorize=on", *STEPS]),
    ("fedavg-epochs", "fundus", ["method=fedavg", "train.local_epochs=0.5", "simulation.vectorize=on"]),
    ("fga-vectorized", "fundus", ["method=fga", "simulation.vectorize=on", "train.local_steps=3"]),
    ("scaffold", "fundus", ["method=scaffold", *STEPS]),
    ("autofedavg", "fundus", ["method=autofedavg", *STEPS]),
    ("ditto", "fundus", ["method=ditto", *STEPS]),
    (
        "dp-sample",
        "fundus",
        [
            "method=fedavg",
            *STEPS,
            'privacy.dp="sample"',
            "privacy.noise_multiplier=1.0",
            'privacy.dp_randomness="seeded"',
            'model.norm="none"',
        ],
    ),
    ("secagg", "fundus", ["method=fedavg", *STEPS, "privacy.secure_aggregation=true"]),
    (
        "volume-fedavg",
        "ct-lesion",
        ["method=fedavg", "train.local_steps=2", "train.batch_size=2", "model.num_res_units=0"],
    ),
]


def tensor_digest(path: Path) -> dict[str, str]:
    """{tensor name: sha256 of its dtype, shape and bytes} of one safetensors file, in sorted name order."""
    from safetensors.torch import load_file

    out = {}
    for name, t in sorted(load_file(str(path)).items()):
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out[name] = h.hexdigest()
    return out


def per_file(digest: dict) -> dict[str, dict[str, str]]:
    """``{run: {file: sha256}}`` of a per-tensor digest (a per-file one as it is)."""
    out: dict[str, dict[str, str]] = {}
    for run, files in digest.items():
        out[run] = {}
        for f, tensors in files.items():
            if isinstance(tensors, str):
                out[run][f] = tensors
            else:
                out[run][f] = hashlib.sha256(json.dumps(sorted(tensors.items())).encode()).hexdigest()
    return out


def run_digest(name: str, spec: Path, overrides: list[str], root: Path) -> dict[str, dict[str, str]]:
    from fedseg.simulation.runner import run

    out = root / name
    run(spec, out=out, overrides=[*SMALL, *overrides], progress=False, log=lambda m: None)
    return {str(p.relative_to(out)): tensor_digest(p) for p in sorted(out.rglob("*.safetensors"))}


def _entries(a: object, b: object) -> list[str]:
    """The tensor names of a file in either digest (one entry, "", for a per-file digest)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return sorted(set(a if isinstance(a, dict) else {}) | set(b if isinstance(b, dict) else {}))
    return [""]


def _entry(files: object, tensor: str) -> object:
    return files.get(tensor) if isinstance(files, dict) else files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the digest here (JSON)")
    ap.add_argument("--check", type=Path, help="compare with this saved digest; exit 1 on any difference")
    ap.add_argument("--only", help="comma list of run names (default: all)")
    ap.add_argument("--tensors", action="store_true", help="--out writes every tensor's digest (default: per file)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("FEDSEG_CPU_GFLOPS", CPU_GFLOPS)
    from fedseg.data.synth import synthesize

    only = set(args.only.split(",")) if args.only else None
    digest: dict[str, dict[str, dict[str, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        specs = {
            "fundus": synthesize("fundus", root / "fundus", seed=0, scale=0.05, size=32, progress=False),
            "ct-lesion": synthesize("ct-lesion", root / "ct", seed=0, scale=0.2, size=32, progress=False),
        }
        for name, preset, overrides in RUNS:
            if only and name not in only:
                continue
            t = time.perf_counter()
            digest[name] = run_digest(name, specs[preset], overrides, root / "runs")
            n = sum(len(v) for v in digest[name].values())
            print(f"{name}: {n} tensors in {len(digest[name])} files, {time.perf_counter() - t:.1f} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps(digest if args.tensors else per_file(digest), indent=1, sort_keys=True) + "\n")
    if args.check:
        ref = json.loads(args.check.read_text())
        if not args.tensors and any(isinstance(t, str) for files in ref.values() for t in files.values()):
            ref, digest = per_file(ref), per_file(digest)  # type: ignore[assignment]
        bad = [
            f"{run}/{f}:{t}"
            for run in digest
            for f in sorted(set(digest[run]) | set(ref.get(run, {})))
            for t in _entries(digest[run].get(f), ref.get(run, {}).get(f))
            if _entry(digest[run].get(f), t) != _entry(ref.get(run, {}).get(f), t)
        ]
        missing = [r for r in ref if r not in digest and not only]
        for b in bad[:40]:
            print("differs:", b)
        print(
            f"{len(digest)} runs compared: {len(bad)} files or tensors differ"
            + (f", runs missing {missing}" if missing else "")
        )
        return 1 if bad or missing else 0
    if not args.out:
        json.dump(digest, sys.stdout, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
