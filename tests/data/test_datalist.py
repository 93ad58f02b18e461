"""Datalist reading and writing."""

from __future__ import annotations

import json

import pytest

from fedseg.data.datalist import load_datalist, write_datalist
from fedseg.foundation.errors import DataError


def test_write_then_load_gives_absolute_paths(tmp_path):
    # Prepare
    img, lab = tmp_path / "s" / "images" / "a.png", tmp_path / "s" / "labels" / "a.png"
    splits = {k: [{"image": img, "label": lab}] for k in ("training", "validation", "testing")}
    # Execute
    path = write_datalist(tmp_path / "s" / "datalist.json", splits)
    loaded = load_datalist(path)
    # Assert
    assert json.loads(path.read_text())["training"][0] == {"image": "images/a.png", "label": "labels/a.png"}
    assert loaded["testing"] == [{"image": img.resolve(), "label": lab.resolve()}]


def test_msd_test_key_is_accepted(tmp_path):
    # Prepare
    e = [{"image": "i.nii.gz", "label": "l.nii.gz"}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"training": e, "validation": e, "test": e}))
    # Execute
    loaded = load_datalist(path)
    # Assert
    assert loaded["testing"][0]["label"] == (tmp_path / "l.nii.gz").resolve()


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "not found"),
        ("{not json", "not valid JSON"),
        ("[]", "must be a JSON object"),
        ('{"training": [], "validation": []}', "no 'testing' key"),
        ('{"training": [{"image": "a.png"}], "validation": [], "testing": []}', "training[0]"),
        ('{"training": {}, "validation": [], "testing": []}', "'training' must be a list"),
    ],
)
def test_bad_datalist_names_file_and_fix(tmp_path, content, expected):
    # Prepare
    path = tmp_path / "datalist.json"
    if content is not None:
        path.write_text(content)
    # Execute
    with pytest.raises(DataError) as err:
        load_datalist(path, site="siteX")
    # Assert
    msg = str(err.value)
    assert expected in msg and str(path) in msg and msg.startswith("siteX: ") and " -> " in msg
