"""The versioned results JSON (``results_version``) and the markdown table over many of them.

One file per (model, run): the model spec and path, what the adapter reports about it
(dtype, parameters, revision), per task the lm-eval task version, n, the data source, each
metric with its standard error, and the seconds spent. Written with sorted keys and a fixed
layout so two runs diff cleanly. Spec: RESULTS_FORMAT.md beside this file.

A reader refuses an unknown MAJOR version with an error naming both versions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from colibri_spec import require_major
from pydantic import BaseModel, Field, ValidationError

from colibri_eval.errors import ResultsFormatError, ResultsVersionError

RESULTS_VERSION = "1.0"

# The metric each task's table column shows: acc_norm where lm-eval users usually quote it.
HEADLINE_METRIC = {
    "lambada_openai": "acc",
    "piqa": "acc",
    "winogrande": "acc",
    "arc_easy": "acc",
    "arc_challenge": "acc_norm",
    "openbookqa": "acc_norm",
    "hellaswag": "acc_norm",
}
LOWER_IS_BETTER = {"perplexity"}


class MetricValue(BaseModel):
    value: float
    stderr: float | None = None


class TaskResult(BaseModel):
    task: str
    task_version: str
    n: int
    n_full: int | None = None
    source: str  # data file, "bundled:TASK.jsonl" or HF dataset id
    metrics: dict[str, MetricValue]
    seconds: float


class EvalResults(BaseModel):
    results_version: str = RESULTS_VERSION
    model: str  # the spec as given, e.g. "hf:/models/smollm2"
    model_kind: str
    model_path: str
    model_info: dict[str, Any] = Field(default_factory=dict)
    colibri_eval_version: str
    compatible_with: str = "lm-evaluation-harness 0.4 (zero-shot prompts and scoring)"
    created: str  # ISO-8601 UTC
    limit: int | None = None
    bootstrap_iters: int
    tasks: dict[str, TaskResult]
    total_seconds: float

    def metric(self, task: str, name: str) -> MetricValue | None:
        result = self.tasks.get(task)
        return None if result is None else result.metrics.get(name)


def write_results(results: EvalResults, path: str | Path) -> None:
    Path(path).write_text(json.dumps(results.model_dump(mode="json"), indent=2, sort_keys=True) + "\n",
                          encoding="utf-8")


def read_results(path: str | Path) -> EvalResults:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsFormatError(f"{path}: no such results file") from None
    except json.JSONDecodeError as exc:
        raise ResultsFormatError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or "results_version" not in data:
        raise ResultsFormatError(f"{path}: not a colibri-eval results file (no results_version)")
    require_major(data["results_version"], RESULTS_VERSION, key="results_version", where=str(path),
                  reader="colibri-eval", error=ResultsVersionError)
    try:
        return EvalResults.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ResultsFormatError(f"{path}: field {where}: {first['msg']}") from None


def _cell(results: EvalResults, task: str, metric: str | None) -> str:
    name = metric or HEADLINE_METRIC.get(task, "acc")
    value = results.metric(task, name)
    if value is None:
        return "-"
    if name in LOWER_IS_BETTER:
        return f"{value.value:.2f}"
    return f"{100 * value.value:.1f}"


def markdown_table(all_results: Sequence[EvalResults], metric: str | None = None) -> str:
    """One row per model, one column per task (tasks in first-seen order), values x100.

    lambada_openai also gets a perplexity column. ``metric`` forces one metric everywhere.
    """
    from colibri_eval.tasks import ALL_TASKS  # noqa: PLC0415 - avoid an import cycle at load

    seen = {task for results in all_results for task in results.tasks}
    tasks = [task for task in ALL_TASKS if task in seen] + sorted(seen - set(ALL_TASKS))
    columns: list[tuple[str, str | None]] = []
    for task in tasks:
        columns.append((task, metric))
        if task == "lambada_openai" and metric is None:
            columns.append((task, "perplexity"))
    header = ["model"] + [
        f"{task} ({name or HEADLINE_METRIC.get(task, 'acc')})" if name != "perplexity" else f"{task} (ppl)"
        for task, name in columns
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(columns)) + "|"]
    for results in all_results:
        row = [results.model] + [_cell(results, task, name) for task, name in columns]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value
