"""Run configuration: the settings' schema, its value checks and its loader, in one import.

- :mod:`~fedseg.foundation.config.schema`: the frozen dataclasses of a run's settings
  (``RunConfig`` and its sections ``[model]``, ``[train]``, ``[eval]``, ``[simulation]``,
  ``[privacy]``), each field with its description, and their validation.
- :mod:`~fedseg.foundation.config.coerce`: what a value of an annotated type may be (one message
  naming the key and the allowed values for anything else).
- :mod:`~fedseg.foundation.config.loader`: TOML files and ``--set`` overrides into those dataclasses
  (:func:`load_run_config`), and the resolved config back to TOML (:func:`dump_toml`).
"""

from __future__ import annotations

from fedseg.foundation.config.coerce import check_literals
from fedseg.foundation.config.loader import (
    apply_overrides,
    dataclass_from_dict,
    dump_toml,
    load_run_config,
    toml_value,
)
from fedseg.foundation.config.schema import (
    BEST_CRITERIA,
    DP_MODES,
    EXCLUSIVE,
    OPTIMIZERS,
    SECTIONS,
    UNET_CHANNELS,
    UNET_STRIDES,
    VOLUME_READS,
    BestCriterion,
    DPMode,
    DPRandomness,
    EvalConfig,
    FloatDtype,
    ModelConfig,
    OptimizerName,
    Precision,
    PrivacyConfig,
    RunConfig,
    SimulationConfig,
    TrainConfig,
    VolumeReads,
)

__all__ = [
    "BEST_CRITERIA",
    "DP_MODES",
    "EXCLUSIVE",
    "OPTIMIZERS",
    "SECTIONS",
    "UNET_CHANNELS",
    "UNET_STRIDES",
    "VOLUME_READS",
    "BestCriterion",
    "DPMode",
    "DPRandomness",
    "EvalConfig",
    "FloatDtype",
    "ModelConfig",
    "OptimizerName",
    "Precision",
    "PrivacyConfig",
    "RunConfig",
    "SimulationConfig",
    "TrainConfig",
    "VolumeReads",
    "apply_overrides",
    "check_literals",
    "dataclass_from_dict",
    "dump_toml",
    "load_run_config",
    "toml_value",
]
