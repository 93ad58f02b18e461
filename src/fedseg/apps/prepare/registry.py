"""The federations ``fedseg prepare`` builds, their sites in the papers' order, and ``--list``."""

from __future__ import annotations

from fedseg.apps.prepare import fundus, prostate
from fedseg.apps.prepare.base import Federation
from fedseg.apps.prepare.pancreas import AUTOFEDAVG_PANCREAS
from fedseg.foundation.errors import ConfigError

FEDSM_FUNDUS = Federation(
    name="fedsm-fundus",
    paper="FedSM (Xu et al., CVPR 2022), Table 1: retinal disc and cup, 6 clients",
    datasets=fundus.DATASETS,
    labels={"disc": [1, 2], "cup": [2]},
    in_channels=3,
    image_size=(256, 256),
    paper_counts={
        "drishti-gs1": (50, 25, 26),
        "riga-binrushed": (98, 49, 48),
        "riga-magrabia": (47, 24, 23),
        "riga-messidor": (230, 115, 115),
        "rim-one-r3": (80, 40, 39),
        "refuge": (400, 200, 200),
    },
    unit="images",
    note="Table 1 is the full releases split 0.5/0.25/0.25 (101, 195, 94, 460, 159 and 800 images): a site that "
    "differs has a different release, missing files or bad cases.",
)
FEDSM_PROSTATE = Federation(
    name="fedsm-prostate",
    paper="FedSM (Xu et al., CVPR 2022), Table 2: prostate on T2 MR slices, 6 clients",
    datasets=prostate.DATASETS,
    labels={"prostate": [1]},
    in_channels=1,
    image_size=(256, 256),
    paper_counts={
        "i2cvb": (153, 77, 61),
        "msd": (404, 215, 245),
        "nci-isbi-3t": (464, 219, 198),
        "nci-isbi-dx": (361, 162, 150),
        "promise12": (609, 289, 329),
        "prostatex": (1179, 582, 532),
    },
    unit="slices",
    note="Table 2 (6,229 slices) does not say which slices FedSM kept; NVIDIA FLARE's 2D preparation of the same "
    "releases, which fedseg follows, gives 4,680 (762, 475, 555, 483, 778, 1,627 per site).",
)
FEDERATIONS = {f.name: f for f in (FEDSM_FUNDUS, FEDSM_PROSTATE, AUTOFEDAVG_PANCREAS)}


def federation(name: str) -> Federation:
    """The federation called ``name``; ConfigError listing the known ones otherwise."""
    try:
        return FEDERATIONS[name]
    except KeyError:
        raise ConfigError(
            f"prepare: no federation {name!r} -> use one of {sorted(FEDERATIONS)} (fedseg prepare --list)"
        ) from None


def list_text() -> str:
    """What ``fedseg prepare --list`` prints: per federation and site, where to get it, its licence,
    the folder expected under --raw and the libraries it is read with."""
    lines = []
    for fed in FEDERATIONS.values():
        lines += [f"{fed.name}: {fed.paper}", f"  fedseg prepare {fed.name} --raw DIR --out DIR", ""]
        for d in fed.datasets:
            lines += [
                f"  {d.site}: {d.title}",
                f"    get it:   {d.source}",
                f"    licence:  {d.licence}",
                f"    cite:     {d.citation}",
                "    layout:   " + "\n              ".join(d.layout.splitlines()),
                f"    steps:    {d.steps}",
            ]
            if d.needs:
                lines.append(f"    reads with: {', '.join(d.needs)} (pip install 'fedseg[prepare]')")
        lines.append("")
    lines.append("Layouts, preprocessing and citations in full: docs/datasets.md")
    return "\n".join(lines)
