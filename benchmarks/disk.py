"""Disk taken by finished runs, before and after pruning (``checkpoint_keep``, ``fedseg clean``).

1. A tiny ``fedseg compare --tune``: the synthetic fundus federation (6 sites, ``--size`` px, ``--scale`` of the
   FedSM paper's counts), ``--methods`` (default FedAvg and FedSM, each at its defaults: the default U-Net 16…256,
   FedSM's selector) over ``--tune`` (default two learning rates), one seed, ``--rounds`` rounds, tracked in a
   local MLflow store.  The runs keep everything (``checkpoint_keep = "all"``: every site's state and optimizer
   moments, as runs did before pruning); then ``fedseg clean`` prunes them to what a run keeps by default
   (``"best"``).  The sizes under ``"final"`` (the last round's server state kept too) are what ``clean --keep
   final --dry-run`` would leave.
2. With ``--volume``: a 3D FedSM run on the synthetic ``ct-lesion`` federation (3 sites, the plan's DynUNet), the
   same way.

Sizes are the bytes of the files under each folder, every file counted once however many hard links it has
(MLflow's artifact of a run's best checkpoint is a link to the run's file); "before" counts the links again, as
the separate copies MLflow held before it linked them, with every run's resumable state kept.

    .venv/bin/python benchmarks/disk.py --md runs/disk/disk.md
    .venv/bin/python benchmarks/disk.py --volume --md runs/disk/disk.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from _report import emit, md_table

from fedseg.apps.clean import clean, run_folders
from fedseg.apps.studies.compare import compare
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.data.synth import synthesize
from fedseg.seams.checkpoint import BEST_ARRAYS, PRUNED, prunable
from fedseg.simulation.runner import run


def disk(folder: Path) -> int:
    """Bytes of the files under ``folder``, each inode once."""
    seen, total = set(), 0
    for root, _dirs, files in os.walk(folder):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def apparent(folder: Path) -> int:
    """Bytes of the files under ``folder`` as separate copies (hard links counted again)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def measure(name: str, folder: Path, rows: list[list[str]], summary: dict) -> None:
    """Sizes of ``folder`` as written (everything kept), under 'final' and after ``fedseg clean`` ('best')."""
    runs = run_folders(folder)
    old = apparent(folder)  # as the code before pruning left it: every state kept, MLflow's copies separate files
    before = disk(folder)
    final = before - sum(size for r in runs for _, size in prunable(r / "checkpoints", "final"))
    store = folder / "mlartifacts"
    copies = apparent(store)
    clean(folder, keep="best", log=lambda m: None)
    after = disk(folder)
    shared = sum(
        json.loads((r / "checkpoints" / PRUNED).read_text())["removed"].get(f"{BEST_ARRAYS} (tensors stored twice)", 0)
        for r in runs
    )
    final -= shared  # 'final' stores the best models' shared tensors once too
    rows.append([name, str(len(runs)), mb(old), mb(before), mb(final), mb(after)])
    summary[name] = {"runs": len(runs), "old": old, "all": before, "final": final, "best": after, "mlflow": copies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/disk")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default="fedavg,fedsm")
    ap.add_argument("--tune", default="train.lr=1e-3,3e-3")
    ap.add_argument("--volume", action="store_true", help="also a 3D FedSM run on ct-lesion")
    ap.add_argument("--volume-size", type=int, default=32, help="in-plane voxels of the ct-lesion preset")
    ap.add_argument("--volume-rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    shutil.rmtree(out / "compare", ignore_errors=True)
    shutil.rmtree(out / "volume", ignore_errors=True)
    quiet = {"progress": False, "log": lambda m: None}
    spec = synthesize("fundus", out / "data", seed=0, scale=args.scale, size=args.size)
    keep_all = ("checkpoint_keep=all", "device=cpu", "train.local_steps=2", "train.local_epochs=none")
    compare(
        spec,
        args.methods.split(","),
        out / "compare",
        StudyOptions(seeds=(0,), rounds=args.rounds, overrides=keep_all, track="mlflow", **quiet),
        tune=[args.tune],
    )
    rows: list[list[str]] = []
    summary: dict = {"args": vars(args)}
    measure(f"compare --methods {args.methods} --tune {args.tune}", out / "compare", rows, summary)
    if args.volume:
        vspec = synthesize("ct-lesion", out / "data3d", seed=0, scale=0.5, size=args.volume_size)
        over = ["checkpoint_keep=all", "device=cpu", "train.local_steps=2", "train.batch_size=2"]
        run(vspec, out=out / "volume", overrides=over, method="fedsm", rounds=args.volume_rounds, **quiet)
        measure(f"3D FedSM, ct-lesion {args.volume_size}², {args.volume_rounds} rounds", out / "volume", rows, summary)
    header = [
        "output",
        "runs",
        "before (everything kept, MLflow copying the best checkpoint)",
        "checkpoint_keep = all",
        "checkpoint_keep = final",
        "default (best) / after fedseg clean",
    ]
    md = [
        f"Command: `.venv/bin/python benchmarks/disk.py {' '.join(sys.argv[1:])}`\n",
        f"Machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), shared 2-core host; "
        f"wall {time.perf_counter() - t0:.0f} s.\n",
        f"{args.rounds} rounds, 2 local steps a round, default U-Net, synthetic fundus {args.size}² at scale "
        f"{args.scale}; sizes of the output folder with every file counted once (MLflow's store included):\n",
        *md_table(header, rows),
    ]
    emit(md, args.md, out, summary)


if __name__ == "__main__":
    main()
