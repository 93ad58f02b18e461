"""Loading a volume federation cold (every case read, normalized, reoriented and resampled) and warm (each
site's cache of preprocessed cases read back) on the ``ct-lesion`` preset.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volume_cache.py --size 64 --repeats 3

Synthesizes the federation (``fedseg synth --preset ct-lesion``) into OUT, plans it (``fedseg plan``), then
times loading every split of every site into the plan's grid (:func:`fedseg.data.volumes.load.load_volume_site`)
with ``volume_cache = "off"``, a cold cache (preprocess and store) and a warm cache (read back), checks that
the warm tensors equal the uncached ones bitwise, and writes ``OUT/volume_cache.json`` and a Markdown line.
The run's validation of every file (``raise_if_invalid``, the same with or without a cache) is timed
apart, and the plan is made before the timings.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from fedseg.data.spec import load_federation
from fedseg.data.synth import synthesize
from fedseg.data.validate import raise_if_invalid
from fedseg.data.volumes.load import load_volume_site, plan_federation


def load_all(fed, plan, setting: str, cache_root: Path | None):
    setting = str(cache_root) if setting == "folder" else setting
    t0 = time.perf_counter()
    data = {s.name: load_volume_site(fed, s, plan, setting, log=lambda m: None) for s in fed.sites}
    return time.perf_counter() - t0, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_volume_cache")
    ap.add_argument("--size", type=int, default=64, help="ct-lesion in-plane voxels (64: the CPU default)")
    ap.add_argument("--scale", type=float, default=1.0, help="ct-lesion case counts multiplier")
    ap.add_argument("--repeats", type=int, default=3, help="timings per variant (the median is reported)")
    a = ap.parse_args()
    out = Path(a.out)
    spec = synthesize("ct-lesion", out / "data", seed=0, scale=a.scale, size=a.size)
    fed = load_federation(spec)
    plan = plan_federation(fed, log=lambda m: None)
    cases = sum(len(ds) for s in fed.sites for ds in load_volume_site(fed, s, plan, "off", log=lambda m: None))
    cache = out / "cache"
    off, cold, warm = [], [], []
    for _ in range(a.repeats):
        t, ref = load_all(fed, plan, "off", None)
        off.append(t)
        shutil.rmtree(cache, ignore_errors=True)
        cold.append(load_all(fed, plan, "folder", cache)[0])
        t, got = load_all(fed, plan, "folder", cache)
        warm.append(t)
        for name in ref:
            for x, y in zip(ref[name], got[name]):
                assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels), "warm differs from cold"
    t0 = time.perf_counter()
    raise_if_invalid(spec)  # what a run does first, cache or not: every file read and checked
    validate = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in {"off": off, "cold": cold, "warm": warm}.items()}
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    record = {
        "preset": "ct-lesion",
        "size": a.size,
        "scale": a.scale,
        "cases": cases,
        "seconds_median": med,
        "seconds_all": {"off": off, "cold": cold, "warm": warm},
        "speedup_warm_over_off": med["off"] / med["warm"],
        "validate_seconds": validate,
        "cache_bytes": size,
        "machine": f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}",
    }
    (out / "volume_cache.json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"| ct-lesion size {a.size}, {cases} cases | off {med['off']:.2f} s | cold cache {med['cold']:.2f} s | "
        f"warm cache {med['warm']:.3f} s | {record['speedup_warm_over_off']:.1f}x | cache {size / 2**20:.1f} MiB | "
        f"validation {validate:.2f} s |"
    )


if __name__ == "__main__":
    main()
