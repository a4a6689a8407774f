"""Run tasks against a loaded model: documents -> requests -> scores -> metrics -> results.

All documents of all requested tasks are read and validated before the model scores
anything, so a bad line fails in a second, not after an hour. Every task's documents then go to
the scoring engine as ONE call (one group per document, so shared contexts are shared), as
lm-eval sends all tasks' requests to one ``loglikelihood`` call: the engine packs and batches
across tasks, so no task leaves a half-empty last batch. A task's ``seconds`` is its share of
that scoring time, in proportion to its input tokens, plus its own metrics' time. ``on_sample`` receives one JSON-able dict per document, the
fields of lm-eval's ``--log_samples`` that matter for comparison: task, doc_id, target,
arguments, per-request (log-likelihood, is_greedy), prediction(s) and metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from colibri_eval.adapters import LoadedModel
from colibri_eval.metrics import DEFAULT_BOOTSTRAP_ITERS, aggregate, multiple_choice_metrics
from colibri_eval.request_encoding import encode_requests
from colibri_eval.results import EvalResults, MetricValue, TaskResult, finite_or_none
from colibri_eval.scoring_engine import ScoringEngine
from colibri_eval.task_data import BUNDLED, Document, load_documents
from colibri_eval.tasks import Task
from colibri_eval.version import __version__

SampleSink = Callable[[dict[str, Any]], None]


def _source(task: Task, data_dir: str | Path | None) -> str:
    if data_dir is None:
        return f"hf:{task.hf_path}" + (f"/{task.hf_name}" if task.hf_name else "") + f"[{task.hf_split}]"
    if str(data_dir) == BUNDLED:
        return f"bundled:{task.name}.jsonl"
    return str(Path(data_dir) / f"{task.name}.jsonl")


def task_samples(task: Task, documents: Sequence[Document], scores: Sequence[Sequence[tuple[float, bool]]]
                 ) -> list[dict[str, Any]]:
    """One sample dict per document from its requests' (log-likelihood, is_greedy) scores."""
    samples = []
    for doc, results in zip(documents, scores, strict=True):
        lls = [ll for ll, _ in results]
        greedy = [g for _, g in results]
        sample: dict[str, Any] = {
            "task": task.name,
            "doc_id": doc.index,
            "target": doc.item.gold,
            "arguments": [list(pair) for pair in doc.item.requests],
            "loglikelihoods": lls,
            "is_greedy": greedy,
        }
        if task.output_type == "loglikelihood":
            sample["metrics"] = {"perplexity": lls[0], "acc": float(greedy[0])}
        else:
            metrics, pred, pred_norm = multiple_choice_metrics(lls, doc.item.choices, doc.item.gold, task.metrics)
            sample.update(pred=pred, pred_norm=pred_norm, metrics=metrics)
        samples.append(sample)
    return samples


def evaluate(
    loaded: LoadedModel,
    tasks: Sequence[Task],
    data_dir: str | Path | None,
    limit: int | None = None,
    *,
    progress: bool = False,
    bootstrap_iters: int = DEFAULT_BOOTSTRAP_ITERS,
    batch_tokens: int = 1024,
    on_sample: SampleSink | None = None,
    documents: dict[str, list[Document]] | None = None,
) -> EvalResults:
    """Score ``tasks``; ``documents`` (task name -> docs) skips reading them again."""
    started = time.perf_counter()
    loaded_docs = documents if documents is not None else {
        task.name: load_documents(task, data_dir, limit) for task in tasks}
    engine = ScoringEngine(loaded.model, batch_tokens=batch_tokens)
    groups = {task.name: [encode_requests(loaded.tokenizer, doc.item.requests) for doc in loaded_docs[task.name]]
              for task in tasks}
    scoring_started = time.perf_counter()
    scores = engine.score([g for task in tasks for g in groups[task.name]], progress=progress)
    scoring_seconds = time.perf_counter() - scoring_started
    tokens = {name: sum(len(r.context) + len(r.continuation) for g in gs for r in g) for name, gs in groups.items()}
    all_tokens = sum(tokens.values()) or 1
    task_results: dict[str, TaskResult] = {}
    first = 0
    for task in tasks:
        task_started = time.perf_counter()
        documents = loaded_docs[task.name]
        samples = task_samples(task, documents, scores[first:first + len(documents)])
        first += len(documents)
        metrics = {}
        if samples:
            for name in task.metrics:
                value, stderr = aggregate(name, [s["metrics"][name] for s in samples], bootstrap_iters)
                metrics[name] = MetricValue(value=value, stderr=finite_or_none(stderr))
        task_results[task.name] = TaskResult(
            task=task.name, task_version=task.version, n=len(samples), n_full=task.full_size,
            source=_source(task, data_dir), metrics=metrics,
            seconds=round(time.perf_counter() - task_started + scoring_seconds * tokens[task.name] / all_tokens, 3))
        if on_sample is not None:
            for sample in samples:
                on_sample(sample)
    return EvalResults(
        model=loaded.spec, model_kind=loaded.kind, model_path=loaded.path, model_info=loaded.info,
        colibri_eval_version=__version__, created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        limit=limit, bootstrap_iters=bootstrap_iters, tasks=task_results,
        total_seconds=round(time.perf_counter() - started, 3))
