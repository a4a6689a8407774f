"""Run lm-eval's own evaluator and colibri-eval on the same model and items, and compare.

lm-eval side: ``simple_evaluate`` with local task YAMLs that ``include`` lm-eval's installed
task definitions and read our JSONL (lm_eval_compat.write_local_task_yamls), so prompts,
hooks and metrics are lm-eval's. colibri-eval side: ``runner.evaluate``. The comparison is
per item (every request's log-likelihood and greedy flag, every per-item metric) and per
task (every metric and its stderr). Used by the parity test and bench/eval_throughput.py.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from colibri_eval.lm_eval_compat import import_lm_eval, write_local_task_yamls
from colibri_eval.task_data import BUNDLED, bundled_data_dir


def run_lm_eval(model: Any, model_args: str | None, task_names: list[str], data_dir: str | Path, limit: int | None,
                bootstrap_iters: int = 1000, batch_size: int | str = 1) -> tuple[dict[str, Any], float]:
    """lm-eval results (with samples) for our tasks over local JSONL, and its wall seconds.

    ``model`` is an lm-eval model name ("hf", "colibri") with ``model_args``, or an already
    built lm-eval ``LM`` (then only scoring is timed, not loading).
    """
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    directory = bundled_data_dir() if str(data_dir) == BUNDLED else Path(data_dir)
    with tempfile.TemporaryDirectory(prefix="colibri-eval-yaml-") as yaml_dir, _bootstrap_in_process():
        names = write_local_task_yamls(directory, yaml_dir, task_names)
        manager = TaskManager(include_path=yaml_dir, include_defaults=False)
        started = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=model, model_args=model_args or "", tasks=[names[t] for t in task_names], limit=limit,
            task_manager=manager, log_samples=True, bootstrap_iters=bootstrap_iters, batch_size=batch_size,
            device="cpu")
        seconds = time.perf_counter() - started
    renamed = {"results": {}, "samples": {}}
    for task, local in names.items():
        renamed["results"][task] = out["results"][local]
        renamed["samples"][task] = sorted(out["samples"][local], key=lambda s: s["doc_id"])
    return renamed, seconds


@contextlib.contextmanager
def _bootstrap_in_process():
    """Run lm-eval's bootstrap stderr in this process, chunk by chunk, with its own
    `_bootstrap_internal` (so the numbers are exactly lm-eval's).

    NOTE: lm-eval's `bootstrap_stderr` opens a `multiprocessing.Pool`. Forking a process that
    runs other threads (torch's, a test's HTTP server, a relay heartbeat) hung `make test` in
    the pool's teardown, and spawned workers hung waiting for their tasks; the bootstrap of a
    few hundred items takes well under a second in-process anyway.
    """
    from lm_eval.api import metrics

    original = metrics.bootstrap_stderr

    def bootstrap_stderr(f, xs, iters):
        chunk = min(1000, iters)
        samples: list = []
        for i in range(iters // chunk):
            samples.extend(metrics._bootstrap_internal(f, chunk)((i, xs)))
        return metrics.sample_stddev(samples)

    metrics.bootstrap_stderr = bootstrap_stderr
    try:
        yield
    finally:
        metrics.bootstrap_stderr = original


def _close(a: float, b: float, rel: float, abs_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


def compare(lm_eval_out: dict[str, Any], results: Any, samples: list[dict[str, Any]],
            ll_rel: float = 1e-5, ll_abs: float = 1e-3, metric_rel: float = 1e-5) -> dict[str, Any]:
    """Return a report; ``report["agree"]`` is True when every item and metric agrees."""
    ours_by_task: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        ours_by_task.setdefault(sample["task"], []).append(sample)
    report: dict[str, Any] = {"tasks": {}, "agree": True}
    for task, theirs in lm_eval_out["samples"].items():
        ours = sorted(ours_by_task.get(task, []), key=lambda s: s["doc_id"])
        problems: list[str] = []
        max_ll_diff = 0.0
        if len(ours) != len(theirs):
            problems.append(f"{len(ours)} items vs lm-eval's {len(theirs)}")
        for mine, their in zip(ours, theirs, strict=False):
            resps = [tuple(r) for r in their["filtered_resps"]]
            if [list(a) for a in mine["arguments"]] != [list(r) for r in (tuple(x[:2]) for x in their["arguments"])]:
                problems.append(f"doc {their['doc_id']}: request strings differ")
            for (their_ll, their_greedy), my_ll, my_greedy in zip(resps, mine["loglikelihoods"], mine["is_greedy"], strict=True):
                max_ll_diff = max(max_ll_diff, abs(float(their_ll) - my_ll))
                if not _close(float(their_ll), my_ll, ll_rel, ll_abs) or bool(their_greedy) != my_greedy:
                    problems.append(f"doc {their['doc_id']}: ll {their_ll} vs {my_ll}, greedy {their_greedy} vs {my_greedy}")
            for name, value in mine["metrics"].items():
                if name in their and not _close(float(their[name]), float(value), ll_rel, ll_abs):
                    problems.append(f"doc {their['doc_id']}: {name} {their[name]} vs {value}")
        metrics = {}
        for key, value in lm_eval_out["results"][task].items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            name = key.split(",")[0]
            base = name.removesuffix("_stderr")
            mine_metric = results.tasks[task].metrics.get(base)
            if mine_metric is None:
                problems.append(f"metric {base} missing")
                continue
            my_value = mine_metric.stderr if name.endswith("_stderr") else mine_metric.value
            metrics[name] = {"lm_eval": value, "colibri_eval": my_value}
            if my_value is None or not _close(float(value), float(my_value), metric_rel, 1e-9):
                problems.append(f"{name}: lm-eval {value} vs colibri-eval {my_value}")
        report["tasks"][task] = {"n": len(theirs), "max_abs_ll_diff": max_ll_diff, "metrics": metrics,
                                 "problems": problems[:10], "n_problems": len(problems)}
        report["agree"] &= not problems
    return report
