"""The remote transport: the safetensors wire format and payload checks (``wire``), the ``[deploy]``
settings (``params``) and :class:`RemoteTransport` (``transport``): deadlines, minimum sites, reply checks.
It works over any ``call(site, op, payload, timeout) -> bytes`` channel; NVIDIA FLARE is one
(``fedseg.apps.deploy.flare``).
"""
