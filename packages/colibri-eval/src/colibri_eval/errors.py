"""Typed exceptions for colibri-eval.

Every user mistake (bad JSONL, unknown task, malformed flag, unreadable results file) raises
a subclass of ``ColibriEvalError`` whose message is ONE line naming what is wrong and where
(file and line where there is one). The CLI prints that line and exits with the code the
class carries, so callers in CI can tell a data problem from a failed quality gate.
"""

from __future__ import annotations


class ColibriEvalError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 2


class UnknownTaskError(ColibriEvalError):
    """A task name that is not one of the seven supported tasks."""


class DataError(ColibriEvalError):
    """A dataset file or row is malformed (bad JSON, missing field, wrong type)."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


class ModelSpecError(ColibriEvalError):
    """A ``--model`` value that is not ``hf:PATH``, ``colibri:PATH`` or ``int4:PATH``, or a
    model whose library is not installed."""


class ResultsFormatError(ColibriEvalError):
    """A results JSON that cannot be read (bad JSON, wrong schema, unknown major version)."""


class GateSpecError(ColibriEvalError):
    """A malformed ``--min`` expression."""
