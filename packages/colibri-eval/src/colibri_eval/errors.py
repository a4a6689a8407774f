"""Typed exceptions for colibri-eval.

Every user mistake (bad JSONL, unknown task, malformed flag, unreadable results file) raises
a subclass of ``ColibriEvalError`` whose message is ONE line naming what is wrong and where
(file and line where there is one). The CLI prints that line and exits with the code the
class carries, so callers in CI can tell a data problem from a failed quality gate.
"""

from __future__ import annotations

from colibri_spec import VersionMismatchError


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
    model that cannot be loaded."""


class MissingDependencyError(ColibriEvalError, ImportError):
    """An optional dependency is not installed; the one-line message names the extra to install.

    ``pip install colibri-eval`` brings numpy, click, tqdm and pydantic only: ``hf:`` models need
    ``[hf]`` (transformers, torch), ``colibri:`` and ``int4:`` models ``[colibri]`` (colibri-model,
    colibri-stream, torch), HF dataset ids ``[hub]`` (datasets), ``colibri-lm-eval`` ``[lm-eval]``.

    Attributes:
        extra: the extra to install, e.g. ``"hf"``.
        module: the module that failed to import, when known.

        >>> raise MissingDependencyError("an hf: model", "hf", "transformers")  # doctest: +SKIP
        colibri_eval.errors.MissingDependencyError: an hf: model needs transformers (not installed): pip install 'colibri-eval[hf]'
    """

    def __init__(self, what: str, extra: str, module: str | None = None, detail: str | None = None) -> None:
        if module:
            needs = f"needs {module} (not installed)"
        else:
            needs = "needs an optional dependency" + (f" ({detail})" if detail else "")
        super().__init__(f"{what} {needs}: pip install 'colibri-eval[{extra}]'")
        self.extra = extra
        self.module = module

    @classmethod
    def from_import_error(cls, what: str, extra: str, exc: ImportError) -> MissingDependencyError:
        """A module that is not there is named (``exc.name``); any other import failure (a
        library too old, a sub-dependency it asks for) is quoted, first line only."""
        if isinstance(exc, ModuleNotFoundError) and exc.name:  # named as pip names it: lm_eval -> lm-eval
            return cls(what, extra, exc.name.split(".")[0].replace("_", "-"))
        return cls(what, extra, detail=str(exc).splitlines()[0] if str(exc) else None)


class ResultsFormatError(ColibriEvalError):
    """A results JSON that cannot be read (bad JSON, wrong schema, unknown major version)."""


class ResultsVersionError(ResultsFormatError, VersionMismatchError):
    """A results JSON of another major `results_version`; names both versions."""


class GateSpecError(ColibriEvalError):
    """A malformed ``--min`` expression."""


class FieldError(ColibriEvalError, ValueError):
    """A row lacks a field or has a value of the wrong shape; the loader adds file and line
    (and reports it as a `DataError`)."""
