"""Volumes with their geometry: reading affines, federated planning, intensity schemes, the plan's grid.

See ``docs/data.md`` ("Volumes") for the pipeline step by step.
"""

from fedseg.data.volumes.fingerprint import site_fingerprint, site_histogram
from fedseg.data.volumes.geometry import Geometry, read_case, to_original_grid, to_plan_grid
from fedseg.data.volumes.intensity import INTENSITY_MODES, normalize_volume
from fedseg.data.volumes.plan import Plan, load_plan, make_plan, save_plan

__all__ = [
    "INTENSITY_MODES",
    "Geometry",
    "Plan",
    "load_plan",
    "make_plan",
    "normalize_volume",
    "read_case",
    "save_plan",
    "site_fingerprint",
    "site_histogram",
    "to_original_grid",
    "to_plan_grid",
]
