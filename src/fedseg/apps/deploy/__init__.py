"""Deployment across real sites: wire format, site/server runtimes, fault rules, NVFlare processes.

Only :mod:`fedseg.apps.deploy.flare` imports NVIDIA FLARE; everything else here
works over any ``call(site, op, payload, timeout) -> bytes`` channel.  See
``docs/deploy.md``.
"""
