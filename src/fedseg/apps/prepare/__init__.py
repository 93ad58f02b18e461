"""``fedseg prepare``: the papers' public datasets, as downloaded, turned into fedseg federations.

``prepare("fedsm-fundus", raw, out)`` reads each dataset's archives in their expected layout under
``raw`` (docs/datasets.md), converts them (:mod:`.fundus`, :mod:`.prostate`), splits each site by
patient and writes a federation spec, datalists and PNG files under ``out`` (:mod:`.pipeline`).
"""

from fedseg.apps.prepare.pipeline import Summary, prepare, split_patients
from fedseg.apps.prepare.registry import FEDERATIONS, federation, list_text

__all__ = ["FEDERATIONS", "Summary", "federation", "list_text", "prepare", "split_patients"]
