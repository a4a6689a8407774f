"""`colibri-stream bench`: tokens/s, hit rate vs Belady and disk-honesty checks over a budget sweep
(studies/bench.py does the measuring)."""

from __future__ import annotations

import json
import sys

import click
from colibri_int4 import Int4Error

from ..cache.policies import serving_policy_names
from ..compute import COMPUTE_CHOICES
from ..errors import BudgetError, SizeFormatError, StreamError
from ..exit_status import EXIT_CHECK_FAILED, click_error
from ..sizes import budget_share, parse_size


@click.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--budgets",
    default="10%,25%,50%,100%",
    show_default=True,
    help="Comma-separated budgets: a percentage of the experts that fit (on top of the fixed part) or a SIZE.",
)
@click.option("--prompt", default=None, help="Prompt text (default: a built-in paragraph).")
@click.option("-p", "--prompt-tokens", type=click.IntRange(min=1), default=None,
              help="A prompt of exactly N tokens instead of text (llama-bench's -p; ids drawn from the vocabulary, "
                   "seeded).")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens generated per run (llama-bench's -n).")
@click.option(
    "--runs", type=click.IntRange(min=1), default=3, show_default=True, help="Interleaved runs per point."
)
@click.option(
    "--bandwidth-mb",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="MB of blobs read to measure O_DIRECT bandwidth.",
)
@click.option("--compute", type=click.Choice(COMPUTE_CHOICES), default="auto", show_default=True)
@click.option("--kernel-dtype", type=click.Choice(["bf16", "f32"]), default="bf16", show_default=True)
@click.option("--prefetch", type=click.Choice(["off", "predict", "on"]), default="predict", show_default=True)
@click.option("--cache-policy", type=click.Choice(serving_policy_names()), default=None,
              help="Eviction policy measured live (default: the engine's, next-use); the hit/Belady column follows it.")
@click.option("--max-context", type=click.IntRange(min=1), default=None)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def bench(
    container,
    budgets,
    prompt,
    prompt_tokens,
    max_new_tokens,
    runs,
    bandwidth_mb,
    compute,
    kernel_dtype,
    prefetch,
    cache_policy,
    max_context,
    threads,
    as_json,
):
    """Prefill and decode tokens/s, hit rate vs Belady and disk-honesty checks over a sweep of RAM budgets.

    Reports prefill (pp, prompt tokens over the time to the first token) and decode (tg) apart, as
    llama-bench does: `-p 512 -n 128` measures a 512-token prefill and 128 generated tokens.

    Exits 1 (after the report) when the disk-honesty check fails: the engine's byte counter and
    /proc/self/io disagree, so the misses were served by the page cache.
    """
    import torch

    from ..studies.bench import format_table, run_bench

    if threads:
        torch.set_num_threads(threads)
    if prompt is not None and prompt_tokens is not None:
        raise click.UsageError("give --prompt or --prompt-tokens, not both")
    prompt = synthetic_prompt(container, prompt_tokens) if prompt_tokens else (prompt or BENCH_PROMPT)
    labels = [b.strip() for b in budgets.split(",") if b.strip()]
    for label in labels:
        try:
            share = budget_share(label)
            size = parse_size(label) if share is None else None
        except SizeFormatError as exc:
            raise click.BadParameter(str(exc), param_hint="--budgets") from None
        if size is not None and size < 4096:  # "0.25" meant a share, not a quarter of a byte
            raise click.BadParameter(
                f"{label!r} is {size} bytes; write a share of the experts as a percentage (25%) "
                "or a size with a unit (600MB)", param_hint="--budgets")
    try:
        report = run_bench(
            container,
            labels,
            prompt,
            max_new_tokens,
            runs,
            bandwidth_mb << 20,
            compute=compute,
            kernel_dtype=kernel_dtype,
            prefetch=prefetch,
            cache_policy=cache_policy,
            max_context=max_context,
        )
    except BudgetError as exc:
        raise click.UsageError(str(exc)) from None
    except (StreamError, Int4Error, ValueError, OSError) as exc:
        raise click_error(exc, str(container)) from None
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(format_table(report))
    if any(p["contaminated"] for p in report["points"]):
        click.echo(
            "WARNING: the engine's byte counter and /proc/self/io disagree by more than 2%: "
            "misses were served by the page cache; these tokens/s are not disk numbers.",
            err=True,
        )
        sys.exit(EXIT_CHECK_FAILED)


def synthetic_prompt(container: str, length: int, seed: int = 0) -> list[int]:
    """`length` token ids drawn from the container's vocabulary (seeded): a prompt of a given size."""
    import random

    from colibri_int4 import Container

    with Container.open(container) as opened:
        vocab = int(opened.header.config["vocab_size"])
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


BENCH_PROMPT = (
    "The river town grew slowly through the nineteenth century. Its mills ran on water until the "
    "railway arrived, and with the railway came coal, workers from the valleys, a school, two "
    "churches and a newspaper that argued with both of them."
)
