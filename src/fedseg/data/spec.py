"""Federation spec: which sites take part and what their data look like.

A federation spec is one TOML file (format in ``docs/data.md``)::

    name = "fundus-synth"
    [data]
    mode = "2d"              # 2d | slices | 3d | patches2d
    spatial_dims = 2
    in_channels = 3
    image_size = [64, 64]    # optional
    foreground_only = false  # optional
    [data.labels]            # channel name -> label-file values that belong to it
    disc = [1, 2]
    cup = [2]
    [[sites]]
    name = "site1"
    datalist = "site1/datalist.json"   # relative to the spec file

Parsing is strict: unknown keys, wrong types and inconsistent values raise
:class:`fedseg.foundation.errors.ConfigError` naming the file, the key and the fix.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from fedseg.foundation.errors import ConfigError

MODES = ("2d", "slices", "3d", "patches2d")
#: Modes whose files are volumes with their geometry, brought into a federated plan's grid.
VOLUME_MODES = ("3d", "patches2d")
IntensityMode = Literal["ct", "zscore", "window", "minmax"]
"""The intensity schemes of volumes, each a class of :data:`fedseg.data.volumes.schemes.SCHEMES`."""
INTENSITY_MODES: tuple[str, ...] = get_args(IntensityMode)
#: ``data.intensity``: "auto" takes the plan's choice; the others override it (fedseg.data.volumes.intensity).
INTENSITIES = ("auto", *INTENSITY_MODES)
_SITE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TOP_KEYS = {"name", "data", "sites"}
_DATA_KEYS = {
    "mode",
    "spatial_dims",
    "in_channels",
    "channels",
    "image_size",
    "foreground_only",
    "labels",
    "intensity",
    "window",
}
_SITE_KEYS = {"name", "datalist", "intensity"}
LAYOUT_NAME = "data.json"
"""The data layout a run folder (and a deployed site's work folder) keeps beside its ``config.toml``:
:func:`data_header`, and a volume run's plan under ``"plan"``; ``fedseg predict`` and ``fedseg export`` read it."""


@dataclass(frozen=True)
class SiteSpec:
    """One site of a federation.

    Attributes
    ----------
    name : str
        Site name, safe as a folder name (``[A-Za-z0-9_.-]+``).
    datalist : Path
        Absolute path to the site's datalist JSON (see :mod:`fedseg.data.datalist`).
    """

    name: str
    datalist: Path
    intensity: dict[str, str] = field(default_factory=dict, hash=False)
    """Volumes: the site's own intensity scheme per channel name (``intensity`` of its ``[[sites]]`` entry),
    overriding ``data.intensity`` and the plan's choice for this site; empty: none."""


@dataclass(frozen=True)
class FederationSpec:
    """A federation: its sites and the shape of their data.

    Attributes
    ----------
    name : str
        Federation name.
    path : Path
        Absolute path of the spec file.
    sites : tuple of SiteSpec
        The sites, in spec order (at least one).
    spatial_dims : int
        2 or 3: the spatial dimensions the *model* sees (2 for "2d"/"slices").
    in_channels : int
        Image channels (3 for RGB, 1 for grey).
    labels : dict of str to tuple of int
        Label channel name -> integer values of the label file that belong to
        it, in channel order. Channel ``c`` of a loaded label is
        ``isin(label_file, labels[c])``; value 0 is background.
    mode : str
        "2d" (2D image files), "slices" (3D NIfTI cut into 2D slices along the
        last axis), "3d" (3D volumes) or "patches2d" (3D volumes in the plan's
        in-plane grid, trained as 2D patches of axial slices, scored per volume).
    image_size : tuple of int or None
        Resize target (H, W) for "2d"/"slices", (D, H, W) for "3d"; None keeps
        the native size (then all cases must share a size).
    foreground_only : bool
        "slices" mode: keep only slices whose label has foreground.
    intensity : str
        Volumes: "auto" (the plan's choice) or the scheme that overrides it
        ("ct", "zscore", "window", "minmax") for every channel; "auto" where
        ``data.intensity`` is a table per channel.
    window : tuple of float or None
        ``(low, high)`` in file units (HU for CT) for the channels whose scheme is "window".
    channels : tuple of str
        The image channel names (``data.channels``; default "0", "1", ...), one per
        ``in_channels``, in the order of the image's channels or of its files.
    channel_intensity : dict of str to str
        ``data.intensity`` given as a table: channel name -> scheme ("auto" or one of
        the schemes); channels it leaves out take ``intensity``.
    """

    name: str
    path: Path
    sites: tuple[SiteSpec, ...]
    spatial_dims: int
    in_channels: int
    labels: dict[str, tuple[int, ...]]
    mode: str
    image_size: tuple[int, ...] | None
    foreground_only: bool
    intensity: str = "auto"
    window: tuple[float, float] | None = None
    channels: tuple[str, ...] = ()
    channel_intensity: dict[str, str] = field(default_factory=dict)

    @property
    def channel_names(self) -> tuple[str, ...]:
        """The image channel names (``data.channels``, or "0", "1", ... when the spec names none)."""
        return self.channels or tuple(str(c) for c in range(self.in_channels))

    def intensity_for(self, site: str) -> list[str]:
        """The scheme the spec asks for each channel of ``site`` ("auto": the plan decides): the site's own
        ``intensity``, else ``data.intensity`` (per channel when a table), else "auto"."""
        own = next((s.intensity for s in self.sites if s.name == site), {})
        return [
            own.get(c) or own.get("*") or self.channel_intensity.get(c) or self.intensity for c in self.channel_names
        ]

    def intensity_table(self) -> dict[str, list[str]]:
        """:meth:`intensity_for` of every site: ``{site: [scheme per channel]}``."""
        return {s.name: self.intensity_for(s.name) for s in self.sites}

    @property
    def volumes(self) -> bool:
        """Whether the cases are volumes brought into a plan's grid (``mode`` "3d" or "patches2d")."""
        return self.mode in VOLUME_MODES

    @property
    def label_channels(self) -> int:
        """Number of label channels ``L`` (one per entry of ``labels``)."""
        return len(self.labels)

    @property
    def site_names(self) -> tuple[str, ...]:
        """Names of the sites, in spec order."""
        return tuple(s.name for s in self.sites)

    @property
    def label_values(self) -> frozenset[int]:
        """Values allowed in a label file: 0 and every declared value."""
        return frozenset({0}).union(*self.labels.values())

    def site(self, name: str) -> SiteSpec:
        """Return the site called ``name``; ConfigError if there is none."""
        for s in self.sites:
            if s.name == name:
                return s
        raise ConfigError(
            f"{self.path}: no site named {name!r}; the federation has sites "
            f"{list(self.site_names)} -> use one of those names or add a [[sites]] entry"
        )


def _err(path: Path, what: str, fix: str) -> ConfigError:
    return ConfigError(f"{path}: {what} -> {fix}")


def _check_keys(path: Path, table: dict, allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise _err(path, f"unknown key {key!r} in {where}", f"remove it or use one of {sorted(allowed)}")


def _int(path: Path, value: Any, key: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _err(path, f"{key} must be an integer >= {low}, got {value!r}", f"set {key} to an integer >= {low}")
    return value


def _parse_labels(path: Path, raw: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(raw, dict) or not raw:
        raise _err(path, "[data.labels] is missing or empty", "add a [data.labels] table, e.g. foreground = [1]")
    labels: dict[str, tuple[int, ...]] = {}
    for name, values in raw.items():
        if isinstance(values, int) and not isinstance(values, bool):
            values = [values]
        if (
            not isinstance(values, list)
            or not values
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values)
        ):
            raise _err(
                path,
                f"data.labels.{name} must be a non-empty list of integers >= 1 (0 is background), got {values!r}",
                f"write e.g. {name} = [1]",
            )
        labels[name] = tuple(values)
    return labels


def _parse_sites(path: Path, raw: Any, channels: tuple[str, ...] = ()) -> tuple[SiteSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise _err(path, "no [[sites]] entries", "add at least one [[sites]] with name and datalist")
    sites, seen = [], set()
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise _err(path, f"sites[{i}] is not a table", "write each site as a [[sites]] table")
        _check_keys(path, entry, _SITE_KEYS, f"sites[{i}]")
        name = entry.get("name")
        if not isinstance(name, str) or not _SITE_NAME.match(name):
            raise _err(
                path,
                f"sites[{i}].name {name!r} is missing or not safe as a folder name",
                "use a non-empty name of letters, digits, '_', '.', '-'",
            )
        if name in seen:
            raise _err(path, f"site name {name!r} is used twice", "give every site a unique name")
        seen.add(name)
        datalist = entry.get("datalist")
        if not isinstance(datalist, str) or not datalist:
            raise _err(
                path,
                f"site {name!r} has no datalist",
                f'add datalist = "{name}/datalist.json" (relative to the spec file)',
            )
        dl = Path(datalist)
        own = _scheme_table(path, entry.get("intensity", {}), channels, f"sites[{i}].intensity", auto=False)
        sites.append(SiteSpec(name, dl if dl.is_absolute() else (path.parent / dl).resolve(), own))
    return tuple(sites)


def load_federation(path: str | Path) -> FederationSpec:
    """Read and check a federation spec TOML file.

    Parameters
    ----------
    path : str or Path
        The spec file. Relative datalist paths inside it are resolved against
        its folder.

    Returns
    -------
    FederationSpec

    Raises
    ------
    ConfigError
        If the file is missing, is not TOML, has unknown keys, or has values of
        the wrong type or inconsistent with each other. The message names the
        file, the key and the fix.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise _err(
            path,
            "federation spec file not found",
            "check the path, or write one (docs/data.md) or generate one with fedseg.data.synthesize",
        )
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _err(path, f"not valid TOML ({e})", "fix the TOML syntax") from None
    _check_keys(path, raw, _TOP_KEYS, "the top level")
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise _err(path, f"name must be a non-empty string, got {name!r}", 'set name = "my-federation"')
    data = raw.get("data")
    if not isinstance(data, dict):
        raise _err(path, "[data] table is missing", "add a [data] table with mode, spatial_dims, in_channels")
    _check_keys(path, data, _DATA_KEYS, "[data]")

    mode = data.get("mode", "2d")
    if mode not in MODES:
        raise _err(
            path,
            f"data.mode must be one of {list(MODES)}, got {mode!r}",
            'set mode = "2d", "slices", "3d" or "patches2d"',
        )
    want_dims = 3 if mode == "3d" else 2  # patches2d: volumes, a 2D model
    spatial_dims = _int(path, data.get("spatial_dims", want_dims), "data.spatial_dims")
    if spatial_dims != want_dims:
        raise _err(
            path, f'data.spatial_dims = {spatial_dims} does not fit mode "{mode}"', f"set spatial_dims = {want_dims}"
        )
    in_channels = _int(path, data.get("in_channels"), "data.in_channels")

    image_size = data.get("image_size")
    if image_size is not None:
        if (
            not isinstance(image_size, list)
            or len(image_size) != spatial_dims
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in image_size)
        ):
            raise _err(
                path,
                f"data.image_size must be a list of {spatial_dims} positive integers "
                f"for mode {mode!r}, got {image_size!r}",
                f"write e.g. image_size = {[64] * spatial_dims} or remove it",
            )
        image_size = tuple(image_size)
    foreground_only = data.get("foreground_only", False)
    if not isinstance(foreground_only, bool):
        raise _err(
            path,
            f"data.foreground_only must be true or false, got {foreground_only!r}",
            "set foreground_only = true or false",
        )
    if foreground_only and mode != "slices":
        raise _err(
            path,
            f'data.foreground_only only applies to mode "slices", not {mode!r}',
            'remove foreground_only or set mode = "slices"',
        )

    channels = _parse_channels(path, data.get("channels"), in_channels)
    intensity, window, per_channel = _parse_intensity(path, data, mode, channels)
    sites = _parse_sites(path, raw.get("sites"), channels)
    if mode not in VOLUME_MODES and any(s.intensity for s in sites):
        raise _err(path, f"sites' intensity only applies to volumes, not mode {mode!r}", "remove it")
    if window is None and any("window" in s.intensity.values() for s in sites):
        raise _err(path, 'a site\'s intensity is "window" but data.window is not set', "set window = [low, high]")
    return FederationSpec(
        name=name,
        path=path,
        sites=sites,
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        labels=_parse_labels(path, data.get("labels")),
        mode=mode,
        image_size=image_size,
        foreground_only=foreground_only,
        intensity=intensity,
        window=window,
        channels=channels,
        channel_intensity=per_channel,
    )


def _parse_channels(path: Path, raw: Any, in_channels: int) -> tuple[str, ...]:
    """``data.channels``: one unique name per image channel (absent: none, the channels are "0", "1", ...)."""
    if raw is None:
        return ()
    if not (isinstance(raw, list) and all(isinstance(c, str) and c for c in raw) and len(set(raw)) == len(raw)):
        raise _err(
            path, f"data.channels must be a list of unique names, got {raw!r}", 'write e.g. channels = ["T2", "ADC"]'
        )
    if len(raw) != in_channels:
        raise _err(
            path,
            f"data.channels names {len(raw)} channel(s) but in_channels = {in_channels}",
            "name every image channel once, in the order of the image's channels or files",
        )
    return tuple(raw)


def _scheme_table(path: Path, raw: Any, channels: tuple[str, ...], key: str, auto: bool = True) -> dict[str, str]:
    """A scheme per channel name: a table ``{name = scheme}``, or one scheme for every channel (a string)."""
    names = channels or ("0",)
    allowed = INTENSITIES if auto else INTENSITY_MODES
    if isinstance(raw, str):
        raw = dict.fromkeys(channels or ("*",), raw)
    if not isinstance(raw, dict):
        raise _err(path, f"{key} must be a scheme or a table per channel, got {raw!r}", 'write e.g. {T2 = "zscore"}')
    out: dict[str, str] = {}
    for name, scheme in raw.items():
        if name != "*" and name not in names and not (not channels and name.isdigit()):
            raise _err(
                path, f"{key} names channel {name!r}, not one of data.channels {list(names)}", "use a channel name"
            )
        if scheme not in allowed:
            raise _err(path, f"{key}.{name} = {scheme!r} is not one of {list(allowed)}", "use one of those schemes")
        out[name] = scheme
    return out


def _parse_intensity(
    path: Path, data: dict, mode: str, channels: tuple[str, ...] = ()
) -> tuple[str, tuple[float, float] | None, dict[str, str]]:
    """``data.intensity`` (one scheme, or a table per channel name) and ``data.window``: volume modes only;
    a window is given exactly when some channel's intensity is "window", as two numbers low < high."""
    intensity = data.get("intensity", "auto")
    window = data.get("window")
    per_channel: dict[str, str] = {}
    if isinstance(intensity, dict):
        per_channel = _scheme_table(path, intensity, channels, "data.intensity")
        intensity = "window" if "window" in per_channel.values() else "auto"
    if intensity not in INTENSITIES:
        raise _err(
            path,
            f"data.intensity must be one of {list(INTENSITIES)}, got {intensity!r}",
            'set intensity = "auto" (the plan decides), "ct", "zscore", "window" (with window = [low, high]) or "minmax"',
        )
    if mode not in VOLUME_MODES and ("intensity" in data or window is not None):
        key = "data.intensity" if "intensity" in data else "data.window"
        raise _err(
            path,
            f'{key} only applies to volumes (mode "3d" or "patches2d"), not mode {mode!r}',
            f'remove {key.split(".")[1]} or set mode = "3d" or "patches2d"',
        )
    if window is not None and intensity != "window":
        raise _err(
            path,
            f"data.window is set but data.intensity = {intensity!r}",
            'set intensity = "window" to use the window, or remove window',
        )
    if intensity == "window":
        if not (
            isinstance(window, list)
            and len(window) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in window)
            and window[0] < window[1]
        ):
            raise _err(
                path,
                f'data.intensity = "window" needs data.window = [low, high] with low < high, got {window!r}',
                "set e.g. window = [0, 80] (a head CT brain window, in HU)",
            )
        if per_channel:
            intensity = "auto"
        assert isinstance(window, list)  # checked above
        return intensity, (float(window[0]), float(window[1])), per_channel
    return intensity, None, per_channel


def data_header(fed: FederationSpec) -> dict[str, Any]:
    """The data layout of a federation spec without any site or path (what a deployed server sends its
    sites, and what a run folder keeps in :data:`LAYOUT_NAME`): mode, dimensions, channels, labels with their
    values, image size; for volumes also the spec's ``data.intensity`` and ``data.window`` (per channel and
    per site where the spec names them), which the plan follows."""
    header: dict[str, Any] = {
        "mode": fed.mode,
        "spatial_dims": fed.spatial_dims,
        "in_channels": fed.in_channels,
        "labels": {k: list(v) for k, v in fed.labels.items()},
        "image_size": list(fed.image_size) if fed.image_size is not None else None,
        "foreground_only": fed.foreground_only,
    }
    if fed.volumes:
        header["intensity"] = fed.intensity
        header["window"] = list(fed.window) if fed.window is not None else None
        header["channels"] = list(fed.channel_names)
        if fed.channel_intensity or any(s.intensity for s in fed.sites):  # schemes per channel or site
            header["intensity_table"] = fed.intensity_table()
    return header
