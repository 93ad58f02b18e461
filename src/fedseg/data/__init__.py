"""fedseg's data layer: federation specs, datalists, loading, validation, synthetic data.

See docs/data.md for the file formats. The names below are imported when first used, so a module of
this layer (a synthesis worker process, say) loads without torch unless it needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedseg.data.datalist import SPLITS, load_datalist, write_datalist
    from fedseg.data.loading import SegmentationDataset, load_split
    from fedseg.data.spec import FederationSpec, SiteSpec, load_federation
    from fedseg.data.synth import synthesize
    from fedseg.data.validate import Problem, raise_if_invalid, validate_federation

_HOME = {
    "SPLITS": "datalist",
    "load_datalist": "datalist",
    "write_datalist": "datalist",
    "SegmentationDataset": "loading",
    "load_split": "loading",
    "FederationSpec": "spec",
    "SiteSpec": "spec",
    "load_federation": "spec",
    "synthesize": "synth",
    "Problem": "validate",
    "raise_if_invalid": "validate",
    "validate_federation": "validate",
}

__all__ = [
    "SPLITS",
    "FederationSpec",
    "Problem",
    "SegmentationDataset",
    "SiteSpec",
    "load_datalist",
    "load_federation",
    "load_split",
    "raise_if_invalid",
    "synthesize",
    "validate_federation",
    "write_datalist",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'fedseg.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedseg.data.{_HOME[name]}"), name)
    globals()[name] = value
    return value
