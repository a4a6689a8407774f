"""Typed exceptions of colibri-model: every error it raises on purpose derives from
`ColibriModelError`, which carries the exit code its command line gives it (`exit_code`): 2 for
bad input (a file, a flag, a config: the user's to fix), 1 for a run that failed its own check
(`TrainingDivergedError`). Each input error is also a `ValueError` and the divergence a
`RuntimeError`, so callers that caught those keep working. The errors of the files colibri-model
shares with other packages (`ConfigError`, `CheckpointFormatError`, ...) are colibri-spec's, whose
base `colibri_spec.SpecError` carries exit code 2 as well.

This module imports nothing heavy: the command line catches these without importing torch.
"""

from __future__ import annotations


class ColibriModelError(Exception):
    """Base class of every error colibri-model raises on purpose; `exit_code` is what the command
    line exits with."""

    exit_code = 2


class TokenizerError(ColibriModelError, ValueError):
    """A tokenizer source that is no readable tokenizer.json, directory or reachable Hub id."""


class ChatFormatError(ColibriModelError, ValueError):
    """A conversation that is not a list of {role, content} messages with known roles."""


class DataSourceError(ColibriModelError, ValueError):
    """An input that cannot be read as documents; the message names the file and line."""


class ShardFormatError(ColibriModelError, ValueError):
    """A token shard that is truncated, corrupt or of an unknown format version."""


class ManifestError(ColibriModelError, ValueError):
    """A data directory whose manifest is missing, corrupt or of an unknown version."""


class LoaderError(ColibriModelError, ValueError):
    """A data source too small for the sequence length, or a position that does not fit it."""


class TrainConfigError(ColibriModelError, ValueError):
    """An invalid or inconsistent training configuration."""


class ScheduleError(ColibriModelError, ValueError):
    """A schedule change that would silently alter a run (e.g. moving a decay already under way)."""


class TrainingStateError(ColibriModelError, ValueError):
    """A training_state.json that is missing, corrupt, or of an unknown version."""


class OptimizerStateError(ColibriModelError, ValueError):
    """An optimizer state file that does not fit the model or cannot be read."""


class CheckpointMismatchError(ColibriModelError, ValueError):
    """A checkpoint that belongs to another model config or another data set."""


class MemoryPlanError(ColibriModelError, ValueError):
    """A planner input that does not describe a training run (bad size, unsupported mode)."""


class UnknownGpuError(ColibriModelError, ValueError):
    """A GPU key or device name that is not in the table."""


class TrainingDivergedError(ColibriModelError, RuntimeError):
    """Too many non-finite steps in a row."""

    exit_code = 1
