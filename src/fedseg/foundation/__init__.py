"""Layer 0, the foundation: errors, seeded random streams, array maths, messages, settings, devices.

Torch and the standard library only; every other layer stands on it.
"""
