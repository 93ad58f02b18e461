"""fedseg's ``centralized`` method against a plain MONAI pipeline written independently, on ``ct-lesion``.

Both train one model on the pooled training cases of every site for the same number of steps, with the same
patch, network, batch, optimizer and loss (``--loss``), and both score every test case in its scan's own grid
(Dice per label channel, mean over the organ and lesion channels per case, then over a site's cases, then over
the sites: the client average).

The MONAI pipeline uses only MONAI and numpy; from fedseg it takes the synthetic data (``synthesize_ct``)
and the plan's target spacing, patch and U-Net topology (so the two train the same network on the same
grid), nothing else:

* ``LoadImaged`` → ``EnsureChannelFirstd`` → ``Orientationd("RAS")`` → ``Spacingd`` to the plan's target
  spacing (image bilinear, label nearest) → ``ScaleIntensityRanged`` that clips to the pooled foreground
  0.5 / 99.5 percentiles and z-scores with the pooled foreground mean and sd (nnU-Net's CT scheme, the
  statistics computed here with numpy over every training case's foreground voxels) → the nested label
  channels (organ = label in {1, 2}, lesion = label 2);
* training: ``SpatialPadd`` to the patch, ``RandCropByPosNegLabeld`` (pos 1 : neg 2, one third of the patches
  on foreground, as fedseg's ``train.foreground_share``), a MONAI ``UNet`` (the plan's channels and strides, 2
  residual units, instance norm, as fedseg builds it), ``DiceCELoss(sigmoid=True)`` (``--loss dice``:
  ``DiceLoss``), Adam;
* validation every ``k`` steps (the interval fedseg's run derived, in steps) on the validation volumes in the
  plan's grid (gaussian ``sliding_window_inference``, overlap 0.5); the best model by validation Dice is
  tested, as fedseg tests its best round;
* test: the same preprocessing without the label, gaussian sliding windows, ``Invertd`` back through the
  spacing and orientation steps into the image file's grid (linear interpolation of the logits), sigmoid >
  0.5, ``DiceMetric`` against the label file as stored (``ignore_empty=False``, as fedseg's metric).

A round of fedseg's centralized method is ``--round-steps`` steps per site on the pooled data, K × ``--round-steps``
steps in all (K sites: the budget of one FedAvg round), so fedseg runs ``--steps / (K × --round-steps)`` rounds.
The times exclude loading and preprocessing (both pipelines keep their cases in memory); torch's optimizer
module is imported before either clock starts (its first use imports ``torch._dynamo``, seconds on a CPU,
once per process).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/volumes_monai.py --steps 240

Writes ``OUT/data`` (the federation, reused), ``OUT/fedseg*/results.json`` and ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _report import emit, md_table
from volumes import f, planned_federation, train

from fedseg.data.datalist import load_datalist
from fedseg.data.volumes.plan import PERCENTILES


def files(fed, split: str) -> dict[str, list[dict[str, str]]]:
    """``{site: [{"image", "label"}]}`` of one split (absolute paths)."""
    return {s.name: load_datalist(s.datalist, site=s.name)[split] for s in fed.sites}


def pooled_statistics(fed) -> dict[str, float]:
    """Foreground (label > 0) statistics of every training case of every site pooled, in file units."""
    import nibabel as nib

    fg = []
    for cases in files(fed, "training").values():
        for e in cases:
            img = np.asarray(nib.load(e["image"]).dataobj, dtype=np.float64)
            lab = np.asarray(nib.load(e["label"]).dataobj)
            fg.append(img[lab > 0])
    v = np.concatenate(fg)
    lo, hi = np.percentile(v, PERCENTILES)
    return {"lo": float(lo), "hi": float(hi), "mean": float(v.mean()), "sd": float(v.std())}


def label_channels(labels: dict[str, tuple[int, ...]]):
    """``(1, X, Y, Z)`` label values → one binary channel per declared label (nested: organ = [1, 2])."""

    def convert(lab):
        return torch.cat([torch.isin(lab, torch.tensor(list(v), dtype=lab.dtype)).float() for v in labels.values()])

    return convert


def preprocessing(spacing, stats, labels, with_label: bool):
    from monai import transforms as T

    keys = ["image", "label"] if with_label else ["image"]
    lo, hi, mean, sd = stats["lo"], stats["hi"], stats["mean"], stats["sd"]
    out = [
        T.LoadImaged(keys, image_only=False),
        T.EnsureChannelFirstd(keys),
        T.Orientationd(keys, axcodes="RAS"),
        T.Spacingd(keys, pixdim=spacing, mode=("bilinear", "nearest")[: len(keys)]),
        # clip to [lo, hi] and z-score with the pooled mean and sd: one linear map with clipping
        T.ScaleIntensityRanged("image", a_min=lo, a_max=hi, b_min=(lo - mean) / sd, b_max=(hi - mean) / sd, clip=True),
        T.EnsureTyped("image", dtype=torch.float32),
    ]
    if with_label:
        out.append(T.Lambdad("label", label_channels(labels)))
    return out


def monai_run(fed, plan, stats, args, every_steps: int) -> dict[str, Any]:
    """Train and test the plain MONAI pipeline (module docstring); returns per-site test Dice."""
    from monai import transforms as T
    from monai.data import CacheDataset, DataLoader, list_data_collate
    from monai.inferers import sliding_window_inference
    from monai.losses import DiceCELoss, DiceLoss
    from monai.metrics import DiceMetric
    from monai.networks.layers import Norm
    from monai.networks.nets import UNet
    from monai.utils import set_determinism

    set_determinism(seed=args.seed)
    labels = dict(fed.labels)
    spacing = tuple(plan.target_spacing)
    patch = tuple(plan.patch_size)
    train_files = [e for cases in files(fed, "training").values() for e in cases]
    val_files = [e for cases in files(fed, "validation").values() for e in cases]
    train_tf = T.Compose(
        [
            *preprocessing(spacing, stats, labels, True),
            T.SpatialPadd(["image", "label"], spatial_size=patch),
            T.RandCropByPosNegLabeld(
                ["image", "label"], label_key="label", spatial_size=patch, pos=1, neg=2, num_samples=1
            ),
        ]
    )
    val_tf = T.Compose(preprocessing(spacing, stats, labels, True))
    train_ds = CacheDataset(train_files, train_tf, cache_rate=1.0, num_workers=0, progress=False)
    val_ds = CacheDataset(val_files, val_tf, cache_rate=1.0, num_workers=0, progress=False)
    loader = DataLoader(train_ds, batch_size=args.batch, shuffle=True, num_workers=0, collate_fn=list_data_collate)
    model = UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=len(labels),
        channels=tuple(plan.channels),
        strides=tuple(tuple(s) for s in plan.strides),
        num_res_units=2,
        norm=Norm.INSTANCE,
    )
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = DiceLoss(sigmoid=True) if args.loss == "dice" else DiceCELoss(sigmoid=True)
    dice = DiceMetric(include_background=True, reduction="none", ignore_empty=False)

    def predict(x):
        return sliding_window_inference(x, patch, 4, model, overlap=0.5, mode="gaussian")

    def validate() -> float:
        model.eval()
        scores = []
        with torch.no_grad():
            for d in val_ds:
                pred = (torch.sigmoid(predict(d["image"][None])) > 0.5).float()
                scores.append(dice(pred, d["label"][None]).mean().item())
                dice.reset()
        model.train()
        return float(np.mean(scores))

    best, best_state, step, t0, history = -1.0, None, 0, time.perf_counter(), []
    while step < args.steps:
        for batch in loader:
            opt.zero_grad()
            loss = loss_fn(model(batch["image"]), batch["label"])
            loss.backward()
            opt.step()
            step += 1
            if step % every_steps == 0 or step == args.steps:
                score = validate()
                history.append([step, score])
                if score > best:
                    best, best_state = score, copy.deepcopy(model.state_dict())
            if step >= args.steps:
                break
    train_s = time.perf_counter() - t0
    model.load_state_dict(best_state)
    model.eval()

    test_tf = T.Compose(preprocessing(spacing, stats, labels, False))
    invert = T.Invertd("pred", transform=test_tf, orig_keys="image", nearest_interp=False, to_tensor=True)
    load_label = T.Compose([T.LoadImage(image_only=True), T.EnsureChannelFirst(), label_channels(labels)])
    per_site = {}
    with torch.no_grad():
        for site, cases in files(fed, "testing").items():
            scores = []
            for e in cases:
                d = test_tf({"image": e["image"]})
                d["pred"] = predict(d["image"][None])[0]
                d = invert(d)
                pred = (torch.sigmoid(torch.as_tensor(d["pred"])) > 0.5).float()
                target = torch.as_tensor(load_label(e["label"]))
                assert pred.shape == target.shape, (pred.shape, target.shape)
                scores.append(dice(pred[None], target[None]).mean().item())
                dice.reset()
            per_site[site] = float(np.mean(scores))
    return {
        "per_site_dice": per_site,
        "client_avg_dice": float(np.mean(list(per_site.values()))),
        "best_val_dice": best,
        "val_dice": history,
        "train_s": train_s,
        "wall_time_s": time.perf_counter() - t0,
    }


def fedseg_run(spec: Path, fed, plan, overrides: list[str], seed: int, out: Path) -> dict[str, Any]:
    """fedseg's ``centralized`` method on the plan, as ``fedseg run`` does (interval derived, best round tested)."""
    return train(spec, fed, {s.name: plan for s in fed.sites}, "centralized", overrides, seed, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=48, help="in-plane voxels of the ct-lesion preset")
    ap.add_argument("--scale", type=float, default=0.5, help="cases per split relative to the preset")
    ap.add_argument("--steps", type=int, default=240, help="training steps (both pipelines)")
    ap.add_argument(
        "--round-steps", type=int, default=16, help="fedseg's local steps per site and round (K x this per round)"
    )
    ap.add_argument("--loss", choices=("dicece", "dice"), default="dicece", help="both pipelines' loss")
    ap.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--patch-voxels", type=int, default=24 * 24 * 16, help="the plan's patch budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--augment", default="off,auto", help="fedseg train.augment values to run (comma-separated)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", default="runs/bench_volumes_monai")
    ap.add_argument("--md", default=None, help="also write the Markdown fragment here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # the one-time import, before either clock starts
    t_start = time.perf_counter()
    out = Path(args.out)
    spec, fed, plan = planned_federation(out, args.seed, args.scale, args.size, args.patch_voxels)
    round_steps = args.round_steps * len(fed.sites)  # centralized: K x train.local_steps per round
    if args.steps % round_steps:
        ap.error(f"--steps must be a multiple of {len(fed.sites)} sites x --round-steps = {round_steps}")
    rounds = args.steps // round_steps
    base = [
        f"rounds={rounds}",
        f"train.local_steps={args.round_steps}",
        "train.local_epochs=none",
        f"train.batch_size={args.batch}",
        f"train.lr={args.lr}",
        f"train.loss={args.loss}",
        f"checkpoint_every={rounds}",
    ]
    sites = [s.name for s in fed.sites]
    summary: dict[str, Any] = {"args": vars(args), "plan": plan.to_json(), "runs": {}}
    rows, every = [], 1
    for augment in [a for a in args.augment.split(",") if a]:
        res = fedseg_run(spec, fed, plan, [*base, f"train.augment={augment}"], args.seed, out / f"fedseg-{augment}")
        every = res["config"]["eval"]["every"]
        label = f"fedseg centralized (train.augment = {augment})"
        summary["runs"][label] = {k: res.get(k) for k in ("per_site_dice", "client_avg_dice", "wall_time_s")}
        rows.append(
            [
                label,
                *[f(res["per_site_dice"][s]) for s in sites],
                f(res["client_avg_dice"]),
                f"{res['wall_time_s']:.0f}",
            ]
        )
        print(f"{label}: client avg Dice {res['client_avg_dice']:.3f} ({res['wall_time_s']:.0f} s)", flush=True)
    stats = pooled_statistics(fed)
    res = monai_run(fed, plan, stats, args, every * round_steps)
    label = "plain MONAI (no augmentation)"
    summary["runs"][label] = res
    rows.append(
        [label, *[f(res["per_site_dice"][s]) for s in sites], f(res["client_avg_dice"]), f"{res['wall_time_s']:.0f}"]
    )
    print(f"{label}: client avg Dice {res['client_avg_dice']:.3f} ({res['wall_time_s']:.0f} s)", flush=True)
    wall = time.perf_counter() - t_start
    shown = ("size", "scale", "steps", "round_steps", "batch", "lr", "loss", "patch_voxels", "seed")
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in shown)
    md = [
        "### fedseg centralized vs a plain MONAI pipeline on ct-lesion\n",
        *md_table(["Pipeline", *[f"Dice {s}" for s in sites], "Client Avg Dice", "Time (s)"], rows),
        "",
        f"{args.steps} steps of batch {args.batch}, Adam lr {args.lr}, patch {plan.patch_size}, U-Net channels "
        f"{plan.channels}, strides {plan.strides}, target spacing {[round(v, 3) for v in plan.target_spacing]} mm, "
        f"loss {args.loss}; validation every {every * round_steps} steps, the best model tested; test Dice in each "
        f"scan's own grid. Settings: `{flags}`. Machine: {platform.machine()}, {torch.get_num_threads()} torch "
        f"thread(s). Wall {wall:.0f} s.\n",
    ]
    summary["wall_s"] = wall
    summary["pooled_statistics"] = stats
    emit(md, args.md, out, summary)


if __name__ == "__main__":
    main()
