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


def test_an_image_as_one_file_per_channel_round_trips(tmp_path):
    """nnU-Net's _0000/_0001 files (MONAI's list of images): the entry's image is a list of paths in channel
    order, resolved one by one; an empty list or a non-string in it is one error naming the entry."""
    files = [tmp_path / "s" / "images" / f"c_000{c}.nii.gz" for c in range(2)]
    lab = tmp_path / "s" / "labels" / "c.nii.gz"
    splits = {k: [{"image": files, "label": lab}] for k in ("training", "validation", "testing")}
    path = write_datalist(tmp_path / "s" / "datalist.json", splits)
    assert json.loads(path.read_text())["training"][0]["image"] == ["images/c_0000.nii.gz", "images/c_0001.nii.gz"]
    assert load_datalist(path)["training"] == [{"image": [f.resolve() for f in files], "label": lab.resolve()}]
    for bad in ([], ["a.nii.gz", 3]):
        e = [{"image": bad, "label": "l.nii.gz"}]
        path.write_text(json.dumps({"training": e, "validation": e, "testing": e}))
        with pytest.raises(DataError, match=r"training\[0\] must be an object with an 'image' path \(or a list"):
            load_datalist(path)


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
