"""FGA benchmark: the paper's Table 1 layout on a synthetic two-site split with disjoint classes.

Remedios et al. 2020, Section 3.1: MNIST split so that site A holds digits 0–4 and
site B digits 5–9; a small CNN (4 conv layers of 16 3×3 filters with ReLU and max
pooling, global max pooling, a linear layer to 10 classes); float64; Adam; FGA's
per-site batch is half the centralized batch; the test set holds all ten classes
and is the same at both sites.  Here the digits are replaced by ten synthetic
"glyph" classes generated in this script from a seeded generator (nothing is
downloaded): each class is a fixed random pattern of three thick strokes, and a
sample is its class pattern shifted by up to ±2 px, scaled in brightness and
covered with Gaussian noise.

Rows: single site A, single site B, centralized (A∪B, pooled and shuffled), Cyclic A
(CWT ending at A), Cyclic B, FWA, FGA — balanced accuracy of the final model on the
common test set — plus the largest weight difference between FGA and centralized
training on the concatenation of FGA's site batches (same data order, the paper's
"AUB"), and bytes per epoch (round) for FGA, FWA and CWT.

    .venv/bin/python benchmarks/fga.py --out runs/bench-fga --md runs/bench-fga/fga.md
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm
from fedseg.foundation.config import EvalConfig, RunConfig, TrainConfig
from fedseg.foundation.seeding import derive_seed, generator
from fedseg.simulation.runner import simulate
from fedseg.site.batches import SiteData
from fedseg.site.runtime import Site
from fedseg.site.workload import Workload, accuracy_metric

NUM_CLASSES = 10


# ----------------------------------------------------------------------------- data
def glyph_prototypes(size: int, g: torch.Generator) -> torch.Tensor:
    """(10, size, size) class patterns: three random strokes each, thickened to 3 px."""
    protos = torch.zeros(NUM_CLASSES, size, size)
    ts = torch.linspace(0, 1, 3 * size)
    for c in range(NUM_CLASSES):
        for _ in range(3):
            p0 = torch.randint(3, size - 3, (2,), generator=g).float()
            p1 = torch.randint(3, size - 3, (2,), generator=g).float()
            pts = (p0[None] + (p1 - p0)[None] * ts[:, None]).round().long()
            protos[c, pts[:, 0], pts[:, 1]] = 1.0
    return F.max_pool2d(protos[:, None], 3, 1, 1)[:, 0]


def glyph_split(
    protos: torch.Tensor, classes: list[int], per_class: int, g: torch.Generator, noise: float
) -> TensorDataset:
    """``per_class`` samples of each class in ``classes``: shifted, brightness-scaled, noisy patterns (N, 1, H, W)."""
    xs, ys = [], []
    for c in classes:
        for _ in range(per_class):
            dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
            img = torch.roll(protos[c], shifts=(dy, dx), dims=(0, 1))
            scale = 0.6 + 0.6 * float(torch.rand((), generator=g))
            xs.append(scale * img + noise * torch.randn(img.shape, generator=g))
            ys.append(c)
    perm = torch.randperm(len(ys), generator=g)
    return TensorDataset(torch.stack(xs)[perm][:, None], torch.tensor(ys)[perm])


def make_sites(
    size: int, train_per_class: int, val_per_class: int, test_per_class: int, noise: float, seed: int
) -> tuple[dict[str, SiteData], torch.Tensor]:
    """Site A: classes 0–4, site B: 5–9 (train and validation); one test set of all 10 classes shared by both."""
    g = generator(seed, "bench-fga-data")
    protos = glyph_prototypes(size, g)
    test = glyph_split(protos, list(range(NUM_CLASSES)), test_per_class, g, noise)
    sites = {}
    for name, classes in (("A", [0, 1, 2, 3, 4]), ("B", [5, 6, 7, 8, 9])):
        sites[name] = SiteData(
            train=glyph_split(protos, classes, train_per_class, g, noise),
            val=glyph_split(protos, classes, val_per_class, g, noise),
            test=test,
        )
    return sites, test.tensors[1]


# ---------------------------------------------------------------------------- model
class SmallCNN(nn.Module):
    """The paper's MNIST CNN: 4 × (conv 3×3, 16 filters, ReLU), max pooling between them, global max pooling, linear."""

    def __init__(self, filters: int = 16):
        super().__init__()
        c = filters
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, c, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(c, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.amax(self.features(x), dim=(2, 3)))


def workload(filters: int) -> Workload:
    return Workload(
        build_model=lambda: SmallCNN(filters),
        loss=nn.CrossEntropyLoss(),
        metric=accuracy_metric,
        metric_names=("accuracy",),
    )


# ---------------------------------------------------------------------- measurements
def balanced_accuracy(correct: list[float], labels: torch.Tensor) -> float:
    """Mean over classes of the fraction of that class's test cases classified correctly."""
    c = torch.tensor(correct, dtype=torch.float64)
    return float(torch.stack([c[labels == k].mean() for k in range(NUM_CLASSES)]).mean())


def bytes_per_epoch(res: dict) -> float:
    """Mean over rounds 2… of the bytes (sent + received, all sites) of a training round."""
    per = [sum(b["sent"] + b["received"] for b in e["bytes"].values()) for e in res["history"][1:]]
    return sum(per) / len(per)


def same_order_centralized(cfg: RunConfig, wl: Workload, sites: dict[str, SiteData], steps: int) -> nn.Module:
    """Centralized training on the concatenation of FGA's site batches, step by step (the paper's unshuffled AUB)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", "global"))
        model = wl.build_model()
    model = model.to(torch.float64 if cfg.train.dtype == "float64" else torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas))
    algo = get_algorithm(cfg)
    runtimes = [Site(s, i, d, wl, cfg, algo) for i, (s, d) in enumerate(sites.items())]
    model.train()
    for rnd in range(1, cfg.rounds + 1):
        for batch in zip(*(r.batches(rnd, "train", steps=steps) for r in runtimes)):
            x = torch.cat([b[0] for b in batch])
            y = torch.cat([b[1] for b in batch])
            opt.zero_grad(set_to_none=True)
            wl.loss(model(x), y).backward()
            opt.step()
    return model


@torch.no_grad()
def model_correct(model: nn.Module, test: TensorDataset, dtype: torch.dtype) -> list[float]:
    model.eval()
    x, y = test.tensors
    return (model(x.to(dtype)).argmax(1) == y).double().tolist()


# ------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-fga")
    ap.add_argument("--md", default=None, help="write the Markdown fragment here (default OUT/fga.md)")
    ap.add_argument("--size", type=int, default=16, help="image side (px)")
    ap.add_argument("--train-per-class", type=int, default=200)
    ap.add_argument("--val-per-class", type=int, default=20)
    ap.add_argument("--test-per-class", type=int, default=50)
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--filters", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40, help="epochs (one round = one epoch for every method)")
    ap.add_argument(
        "--batch", type=int, default=200, help="batch of single-site, centralized, FWA, CWT; FGA uses batch/2 per site"
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    sites, test_labels = make_sites(
        args.size, args.train_per_class, args.val_per_class, args.test_per_class, args.noise, args.seed
    )
    wl = workload(args.filters)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32

    def cfg(method: str, batch: int, params: dict | None = None) -> RunConfig:
        return RunConfig(
            federation="(synthetic glyphs, in memory)",
            method=method,
            rounds=args.rounds,
            seed=args.seed,
            train=TrainConfig(batch_size=batch, lr=args.lr, dtype=args.dtype),
            eval=EvalConfig(every=args.rounds, batch_size=256),  # evaluate the final model, as the paper does
            params=params or {},
        )

    runs = {
        "local": cfg("local", args.batch),
        "centralized": cfg("centralized", args.batch),
        "cwt-A": cfg("cwt", args.batch, {"cwt": {"end": "A"}}),
        "cwt-B": cfg("cwt", args.batch, {"cwt": {"end": "B"}}),
        "fwa": cfg("fwa", args.batch),
        "fga": cfg("fga", args.batch // 2),
    }
    results, times = {}, {}
    for name, c in runs.items():
        t0 = time.perf_counter()
        results[name] = simulate(c, wl, sites, out=out / name, progress=False, log=lambda m: None)
        times[name] = time.perf_counter() - t0
        print(f"{name}: {times[name]:.1f} s", flush=True)

    def bacc(res: dict, cand: str) -> float:
        return balanced_accuracy(res["per_case_dice"][cand]["A"], test_labels)

    rows = [
        ("Single site", "A", bacc(results["local"], "local/A")),
        ("Single site", "B", bacc(results["local"], "local/B")),
        ("Single site", "A∪B (centralized, pooled and shuffled)", bacc(results["centralized"], "global")),
        ("Cyclic", "A (ends at A)", bacc(results["cwt-A"], "global")),
        ("Cyclic", "B (ends at B)", bacc(results["cwt-B"], "global")),
        ("FWA", "A, B", bacc(results["fwa"], "global")),
        ("FGA", "A, B", bacc(results["fga"], "global")),
    ]
    # FGA vs centralized on the same batches in the same order
    steps = results["fga"]["history"][0]["steps"]
    t0 = time.perf_counter()
    ref = same_order_centralized(runs["fga"], wl, sites, steps)
    times["same-order centralized"] = time.perf_counter() - t0
    rows.insert(
        3,
        (
            "Single site",
            "A∪B (centralized on FGA's batches, same order)",
            balanced_accuracy(model_correct(ref, sites["A"].test, dtype), test_labels),
        ),
    )
    fga_w = {
        k.removeprefix("global/"): v for k, v in load_file(str(out / "fga/checkpoints/server.safetensors")).items()
    }
    ref_w = ref.state_dict()
    max_diff = max(float((fga_w[k].double() - ref_w[k].double()).abs().max()) for k in ref_w)
    max_w = max(float(v.double().abs().max()) for v in ref_w.values())
    traffic = {m: bytes_per_epoch(results[m]) for m in ("fga", "fwa", "cwt-A", "centralized")}
    n_params = sum(v.numel() for v in ref_w.values())
    wall = time.perf_counter() - t_all

    lines = [
        "| Method | Train site | Balanced accuracy (%) |",
        "| --- | --- | ---: |",
    ]
    for method, train_site, v in rows:
        lines.append(f"| {method} | {train_site} | {100 * v:.2f} |")
    md = [
        f"Synthetic 10-class glyphs, {args.size}×{args.size} px, noise {args.noise}; site A classes 0–4, site B 5–9; "
        f"{args.train_per_class * 5} training + {args.val_per_class * 5} validation cases per site; one test set of "
        f"{args.test_per_class * NUM_CLASSES} cases ({args.test_per_class} per class) shared by both sites.",
        f"CNN 4×conv{args.filters} ({n_params} parameters), Adam lr {args.lr}, {args.dtype}, {args.rounds} epochs (rounds), "
        f"batch {args.batch} (FGA: {args.batch // 2} per site, {steps} lockstep steps per epoch); final model evaluated; seed {args.seed}.",
        "",
        *lines,
        "",
        f"* FGA vs centralized on the same batches (float64): max |Δw| = {max_diff:.3e} (max |w| = {max_w:.3f}, relative {max_diff / max_w:.3e}) after {steps * args.rounds} Adam steps.",
        f"* Bytes per epoch (sent + received, both sites, rounds ≥ 2): FGA {traffic['fga'] / 1e6:.3f} MB, FWA {traffic['fwa'] / 1e6:.3f} MB "
        f"(FGA/FWA = {traffic['fga'] / traffic['fwa']:.1f}×), CWT {traffic['cwt-A'] / 1e6:.3f} MB, centralized (simulation only) {traffic['centralized'] / 1e6:.3f} MB.",
        "* Wall time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f"; total {wall:.1f}.",
        f"* Machine: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s).",
    ]
    text = "\n".join(md) + "\n"
    print(text)
    md_path = Path(args.md) if args.md else out / "fga.md"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    summary = {
        "balanced_accuracy": {f"{m} {t}": v for m, t, v in rows},
        "max_weight_diff_fga_vs_same_order_centralized": max_diff,
        "bytes_per_epoch": traffic,
        "times_s": times,
        "wall_s": wall,
        "args": vars(args),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
