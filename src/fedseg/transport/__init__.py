"""Transports carry tasks to sites and replies back; they never change a number."""

from fedseg.transport.base import Traffic, Transport
from fedseg.transport.inprocess import InProcessTransport

__all__ = ["InProcessTransport", "Traffic", "Transport"]
