"""Typed exceptions of colibri-stream.

Every error raised on purpose derives from `StreamError`. Errors about bad input (a budget too
small, a malformed size string, a corrupted container) also derive from `ValueError`, so callers
that already catch `ValueError` for bad input (colibri-eval's adapter does) catch them too.
"""

from __future__ import annotations


class StreamError(Exception):
    """Base class of every error colibri-stream raises on purpose."""


class SizeFormatError(StreamError, ValueError):
    """A size string such as "600MB" that cannot be parsed; the message quotes it."""


class BudgetError(StreamError, ValueError):
    """The RAM budget cannot hold the resident weights plus one layer's working set.

    `minimum_bytes` is the smallest budget that would be accepted."""

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class ExpertCorruptError(StreamError, ValueError):
    """A routed-expert blob failed its CRC-32 or could not be read; names (layer, expert)."""

    def __init__(self, message: str, layer: int, expert: int):
        super().__init__(message)
        self.layer, self.expert = layer, expert


class ContainerConfigError(StreamError, ValueError):
    """The container's model config is unusable by this runtime (unknown version, bad fields)."""


class SmallCacheWarning(UserWarning):
    """The expert cache holds fewer experts than one decode token uses (MoE layers x top-k):
    a global LRU then hits nothing, and every policy misses most of each token."""
