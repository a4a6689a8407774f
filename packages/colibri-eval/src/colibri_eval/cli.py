"""``colibri-eval``: run tasks, gate CI on scores, tabulate results.

Exit codes (stable, for CI, the same convention as every Colibri command):
  0  every requested task ran and every gate passed
  1  a check failed: a quality gate (``--min`` bar missed, or a regression against ``--baseline``)
  2  bad usage or bad input: unknown flag or task, malformed ``--min``, unreadable or
     malformed data/results file, model that cannot be loaded, a missing optional dependency
     (the message names the extra to install) (one-line message, no traceback)

Progress bars go to stderr only when it is a terminal, unless ``--progress``/``--no-progress``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from colibri_eval import __version__
from colibri_eval.errors import ColibriEvalError, GateSpecError, MissingDependencyError
from colibri_eval.gates import check_bars, compare_with_baseline, parse_bar
from colibri_eval.results import markdown_table, read_results, write_results
from colibri_eval.task_data import BUNDLED, bundled_data_dir, load_documents
from colibri_eval.tasks import ALL_TASKS, TASKS, parse_task_list

EXIT_OK, EXIT_GATE_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class InputError(click.ClickException):
    exit_code = EXIT_BAD_INPUT


def _fail(exc: ColibriEvalError) -> click.ClickException:
    error = click.ClickException(str(exc))
    error.exit_code = exc.exit_code
    return error


class DtypeChoice(click.Choice):
    """`f32|bf16`, the dtype spelling of every Colibri command; `float32` / `bfloat16` stay accepted
    (not shown) so that older scripts keep working."""

    ALIASES = {"float32": "f32", "fp32": "f32", "bfloat16": "bf16"}

    def __init__(self) -> None:
        super().__init__(["f32", "bf16"])

    def convert(self, value, param, ctx):
        return super().convert(self.ALIASES.get(value, value), param, ctx)


# the torch names the model adapters and the results JSON use
_TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


def _resolve_progress(_ctx, _param, value: bool | None) -> bool:
    return sys.stderr.isatty() if value is None else value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-eval")
def main() -> None:
    """Zero-shot evaluation with lm-evaluation-harness 0.4's prompts and scoring.

    Exit status: 0 ok, 1 a check failed (e.g. a gate failed), 2 bad usage or bad input.
    """


@main.command()
@click.option("--model", "model_spec", required=True, metavar="KIND:PATH",
              help="hf:PATH (transformers causal LM or .gguf), colibri:PATH (checkpoint dir), int4:PATH (container).")
@click.option("--tasks", "task_spec", default="all", show_default=True, help=f"'all' or a comma list of: {', '.join(ALL_TASKS)}.")
@click.option("--data-dir", default=None, metavar="DIR",
              help="Directory of TASK.jsonl files (HF field names); 'bundled' for the shipped 200-item samples; omit to load HF dataset ids (online).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Score only the first N documents of each task.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Results JSON to write.")
@click.option("--log-samples", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write one JSON line per document (log-likelihoods, prediction, gold).")
@click.option("--min", "bars", multiple=True, metavar="TASK.METRIC=V",
              help="Fail (exit 1) unless TASK.METRIC >= V; use TASK.METRIC<=V for perplexity. Repeatable.")
@click.option("--baseline", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Earlier results JSON to compare with.")
@click.option("--max-drop", type=click.FloatRange(min=0), default=0.02, show_default=True,
              help="Largest tolerated drop vs --baseline (absolute for accuracies, relative for perplexity).")
@click.option("--dtype", type=DtypeChoice(), default="f32", show_default=True,
              help="Dtype of weights and activations.")
@click.option("--batch-tokens", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Padded tokens per forward pass (1024 measured fastest on CPU for a 135M model).")
@click.option("--bootstrap-iters", type=click.IntRange(min=0), default=100_000, show_default=True,
              help="Bootstrap resamples for perplexity stderr (lm-eval's default); 0 = no stderr.")
@click.option("--ram-budget", default=None, help="int4 only: RAM budget for the expert cache, e.g. 2GiB.")
@click.option("--progress/--no-progress", default=None, callback=_resolve_progress,
              help="Progress bars on stderr [default: only when stderr is a terminal].")
def run(model_spec: str, task_spec: str, data_dir: str | None, limit: int | None, out: Path, log_samples: Path | None,
        bars: tuple[str, ...], baseline: Path | None, max_drop: float, dtype: str, batch_tokens: int,
        bootstrap_iters: int, ram_budget: str | None, progress: bool) -> None:
    """Evaluate a model on tasks and write a results JSON."""
    try:
        tasks = parse_task_list(task_spec)
        parsed_bars = [parse_bar(text) for text in bars]
        names = {task.name for task in tasks}
        for bar in parsed_bars:
            if bar.task not in names:
                raise GateSpecError(f"--min {bar.describe()}: task {bar.task!r} is not in --tasks")
            if bar.metric not in TASKS[bar.task].metrics:
                raise GateSpecError(f"--min {bar.describe()}: {bar.task} has metrics {', '.join(TASKS[bar.task].metrics)}")
        old = read_results(baseline) if baseline is not None else None
        if data_dir is not None and data_dir != BUNDLED and not Path(data_dir).is_dir():
            raise InputError(f"--data-dir {data_dir}: not a directory")
        for option, path in (("--out", out), ("--log-samples", log_samples)):
            if path is not None and not path.absolute().parent.is_dir():  # found before the slow run
                raise InputError(f"{option} {path}: no such directory {path.absolute().parent}")
        # read and validate every document before the (slow) model load
        documents = {task.name: load_documents(task, data_dir, limit) for task in tasks}
        from colibri_eval.adapters import EXTRAS, load_model  # noqa: PLC0415

        # the model first: a missing library is then named with the extra of this kind of model
        loaded = load_model(model_spec, dtype=_TORCH_DTYPE[dtype], ram_budget=ram_budget)
        try:
            from colibri_eval.runner import evaluate  # noqa: PLC0415 - imports torch
        except ImportError as exc:
            raise MissingDependencyError.from_import_error("scoring", EXTRAS[loaded.kind], exc) from None
    except ColibriEvalError as exc:
        raise _fail(exc) from None

    try:
        sample_file = open(log_samples, "w", encoding="utf-8") if log_samples else None  # noqa: SIM115
    except OSError as exc:
        raise InputError(f"--log-samples {log_samples}: {exc.strerror}") from None
    try:
        def write_sample(sample: dict) -> None:
            sample_file.write(json.dumps(sample, sort_keys=True, ensure_ascii=False) + "\n")

        results = evaluate(loaded, tasks, data_dir, limit, progress=progress, bootstrap_iters=bootstrap_iters,
                           batch_tokens=batch_tokens, on_sample=write_sample if sample_file else None,
                           documents=documents)
    finally:
        if sample_file:
            sample_file.close()
    try:
        write_results(results, out)
    except OSError as exc:
        raise InputError(f"--out {out}: {exc.strerror}") from None

    click.echo(f"model {results.model}  ({results.total_seconds:.1f} s)")
    for name, task_result in results.tasks.items():
        for metric, value in task_result.metrics.items():
            stderr = "n/a" if value.stderr is None else f"{value.stderr:.4f}"
            click.echo(f"{name:<16} {metric:<10} {value.value:>12.4f}  +- {stderr:<8} n={task_result.n}")
    failed = False
    if parsed_bars:
        for line in check_bars(results, parsed_bars):
            click.echo(line)
            failed |= line.startswith("FAIL")
    if old is not None:
        click.echo(f"baseline {baseline} ({old.model}), max drop {max_drop:g}")
        for comparison in compare_with_baseline(results, old, max_drop):
            click.echo(comparison.line())
            failed |= comparison.verdict == "REGRESSION"
    sys.exit(EXIT_GATE_FAILED if failed else EXIT_OK)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--metric", default=None, help="Show this metric for every task instead of each task's headline metric.")
def table(files: tuple[Path, ...], metric: str | None) -> None:
    """Print a markdown table: one row per results file, one column per task (scores x100)."""
    try:
        all_results = [read_results(path) for path in files]
    except ColibriEvalError as exc:
        raise _fail(exc) from None
    click.echo(markdown_table(all_results, metric))


@main.command(name="tasks")
def list_tasks() -> None:
    """List the supported tasks, their HF sources and the bundled sample directory."""
    for task in TASKS.values():
        source = f"{task.hf_path}" + (f" {task.hf_name}" if task.hf_name else "") + f" [{task.hf_split}]"
        click.echo(f"{task.name:<16} {','.join(task.metrics):<16} n={task.full_size:<6} {source}")
    click.echo(f"bundled samples: {bundled_data_dir()}")
