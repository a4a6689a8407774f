"""The exit status of every `colibri-stream` command (cli/: __init__.py, bench.py, traces.py).

    0  ok
    1  a check failed: a routed-expert blob or a resident tensor failed its CRC-32 (or could not
       be read back), a benchmark's disk-honesty check found page-cache contamination
    2  bad usage or bad input: an unknown flag, a malformed size, a budget below the minimum, a
       container, trace or model that is malformed or of an unknown version, a missing optional
       dependency, a path that cannot be read or written

Errors are one line on stderr and never a traceback. `click_error` maps a typed error to those
codes by the `exit_code` its base carries (`StreamError`, colibri-int4's `Int4Error`,
colibri-spec's `SpecError`); any other error is bad input.
"""

from __future__ import annotations

import click

EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 1, 2


class InputError(click.ClickException):
    """Bad input, one line, exit 2 (click's usage errors exit 2 as well)."""

    exit_code = EXIT_BAD_INPUT


class CheckFailed(click.ClickException):
    """A failed check (corrupt data), one line, exit 1."""

    exit_code = EXIT_CHECK_FAILED


def click_error(exc: Exception, prefix: str = "") -> click.ClickException:
    """`exc` (a StreamError, an Int4Error, a ValueError or an OSError) as a one-line click error:
    CheckFailed for corruption found by a checksum, InputError for everything else."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        named = exc.filename is not None and str(exc.filename) != prefix
        line = f"{exc.filename}: {exc.strerror}" if named else exc.strerror
    message = f"{prefix}: {line}" if prefix else line
    failed_check = getattr(exc, "exit_code", EXIT_BAD_INPUT) == EXIT_CHECK_FAILED
    return (CheckFailed if failed_check else InputError)(message)
