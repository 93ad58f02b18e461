"""The volume plan for a memory budget beside nnU-Net v2's, for the example of 30 CTs of 512 × 512 × 150 at
0.8 × 0.8 × 2.5 mm (two label channels): patch, levels, features, first kernel, batch and the parameters of
the DynUNet built from it.  No data is read: the plan depends only on the median shape and spacing.

    .venv/bin/python benchmarks/plan_table.py [--gpu-memory 8 4 16 24]
"""

from __future__ import annotations

import argparse

from fedseg.data.volumes.plan import network_plan
from fedseg.foundation.config import ModelConfig
from fedseg.models import build_model

NNUNET = {"patch (z, y, x)": "56 × 192 × 192", "levels / features": "6, 32 → 320", "first kernel": "1 × 3 × 3"}
NNUNET.update({"batch": "2", "parameters": "30.7 M"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpu-memory", type=float, nargs="+", default=[8.0])
    args = ap.parse_args()
    shape, spacing = [512, 512, 150], [0.8, 0.8, 2.5]
    print("| GiB | | nnU-Net v2 | fedseg |\n|---|---|---|---|")
    for gib in args.gpu_memory:
        p = network_plan(shape, spacing, gpu_memory=gib, labels=2, dataset_voxels=30 * 512 * 512 * 150)
        net = ModelConfig(
            name="dynunet",
            channels=tuple(p["channels"]),
            strides=tuple(map(tuple, p["strides"])),
            kernels=tuple(map(tuple, p["kernels"])),
        )
        params = sum(t.numel() for t in build_model(3, 1, 2, net).parameters())
        x, y, z = p["patch"]
        k = p["kernels"][0]
        ours = {
            "patch (z, y, x)": f"{z} × {y} × {x}",
            "levels / features": f"{len(p['channels'])}, {p['channels'][0]} → {max(p['channels'])}",
            "first kernel": f"{k[2]} × {k[1]} × {k[0]}",
            "batch": str(p["batch_size"]),
            "parameters": f"{params / 1e6:.2f} M",
        }
        for row, value in ours.items():
            print(f"| {gib:g} | {row} | {NNUNET[row] if gib == 8 else ''} | {value} |")


if __name__ == "__main__":
    main()
