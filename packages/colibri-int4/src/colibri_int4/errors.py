"""Typed exceptions of colibri-int4.

`ContainerError` is raised for any problem with a `.coli` file (truncated, corrupted, wrong
magic, unsupported version, hostile header), its subclass `ChecksumError` when a CRC-32 does
not match; `CheckpointError` for a checkpoint directory that
does not follow CHECKPOINT.md. Both derive from `Int4Error`, so a caller can catch either or
both; both derive from `ValueError` because they describe bad input, not a bug.
"""

from __future__ import annotations

from colibri_spec import HFConfigError, VersionMismatchError


class Int4Error(ValueError):
    """Base class of every error colibri-int4 raises on purpose; `exit_code` is what the command
    line exits with (2: bad input)."""

    exit_code = 2


class ContainerError(Int4Error):
    """A container file is unreadable: the message says what is wrong and where (byte offset,
    tensor name or (layer, expert))."""


class ChecksumError(ContainerError):
    """A CRC-32 of the container (preamble, header JSON, tokenizer, a resident tensor or an
    expert blob) does not match: the bytes were damaged after export. The command line exits 1
    for it (a check failed), and 2 for the other, malformed-input errors."""

    exit_code = 1


class ContainerVersionError(ContainerError, VersionMismatchError):
    """A container of another major version (preamble or header `container_version`); the
    message and the `found` / `known` attributes name both versions."""


class CheckpointError(Int4Error):
    """A checkpoint directory (config.json + model.safetensors) is missing, malformed or does
    not match the tensor names and shapes of CHECKPOINT.md."""


class CheckpointVersionError(CheckpointError, VersionMismatchError):
    """A checkpoint config.json of another major `format_version`; names both versions."""


class HFImportError(CheckpointError, HFConfigError):
    """A Hugging Face checkpoint directory that `import-hf` cannot convert: a missing or malformed
    file, an unknown `model_type`, or a config field whose value Colibri cannot represent (the
    message names the field and its value; colibri-spec's config mapping raises it as this class
    when int4 asks, so it is also a `colibri_spec.HFConfigError`)."""


class GGUFImportError(CheckpointError):
    """A GGUF file that `import-gguf` cannot convert: unreadable or truncated, an architecture,
    metadata key, tensor or tensor type Colibri has no place for (the message names it and the
    file), or the optional `gguf` package missing."""
