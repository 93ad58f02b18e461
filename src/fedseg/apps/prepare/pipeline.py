"""``prepare(name, raw, out)``: from downloaded archives to a federation fedseg can run.

For each site: list its cases (:attr:`Dataset.discover`), split its *patients* into training,
validation and testing (seeded, the federation's shares), convert each case into PNG images and
labels (skipping a case whose sources are unchanged since it was last converted: size and SHA-256
of every source file, kept in ``OUT/<site>/manifest.json``), and write the site's datalist. Then
write ``OUT/federation.toml`` and return a summary whose table sets the counts beside the paper's.
Nothing under ``raw`` is written.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedseg.apps.prepare.base import Case, Dataset, Federation, require
from fedseg.apps.prepare.registry import federation
from fedseg.data.datalist import SPLITS, load_datalist, write_datalist
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.foundation.seeding import derive_seed

MANIFEST = "manifest.json"
FORMAT = 2


@dataclass
class SiteResult:
    """What preparing one site gave.

    Attributes
    ----------
    site : str
        Site name.
    counts : dict
        Split -> number of 2D units (images or slices) in the datalist.
    patients : dict
        Split -> number of patients.
    paper : tuple of int
        The paper's (train, validation, test) counts.
    converted, reused : int
        Cases converted by this call / kept from a previous call (sources unchanged).
    bad : dict
        Case id -> why it was skipped (corrupt or unexpected file).
    excluded : dict
        Case id -> why it is left out on purpose.
    notes : dict
        Case id -> remarks on a quirk of its files read around (converted, but worth a look).
    """

    site: str
    counts: dict[str, int]
    patients: dict[str, int]
    paper: tuple[int, int, int]
    converted: int = 0
    reused: int = 0
    bad: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class Summary:
    """The result of :func:`prepare`: the spec written, one :class:`SiteResult` per site, the table, and
    the problems for which ``fedseg validate`` would refuse the spec (empty when it can run)."""

    spec: Path
    federation: Federation
    sites: list[SiteResult]
    problems: list[str] = field(default_factory=list)

    def table(self) -> str:
        """Counts per site and split beside the paper's, and where and why they differ."""
        unit = self.federation.unit
        head = f"{'site':<16} {'train':>6} {'val':>6} {'test':>6}   {'paper train/val/test':>20}   patients    note"
        lines = [f"{self.federation.name}: {unit} per site and split ({self.federation.paper})", head, "-" * len(head)]
        notes = []
        for r in self.sites:
            ours = tuple(r.counts[s] for s in SPLITS)
            pts = "/".join(str(r.patients[s]) for s in SPLITS)
            paper = "/".join(map(str, r.paper))
            note = (
                "as in the paper"
                if ours == r.paper
                else "differs: "
                + ", ".join(f"{s} {o - p:+d}" for s, o, p in zip(("train", "val", "test"), ours, r.paper) if o != p)
            )
            if r.bad:
                note += f"; {len(r.bad)} case(s) skipped as bad"
            lines.append(f"{r.site:<16} {ours[0]:>6} {ours[1]:>6} {ours[2]:>6}   {paper:>20}   {pts:<10}  {note}")
            for cid, why in r.bad.items():
                notes.append(f"  {r.site}: {cid}: skipped: {why}")
            for cid, why in r.excluded.items():
                notes.append(f"  {r.site}: {cid}: left out: {why}")
            for cid, why in r.notes.items():
                notes.append(f"  {r.site}: {cid}: note: {why}")
        total = tuple(sum(r.counts[s] for r in self.sites) for s in SPLITS)
        ptotal = tuple(sum(r.paper[i] for r in self.sites) for i in range(3))
        lines.append(f"{'all':<16} {total[0]:>6} {total[1]:>6} {total[2]:>6}   {'/'.join(map(str, ptotal)):>20}")
        if any(tuple(r.counts[s] for s in SPLITS) != r.paper for r in self.sites):
            if self.federation.note:
                lines.append(self.federation.note)
            lines.append(
                f"Where counts differ: the paper's release or selection of a dataset differs from the one read here "
                f"(its {unit} per patient, excluded or bad cases); the splits here are by patient, "
                f"{'/'.join(f'{f:g}' for f in self.federation.fractions)} of the patients (docs/datasets.md)."
            )
        bad = sum(len(r.bad) for r in self.sites)
        if notes:
            lines += ["", *notes]
        if bad:
            lines.append(f"{bad} bad case(s) skipped in all (--strict stops at the first)")
        if self.problems:
            lines += ["", f"WARNING: fedseg validate will refuse {self.spec}:", *(f"  {p}" for p in self.problems)]
        return "\n".join(lines)


def split_patients(
    patients: list[str], seed: int, key: str, fractions=(0.5, 0.25, 0.25), rest: int = 2
) -> dict[str, str]:
    """Patient -> split: the sorted patients in a seeded random order, then ``round(n × f)`` patients to
    each split but ``rest``, which takes those left, in the order training, validation, testing.
    With the default (NVIDIA FLARE's rule; Python rounds halves to even) 101 images give 50/25/26 as
    FedSM's Table 1; Auto-FedAvg's 95/93/93 of 281 is ``(0.34, 0.33, 0.33)`` with ``rest=0``. With at least
    as many patients as splits none is left empty: an empty split takes one patient from the largest
    (3 patients give 1/1/1, not 2/1/0)."""
    ordered = sorted(set(patients))
    rng = np.random.default_rng(derive_seed(seed, "prepare", key))
    order = [ordered[i] for i in rng.permutation(len(ordered))]
    n = len(order)
    sizes = [round(n * f) for f in fractions]
    sizes[rest] = n - sum(sz for i, sz in enumerate(sizes) if i != rest)
    if sizes[rest] < 0:
        raise ConfigError(f"prepare: shares {fractions} do not fit {n} patients -> use shares summing to 1")
    while n >= len(sizes) and min(sizes) == 0:
        sizes[sizes.index(max(sizes))] -= 1
        sizes[sizes.index(0)] += 1
    split = [SPLITS[i] for i, sz in enumerate(sizes) for _ in range(sz)]
    return dict(zip(order, split))


def fingerprint(paths: tuple[Path, ...], raw: Path) -> dict[str, list]:
    """``{path relative to raw: [size, sha256]}`` of a case's source files (missing ones: [-1, ""])."""
    out = {}
    for p in paths:
        rel = p.relative_to(raw).as_posix() if p.is_relative_to(raw) else str(p)
        if not p.is_file():
            out[rel] = [-1, ""]
            continue
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        out[rel] = [p.stat().st_size, h.hexdigest()]
    return out


def _save_json(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _load_manifest(path: Path, ds: Dataset, force: bool) -> dict:
    fresh = {"format": FORMAT, "dataset": ds.title, "steps": ds.steps, "cases": {}}
    if force or not path.is_file():
        return fresh
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return fresh
    if doc.get("format") != FORMAT or doc.get("steps") != ds.steps or not isinstance(doc.get("cases"), dict):
        return fresh
    return doc


def _write_units(site_dir: Path, case: Case, units) -> list[list[str]]:
    """PNG files for numpy arrays; NIfTI files, with their geometry, for SimpleITK images (volumes)."""
    from PIL import Image

    outputs = []
    for suffix, image, label in units:
        volume = hasattr(image, "GetSize")
        ext = ".nii.gz" if volume else ".png"
        name = f"{case.case_id}/{suffix}{ext}" if suffix else f"{case.case_id}{ext}"
        pair = []
        for kind, arr in (("images", image), ("labels", label)):
            path = site_dir / kind / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if volume:
                require("SimpleITK", case.case_id).WriteImage(arr, str(path), True)
            else:
                Image.fromarray(np.ascontiguousarray(arr)).save(path)
            pair.append(f"{kind}/{name}")
        outputs.append(pair)
    return outputs


def _remove_outputs(site_dir: Path, entry: dict) -> None:
    for pair in entry.get("outputs", []):
        for rel in pair:
            (site_dir / rel).unlink(missing_ok=True)


def _prepare_site(
    fed: Federation, ds: Dataset, cases: list[Case], raw: Path, out: Path, force: bool, strict: bool, seed: int, log
) -> SiteResult:
    site_dir = out / ds.site
    site_dir.mkdir(parents=True, exist_ok=True)
    excluded = {c.case_id: ds.excluded[c.case_id] for c in cases if c.case_id in ds.excluded}
    cases = [c for c in cases if c.case_id not in ds.excluded]
    ids = [c.case_id for c in cases]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise DataError(f"{ds.title}: case ids {dup[:5]} occur twice under --raw -> keep one copy of each case")
    manifest_path = site_dir / MANIFEST
    manifest = _load_manifest(manifest_path, ds, force)
    old = manifest["cases"]
    for cid in set(old) - set(ids):  # a case no longer under --raw (or now excluded)
        _remove_outputs(site_dir, old.pop(cid))
    result = SiteResult(ds.site, {}, {}, fed.paper_counts[ds.site], excluded=excluded)
    try:
        for i, case in enumerate(cases):
            prints = fingerprint(case.sources, raw)
            entry = old.get(case.case_id)
            if (
                entry is not None
                and entry.get("sources") == prints
                and entry.get("outputs")
                and all((site_dir / rel).is_file() for pair in entry["outputs"] for rel in pair)
            ):
                entry["patient"] = case.patient
                result.reused += 1
                continue
            if entry is not None:
                _remove_outputs(site_dir, old.pop(case.case_id))
            try:
                units = list(ds.convert(case))
                if not units:
                    raise DataError("no image with a labelled structure (empty mask) -> check the case's mask")
            except ConfigError:
                raise
            except Exception as e:  # a corrupt or unexpected file of a third-party release
                why = f"{type(e).__name__}: {e}" if not isinstance(e, DataError) else str(e)
                if strict:
                    raise DataError(f"{ds.title}: case {case.case_id}: {why} (stopped by --strict)") from e
                result.bad[case.case_id] = why
                continue
            old[case.case_id] = {
                "patient": case.patient,
                "sources": prints,
                "outputs": _write_units(site_dir, case, units),
                "notes": list(case.info.get("notes", [])),
            }
            result.converted += 1
            if result.converted % 25 == 0:
                _save_json(manifest_path, manifest)
                log(f"  {ds.site}: {i + 1}/{len(cases)} cases")
    finally:
        # the splits are drawn over the patients whose cases converted, so a skipped case leaves no hole
        split_of = split_patients([e["patient"] for e in old.values()], seed, ds.site, fed.fractions, fed.rest)
        for entry in old.values():
            entry["split"] = split_of[entry["patient"]]
        manifest["bad"] = result.bad
        _save_json(manifest_path, manifest)
    result.notes = {cid: "; ".join(old[cid]["notes"]) for cid in sorted(old) if old[cid].get("notes")}
    splits: dict[str, list[dict[str, str | Path]]] = {s: [] for s in SPLITS}
    patients: dict[str, set[str]] = {s: set() for s in SPLITS}
    for cid in sorted(old):
        entry = old[cid]
        for img, lbl in entry["outputs"]:
            splits[entry["split"]].append({"image": site_dir / img, "label": site_dir / lbl})
        patients[entry["split"]].add(entry["patient"])
    write_datalist(site_dir / "datalist.json", splits)
    result.counts = {s: len(splits[s]) for s in SPLITS}
    result.patients = {s: len(patients[s]) for s in SPLITS}
    return result


def _spec_toml(fed: Federation, sites: list[str]) -> str:
    lines = [
        f'name = "{fed.name}"',
        "",
        "[data]",
        f'mode = "{fed.mode}"',
        f"spatial_dims = {3 if fed.mode == '3d' else 2}",
        f"in_channels = {fed.in_channels}",
        *([f"image_size = {list(fed.image_size)}"] if fed.image_size else []),
        "",
        "[data.labels]",
        *(f"{k} = {json.dumps(v)}" for k, v in fed.labels.items()),
    ]
    for s in sites:
        lines += ["", "[[sites]]", f'name = "{s}"', f'datalist = "{s}/datalist.json"']
    return "\n".join(lines) + "\n"


def prepare(
    name: str | Federation,
    raw: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    strict: bool = False,
    seed: int = 0,
    sites: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> Summary:
    """Build federation ``name`` in ``out`` from the archives unpacked under ``raw``.

    Parameters
    ----------
    name : str or Federation
        A federation of :data:`fedseg.apps.prepare.registry.FEDERATIONS` (``fedsm-fundus``, ``fedsm-prostate``),
        or a :class:`Federation` itself.
    raw : str or Path
        The folder holding each dataset in its expected layout (docs/datasets.md); only read.
    out : str or Path
        Where the spec, the datalists, the converted images and the manifests go.
    force : bool
        Convert every case again, even those whose sources are unchanged.
    strict : bool
        Stop at the first bad case instead of skipping it.
    seed : int
        Seed of the patient splits.
    sites : list of str, optional
        Prepare only these sites (the spec names them and the sites prepared in ``out`` before).
    log : callable
        Progress messages.

    Returns
    -------
    Summary
        The spec path and per-site counts; ``summary.table()`` sets them beside the paper's.

    Raises
    ------
    DataError
        A dataset's folder is missing (the message names each missing dataset, the expected path and
        where to get it), or, with ``strict``, a case is bad.
    ConfigError
        Unknown federation or site, a bad seed, or a reader library missing (names the extra).
    """
    fed = name if isinstance(name, Federation) else federation(name)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"prepare: seed must be a non-negative integer, got {seed!r} -> pass e.g. --seed 0")
    chosen = [fed.dataset(s) for s in sites] if sites else list(fed.datasets)
    raw = Path(raw).expanduser().resolve()
    out = Path(out).expanduser().resolve()
    if not raw.is_dir():
        raise DataError(f"prepare: --raw {raw} is not a folder -> point --raw at the folder holding the downloads")
    if out == raw or out.is_relative_to(raw):
        raise ConfigError(f"prepare: --out {out} lies inside --raw {raw} -> write the federation elsewhere")
    found, missing = {}, []
    for ds in chosen:
        try:
            root = raw / ds.folder
            if not root.is_dir():
                raise ds.missing(root)
            found[ds.site] = ds.discover(root)
        except DataError as e:
            missing.append(str(e))
    if missing:
        raise DataError("\n".join(missing))
    for ds in chosen:
        for module in ds.needs:
            require(module, ds.title)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for ds in chosen:
        log(f"{ds.site}: {len(found[ds.site])} cases ({ds.title})")
        results.append(_prepare_site(fed, ds, found[ds.site], raw, out, force, strict, seed, log))
    # the spec names every site of the federation prepared in OUT, by this call or a previous one
    done = [d.site for d in fed.datasets if d in chosen or (out / d.site / "datalist.json").is_file()]
    spec = out / "federation.toml"
    problems = _empty_splits(out, done, results)
    for p in problems:
        log(f"WARNING: {p}")
    spec.write_text(_spec_toml(fed, done), encoding="utf-8")
    return Summary(spec, fed, results, problems)


def _empty_splits(out: Path, sites: list[str], results: list[SiteResult]) -> list[str]:
    """What ``fedseg validate`` refuses in the datalists written: a site with an empty split, and why."""
    prepared = {r.site: r for r in results}
    problems = []
    for site in sites:
        if site in prepared:
            counts, patients, bad = prepared[site].counts, sum(prepared[site].patients.values()), prepared[site].bad
        else:
            try:
                doc = load_datalist(out / site / "datalist.json", site=site)
            except DataError as e:
                problems.append(str(e))
                continue
            counts, patients, bad = {s: len(doc[s]) for s in SPLITS}, None, {}
        empty = [s for s in SPLITS if counts[s] == 0]
        if empty:
            had = f" has {patients} patient(s) with converted cases" if patients is not None else ""
            problems.append(
                f"{site}: split(s) {', '.join(empty)} empty: the site{had}, each split needs one"
                + (f" ({len(bad)} case(s) skipped as bad, listed in the table)" if bad else "")
                + " -> fix or add cases under --raw and run prepare again, or prepare the other sites into "
                "another --out with --sites"
            )
    return problems
