"""Time ``fedseg synth`` (:func:`fedseg.data.synth.synthesize`) and fingerprint what it writes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/synth.py --preset fundus --scale 1.0 --size 256 --workers 1 8
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/synth.py --preset ct-lesion --scale 0.1 --size 128 --workers 1 2

For each worker count, writes the federation into a fresh folder under OUT, and reports the wall time, the
CPU time of this process and its worker processes, and a SHA-256 over every file's path and SHA-256: one
fingerprint of the bytes, the same for every worker count (checked) and across versions of fedseg that
write the same files. Prints a Markdown table and writes ``OUT/synth.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import time
from pathlib import Path

from fedseg.data.synth import PRESET_NAMES, synthesize


def fingerprint(root: Path) -> tuple[int, str]:
    """(number of files, SHA-256 over every file's relative path and SHA-256, in path order)."""
    h, n = hashlib.sha256(), 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(f"{p.relative_to(root).as_posix()} {hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
            n += 1
    return n, h.hexdigest()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESET_NAMES, default="fundus")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1], help="worker counts to time, in turn")
    ap.add_argument("--out", default="bench_synth")
    a = ap.parse_args()
    out = Path(a.out)
    rows = []
    for workers in a.workers:
        target = out / f"w{workers}"
        shutil.rmtree(target, ignore_errors=True)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        synthesize(a.preset, target, seed=a.seed, scale=a.scale, size=a.size, workers=workers)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        files, digest = fingerprint(target)
        rows.append(
            {"workers": workers, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "files": files, "sha256": digest}
        )
        print(f"workers={workers}: {wall:.2f} s wall, {cpu:.2f} s CPU, {files} files, sha256 {digest}", flush=True)
    if len({r["sha256"] for r in rows}) != 1:
        raise SystemExit("the files differ between worker counts")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\n`benchmarks/synth.py --preset {a.preset} --scale {a.scale} --size {a.size}` ({machine})\n")
    print("| workers | wall s | CPU s | files |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['wall_s']} | {r['cpu_s']} | {r['files']} |")
    doc = {"preset": a.preset, "scale": a.scale, "size": a.size, "seed": a.seed, "machine": machine, "runs": rows}
    (out / "synth.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
