"""Wire format of deployed tasks and replies, and their validation on arrival.

A task or reply crosses the network as **one safetensors blob**: the tensors are
the safetensors body, the small JSON part (task kind and config; reply metrics
and sample count) rides in the safetensors header's ``__metadata__`` under the key
``"fedseg"``.  Nothing is pickled: a receiver parses a length-prefixed JSON header
and raw little-endian tensor bytes, so a malicious peer can at worst send wrong
numbers, which :func:`check_reply` rejects.

All functions here are pure (bytes in, objects out) and need no network.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedseg.foundation.arrays import Arrays, nonfinite
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "check_arrays",
    "check_reply",
    "decode_reply",
    "decode_task",
    "encode_reply",
    "encode_task",
    "parse_json_object",
    "read_header",
]

MAX_PAYLOAD_BYTES = 4 << 30
"""Largest blob accepted (4 GiB); a larger header or body is rejected before parsing."""

_KEY = "fedseg"
_VERSION = 1


def _pack(arrays: Mapping[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    tensors = {k: v.detach().contiguous().cpu() for k, v in arrays.items()}
    # safetensors refuses tensors that share storage; clone the ones that do
    seen: set[int] = set()
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        if ptr in seen:
            tensors[k] = v.clone()
        elif ptr != -1:
            seen.add(ptr)
    try:
        text = json.dumps({"v": _VERSION, **meta}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PayloadError(
            f"the JSON part of a payload cannot be written ({e}); keep config and metrics to finite numbers, strings, lists and dicts"
        ) from None
    return st_save(tensors, metadata={_KEY: text})


def read_header(data: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse a blob's safetensors header without touching tensor bytes.

    Returns ``(tensor_index, fedseg_meta)``; ``tensor_index`` maps names to
    ``{"dtype", "shape", "data_offsets"}`` as in the safetensors format.
    Raises :class:`PayloadError` on anything malformed.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"payload must be bytes, got {type(data).__name__}; the peer is not speaking fedseg's wire format"
        )
    if len(data) > max_bytes:
        raise PayloadError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    if len(data) < 8:
        raise PayloadError(f"payload of {len(data)} bytes is too short to be a safetensors blob")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise PayloadError(f"payload header claims {n} bytes but only {len(data) - 8} follow; the blob is truncated")
    header = parse_json_object(bytes(data[8 : 8 + n]), "payload header")
    meta_table = header.pop("__metadata__", None) or {}
    if not isinstance(meta_table, dict):
        raise PayloadError(
            f"payload's safetensors metadata is a {type(meta_table).__name__}, not a JSON object of strings"
        )
    meta_raw = meta_table.get(_KEY)
    if meta_raw is None:
        raise PayloadError("payload has no fedseg metadata; it was not written by fedseg's encode_task/encode_reply")
    if not isinstance(meta_raw, str):
        raise PayloadError(f"payload's fedseg metadata is a {type(meta_raw).__name__}, not a JSON string")
    meta = parse_json_object(meta_raw, "payload metadata")
    if meta.get("v") != _VERSION:
        raise PayloadError(
            f"payload wire version {meta.get('v')!r} is not {_VERSION}; run the same fedseg version on server and sites"
        )
    return header, meta


MAX_JSON_DEPTH = 64
"""Deepest nesting of lists/objects accepted in a payload's JSON parts (fedseg's own are < 10 deep)."""


def _json_depth(text: str | bytes) -> int:
    """Maximum bracket nesting of a JSON text (brackets inside strings skipped), without recursion."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """Parse a JSON object from an untrusted peer: too deep a nesting, invalid JSON or another type is a
    :class:`PayloadError` (never a RecursionError or a parser's own exception)."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise PayloadError(
            f"{what} nests {depth} levels deep (limit {MAX_JSON_DEPTH}); the peer is not speaking fedseg's wire format"
        )
    try:
        out = json.loads(text)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise PayloadError(f"{what} is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(out, dict):
        raise PayloadError(f"{what} is not a JSON object (a JSON {type(out).__name__})")
    return out


def _unpack(data: bytes, max_bytes: int) -> tuple[Arrays, dict[str, Any]]:
    _, meta = read_header(data, max_bytes)
    try:
        loaded = st_load(bytes(data))
    except Exception as e:  # safetensors raises its own error types
        raise PayloadError(f"payload tensors cannot be read ({e})") from None
    # safetensors' ``load`` returns the tensors in an order that changes from call to call; a fixed
    # order (by name, as ``load_file`` reads a checkpoint) keeps every sum over a payload's tensors,
    # e.g. SCAFFOLD's correction norm, the same in two equal runs
    return {k: loaded[k] for k in sorted(loaded)}, meta


def encode_task(task: Task) -> bytes:
    """A :class:`Task` as one safetensors blob (kind and config in the header)."""
    return _pack(task.arrays, {"kind": task.kind, "config": task.config})


def decode_task(data: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> Task:
    """Inverse of :func:`encode_task`; raises :class:`PayloadError` on a malformed blob."""
    arrays, meta = _unpack(data, max_bytes)
    kind, config = meta.get("kind"), meta.get("config", {})
    if not isinstance(kind, str) or not kind:
        raise PayloadError(f"task has no kind (got {kind!r})")
    if not isinstance(config, dict):
        raise PayloadError(f"task config must be a JSON object, got {type(config).__name__}")
    return Task(kind, arrays, config)


def encode_reply(reply: Reply) -> bytes:
    """A :class:`Reply` as one safetensors blob (metrics and sample count in the header)."""
    return _pack(reply.arrays, {"metrics": reply.metrics, "num_samples": int(reply.num_samples)})


def decode_reply(data: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> Reply:
    """Inverse of :func:`encode_reply`; raises :class:`PayloadError` on a malformed blob."""
    arrays, meta = _unpack(data, max_bytes)
    metrics, n = meta.get("metrics", {}), meta.get("num_samples")
    if not isinstance(metrics, dict):
        raise PayloadError(f"reply metrics must be a JSON object, got {type(metrics).__name__}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PayloadError(f"reply num_samples must be an integer >= 0, got {n!r}")
    return Reply(arrays, metrics, n)


def check_arrays(arrays: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise :class:`PayloadError` if any floating tensor holds NaN or an infinity."""
    bad = nonfinite(arrays)
    if bad:
        raise PayloadError(f"{what}: non-finite values in {bad[:5]}{' …' if len(bad) > 5 else ''}")


def _finite_json(x: Any) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite_json(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite_json(v) for v in x)
    return True


def check_reply(
    task: Task, reply: Reply, schema: Mapping[str, torch.Tensor] | None = None, what: str = "reply"
) -> None:
    """Validate a reply against the task that asked for it.

    Rules (any violation raises :class:`PayloadError` with the reason):

    1. every floating tensor is finite;
    2. a tensor whose name is also in the task (a model sent out and returned)
       has the task's shape and dtype;
    3. when ``schema`` is given (the layout of the names this site has returned
       before for the same task kind), every name seen before keeps its shape and
       dtype (a reply may carry other names: FGA's last step of a round returns the
       weights instead of a gradient);
    4. numbers in ``metrics`` are finite.
    """
    check_arrays(reply.arrays, what)
    for k, v in reply.arrays.items():
        ref = task.arrays.get(k)
        if ref is not None and (tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype):
            raise PayloadError(
                f"{what}: '{k}' has shape {tuple(v.shape)} {v.dtype}, but the task sent {tuple(ref.shape)} {ref.dtype}"
            )
    for k, v in reply.arrays.items():
        ref = None if schema is None else schema.get(k)
        if ref is not None and (tuple(v.shape) != tuple(ref.shape) or v.dtype != ref.dtype):
            raise PayloadError(
                f"{what}: '{k}' has shape {tuple(v.shape)} {v.dtype}, but earlier replies had {tuple(ref.shape)} {ref.dtype}"
            )
    if not _finite_json(reply.metrics):
        raise PayloadError(f"{what}: metrics hold a non-finite number")
