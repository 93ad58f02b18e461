"""The run's settings: one frozen dataclass per section, each field with its description.

A field's docstring (the string right after it) is its description in ``fedseg settings`` and
docs/settings.md (:mod:`fedseg.foundation.settings` reads them); its type and default are the
setting's.  Every option that takes one of a few words is typed ``Literal[...]``; each section's
``validate`` refuses any other value (:func:`~fedseg.foundation.config.coerce.check_literals`) and
checks the section's ranges and the combinations of settings, with one message naming the key and
the fix.  Reading these from TOML and ``--set`` overrides, and writing them back, is
:mod:`fedseg.foundation.config.loader`.  The ``[privacy]`` section lives in
:mod:`fedseg.foundation.config.privacy` and is re-exported here with its word options.

Defaults follow the FedSM paper and its reference code (Section 4: Adam with
betas (0.9, 0.999), Dice loss, 1 local epoch, 2D U-Net) unless noted.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from fedseg.foundation.config.coerce import check_literals
from fedseg.foundation.config.privacy import DP_MODES, DPMode, DPRandomness, PrivacyConfig
from fedseg.foundation.errors import ConfigError

__all__ = [
    "BEST_CRITERIA",
    "CHECKPOINT_KEEP",
    "DP_MODES",
    "EXCLUSIVE",
    "OPTIMIZERS",
    "SECTIONS",
    "UNET_CHANNELS",
    "UNET_STRIDES",
    "VOLUME_READS",
    "BestCriterion",
    "CheckpointKeep",
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
]


FloatDtype = Literal["float32", "float64"]
"""Values of ``train.dtype`` (:data:`fedseg.foundation.device.DTYPES` maps them to torch's)."""
BestCriterion = Literal["cases", "sites"]
"""Values of ``eval.best_criterion``."""
BEST_CRITERIA: tuple[str, ...] = typing.get_args(BestCriterion)
OptimizerName = Literal["adam", "sgd"]
"""Values of ``train.optimizer``."""
OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
Precision = Literal["fp32", "bf16", "fp16"]
"""Values of ``train.precision`` (:data:`fedseg.foundation.device.PRECISIONS` maps them to autocast's dtype)."""
VolumeReads = Literal["auto", "memory", "cache"]
"""Values of ``RunConfig.volume_reads`` (:func:`fedseg.data.volumes.load.memory_budget`)."""
VOLUME_READS: tuple[str, ...] = typing.get_args(VolumeReads)
CheckpointKeep = Literal["best", "final", "all"]
"""Values of ``RunConfig.checkpoint_keep`` (:func:`fedseg.seams.checkpoint.prune_checkpoints`)."""
CHECKPOINT_KEEP: tuple[str, ...] = typing.get_args(CheckpointKeep)

UNET_CHANNELS = (16, 32, 64, 128, 256)
"""``model.channels`` when unset outside a volume plan: the FedSM reference's 2D U-Net."""
UNET_STRIDES = (2, 2, 2, 2)
"""``model.strides`` when unset outside a volume plan."""
NetworkName = Literal[
    "auto", "unet", "fga-unet", "dynunet", "segresnet", "swinunetr", "unetr", "basicunet", "attentionunet"
]
"""``model.name``: the networks :func:`fedseg.models.build_model` builds by name."""


@dataclass(frozen=True)
class ModelConfig:
    """Segmentation network: any of MONAI's by name (``name``, ``kwargs``), FGA's reduced U-Net, or a
    user's own (``module``), optionally started from pretrained weights (``init``).

    Defaults are the FedSM reference's 2D U-Net: channels (16, 32, 64, 128, 256),
    strides 2 (:meth:`levels`; a volume run's plan sets both where the run leaves them unset),
    2 residual units, instance norm; volumes (``mode = "3d"``) get the plan's network (DynUNet on a GPU plan,
    the U-Net on a CPU plan) configured from the plan.
    """

    name: NetworkName = "auto"
    """'auto': for volumes (data.mode "3d") when model.channels and model.strides are left to the plan, the plan's network: MONAI's DynUNet on a plan made for a GPU, MONAI's U-Net on one made for a CPU (docs/data.md); else MONAI's U-Net (2D images, 2D patches, a network set by hand); 'unet': MONAI's U-Net; 'fga-unet': FGA's reduced U-Net (single 5x5 stride-2 convolutions down, the deepest 3x3, 5x5 transposed convolutions up, skips, ReLU, no normalization; the paper's network is channels = [2, 4, 8, 16, 32, 64], strides = [2, 2, 2, 2, 2]); 'dynunet' (nnU-Net's network: channels, strides, kernels), 'segresnet', 'swinunetr', 'unetr', 'basicunet', 'attentionunet': MONAI's networks of those names, with [model.kwargs] passed to their constructor (docs/models.md)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the network's constructor beside spatial_dims, in_channels and out_channels (e.g. [model.kwargs] feature_size = 24 for swinunetr); they override what fedseg derives from channels, strides and kernels."""
    module: str | None = None
    """A user's own network: 'package.module:factory', called as factory(spatial_dims=, in_channels=, out_channels=, **kwargs) and returning an nn.Module of logits; replaces name. The module must be importable at every site."""
    init: str | None = None
    """Start from pretrained weights: a .safetensors file of the network's state dict (a path relative to the run config's folder), checked key by key and shape by shape (a mismatch is an error naming the keys)."""
    channels: tuple[int, ...] | None = None
    """Feature channels of the U-Net levels, from the top level down (fga-unet: channels[0] at full resolution, the last transposed convolution's; channels[i] the i-th strided convolution's); unset: [16, 32, 64, 128, 256], or for volumes (``mode = "3d"``) the plan's when strides is unset too."""
    strides: tuple[int | tuple[int, ...], ...] | None = None
    """Down-sampling stride between consecutive levels (one entry fewer than channels); an entry may be a
    list with one stride per axis (a volume plan's ``[2, 2, 1]`` pools a thick-slice axis less); unset:
    [2, 2, 2, 2], or for volumes (``mode = "3d"``) the plan's when channels is unset too."""
    kernels: tuple[int | tuple[int, ...], ...] | None = None
    """dynunet: convolution kernel of each level (one per channel entry; a list per axis, e.g. the plan's [3, 3, 1] on a thick-slice axis); unset: 3 on every axis, or the plan's for volumes."""
    deep_supervision: bool = True
    """dynunet: also train on the outputs of the lower decoder levels (nnU-Net's deep supervision: loss weights halving per level); the network returns only the full-resolution output when evaluated."""
    num_res_units: int = 2
    """Residual units per U-Net block (0: plain convolutions; unet only)."""
    norm: Literal["instance", "batch", "none"] = "instance"
    """Normalization layer of the U-Net: 'instance', 'batch' or 'none' (unet only; fga-unet has none)."""
    dropout: float = 0.0
    """Dropout probability inside the U-Net blocks (unet only)."""
    roi_size: tuple[int, ...] | None = None
    """Patch size for training and sliding-window inference; for volumes (``mode = "3d"``) unset means the
    plan's patch size."""

    def levels(self) -> tuple[tuple[int, ...], tuple[int | tuple[int, ...], ...]]:
        """``(channels, strides)`` of the network, each unset one at :data:`UNET_CHANNELS` or :data:`UNET_STRIDES`."""
        return (
            UNET_CHANNELS if self.channels is None else tuple(self.channels),
            UNET_STRIDES if self.strides is None else tuple(self.strides),
        )

    def validate(self) -> None:
        check_literals(self, "model")
        channels, strides = self.levels()
        if self.module is not None and (":" not in self.module or not all(self.module.split(":", 1))):
            raise ConfigError(
                f"model.module = {self.module!r}; give 'package.module:factory' (e.g. 'mynets.seg:build')"
            )
        if self.kernels is not None and len(self.kernels) != len(channels):
            raise ConfigError(
                f"model.kernels has {len(self.kernels)} entries but model.channels has {len(channels)}; "
                "give one kernel per level"
            )
        if len(strides) != len(channels) - 1:
            raise ConfigError(
                f"model.strides has {len(strides)} entries but model.channels has {len(channels)}; "
                "give one stride fewer than channels"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Local training at every site.

    Local work is counted in epochs (``local_epochs``, the paper's E = 1) or in
    optimizer steps (``local_steps``); set exactly one (``--set`` of one replaces the other,
    :data:`EXCLUSIVE`).  The optimizer state of a
    site's training of a shared model persists across rounds unless
    ``reset_optimizer`` (the FedSM reference keeps the Adam moments).
    """

    batch_size: int = 8
    """Training images per local batch (>= 1)."""
    local_epochs: float | None = 1.0
    """Local work per round in passes over the site's training cases (> 0, may be fractional); exclusive with local_steps (--set of either replaces the other)."""
    local_steps: int | None = None
    """Local work per round in optimizer steps (>= 1); exclusive with local_epochs (--set of either replaces the other)."""
    optimizer: OptimizerName = "adam"
    """Local optimizer: 'adam' (with betas) or 'sgd' (with momentum)."""
    lr: float = 1e-3
    """Learning rate of the local optimizer (> 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2)."""
    momentum: float = 0.9
    """SGD momentum (optimizer = 'sgd' only)."""
    nesterov: bool = False
    """SGD with Nesterov momentum (optimizer = 'sgd' only; nnU-Net's: momentum 0.99, lr 0.01, weight_decay 3e-5)."""
    lr_schedule: Literal["constant", "poly"] = "constant"
    """Learning rate over the run: 'constant' (train.lr every round) or 'poly' (nnU-Net's: train.lr · (1 − (round − 1) / rounds)^0.9, set when a site starts a round's local work; a round stands for nnU-Net's epoch)."""
    weight_decay: float = 0.0
    """L2 weight decay of the local optimizer (torch's weight_decay of Adam or SGD; 0 = none)."""
    reset_optimizer: bool = False
    """Start a fresh optimizer state every round instead of keeping each site's moments across rounds."""
    bn_policy: Literal["average", "local"] = "average"
    """Batch-norm running statistics: 'average' them with the weights, or keep them 'local' to each site."""
    loss: Literal["auto", "dice", "dicece", "bce"] = "auto"
    """Training loss on the sigmoid outputs: 'dice' (MONAI DiceLoss), 'dicece' (Dice + cross-entropy) or 'bce' (binary cross-entropy); 'auto': 'dice' for 2D images (the papers'), 'dicece' for volumes (nnU-Net's; a Dice loss alone can settle on empty predictions when most patches hold no foreground)."""
    dtype: FloatDtype = "float32"
    """Floating-point type of weights, optimizer state and aggregation: 'float32' or 'float64'."""
    precision: Precision = "fp32"
    """Mixed precision of the forward/backward pass: 'fp32' (none), 'bf16' or 'fp16' (with a gradient
    scaler); weights, optimizer moments and aggregation stay in ``dtype`` (float32 or wider).  Methods
    that use raw gradients outside an optimizer step (APFL, pFedMe, Per-FedAvg, FGA, FedSM's 'fga'
    selector) refuse 'fp16' when the run starts and name bf16 (docs/architecture.md)."""
    data: Literal["auto", "device", "stream"] = "auto"
    """Where a site keeps its data on a GPU run: 'device' (moved once), 'stream' (pinned host memory,
    each batch copied as it is used) or 'auto' (device when it fits in half the free GPU memory)."""
    foreground_share: float = 0.33
    """Patch training (``model.roi_size``, volumes): the share of patches centred on a random foreground
    voxel (the rest are placed uniformly); nnU-Net uses one third, 0 places every patch uniformly."""
    augment: Literal["auto", "on", "off"] = "off"
    """Random augmentation of every training patch or image (MONAI: a flip along each axis, 90° and small in-plane rotations and scaling, intensity scale and shift, gaussian noise; seeded by run seed, site and round): 'on', 'off' (the default: augmentation did not raise Dice on ct-lesion, docs/results/volumes.md), or 'auto' (on for volumes, data.mode "3d" or "patches2d"; off for 2D images) for long trainings."""

    def loss_for(self, volumes: bool) -> str:
        """The loss a run trains with: ``loss``, or for "auto" Dice + cross-entropy on volumes and Dice on 2D images."""
        if self.loss != "auto":
            return self.loss
        return "dicece" if volumes else "dice"

    def validate(self) -> None:
        check_literals(self, "train")
        if not 0.0 <= self.foreground_share <= 1.0:
            raise ConfigError(f"train.foreground_share must be in [0, 1], got {self.foreground_share}")
        if (self.local_epochs is None) == (self.local_steps is None):
            raise ConfigError(
                "set exactly one of train.local_epochs and train.local_steps "
                f"(got local_epochs={self.local_epochs}, local_steps={self.local_steps}); "
                "remove one, or set it to none (--set train.local_steps=20 alone replaces the epochs)"
            )
        if self.local_epochs is not None and not self.local_epochs > 0:
            raise ConfigError(f"train.local_epochs must be > 0, got {self.local_epochs}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"train.local_steps must be >= 1, got {self.local_steps}")
        if self.batch_size < 1:
            raise ConfigError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum > 0):
            raise ConfigError(
                f"train.nesterov needs train.optimizer = 'sgd' and momentum > 0 (got {self.optimizer!r}, "
                f"momentum {self.momentum}) -> --set train.optimizer=sgd train.momentum=0.99, or nesterov=false"
            )
        if self.precision != "fp32" and self.dtype != "float32":
            raise ConfigError(
                f"train.precision = {self.precision!r} needs train.dtype = 'float32' (got {self.dtype!r}); "
                "mixed precision runs float32 weights"
            )


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation schedule and Dice computation."""

    every: int | None = None
    """Validate every this many rounds (and always after the last round); unset: every round, or for volumes
    the plan's interval (the plan's ``eval_every``, else validation kept to a share of the computation)."""
    threshold: float = 0.5
    """A label channel is lit where its sigmoid output is above this; the lit channels are painted into the label map that predict writes and every score is of (nested regions outermost first)."""
    batch_size: int = 16
    """Images per batch at validation and testing."""
    empty_dice: float = 1.0
    """Dice of a case (channel) whose mask and prediction are both empty: 1 (default: a correct
    "nothing here"), 0, or any value in [0, 1].  (MONAI's ``DiceMetric`` default ignores such
    cases instead; that is not offered, as every per-case mean would then need to skip them.)"""
    sw_overlap: float = 0.5
    """Overlap of neighbouring sliding windows (volumes and patch-trained models), as a fraction of the
    window; Auto-FedAvg's stride (64, 64, 8) on a 256 × 256 × 32 window is 0.75."""
    sw_weighting: Literal["gaussian", "constant"] = "gaussian"
    """How overlapping windows are blended: 'gaussian' (centre voxels count most, MONAI's and nnU-Net's
    choice) or 'constant'."""
    hd95: Literal["auto", "on", "off"] = "auto"
    """95th-percentile Hausdorff distance per test case beside Dice (MONAI's, in mm in each scan's own grid
    for volumes, in pixels for 2D images): 'auto' (default) for 3D runs only, 'on' also for 2D, 'off'
    never.  Both masks empty scores 0 and exactly one empty the diagonal of the grid's field of view;
    it is reported, never used to pick a best round."""
    best_criterion: BestCriterion = "cases"
    """Validation score that picks a candidate's best round: 'cases' (default; mean Dice over the
    pooled validation cases of its sites) or 'sites' (mean of the per-site mean Dice, the papers'
    client average)."""

    def validate(self) -> None:
        check_literals(self, "eval")
        if self.every is not None and self.every < 1:
            raise ConfigError(f"eval.every must be >= 1, got {self.every}")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"eval.threshold must be in (0, 1), got {self.threshold}")
        if not 0.0 <= self.sw_overlap < 1.0:
            raise ConfigError(f"eval.sw_overlap must be in [0, 1), got {self.sw_overlap}")
        if not 0.0 <= self.empty_dice <= 1.0:
            raise ConfigError(
                f"eval.empty_dice = {self.empty_dice}; give a value in [0, 1] (1: both empty counts as perfect, 0: as a miss)"
            )


@dataclass(frozen=True)
class SimulationConfig:
    """How a one-machine simulation executes the sites' local work (never changes what a site computes).

    ``vectorize = "on"`` runs the sites' local steps of a round as one vectorized computation
    (:mod:`fedseg.execution.vectorize`); ``"auto"`` turns it on on CUDA with at least 4 sites
    (``AUTO_MIN_SITES``; fewer gained nothing on an H100).  ``vectorize_group = 0`` stacks as many
    sites as fit in the free GPU memory on CUDA (all sites on the CPU).  ``cuda_graphs = "on"``
    removes the per-kernel launch cost that bounds small-image rounds (equal to the eager
    vectorized step).  Sites that take different numbers of steps (epoch mode, sites of different
    sizes) are stacked while they train: the stack shrinks as sites finish, so a round computes the
    arithmetic of training the sites one after another.  On the CPU ``on`` gains only where a step
    costs little arithmetic (small models and images); with the default U-Net at 64² a stacked step
    costs about what the sites' steps cost in turn, and packing the sites' weights and moments into
    the stack and back each round makes short rounds slower than ``off``.
    """

    vectorize: Literal["auto", "on", "off"] = "auto"
    """'on': a round's local steps of all sites run as one vectorized computation (equal to the sequential run to rounding, not bitwise; sites that finish their round early leave the stack, so no step computes a finished site); 'off': one site after another, as deployed sites run; 'auto': on on CUDA with at least 4 sites, off on the CPU. On the CPU 'on' is faster only for small models and images; with the default U-Net at 64² a stacked step costs what the sites' steps cost in turn, and packing the weights and moments each round makes rounds of few steps slower than 'off' (the speed-ups: docs/results/vectorize.md)."""
    vectorize_group: int = 0
    """Most sites stacked into one vectorized computation; 0 = as many as fit in free GPU memory on CUDA (all sites on the CPU); on CUDA a group that does not fit at its first step is split in halves."""
    cuda_graphs: Literal["on", "off"] = "on"
    """'on': on CUDA a vectorized group's local step is captured once as a CUDA graph and replayed (steps that cannot be captured run eagerly, the log says why); 'off': every step eagerly. No effect on the CPU or on sequential runs."""

    def validate(self) -> None:
        check_literals(self, "simulation")
        if self.vectorize_group < 0:
            raise ConfigError(
                f"simulation.vectorize_group must be >= 0 (0 = as many sites as fit in memory), got {self.vectorize_group}"
            )


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines one run.

    ``params`` holds the method-specific sections (``[fedavg]``, ``[fedsm]``…) as
    plain tables; each algorithm turns its own section into its frozen
    ``Params`` dataclass and rejects unknown keys.
    """

    federation: str
    """Path of the federation spec (TOML with [[sites]]) the run trains on; relative to the run config's folder."""
    method: str = "fedavg"
    """Federated method, a name of the algorithm registry (`fedseg run --help` lists them)."""
    rounds: int = 20
    """Communication rounds (>= 1)."""
    seed: int = 0
    """Seed of weight initialization, data order and augmentation (same seed, same run)."""
    checkpoint_every: int = 1
    """Write a checkpoint (weights, optimizer state, progress) every this many rounds and after the last one (>= 1)."""
    checkpoint_background: bool = True
    """Write checkpoints in a background thread (after a synchronous snapshot to host memory)."""
    checkpoint_keep: CheckpointKeep = "best"
    """What a finished run keeps in checkpoints/ once its results are written: 'best' (default) the best models
    (every candidate's best round and the models assembled after the last one, e.g. FedSM's composite: what
    evaluate, predict, export and the report read); 'final' also the last round's server state; 'all'
    everything, every site's state and optimizer moments included, so that --resume can continue it. Results,
    config and history are always kept; `fedseg clean OUT` prunes an existing folder the same way."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'; see :mod:`fedseg.foundation.device`."""
    deterministic: bool = True
    """On CUDA: deterministic kernels (same seed → bitwise the same weights); false lets cuDNN pick
    the fastest kernels.  No effect on the CPU."""
    volume_cache: str = "auto"
    """Volumes: where each site keeps its cases preprocessed into the plan's grid, reused by later runs
    under the same plan and source files: 'auto' (a `.fedseg-cache` folder beside the site's datalist),
    'off' (preprocess on every run) or a folder (one subfolder per site; a deployed site always caches
    beside its own datalist unless 'off'); see docs/data.md, "Cache"."""
    volume_reads: VolumeReads = "auto"
    """Volumes: where a site keeps its cases while it trains: 'memory' (every split held, padded to the
    federation's common shape), 'cache' (read from the site's volume cache as used: one batch of patches per
    training step, one batch of volumes per evaluation step; needs volume_cache) or 'auto' (held while a
    site's splits take at most a quarter of the machine's memory shared by the sites it runs, the rest read
    from the cache). All three train on the same patches; see docs/data.md, "Memory"."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> None:
        if self.rounds < 1:
            raise ConfigError(f"rounds must be >= 1, got {self.rounds}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        d = str(self.device).lower()
        if not (d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ConfigError(
                f"device = {self.device!r} is not known; use 'auto', 'cpu', 'cuda' or 'cuda:N' (e.g. --device cuda:1)"
            )
        if not str(self.volume_cache).strip():
            raise ConfigError("volume_cache is empty; use 'auto', 'off' or a folder")
        check_literals(self, "")
        if self.volume_reads == "cache" and self.volume_cache == "off":
            raise ConfigError(
                "volume_reads = 'cache' reads volumes from the site's cache, but volume_cache = 'off' -> set "
                "volume_cache to 'auto' or a folder, or volume_reads to 'auto' or 'memory'"
            )
        self.model.validate()
        self.train.validate()
        self.eval.validate()
        self.simulation.validate()
        self.privacy.validate()
        if self.privacy.dp == "sample" and self.model.norm == "batch":
            raise ConfigError(
                "privacy.dp = 'sample' clips each sample's gradient, which batch norm mixes across the batch; "
                'use model.norm = "instance" (--set model.norm=instance) or "none"'
            )
        if self.privacy.dp == "sample" and self.train.precision == "fp16":
            raise ConfigError(
                "privacy.dp = 'sample' clips unscaled per-sample gradients, which fp16 loss scaling does not give; "
                "use --set train.precision=bf16"
            )
        if self.privacy.dp == "sample" and self.simulation.vectorize == "on":
            raise ConfigError(
                "privacy.dp = 'sample' computes per-sample gradients one site at a time, which the vectorized "
                "simulation does not; use --set simulation.vectorize=off (or auto)"
            )

    def is_eval_round(self, rnd: int) -> bool:
        """True on the rounds the engine validates after: every ``eval.every`` rounds (every round when unset)
        and the last one."""
        return rnd % (self.eval.every or 1) == 0 or rnd == self.rounds

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        params = d.pop("params")
        d.update(params)
        return d


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "simulation": SimulationConfig,
    "privacy": PrivacyConfig,
}

"""The sections of a run config and their dataclasses (``[model]``, ``[train]``…)."""


EXCLUSIVE: tuple[tuple[str, str], ...] = (("train.local_epochs", "train.local_steps"),)
"""Pairs of settings of which a run sets exactly one.  A file or an override that sets one of a pair (not
to ``none``) leaves the other unset, wherever the other came from (the default or, for an override, the
file); overrides that set both are refused by validation, as is a file that sets both."""
