"""fedseg's data layer: federation specs, datalists, loading, validation, synthetic data.

See docs/data.md for the file formats.
"""

from fedseg.data.datalist import SPLITS, load_datalist, write_datalist
from fedseg.data.loading import SegmentationDataset, load_split
from fedseg.data.spec import FederationSpec, SiteSpec, load_federation
from fedseg.data.synth import synthesize
from fedseg.data.validate import Problem, raise_if_invalid, validate_federation

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
