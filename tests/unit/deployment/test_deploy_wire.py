"""Wire format of deployed tasks/replies and their validation (pure, no network)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save as st_save

from fedseg.deployment.params import DeployParams, deploy_params
from fedseg.deployment.wire import check_reply, decode_reply, decode_task, encode_reply, encode_task, read_header
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task


def _model() -> dict[str, torch.Tensor]:
    return {
        "global/w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "global/b": torch.tensor([0.5], dtype=torch.float64),
        "global/n": torch.tensor(7, dtype=torch.int64),
    }


def test_task_round_trip_is_bitwise():
    """Every tensor (float32, float64, int64, 0-d) and the JSON config survive encode → decode unchanged."""
    # Prepare
    task = Task("train", _model(), {"round": 3, "steps": None, "nested": {"a": [1, 2.5]}})
    # Execute
    back = decode_task(encode_task(task))
    # Assert
    assert back.kind == "train" and back.config == task.config
    assert set(back.arrays) == set(task.arrays)
    for k, v in task.arrays.items():
        assert back.arrays[k].dtype == v.dtype and torch.equal(back.arrays[k], v)


def test_reply_round_trip_and_empty_arrays():
    """A reply with no tensors (an evaluation reply) keeps its metrics and sample count."""
    # Prepare
    reply = Reply({}, {"per_case": {"global": [[0.25, 1.0]]}}, num_samples=4)
    # Execute
    back = decode_reply(encode_reply(reply))
    # Assert
    assert back.arrays == {} and back.metrics == reply.metrics and back.num_samples == 4


def test_views_sharing_storage_are_encoded():
    """Two names that view one storage (tied weights) are written as separate copies."""
    # Prepare
    base = torch.arange(4.0)
    task = Task("t", {"a": base, "b": base[:2]})
    # Execute
    back = decode_task(encode_task(task))
    # Assert
    assert torch.equal(back.arrays["a"], base) and torch.equal(back.arrays["b"], base[:2])


def test_header_is_read_without_the_body():
    """read_header returns the tensor index (dtype, shape) and the fedseg metadata."""
    # Prepare
    blob = encode_task(Task("train", {"w": torch.zeros(2, 5)}, {"round": 1}))
    # Execute
    index, meta = read_header(blob)
    # Assert
    assert index["w"]["shape"] == [2, 5] and index["w"]["dtype"] == "F32"
    assert meta["kind"] == "train" and meta["config"] == {"round": 1}


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"abc", "too short"),
        (struct.pack("<Q", 1000) + b"{}", "truncated"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (st_save({"w": torch.zeros(1)}), "no fedseg metadata"),
        (st_save({}, metadata={"fedseg": json.dumps({"v": 99})}), "wire version 99"),
        ("text", "must be bytes"),
    ],
)
def test_malformed_blobs_are_rejected_with_a_reason(blob, message):
    """Garbage, truncation, foreign safetensors and a wrong version each name the problem."""
    with pytest.raises(PayloadError, match=message):
        decode_reply(blob)


def test_oversized_blob_is_rejected_before_parsing():
    """The size limit applies to the raw bytes (a 1 kB limit refuses a 4 kB model)."""
    blob = encode_reply(Reply({"w": torch.zeros(1024)}))
    with pytest.raises(PayloadError, match="exceeds the limit of 1000 bytes"):
        decode_reply(blob, max_bytes=1000)


def test_bad_reply_fields_are_rejected():
    """num_samples must be a non-negative integer; metrics must be an object; config must be finite JSON."""
    bad_n = st_save({}, metadata={"fedseg": json.dumps({"v": 1, "metrics": {}, "num_samples": -1})})
    with pytest.raises(PayloadError, match="num_samples must be an integer >= 0, got -1"):
        decode_reply(bad_n)
    bad_m = st_save({}, metadata={"fedseg": json.dumps({"v": 1, "metrics": [1], "num_samples": 1})})
    with pytest.raises(PayloadError, match="metrics must be a JSON object"):
        decode_reply(bad_m)
    with pytest.raises(PayloadError, match="cannot be written"):
        encode_task(Task("t", {}, {"x": float("nan")}))


def test_check_reply_accepts_a_model_sent_back():
    """The returned model has the task's names, shapes and dtypes and finite values: accepted."""
    task = Task("train", _model())
    reply = Reply({k: v.clone() for k, v in _model().items()}, {"loss": 0.3}, 5)
    check_reply(task, reply)  # no exception


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda a: a.update({"global/w": torch.full((2, 3), float("nan"))}), r"non-finite values in \['global/w'\]"),
        (lambda a: a.update({"global/b": torch.tensor([float("inf")], dtype=torch.float64)}), "non-finite"),
        (lambda a: a.update({"global/w": torch.zeros(3, 2)}), r"shape \(3, 2\).*task sent \(2, 3\)"),
        (lambda a: a.update({"global/w": torch.zeros(2, 3, dtype=torch.float64)}), "torch.float64.*task sent"),
    ],
)
def test_check_reply_rejects_poisoned_or_misshapen_arrays(edit, message):
    """NaN/inf anywhere, or a returned model of another shape or dtype, is rejected naming the tensor."""
    # Prepare
    task = Task("train", _model())
    arrays = {k: v.clone() for k, v in _model().items()}
    edit(arrays)
    # Execute / Assert
    with pytest.raises(PayloadError, match=message):
        check_reply(task, Reply(arrays, {}, 1))


def test_check_reply_against_a_learned_schema():
    """Arrays the task did not send keep the shape and dtype this site returned before under the same name;
    other names are allowed (FGA's last step of a round returns weights instead of a gradient)."""
    task = Task("train", {})
    schema = {"cv": torch.zeros(4)}
    check_reply(task, Reply({"cv": torch.ones(4)}), schema)
    check_reply(task, Reply({"weights/w": torch.ones(2)}), schema)
    with pytest.raises(PayloadError, match="earlier replies had"):
        check_reply(task, Reply({"cv": torch.ones(5)}), schema)
    with pytest.raises(PayloadError, match="earlier replies had"):
        check_reply(task, Reply({"cv": torch.ones(4, dtype=torch.float64)}), schema)
    with pytest.raises(PayloadError, match="non-finite number"):
        check_reply(task, Reply({}, {"loss": float("inf")}))


def test_deploy_params_validation_names_the_key():
    """Bad deploy settings name deploy.<key>; defaults are valid."""
    assert deploy_params({}) == DeployParams()
    with pytest.raises(ConfigError, match="deploy.min_sites must be >= 1"):
        deploy_params({"min_sites": 0})
    with pytest.raises(ConfigError, match="deploy.round_deadline_s must be > 0"):
        deploy_params({"round_deadline_s": 0})
    with pytest.raises(ConfigError, match=r"\[deploy\] has unknown key"):
        deploy_params({"deadline": 3})
