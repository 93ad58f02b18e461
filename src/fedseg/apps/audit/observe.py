r"""What the server observes of the sites' messages under each protection.

The audit attacks the server's view, so a protection enters it as what the server receives:

* ``"plain"`` — one site's message as sent (the attacked site's gradient or update);
* ``"secagg"`` — secure aggregation: only the weighted sum Σ_k p_k m_k over the K sites (the masks
  cancel exactly in the sum and hide everything else; the audit forms the sum directly,
  :func:`secure_sum`);
* ``"dp"`` — fedseg's differential privacy, each site's message as its own DP code sends it
  (:func:`fedseg.apps.audit.messages.private_messages`): a gradient is DP-SGD's (``privacy.dp = "sample"``:
  every sample's gradient clipped to L2 norm C, N(0, σ²C²) noise on their sum, divided by the batch size),
  an update is clipped to norm C with the site's share N(0, σ²C²/K) of client-level DP's noise
  (``privacy.dp = "client"``);
* ``"secagg+dp"`` — the sum over the sites of their DP messages;
* ``"dp-known-seed"`` — the attacked site's DP message less the noise regenerated from the run seed, as
  the sites' DP code draws it (:func:`fedseg.apps.audit.messages.known_seed_message`; the row says whether
  the regenerated noise matched);
* ``"malicious-server"`` — an active server under secure aggregation that isolates the attacked site's
  message with the sites' own code (:func:`fedseg.apps.audit.messages.server_isolated`: the same step asked
  twice with one site fewer, or ``steps = 0`` sent to the others).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from fedseg.foundation.arrays import Arrays

__all__ = ["PROTECTIONS", "Protection", "secure_sum"]

Protection = Literal["plain", "secagg", "dp", "secagg+dp", "dp-known-seed", "malicious-server"]
PROTECTIONS: tuple[Protection, ...] = ("plain", "secagg", "dp", "secagg+dp", "dp-known-seed", "malicious-server")


def secure_sum(messages: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Arrays:
    """Σ_k p_k m_k: all the server learns of the sites' messages under secure aggregation."""
    if len(messages) != len(weights) or not messages:
        raise ValueError(f"{len(messages)} messages and {len(weights)} weights; give one weight per message")
    return {k: functools.reduce(operator.add, (w * m[k] for m, w in zip(messages, weights))) for k in messages[0]}
