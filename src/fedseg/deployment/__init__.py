"""Layer 6, many machines: a run across real sites, beside the one-process :mod:`fedseg.simulation`.

The remote transport over any ``call(site, op, payload, timeout) -> bytes`` channel: the safetensors wire
format and payload checks (``wire``), the ``[deploy]`` settings (``params``), :class:`RemoteTransport`
with deadlines, minimum sites and dropouts (``transport``) and its reply checks (``checks``).  On it, the
site and server mains (``site``, ``server``), the site's policy and its checks of the requests it answers
(``policy``, ``guard``), volume runs (``volumes``), the processes, rehearsal and ``deploy run`` (``run``),
the supervisor (``supervise``) and NVIDIA FLARE (``flare``, the only module that imports it).  See
``docs/deploy.md``.
"""
