"""Transports carry tasks to sites and replies back; they never change a number.

``transport.base`` is the seam (the ``Transport`` protocol, byte accounting) that the algorithms
see; ``transport.inprocess`` is the simulation's transport.  This package's ``__init__`` imports
neither, so importing the seam never pulls in the simulation's transport (and its checkpoint
files) with it.
"""
