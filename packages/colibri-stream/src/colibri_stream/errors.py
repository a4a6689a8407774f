"""Typed exceptions of colibri-stream, all of them here but two that live beside their code: the
server's `APIError` (serve/errors.py, an HTTP answer) and `ProcIOUnavailable` (io/accounting.py).

Every error raised on purpose derives from `StreamError` (those two as well), whose `exit_code` is
what the command line exits with (exit_status.py): 2 for bad input, 1 for a failed check
(`ExpertCorruptError`). The command line's own click exceptions (exit_status.py: `InputError`,
`CheckFailed`) are how a command prints such an error, not errors of the library.
Errors about bad input (a budget too small, a malformed size string, a corrupted container) also
derive from `ValueError`, so callers that already catch `ValueError` for bad input
(colibri-eval's adapter does) catch them too. Version mismatches are also colibri-spec's
`VersionMismatchError`, which names both versions.
"""

from __future__ import annotations

from colibri_spec import VersionMismatchError


class StreamError(Exception):
    """Base class of every error colibri-stream raises on purpose."""

    exit_code = 2


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

    exit_code = 1  # a check failed

    def __init__(self, message: str, layer: int, expert: int):
        super().__init__(message)
        self.layer, self.expert = layer, expert


class ContainerConfigError(StreamError, ValueError):
    """The container's model config is unusable by this runtime (unknown version, bad fields)."""


class NativeKernelError(StreamError, RuntimeError):
    """The native kernel could not be built or loaded (the message says why)."""


class NoRouterError(StreamError, ValueError):
    """The model has no module that behaves like a transformers >= 5 MoE router."""


class ContextOverflowError(StreamError, ValueError):
    """A conversation that does not fit the engine's context even after the overflow policy."""


class ChatTemplateError(StreamError, ValueError):
    """A chat template that does not render (bad Jinja, or `raise_exception` in the template)."""


class TraceFormatError(StreamError, ValueError):
    """A routing trace file that breaks ROUTING_TRACE.md; the message names path and line."""


class TraceVersionError(TraceFormatError, VersionMismatchError):
    """A routing trace of another major version; names both versions."""


class DumpFormatError(StreamError, ValueError):
    """A routing dump that cannot be imported; the message names the file and, where one is at
    fault, the line."""


class ReportVersionError(StreamError, VersionMismatchError):
    """A report of a major version this reader does not know; names both versions."""


class MemoryCapWarning(UserWarning):
    """A stated RAM budget larger than what this process's memory cgroup leaves for it: the
    kernel, not the engine, would end the process (the OOM killer) when the cache fills."""


class SmallCacheWarning(UserWarning):
    """The expert cache holds fewer experts than one decode token uses (MoE layers x top-k):
    a global LRU then hits nothing, and every policy misses most of each token."""
