"""validate_federation: one test per kind of bad input, each naming the file."""

from __future__ import annotations

import numpy as np
import pytest

from fedseg.data.validate import Problem, raise_if_invalid, validate_federation
from fedseg.foundation.errors import DataError


def _federation(tmp_path, h, *, training=None, **spec_kwargs):
    """One-site federation; ``training`` replaces the training cases."""
    good = [h.disc_cup_pair(seed=i) for i in range(2)]
    h.write_site(
        tmp_path, "site1", {"training": training if training is not None else good, "validation": good, "testing": good}
    )
    return h.write_spec(tmp_path, **spec_kwargs)


def _only(problems, text):
    hits = [p for p in problems if text in p.message]
    assert len(hits) == 1, [str(p) for p in problems]
    return hits[0]


def test_valid_federation_has_no_problems(png_federation):
    # Execute / Assert
    assert validate_federation(png_federation) == []
    raise_if_invalid(png_federation)


def test_problem_str_is_one_line():
    # Prepare
    p = Problem("site1", "/d/x.png", "image is constant", "remove it")
    # Execute / Assert
    assert str(p) == "site1: /d/x.png: image is constant -> remove it"


def test_malformed_spec_is_a_problem_not_an_exception(tmp_path, h):
    # Prepare
    path = _federation(tmp_path, h, extra="colour = 1\n")
    # Execute
    problems = validate_federation(path)
    # Assert
    assert len(problems) == 1 and problems[0].site == "federation"
    assert problems[0].file == str(path.resolve()) and "'colour'" in problems[0].message and problems[0].fix


@pytest.mark.parametrize("content, text", [(None, "not found"), ("{oops", "not valid JSON")])
def test_datalist_missing_or_invalid(tmp_path, h, content, text):
    # Prepare
    path = _federation(tmp_path, h, sites=("site1", "site2"))
    (tmp_path / "site2").mkdir(exist_ok=True)
    if content is not None:
        (tmp_path / "site2" / "datalist.json").write_text(content)
    # Execute
    problems = validate_federation(path)
    # Assert
    p = _only(problems, text)
    assert p.site == "site2" and p.file.endswith("site2/datalist.json") and p.fix


@pytest.mark.parametrize("which", ["image", "label"])
def test_listed_file_missing(tmp_path, h, which):
    # Prepare
    path = _federation(tmp_path, h)
    (tmp_path / "site1" / f"{which}s" / "testing_1.png").unlink()
    # Execute
    p = _only(validate_federation(path), "does not exist")
    # Assert
    assert p.file == str(tmp_path / "site1" / f"{which}s" / "testing_1.png") and "datalist" in p.fix


def test_image_label_shape_mismatch(tmp_path, h):
    # Prepare
    image, _ = h.disc_cup_pair(16, 16)
    _, label = h.disc_cup_pair(16, 12)
    path = _federation(tmp_path, h, training=[(image, label)])
    # Execute
    p = _only(validate_federation(path), "differs from image shape")
    # Assert
    assert p.file.endswith("labels/training_0.png") and "training_0.png" in p.message


def test_wrong_channel_count(tmp_path, h):
    # Prepare
    image, label = h.disc_cup_pair()
    path = _federation(tmp_path, h, training=[(image[..., 0], label)])
    # Execute
    p = _only(validate_federation(path), "in_channels")
    # Assert
    assert p.file.endswith("images/training_0.png") and "grey" in p.message


def test_empty_split(tmp_path, h):
    # Prepare
    path = _federation(tmp_path, h, training=[])
    # Execute
    p = _only(validate_federation(path), "is empty")
    # Assert
    assert "'training'" in p.message and p.file.endswith("datalist.json")


def test_nan_in_image(tmp_path, h):
    # Prepare: a NIfTI slices federation whose training volume has a NaN
    vol = np.random.default_rng(0).random((6, 6, 3)).astype(np.float32)
    lab = np.zeros((6, 6, 3), np.uint8)
    lab[2:4, 2:4, :] = 1
    bad = vol.copy()
    bad[0, 0, 0] = np.nan
    h.write_site(
        tmp_path,
        "site1",
        {"training": [(bad, lab)], "validation": [(vol, lab)], "testing": [(vol, lab)]},
        suffix=".nii.gz",
    )
    path = h.write_spec(tmp_path, mode="slices", in_channels=1, labels={"prostate": [1]})
    # Execute
    p = _only(validate_federation(path), "NaN")
    # Assert
    assert p.file.endswith("images/training_0.nii.gz")


def test_constant_image(tmp_path, h):
    # Prepare
    _, label = h.disc_cup_pair()
    path = _federation(tmp_path, h, training=[(np.full((16, 16, 3), 7, np.uint8), label)])
    # Execute
    p = _only(validate_federation(path), "constant")
    # Assert
    assert p.file.endswith("images/training_0.png")


def test_undeclared_label_values(tmp_path, h):
    # Prepare: a 0/255 mask while labels declare only [1]
    image, label = h.disc_cup_pair()
    path = _federation(tmp_path, h, training=[(image, (label > 0).astype(np.uint8) * 255)], labels={"disc": [1, 2]})
    # Execute
    p = _only(validate_federation(path), "[255]")
    # Assert
    assert p.file.endswith("labels/training_0.png")
    assert p.fix == "declare the value in [data.labels] or re-save the mask as 0/1"


def test_keeps_going_and_raise_lists_all(tmp_path, h):
    # Prepare: two different problems in one federation
    image, label = h.disc_cup_pair()
    path = _federation(tmp_path, h, training=[(image[..., 0], label), (image, label * 100)])
    # Execute
    problems = validate_federation(path)
    with pytest.raises(DataError) as err:
        raise_if_invalid(path)
    # Assert
    assert len(problems) == 2
    assert all(str(p) in str(err.value) for p in problems)


def test_sizes_differ_without_image_size(tmp_path, h):
    # Prepare
    path = _federation(tmp_path, h, training=[h.disc_cup_pair(16, 20)])
    # Execute
    p = _only(validate_federation(path), "no image_size is set")
    # Assert
    assert "image_size" in p.fix
    assert validate_federation(_federation(tmp_path, h, training=[h.disc_cup_pair(16, 20)], image_size=(16, 16))) == []
