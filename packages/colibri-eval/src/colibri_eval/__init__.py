"""colibri-eval: zero-shot evaluation with lm-evaluation-harness 0.4's prompts and scoring.

Every model (colibri checkpoints, int4 containers, Hugging Face references) goes through the
same request construction and the same batched scoring engine. ``import colibri_eval`` needs
only numpy, click, tqdm and pydantic; torch, transformers, lm-eval and the colibri packages
are imported by the parts that need them.

Example:
    >>> from colibri_eval import load_model, evaluate, parse_task_list   # doctest: +SKIP
    >>> model = load_model("hf:/path/to/model")                          # doctest: +SKIP
    >>> results = evaluate(model, parse_task_list("piqa"), "bundled", limit=50)  # doctest: +SKIP
    >>> results.tasks["piqa"].metrics["acc"].value                       # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from colibri_eval.errors import (
    ColibriEvalError,
    DataError,
    GateSpecError,
    MissingDependencyError,
    ModelSpecError,
    ResultsFormatError,
    ResultsVersionError,
    UnknownTaskError,
)
from colibri_eval.results import RESULTS_VERSION, EvalResults, read_results, write_results
from colibri_eval.task_data import bundled_data_dir, load_documents
from colibri_eval.tasks import ALL_TASKS, TASKS, Task, get_task, parse_task_list
from colibri_eval.version import __version__


def load_model(spec: str, dtype: str = "float32", ram_budget: str | None = None) -> Any:
    """``hf:PATH`` | ``colibri:PATH`` | ``int4:PATH`` -> ``LoadedModel`` (imports torch)."""
    from colibri_eval.adapters import load_model as _load  # noqa: PLC0415 - torch is heavy

    return _load(spec, dtype=dtype, ram_budget=ram_budget)


def evaluate(*args: Any, **kwargs: Any) -> EvalResults:
    """See ``colibri_eval.runner.evaluate`` (imports torch)."""
    from colibri_eval.runner import evaluate as _evaluate  # noqa: PLC0415

    return _evaluate(*args, **kwargs)


__all__ = [
    "ALL_TASKS",
    "RESULTS_VERSION",
    "TASKS",
    "ColibriEvalError",
    "DataError",
    "EvalResults",
    "GateSpecError",
    "MissingDependencyError",
    "ModelSpecError",
    "ResultsFormatError",
    "ResultsVersionError",
    "Task",
    "UnknownTaskError",
    "__version__",
    "bundled_data_dir",
    "evaluate",
    "get_task",
    "load_documents",
    "load_model",
    "parse_task_list",
    "read_results",
    "write_results",
]
