"""Typed exceptions of colibri-spec: one base, `SpecError`, so a caller can catch every problem
with a file whose schema lives here; each derives from `ValueError` because it describes bad
input, not a bug.

`VersionMismatchError` is the one error for a file of another major version: it names both
versions (`found`, `known`) and the key that carries them. Other packages derive their own
version errors from it and from their own base, so `except VersionMismatchError` catches every
version mismatch of the project and `except ContainerError` (say) still catches theirs.
"""

from __future__ import annotations


class SpecError(ValueError):
    """Base class of every error colibri-spec raises on purpose. Command lines exit 2 for it
    (bad input)."""

    exit_code = 2


class VersionMismatchError(ValueError):
    """A versioned file of a major version this reader does not know.

    Attributes:
        key: the field that holds the version (`format_version`, `metrics_version`, ...).
        found: the version the file carries ("" when the field is missing).
        known: the version this reader writes and reads.
    """

    key: str = ""
    found: str = ""
    known: str = ""


class ConfigError(SpecError):
    """An invalid model configuration; the message names the offending field."""


class CheckpointFormatError(SpecError):
    """A checkpoint that this version cannot read; the message says which file and why."""


class CheckpointVersionError(CheckpointFormatError, VersionMismatchError):
    """A checkpoint config.json of another major `format_version` or `schema_version`."""


class MetricsFormatError(SpecError):
    """A metrics.jsonl line that is not valid JSON or not a valid record; the message names the
    file and the line."""


class MetricsVersionError(MetricsFormatError, VersionMismatchError):
    """A metrics.jsonl record of another major `metrics_version`."""


class HFConfigError(SpecError):
    """A Hugging Face config.json that Colibri cannot represent: an unknown `model_type`, a
    missing field, or a field whose value would change the math (the message names the field
    and its value)."""


class FP8ConfigError(SpecError):
    """A quantization_config this reader refuses: the field, its value and why."""

    def __init__(self, key: str, value, why: str):
        super().__init__(f"{key}={value!r} is not supported ({why})")
        self.key, self.value, self.why = key, value, why
