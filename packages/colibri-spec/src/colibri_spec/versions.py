"""The one version check of every versioned file: a reader compares the MAJOR part of the file's
version with its own and refuses another major with one error naming both (COMPATIBILITY.md:
a newer minor only adds optional fields, so it is read)."""

from __future__ import annotations

from .errors import VersionMismatchError


def major(version: object) -> str:
    """The major part of a `MAJOR.MINOR` version ("1" of "1.2"); the whole text if it has no dot."""
    return str(version).split(".")[0]


def require_major(found: object, known: str, *, key: str, where: str, reader: str = "colibri-spec",
                  error: type[Exception] = VersionMismatchError, known_text: str | None = None) -> None:
    """Raise `error` unless `found` has `known`'s major version.

    The message is `WHERE: KEY FOUND is not supported (this READER reads KNOWN)`, with "(missing)"
    for a missing version; `known_text` replaces KNOWN there for a reader that accepts more than
    one major (it has checked the others itself). When `error` derives from `VersionMismatchError` its `key`, `found`
    and `known` attributes are set.

    >>> require_major("1.3", "1.0", key="metrics_version", where="metrics.jsonl:4")
    >>> require_major("2.0", "1.0", key="metrics_version", where="metrics.jsonl:4")
    Traceback (most recent call last):
    ...
    colibri_spec.errors.VersionMismatchError: metrics.jsonl:4: metrics_version 2.0 is not supported (this colibri-spec reads 1.0)
    """
    text = "" if found is None else str(found)
    if text and major(text) == major(known):
        return
    exc = error(f"{where}: {key} {text or '(missing)'} is not supported (this {reader} reads {known_text or known})")
    if isinstance(exc, VersionMismatchError):
        exc.key, exc.found, exc.known = key, text, known
    raise exc
