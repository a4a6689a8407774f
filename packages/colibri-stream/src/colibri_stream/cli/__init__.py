"""The `colibri-stream` command line: generate, chat, plan, bench (and, from their own modules,
bench-suite, trace-hf, policy-study).

    colibri-stream generate model.coli --prompt "Once upon a time" --ram-budget 600MB --max-new-tokens 64
    colibri-stream generate model.coli --prompt "..." --ram-budget 1GiB --max-new-tokens 64 --json
    colibri-stream chat model.coli --ram-budget 600MB
    colibri-stream plan model.coli --ram-budget 600MB

Errors are one line on stderr, no traceback. Exit status (exit_status.py, the same for every
Colibri command): 0 ok; 1 a check failed (a blob or tensor failed its checksum or could not be
read back; `bench` found page-cache contamination); 2 bad usage or bad input (a malformed size,
a budget below the minimum, which the message names, a malformed container).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import click
from colibri_int4 import Int4Error

from .. import __version__
from ..cache.policies import serving_policy_names
from ..errors import BudgetError, SizeFormatError, StreamError
from ..exit_status import EXIT_CHECK_FAILED, InputError, click_error
from ..report import REPORT_VERSION
from ..sizes import format_size, parse_size


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except SizeFormatError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeType()


def _engine_options(f):
    options = [
        click.option(
            "--ram-budget",
            type=SIZE,
            required=True,
            help="RAM for weights, caches and buffers: bytes or with a unit (KB, MB, GB, KiB, MiB, GiB).",
        ),
        click.option(
            "--compute",
            type=click.Choice(["auto", "int4", "dequant"]),
            default="auto",
            show_default=True,
            help="Routed-expert kernels: torch's CPU int4 kernels, or dequantized matmuls (reference).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["f32", "bf16"]),
            default="f32",
            show_default=True,
            help="Dtype of resident weights, activations and KV cache.",
        ),
        click.option(
            "--kernel-dtype",
            type=click.Choice(["bf16", "f32"]),
            default="bf16",
            show_default=True,
            help="Activations inside the int4 kernels: bf16 is the fast path, f32 the exact one.",
        ),
        click.option(
            "--top-k",
            type=click.IntRange(min=1),
            default=None,
            help="Experts per token (default: the config's top_k_infer).",
        ),
        click.option(
            "--max-context",
            type=click.IntRange(min=1),
            default=None,
            help="KV cache length (default: the config's max_seq_len).",
        ),
        click.option("--no-direct-io", is_flag=True, help="Buffered reads instead of O_DIRECT."),
        click.option(
            "--cache-policy",
            type=click.Choice(serving_policy_names()),
            default=None,
            help="Expert-cache eviction policy (default: lfu, chosen by measurement; see bench/RESULTS.md).",
        ),
        click.option(
            "--prefetch",
            type=click.Choice(["auto", "off", "predict", "on"]),
            default="auto",
            show_default=True,
            help="Read the next layer's predicted experts ahead (on), or only measure the prediction "
            "(predict); auto = on for experts of 512 KiB or more with a CPU free beyond --threads, "
            "where it pays.",
        ),
        click.option("--prefetch-threads", type=click.IntRange(min=1), default=2, show_default=True),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="torch intra-op threads (default: torch's choice; 1 is best on a busy shared CPU).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _sampling_options(f):
    options = [
        click.option(
            "--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy."
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(min=0, max=1, min_open=True),
            default=1.0,
            show_default=True,
            help="Nucleus sampling mass (with --temperature > 0).",
        ),
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); cut from the output."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _open_engine(container, options: dict, **extra):
    """Engine.open with the CLI's engine options; errors become one-line click errors."""
    import torch

    from ..engine import Engine  # torch import is slow; keep --help fast

    options = dict(options)
    threads = options.pop("threads")
    if threads:
        torch.set_num_threads(threads)
    ram_budget = options.pop("ram_budget")
    options["direct_io"] = not options.pop("no_direct_io")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            engine = Engine.open(container, ram_budget, **options, **extra)
        except BudgetError as exc:
            raise click.UsageError(str(exc)) from None
        except (StreamError, Int4Error, ValueError, OSError) as exc:
            raise click_error(exc, str(container)) from None
    for w in caught:
        click.echo(f"note: {w.message}", err=True)
    return engine


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="colibri-stream")
def main() -> None:
    """Run a Colibri int4 container bigger than RAM: resident backbone, routed experts streamed
    from disk through a RAM-budgeted cache.

    Exit status: 0 ok, 1 a check failed (e.g. a blob failed its checksum, bench found page-cache
    contamination), 2 bad usage or bad input.
    """


@main.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=64, show_default=True)
@_engine_options
@_sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the text and the stats.")
@click.option("--trace", is_flag=True, help="With --json: include the routing trace.")
@click.option("--trace-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the routing trace to this file (ROUTING_TRACE.md; .gz compresses) for policy-study.")
def generate(container, prompt, max_new_tokens, temperature, top_p, seed, stop, as_json, trace, trace_out, **options):
    """Continue PROMPT with the model in CONTAINER (greedy unless --temperature is given)."""
    engine = _open_engine(container, options, record_trace=trace or trace_out is not None)
    with engine:

        def show(piece: str) -> None:
            if not as_json:
                click.echo(piece, nl=False)
                sys.stdout.flush()

        try:
            result = engine.generate(
                prompt,
                max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop=stop,
                on_text=show,
            )
        except (StreamError, Int4Error, ValueError) as exc:
            raise click_error(exc) from None
        if trace_out is not None:
            try:
                engine.save_trace(trace_out, source=f"generate --prompt {prompt[:60]!r} --max-new-tokens {max_new_tokens}")
            except OSError as exc:
                raise InputError(f"{trace_out}: cannot write the trace ({exc.strerror or exc})") from None
        if as_json:
            out = {"report_version": REPORT_VERSION, **result.to_dict()}
            out["stats"] = engine.stats.to_dict(include_trace=trace)
            out["budget"] = _budget_dict(engine)
            click.echo(json.dumps(out))
        else:
            click.echo()
            _print_summary(engine, result)


@main.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option("--system", default=None, help="Optional system message.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@_engine_options
@_sampling_options
def chat(container, system, max_new_tokens, temperature, top_p, seed, stop, **options):
    """Chat with the model in CONTAINER (ChatML template). An empty line, /exit or EOF ends."""
    engine = _open_engine(container, options)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    with engine:
        while True:
            if interactive:
                click.echo("you> ", nl=False, err=True)
            line = sys.stdin.readline()
            if not line or not line.strip() or line.strip() == "/exit":
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            click.echo("colibri> ", nl=False)
            try:
                result = engine.chat(
                    messages,
                    max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed,
                    stop=stop,
                    on_text=lambda piece: (click.echo(piece, nl=False), sys.stdout.flush()),
                )
            except (StreamError, Int4Error, ValueError) as exc:
                raise click_error(exc) from None
            click.echo()
            messages.append({"role": "assistant", "content": result.text})
            s = engine.stats
            click.echo(
                f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tok/s, "
                f"hit rate {s.hit_rate:.1%}, read {format_size(s.bytes_read)}]",
                err=True,
            )


@main.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@_engine_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(container, as_json, **options):
    """Show how the RAM budget is split (resident, KV cache, workspace, expert cache) without running."""
    engine = _open_engine(container, options)
    with engine:
        if as_json:
            click.echo(json.dumps(_budget_dict(engine)))
        else:
            click.echo(engine.budget.describe())
            click.echo(
                f"compute {engine.stats.compute_mode}, I/O {engine.stats.io_mode}, "
                f"expert bytes on disk {format_size(engine.container.expert_bytes)}"
            )


@main.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--budgets",
    default="10%,25%,50%,100%",
    show_default=True,
    help="Comma-separated budgets: a percentage of the experts that fit (on top of the fixed part) or a SIZE.",
)
@click.option("--prompt", default=None, help="Prompt text (default: a built-in paragraph).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
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
@click.option("--compute", type=click.Choice(["auto", "int4", "dequant"]), default="auto", show_default=True)
@click.option("--kernel-dtype", type=click.Choice(["bf16", "f32"]), default="bf16", show_default=True)
@click.option("--prefetch", type=click.Choice(["off", "predict", "on"]), default="predict", show_default=True)
@click.option("--cache-policy", type=click.Choice(serving_policy_names()), default=None,
              help="Eviction policy measured live (default: the engine's, lfu); the hit/Belady column follows it.")
@click.option("--max-context", type=click.IntRange(min=1), default=None)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of a table.")
def bench(
    container,
    budgets,
    prompt,
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
    """Tokens/s, hit rate vs Belady and disk-honesty checks over a sweep of RAM budgets.

    Exits 1 (after the report) when the disk-honesty check fails: the engine's byte counter and
    /proc/self/io disagree, so the misses were served by the page cache.
    """
    import torch

    from ..studies.bench import format_table, run_bench

    if threads:
        torch.set_num_threads(threads)
    prompt = prompt or BENCH_PROMPT
    labels = [b.strip() for b in budgets.split(",") if b.strip()]
    for label in labels:
        if not label.endswith("%"):
            try:
                size = parse_size(label)
            except SizeFormatError as exc:
                raise click.BadParameter(str(exc), param_hint="--budgets") from None
            if size < 4096:  # "0.25" meant a share, not a quarter of a byte
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


BENCH_PROMPT = (
    "The river town grew slowly through the nineteenth century. Its mills ran on water until the "
    "railway arrived, and with the railway came coal, workers from the valleys, a school, two "
    "churches and a newspaper that argued with both of them."
)


def _budget_dict(engine) -> dict:
    b = engine.budget
    return {
        "ram_budget": b.ram_budget,
        "resident_bytes": b.resident_bytes,
        "kv_cache_bytes": b.kv_cache_bytes,
        "workspace_bytes": b.workspace_bytes,
        "staging_bytes": b.staging_bytes,
        "tokenizer_bytes": b.other_bytes,
        "heap_slack_bytes": b.heap_slack_bytes,
        "slot_bytes": b.slot_bytes,
        "cache_slots": b.slots,
        "total_experts": b.total_experts,
        "expert_bytes_on_disk": engine.container.expert_bytes,
        "compute": engine.stats.compute_mode,
        "io_mode": engine.stats.io_mode,
    }


def _print_summary(engine, result) -> None:
    s = engine.stats
    click.echo(
        f"[{len(result.token_ids)} tokens ({result.finish_reason}), TTFT {result.prefill_seconds:.2f} s, "
        f"{result.tokens_per_s:.1f} tok/s; hits {s.hits} misses {s.misses} ({s.hit_rate:.1%}), "
        f"read {format_size(s.bytes_read)}, evictions {s.evictions}; I/O {s.io_seconds:.2f} s, "
        f"expert compute {s.compute_seconds:.2f} s; resident {format_size(s.resident_bytes)}, "
        f"cache {format_size(s.cache_bytes)} of {format_size(s.cache_capacity_bytes)}; {s.io_mode} I/O]",
        err=True,
    )


from ..cli.bench import bench_suite  # noqa: E402 - issue 9's full study lives in its own module
from ..cli.traces import policy_study_command, trace_hf  # noqa: E402

main.add_command(bench_suite)
main.add_command(policy_study_command)
main.add_command(trace_hf)

if __name__ == "__main__":
    main()
