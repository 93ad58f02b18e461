"""Federation spec loading and its error messages."""

from __future__ import annotations

import pytest

from fedseg.data.spec import load_federation
from fedseg.foundation.errors import ConfigError


def test_valid_spec_loads(tmp_path, h):
    # Prepare
    path = h.write_spec(tmp_path, sites=("a", "b.2"), image_size=(32, 48))
    # Execute
    fed = load_federation(path)
    # Assert
    assert fed.name == "test" and fed.path == path.resolve()
    assert fed.site_names == ("a", "b.2")
    assert fed.sites[1].datalist == (tmp_path / "b.2" / "datalist.json").resolve()
    assert fed.labels == {"disc": (1, 2), "cup": (2,)} and fed.label_channels == 2
    assert (fed.mode, fed.spatial_dims, fed.in_channels) == ("2d", 2, 3)
    assert fed.image_size == (32, 48) and fed.foreground_only is False
    assert fed.label_values == {0, 1, 2}


@pytest.mark.parametrize(
    "kwargs, extra, expected",
    [
        ({}, "colour = 1\n", "'colour'"),  # unknown top-level key
        ({"mode": "2d"}, "", None),  # control: valid
        ({"mode": "4d"}, "", "data.mode"),
        ({"mode": "2d", "spatial_dims": 3}, "", "spatial_dims"),
        ({"image_size": (64,)}, "", "data.image_size"),
        ({"labels": {"disc": []}}, "", "data.labels.disc"),
        ({"labels": {"disc": [0]}}, "", "data.labels.disc"),
        ({"sites": ("a", "a")}, "", "'a' is used twice"),
        ({"sites": ("a/b",)}, "", "'a/b'"),
        ({"sites": ()}, "", "[[sites]]"),
        ({"foreground_only": True}, "", "foreground_only"),
        ({"in_channels": 0}, "", "data.in_channels"),
    ],
)
def test_malformed_spec_names_the_key(tmp_path, h, kwargs, extra, expected):
    # Prepare
    path = h.write_spec(tmp_path, extra=extra, **kwargs)
    # Execute / Assert
    if expected is None:
        load_federation(path)
        return
    with pytest.raises(ConfigError) as err:
        load_federation(path)
    assert expected in str(err.value) and str(path.resolve()) in str(err.value)
    assert " -> " in str(err.value)  # every message carries a fix


def test_unknown_key_in_data_and_site_tables(tmp_path, h):
    # Prepare
    p1 = h.write_spec(tmp_path)
    p1.write_text(p1.read_text().replace("[data]\n", "[data]\nresolution = 1\n"))
    p2 = tmp_path / "b.toml"
    p2.write_text(p1.read_text().replace("resolution = 1\n", "") + "weight = 2\n")
    # Execute / Assert
    with pytest.raises(ConfigError, match="'resolution' in \\[data\\]"):
        load_federation(p1)
    with pytest.raises(ConfigError, match="'weight' in sites\\[0\\]"):
        load_federation(p2)


def test_missing_and_invalid_toml(tmp_path):
    # Prepare
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed\n")
    # Execute / Assert
    with pytest.raises(ConfigError, match="not found"):
        load_federation(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        load_federation(bad)
    assert "bad.toml" in str(err.value)


def test_unknown_site_lookup(tmp_path, h):
    # Prepare
    fed = load_federation(h.write_spec(tmp_path))
    # Execute / Assert
    with pytest.raises(ConfigError, match="no site named 'site9'"):
        fed.site("site9")
