"""Peak memory and time of a volume run holding every volume in memory against reading them from the sites'
caches as used (``volume_reads = "memory"`` / ``"cache"``), on the ``ct-lesion`` preset.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_memory.py --size 128 --scale 2 --rounds 2

Synthesizes the federation (``fedseg synth --preset ct-lesion``) into OUT and fills each site's cache with
one untimed warm-up run (so both timed runs read preprocessed cases), then runs ``fedseg run`` FedAvg once
per setting, each in its own process, and reports the process's peak resident memory (its own
``ru_maxrss``), the wall time, and whether the two runs end with the same server weights (SHA-256 of the
last checkpoint).  The memory a site needs to hold its volumes is also computed from the cases' shapes
(docs/data.md, "Memory").  Writes ``OUT/summary.json`` and a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _report import emit, md_table

from fedseg.data.spec import load_federation
from fedseg.data.synth import synthesize
from fedseg.data.volumes.load import load_volume_site, pad_to_common_shape, plan_federation
from fedseg.site.batches import SiteData

SETTINGS = ("memory", "cache")


CHILD = (
    "import resource, sys\n"
    "from fedseg.cli import main\n"
    "code = main(sys.argv[2:])\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\n"
    "sys.exit(code)\n"
)
"""A child process running ``fedseg`` and writing its own peak resident memory (KiB on Linux) to a file."""


def fedseg_run(spec: Path, out: Path, sets: list[str]) -> tuple[float, float]:
    """``fedseg run`` FedAvg in a child process: (wall seconds, the child's peak resident memory in MiB)."""
    peak_file = out.with_name(out.name + ".maxrss")
    cmd = [sys.executable, "-c", CHILD, str(peak_file), "run", str(spec), "--method", "fedavg", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return wall, int(peak_file.read_text()) / 1024


def digest(run: Path) -> str:
    return hashlib.sha256((run / "checkpoints" / "server.safetensors").read_bytes()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_volume_memory")
    ap.add_argument("--size", type=int, default=128, help="ct-lesion in-plane voxels")
    ap.add_argument("--scale", type=float, default=2.0, help="ct-lesion case counts multiplier")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--md", default=None, help="also write the Markdown fragment here")
    a = ap.parse_args()
    out = Path(a.out)
    spec = synthesize("ct-lesion", out / "data", seed=0, scale=a.scale, size=a.size)
    fed = load_federation(spec)
    sets = [f"rounds={a.rounds}", "eval.every=1000", "eval.hd95=off", "checkpoint_background=false"]
    # the warm-up (untimed; run in its own process so the timed children start alike) fills the caches
    subprocess.run(
        [sys.executable, "-m", "fedseg.cli", "run", str(spec), "--out", str(out / "warm"), "--set", "rounds=1"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    plan = plan_federation(fed, log=lambda m: None)
    data = {
        s.name: SiteData(*load_volume_site(fed, s, plan, "auto", log=lambda m: None, volume_reads="cache"))
        for s in fed.sites
    }
    splits = [ds for d in pad_to_common_shape(data).values() for ds in (d.train, d.val, d.test)]
    cases = sum(len(ds) for ds in splits)
    shape = splits[0].shape
    per_voxel = 4 * (fed.in_channels + len(fed.labels))  # float32 image and label channels
    own = sum(int(np.prod(g.shape)) for ds in splits for g in ds.originals or [])  # own-grid labels of val/test
    held_mib = (cases * per_voxel * int(np.prod(shape)) + 4 * len(fed.labels) * own) / 2**20
    refs_mib = sum(ds.nbytes for ds in splits) / 2**20
    rows, summary = [], {"size": a.size, "scale": a.scale, "rounds": a.rounds, "cases": cases, "runs": {}}
    for reads in SETTINGS:
        wall, peak = fedseg_run(spec, out / reads, [*sets, f"volume_reads={reads}"])
        summary["runs"][reads] = {"seconds": wall, "peak_rss_mib": peak, "server": digest(out / reads)}
        rows.append([reads, f"{peak:.0f}", f"{wall:.1f}", summary["runs"][reads]["server"]])
    same = len({r["server"] for r in summary["runs"].values()}) == 1
    summary.update(
        same_weights=same,
        padded_volumes_mib=held_mib,
        references_mib=refs_mib,
        machine=f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}",
    )
    md = [
        f"ct-lesion size {a.size}, scale {a.scale}: {cases} cases in {len(fed.sites)} sites, padded to {shape} in "
        f"the plan's grid; FedAvg {a.rounds} rounds, validated after the last round only, one process per setting.",
        "",
        *md_table(["volume_reads", "peak RSS (MiB)", "wall (s)", "server weights (SHA-256)"], rows),
        "",
        f"Volumes padded to the common shape, as held in memory: {held_mib:.0f} MiB; what the cached splits hold "
        f"instead (foreground positions): {refs_mib:.1f} MiB. Same final weights: {'yes' if same else 'NO'}.",
    ]
    emit(md, a.md, out, summary)


if __name__ == "__main__":
    main()
