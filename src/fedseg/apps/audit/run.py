"""The leakage audit: attack what each method sends, as the server observes it under each protection,
and score the reconstructions against the images the sites used (``fedseg audit``).

For every message of :mod:`.messages` and every protection of :mod:`.observe`, the attack of
:mod:`.inversion` reconstructs the attacked site's batch (plain, DP) or every audited site's batch
(secure aggregation: the server sees only the sum), and :mod:`.metrics` scores it.  Each row
has two baselines, scored the same way as the reconstructions: *unrelated images* (as many validation, else
test, images of each site as the attacker reconstructs of it) and *the site's mean image* (the per-pixel
mean of its training images, one copy per reconstruction) — what an attacker who knows only what the
site's images look like already "reconstructs", with no message at all.  Beside PSNR/SSIM, each
reconstruction is *re-identified*: its nearest neighbour among the sites' images (the attacked ones and
every other: training, validation, test) under normalized cross-correlation; the top-1 rate is reported
with its chance rate.  The verdict (:func:`fedseg.apps.audit.metrics.verdict`) is "leaks" only when the
reconstructions beat the mean image in PSNR and re-identify the attacked images above chance.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedseg.algorithms import known_sections
from fedseg.apps.audit.inversion import REFERENCE_ATTACK, AttackConfig, Part, Update, invert
from fedseg.apps.audit.messages import (
    MESSAGES,
    METHOD_MESSAGES,
    Sent,
    known_seed_message,
    private_messages,
    sent_by_sites,
    server_isolated,
    weights_of,
)
from fedseg.apps.audit.metrics import match_scores, reidentification, verdict
from fedseg.apps.audit.observe import PROTECTIONS, secure_sum
from fedseg.apps.audit.page import audit_page
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.arrays import Arrays
from fedseg.foundation.config import RunConfig, load_run_config
from fedseg.foundation.device import resolve_device
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.seeding import generator
from fedseg.seams.checkpoint import save_json
from fedseg.site.runtime import SiteData, batch_of, dataset_len
from fedseg.site.workload import Workload, workload_for

__all__ = [
    "AuditOptions",
    "AuditRow",
    "audit_federation",
    "audit_table",
    "budget",
    "budget_line",
    "messages_for",
    "run_audit",
    "write_audit",
]


@dataclass(frozen=True)
class AuditOptions:
    """What the audit attacks and how.

    messages
        Messages of :data:`fedseg.apps.audit.messages.MESSAGES` to attack.
    protections
        Observations of :data:`fedseg.apps.audit.observe.PROTECTIONS`.
    sites
        The federation's first ``sites`` sites take part (secure aggregation sums over them); the first
        is the attacked site.
    images
        Images per batch (the sites' ``train.batch_size`` for the audit; 1 is the attacker's best case).
    clip, sigma
        DP's clipping bound C and noise multiplier σ (``privacy.clip``, ``privacy.noise_multiplier``).
    attack
        The attack's settings.
    """

    messages: tuple[str, ...] = MESSAGES
    protections: tuple[str, ...] = PROTECTIONS
    sites: int = 3
    images: int = 1
    clip: float = 1.0
    sigma: float = 1.0
    attack: AttackConfig = field(default_factory=AttackConfig)

    def validate(self) -> None:
        bad = [m for m in self.messages if m not in MESSAGES]
        if bad:
            raise ConfigError(f"unknown audit message(s) {bad}; choose from {', '.join(MESSAGES)}")
        bad = [p for p in self.protections if p not in PROTECTIONS]
        if bad:
            raise ConfigError(f"unknown protection(s) {bad}; choose from {', '.join(PROTECTIONS)}")
        if self.sites < 1 or self.images < 1:
            raise ConfigError(f"the audit needs --sites >= 1 and --images >= 1, got {self.sites} and {self.images}")
        if self.clip <= 0 or self.sigma <= 0:
            raise ConfigError(f"DP needs a clip bound > 0 and a noise multiplier > 0, got {self.clip}, {self.sigma}")
        self.attack.validate()


@dataclass
class AuditRow:
    """One attack: a message under a protection, its scores, and the images to draw."""

    message: str
    protection: str
    kind: str
    scores: dict[str, Any]
    baseline: dict[str, Any]
    cost: float
    seconds: float
    reconstructions: torch.Tensor
    truth: torch.Tensor
    notes: list[str] = field(default_factory=list)
    mean_image: dict[str, Any] = field(default_factory=dict)
    """The site's mean image scored as the reconstructions are (:func:`match_scores`)."""
    reid: dict[str, Any] = field(default_factory=dict)
    """Re-identification of the reconstructions (:func:`fedseg.apps.audit.metrics.reidentification`)."""
    verdict: str = ""
    """:func:`fedseg.apps.audit.metrics.verdict`; ``"not attacked"`` when there was nothing to attack."""

    def summary(self) -> dict[str, Any]:
        """The row's numbers (``audit.json``)."""
        return {
            "message": self.message,
            "protection": self.protection,
            "kind": self.kind,
            "psnr_mean": self.scores["psnr_mean"],
            "psnr_max": self.scores["psnr_max"],
            "ssim_mean": self.scores["ssim_mean"],
            "ssim_max": self.scores["ssim_max"],
            "psnr": self.scores["psnr"],
            "ssim": self.scores["ssim"],
            "pairs": self.scores["pairs"],
            "baseline_psnr_mean": self.baseline["psnr_mean"],
            "baseline_ssim_mean": self.baseline["ssim_mean"],
            "mean_image_psnr_mean": self.mean_image.get("psnr_mean"),
            "mean_image_ssim_mean": self.mean_image.get("ssim_mean"),
            "reid_rate": self.reid.get("rate"),
            "reid_chance": self.reid.get("chance"),
            "reid_pool": self.reid.get("pool"),
            "reid_nearest": self.reid.get("nearest"),
            "reid_ncc_nearest": self.reid.get("ncc_nearest"),
            "reid_ncc_true": self.reid.get("ncc_true_best"),
            "verdict": self.verdict,
            "reconstructed": int(self.reconstructions.shape[0]),
            "true_images": int(self.truth.shape[0]),
            "matching_cost": self.cost,
            "seconds": self.seconds,
            "notes": self.notes,
        }


def messages_for(method: str) -> tuple[str, ...]:
    """The messages ``fedseg audit --method`` attacks (``"all"``: every one)."""
    if method == "all":
        return MESSAGES
    if method not in METHOD_MESSAGES:
        raise ConfigError(f"unknown audit method {method!r}; use one of {', '.join([*METHOD_MESSAGES, 'all'])}")
    return METHOD_MESSAGES[method]


def _unrelated(data: SiteData, n: int, like: torch.Tensor) -> torch.Tensor:
    """``n`` images of a site that no message was computed from (its validation, else test cases)."""
    for split in (data.val, data.test):
        if split is not None and dataset_len(split) > 0:
            idx = torch.arange(n) % dataset_len(split)
            x, _ = batch_of(split, idx)
            return x.to(like.dtype).cpu()
    raise ConfigError("an audited site has no validation or test cases to draw an unrelated image from; add some")


def _split_images(split: Any) -> torch.Tensor | None:
    n = dataset_len(split)
    if n == 0:
        return None
    x, _ = batch_of(split, torch.arange(n))
    return x.detach().cpu()


def _mean_image(data: SiteData, n: int, like: torch.Tensor) -> torch.Tensor:
    """``n`` copies of the per-pixel mean of a site's training images: "knows what the site's images look like"."""
    x = _split_images(data.train)
    if x is None or x.shape[1:] != like.shape[1:]:
        raise ConfigError(
            f"the audit's mean-image baseline needs training images shaped like the attacked batch "
            f"{tuple(like.shape[1:])}; got {None if x is None else tuple(x.shape[1:])} (a patch transform?)"
        )
    return x.to(torch.float64).mean(dim=0, keepdim=True).to(like.dtype).expand(n, *x.shape[1:]).clone()


def _same_up_to_flips(candidates: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """For each candidate image, whether it equals one of ``truth`` exactly up to flips of its spatial axes
    (the selector's augmentation): (N,) bool."""
    dims = list(range(1, candidates.dim() - 1))  # the spatial axes of one image (C, *spatial)
    known = {t.contiguous().numpy().tobytes() for t in truth.detach().cpu()}
    flips = [[d for i, d in enumerate(dims) if mask >> i & 1] for mask in range(1 << len(dims))]
    return torch.tensor(
        [
            any((c.flip(f) if f else c).contiguous().numpy().tobytes() in known for f in flips)
            for c in candidates.detach().cpu()
        ],
        dtype=torch.bool,
    )


def _pool(truth: torch.Tensor, sites: Sequence[SiteData]) -> torch.Tensor:
    """The images a reconstruction is re-identified among: the true images first, then every image of the
    ``sites`` (training, validation, test) shaped like them and not one of them up to flips."""
    others = [
        x
        for d in sites
        for split in (d.train, d.val, d.test)
        if (x := _split_images(split)) is not None and x.shape[1:] == truth.shape[1:]
    ]
    if not others:
        return truth
    rest = torch.cat(others).to(truth.dtype)
    return torch.cat([truth, rest[~_same_up_to_flips(rest, truth)]])


def _parts(s: Sent, weight: float, opts: AuditOptions) -> Part | Update:
    if s.kind == "update" and opts.attack.unroll and s.optimizer is not None:
        steps = [Part(tuple(x.shape), y, s.loss) for x, y in s.batches]
        return Update(steps, s.optimizer, weight)
    return Part(tuple(s.batch.shape), s.target, s.loss, weight)


def _count(part: Part | Update) -> int:
    return sum(p.shape[0] for p in part.steps) if isinstance(part, Update) else part.shape[0]


def _observation(
    sent: Sequence[Sent],
    private: Sequence[Arrays] | None,
    protection: str,
    opts: AuditOptions,
    extra: Callable[[str], tuple[Arrays | None, str]],
) -> tuple[Arrays | None, list[Part | Update], torch.Tensor, list[int], list[str]]:
    """What the server observes (``private``: the sites' messages under DP; ``extra(protection)``: the known-seed
    and active-server observations), the attacker's model of it (its parts), the true images to score against
    and the sites they are of.  The observation is None when the server got nothing to attack."""
    dp = "dp" in protection
    notes: list[str] = []
    observed: Arrays | None
    if protection in ("dp-known-seed", "malicious-server"):
        observed, note = extra(protection)
        notes.append(note)
    else:
        shown = list(private) if dp and private is not None else [s.message for s in sent]
        observed = shown[0]
    if dp:
        notes.append(
            f"privacy.dp = 'sample' (DP-SGD: C = {opts.clip}, σ = {opts.sigma})"
            if sent[0].kind == "gradient"
            else f"privacy.dp = 'client' (C = {opts.clip}, σ = {opts.sigma}; each site adds its share σC/√K of the noise)"
        )
    if protection.startswith("secagg"):
        # client-level DP runs with even weights (its sensitivity holds for the plain mean)
        weights = [1 / len(sent)] * len(sent) if dp and sent[0].kind == "update" else weights_of(sent)
        shown = list(private) if dp and private is not None else [s.message for s in sent]
        observed = secure_sum(shown, weights)
        parts = [_parts(s, w, opts) for s, w in zip(sent, weights)]
        truth = torch.cat([s.seen for s in sent])
        site_ids = list(range(len(sent)))
        notes.append(f"the server sees the sum over {len(sent)} sites; the attacker models all their batches")
    else:
        parts = [_parts(sent[0], 1.0, opts)]
        truth = sent[0].seen
        site_ids = [0]
    if sent[0].kind == "update":
        if isinstance(parts[0], Update):
            notes.append(
                f"update after {sent[0].steps} local step(s) of {sent[0].optimizer.kind if sent[0].optimizer else '?'}"
                " unrolled (one dummy batch per step)"
            )
        else:
            notes.append(f"update after {sent[0].steps} local step(s) attacked as one gradient of its first batch")
    return observed, parts, truth, site_ids, notes


def run_audit(
    cfg: RunConfig,
    workload: Workload,
    data: Mapping[str, SiteData],
    opts: AuditOptions,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], list[AuditRow]]:
    """Attack every message of ``opts`` under every protection; returns the ``audit.json`` document and
    the rows (with their images)."""
    opts.validate()
    if len(data) < opts.sites:
        raise ConfigError(f"the federation has {len(data)} site(s); give --sites {len(data)} or fewer")
    names = list(data)[: opts.sites]
    data = {n: data[n] for n in names}
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=opts.images))
    device = resolve_device(cfg.device)
    rows: list[AuditRow] = []
    for message in opts.messages:
        t0 = time.perf_counter()
        sent = sent_by_sites(message, cfg, workload, data)
        private = None
        if any("dp" in p for p in opts.protections):
            private = private_messages(message, cfg, workload, data, opts.clip, opts.sigma)
        log(f"{message}: messages of {len(sent)} site(s) built in {time.perf_counter() - t0:.1f} s")

        def extra(protection: str, message: str = message, sent: list[Sent] = sent) -> tuple[Arrays | None, str]:
            if protection == "dp-known-seed":
                known = known_seed_message(message, cfg, workload, data, opts.clip, opts.sigma, sent[0])
                return known.message, known.note()
            isolated = server_isolated(message, cfg, workload, data, sent[0])
            return isolated.message, isolated.how

        for protection in opts.protections:
            t = time.perf_counter()
            observed, parts, truth, site_ids, notes = _observation(sent, private, protection, opts, extra)
            counts = [_count(p) for p in parts]
            site_data = [data[names[k]] for k in site_ids]
            if observed is None:  # nothing to attack: the sites did not let the server have it
                recon = torch.cat([_mean_image(d, c, truth) for d, c in zip(site_data, counts)])
                cost, verdict_ = float("nan"), "not attacked"
            else:
                inv = invert(
                    sent[0].model,
                    sent[0].weights,
                    observed,
                    parts,
                    opts.attack,
                    generator(cfg.seed, "audit-attack", message, protection),
                    device,
                )
                recon, cost, verdict_ = torch.cat(inv.images), inv.cost, ""
            scores = match_scores(recon, truth)
            # as many unrelated images, and copies of the mean image, of each site as the attacker reconstructs of it
            unrelated = torch.cat([_unrelated(d, c, recon) for d, c in zip(site_data, counts)])
            baseline = match_scores(unrelated, truth)
            mean_image = match_scores(torch.cat([_mean_image(d, c, truth) for d, c in zip(site_data, counts)]), truth)
            pool = _pool(truth, site_data)
            reid = reidentification(recon, pool, range(truth.shape[0]))
            if not verdict_:
                verdict_ = verdict(scores["psnr_mean"], mean_image["psnr_mean"], reid["rate"], reid["chance"])
            row = AuditRow(
                message=message,
                protection=protection,
                kind=sent[0].kind,
                scores=scores,
                baseline=baseline,
                cost=cost,
                seconds=time.perf_counter() - t,
                reconstructions=recon,
                truth=truth,
                notes=notes,
                mean_image=mean_image,
                reid=reid,
                verdict=verdict_,
            )
            rows.append(row)
            log(
                f"  {protection:16s} PSNR {scores['psnr_mean']:6.2f} dB (max {scores['psnr_max']:6.2f}), "
                f"SSIM {scores['ssim_mean']:.3f}; mean image {mean_image['psnr_mean']:6.2f} dB, unrelated "
                f"{baseline['psnr_mean']:6.2f} dB; re-identified {reid['rate']:.2f} (chance {reid['chance']:.2f}) "
                f"-> {verdict_}  [{row.seconds:.1f} s]"
            )
            for n in notes:
                log(f"    {n}")
    doc = {
        "federation": str(cfg.federation),
        "seed": cfg.seed,
        "device": str(device),
        "sites": names,
        "attacked_site": names[0],
        "images_per_batch": opts.images,
        "model": dataclasses.asdict(cfg.model),
        "train": {
            "optimizer": cfg.train.optimizer,
            "lr": cfg.train.lr,
            "local_steps": cfg.train.local_steps,
            "local_epochs": cfg.train.local_epochs,
        },
        "attack": dataclasses.asdict(opts.attack),
        "budget": budget(opts.attack),
        "dp": {"clip": opts.clip, "sigma": opts.sigma},
        "verdict_rule": (
            "leaks: mean PSNR above the site's mean image's AND top-1 re-identification (nearest neighbour by "
            "normalized cross-correlation among the sites' images) above chance; else no leak shown"
        ),
        "assumptions": [
            "honest-but-curious server (every row but malicious-server): it knows the model, the weights it sent, "
            "the loss and the batch size",
            "the labels of the attacked batch are known to the attacker (the selector's label is the site's index)",
            (
                "an update w_before − w_after after local steps is modelled by unrolling the site's optimizer"
                if opts.attack.unroll
                else "an update w_before − w_after after local steps is attacked as one gradient"
            ),
            "dp-known-seed: the attacker knows the run seed and the site's index, and regenerates its DP noise",
            "malicious-server: the server runs secure aggregation but chooses whom it asks and what steps it sends",
        ],
        "rows": [r.summary() for r in rows],
    }
    return doc, rows


def budget(attack: AttackConfig) -> dict[str, Any]:
    """The attack's budget against the reference attack's (:data:`fedseg.apps.audit.inversion.REFERENCE_ATTACK`)."""
    ref = REFERENCE_ATTACK
    return {
        "iterations": attack.iterations,
        "restarts": attack.restarts,
        "reference_iterations": ref["iterations"],
        "reference_restarts": ref["restarts"],
        "fraction_of_reference": attack.iterations * attack.restarts / (ref["iterations"] * ref["restarts"]),
        "reference": ref["source"],
    }


def budget_line(attack: AttackConfig) -> str:
    """One sentence: the attack's budget against the reference's."""
    b = budget(attack)
    return (
        f"attack budget {b['iterations']} iterations × {b['restarts']} restart(s) per reconstruction, "
        f"{100 * b['fraction_of_reference']:.2g}% of the reference attack's {b['reference_iterations']:,} × "
        f"{b['reference_restarts']} (Geiping et al. 2020, released code); a weaker attack can miss a leak"
    )


def audit_table(rows: Sequence[AuditRow], attack: AttackConfig | None = None) -> str:
    """The audit table in Markdown: PSNR/SSIM per message × protection, the mean-image and unrelated-image
    baselines, re-identification against chance and the verdict; with ``attack``, its budget below."""
    lines = [
        "| message | protection | PSNR (dB) | SSIM | mean image PSNR | unrelated PSNR | re-identified | chance "
        "| verdict |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.message} | {r.protection} | {r.scores['psnr_mean']:.2f} | {r.scores['ssim_mean']:.3f} | "
            f"{r.mean_image.get('psnr_mean', float('nan')):.2f} | {r.baseline['psnr_mean']:.2f} | "
            f"{r.reid.get('rate', float('nan')):.2f} | {r.reid.get('chance', float('nan')):.2f} | {r.verdict} |"
        )
    if attack is not None:
        lines += ["", budget_line(attack) + "."]
    return "\n".join(lines)


def write_audit(doc: Mapping[str, Any], rows: Sequence[AuditRow], out: str | Path) -> tuple[Path, Path]:
    """``out/audit.json`` and ``out/audit.html``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(dict(doc), out / "audit.json")
    page = out / "audit.html"
    page.write_text(audit_page(doc, rows, audit_table(rows)))
    return out / "audit.json", page


def audit_federation(
    config: str | Path,
    out: str | Path,
    opts: AuditOptions,
    overrides: Sequence[str] = (),
    seed: int | None = None,
    device: str | None = None,
    log: Callable[[str], None] = print,
    iterations_for: Callable[[torch.device], int] | None = None,
) -> tuple[dict[str, Any], list[AuditRow], Path, Path]:
    """``fedseg audit``: load a run config or federation spec (with ``overrides``), load its sites' data,
    attack, and write ``out/audit.json`` and ``out/audit.html``.  ``iterations_for(device)``, when given, sets
    the attack's iterations for the run's device (``fedseg audit`` without ``--iterations``)."""
    fields: dict[str, Any] = {"seed": seed}
    if device is not None:
        fields["device"] = device
    cfg = load_run_config(config, list(overrides), known_sections(), **fields)
    resolved = resolve_device(cfg.device)  # a missing CUDA stops here, before any data is read
    if iterations_for is not None:
        opts = dataclasses.replace(opts, attack=dataclasses.replace(opts.attack, iterations=iterations_for(resolved)))
    fed, data = load_federation_data(cfg.federation)
    doc, rows = run_audit(cfg, workload_for(fed, cfg), data, opts, log=log)
    json_path, page = write_audit(doc, rows, out)
    return doc, rows, json_path, page
