"""The leakage audit: attack what each method sends, as the server observes it under each protection,
and score the reconstructions against the images the sites used (``fedseg audit``).

For every message of :mod:`.messages` and every protection of :mod:`.observe`, the attack of
:mod:`.inversion` reconstructs the attacked site's batch (plain, DP) or every audited site's batch
(secure aggregation: the server sees only the sum), and :mod:`.metrics` scores it.  The baseline
of each attack is *unrelated* images: as many validation (else test) images of each site as the attacker
reconstructs of it, scored the same way — what an attacker who knows only what a typical image of the
site looks like already "reconstructs".
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
from fedseg.apps.audit.inversion import AttackConfig, Part, invert
from fedseg.apps.audit.messages import MESSAGES, METHOD_MESSAGES, Sent, private_messages, sent_by_sites, weights_of
from fedseg.apps.audit.metrics import match_scores
from fedseg.apps.audit.observe import PROTECTIONS, secure_sum
from fedseg.apps.audit.page import audit_page
from fedseg.foundation.arrays import Arrays
from fedseg.foundation.config import RunConfig, load_run_config
from fedseg.foundation.device import resolve_device
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.seeding import generator
from fedseg.seams.checkpoint import save_json
from fedseg.simulation.runner import load_federation_data
from fedseg.site.runtime import SiteData, batch_of, dataset_len
from fedseg.site.workload import Workload, workload_for

__all__ = ["AuditOptions", "AuditRow", "audit_federation", "audit_table", "messages_for", "run_audit", "write_audit"]


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
        if dataset_len(split) > 0:
            idx = torch.arange(n) % dataset_len(split)
            x, _ = batch_of(split, idx)
            return x.to(like.dtype).cpu()
    raise ConfigError("an audited site has no validation or test cases to draw an unrelated image from; add some")


def _observation(
    sent: Sequence[Sent], private: Sequence[Arrays] | None, protection: str, opts: AuditOptions
) -> tuple[Arrays, list[Part], torch.Tensor, list[str]]:
    """What the server observes (``private``: the sites' messages under DP), the attacker's model of it (its
    parts), and the true images to score against."""
    dp = "dp" in protection
    shown = list(private) if dp and private is not None else [s.message for s in sent]
    notes: list[str] = []
    if dp:
        notes.append(
            f"privacy.dp = 'sample' (DP-SGD: C = {opts.clip}, σ = {opts.sigma})"
            if sent[0].kind == "gradient"
            else f"privacy.dp = 'client' (C = {opts.clip}, σ = {opts.sigma}; each site adds its share σC/√K of the noise)"
        )
    if protection.startswith("secagg"):
        # client-level DP runs with even weights (its sensitivity holds for the plain mean)
        weights = [1 / len(sent)] * len(sent) if dp and sent[0].kind == "update" else weights_of(sent)
        observed = secure_sum(shown, weights)
        parts = [Part(tuple(s.batch.shape), s.target, s.loss, w) for s, w in zip(sent, weights)]
        truth = torch.cat([s.seen for s in sent])
        notes.append(f"the server sees the sum over {len(sent)} sites; the attacker models all their batches")
    else:
        observed = shown[0]
        s = sent[0]
        parts = [Part(tuple(s.batch.shape), s.target, s.loss, 1.0)]
        truth = s.seen
    if sent[0].kind == "update":
        notes.append(f"update after {sent[0].steps} local step(s) attacked as a gradient")
    return observed, parts, truth, notes


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
        for protection in opts.protections:
            t = time.perf_counter()
            observed, parts, truth, notes = _observation(sent, private, protection, opts)
            model = sent[0].model
            inv = invert(
                model,
                sent[0].weights,
                observed,
                parts,
                opts.attack,
                generator(cfg.seed, "audit-attack", message, protection),
                device,
            )
            recon = torch.cat(inv.images)
            scores = match_scores(recon, truth)
            # as many unrelated images of each site as the attacker reconstructs of it
            counts = [p.shape[0] for p in parts]
            unrelated = torch.cat([_unrelated(data[names[k]], c, recon) for k, c in enumerate(counts)])
            baseline = match_scores(unrelated, truth)
            row = AuditRow(
                message=message,
                protection=protection,
                kind=sent[0].kind,
                scores=scores,
                baseline=baseline,
                cost=inv.cost,
                seconds=time.perf_counter() - t,
                reconstructions=recon,
                truth=truth,
                notes=notes,
            )
            rows.append(row)
            log(
                f"  {protection:10s} PSNR {scores['psnr_mean']:6.2f} dB (max {scores['psnr_max']:6.2f}), "
                f"SSIM {scores['ssim_mean']:.3f}; unrelated image {baseline['psnr_mean']:6.2f} dB  "
                f"[{row.seconds:.1f} s]"
            )
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
        "dp": {"clip": opts.clip, "sigma": opts.sigma},
        "assumptions": [
            "honest-but-curious server: it knows the model, the weights it sent, the loss and the batch size",
            "the labels of the attacked batch are known to the attacker (the selector's label is the site's index)",
            "an update w_before − w_after after local steps is attacked as a gradient",
        ],
        "rows": [r.summary() for r in rows],
    }
    return doc, rows


def audit_table(rows: Sequence[AuditRow]) -> str:
    """The audit table in Markdown: PSNR/SSIM per message × protection, with the unrelated image's PSNR."""
    lines = [
        "| message | protection | PSNR (dB) | max PSNR | SSIM | unrelated image PSNR | unrelated SSIM |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.message} | {r.protection} | {r.scores['psnr_mean']:.2f} | {r.scores['psnr_max']:.2f} | "
            f"{r.scores['ssim_mean']:.3f} | {r.baseline['psnr_mean']:.2f} | {r.baseline['ssim_mean']:.3f} |"
        )
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
) -> tuple[dict[str, Any], list[AuditRow], Path, Path]:
    """``fedseg audit``: load a run config or federation spec (with ``overrides``), load its sites' data,
    attack, and write ``out/audit.json`` and ``out/audit.html``."""
    fields: dict[str, Any] = {"seed": seed}
    if device is not None:
        fields["device"] = device
    cfg = load_run_config(config, list(overrides), known_sections(), **fields)
    resolve_device(cfg.device)  # a missing CUDA stops here, before any data is read
    fed, data = load_federation_data(cfg.federation)
    doc, rows = run_audit(cfg, workload_for(fed, cfg), data, opts, log=log)
    json_path, page = write_audit(doc, rows, out)
    return doc, rows, json_path, page
