"""Errors that fedseg raises for bad input.

Every error names the thing that is wrong and says how to fix it, so that a
user reading one line knows what to do.  They derive from ``ValueError`` so
that callers who do not know fedseg can still catch them generically.
"""

from __future__ import annotations


class FedsegError(ValueError):
    """Base class of fedseg's user-facing errors."""


class ConfigError(FedsegError):
    """A run config, federation spec or override is malformed."""


class DataError(FedsegError):
    """A data file, datalist or dataset is missing or inconsistent."""


class PayloadError(FedsegError):
    """A task or reply crossing the transport has unexpected content."""
