"""`colibri-stream generate | chat`: serving a container, and the engine options every command
shares (`plan` is cli/plan.py).

    colibri-stream generate model.coli --prompt "Once upon a time" --ram-budget 600MB --max-new-tokens 64
    colibri-stream generate model.coli --prompt "..." --ram-budget auto --json    # fit under the cgroup cap
    colibri-stream chat model.coli --ram-budget 600MB
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import click
from colibri_int4 import Int4Error

from ..cache.policies import serving_policy_names
from ..compute import COMPUTE_CHOICES
from ..errors import BudgetError, SizeFormatError, StreamError
from ..exit_status import InputError, click_error
from ..report import REPORT_VERSION
from ..sizes import format_size, parse_budget


class BudgetType(click.ParamType):
    """A SIZE, or "auto": fit under this process's memory cap."""

    name = "SIZE|auto"

    def convert(self, value, param, ctx):
        try:
            return parse_budget(value)
        except SizeFormatError as exc:
            self.fail(str(exc), param, ctx)


BUDGET = BudgetType()
BUDGET_HELP = ("RAM for weights, caches and buffers: bytes or with a unit (KB, MB, GB, KiB, MiB, GiB), "
               "or 'auto': what fits under this process's cgroup memory limit (else MemAvailable), with a margin.")


def engine_options(required_budget: bool):
    def decorate(f):
        options = [
            # no default where it is required: click >= 8.3 takes an explicit default=None as given
            click.option("--ram-budget", type=BUDGET, required=required_budget, help=BUDGET_HELP),
            click.option("--compute", type=click.Choice(COMPUTE_CHOICES), default="auto",
                         show_default=True,
                         help="Kernels: native (C on the container's q4/q8 bytes, projections kept as stored), "
                         "torch's CPU int4 kernels (routed experts), or dequantized matmuls (reference); auto: "
                         "timed on this CPU (a model without experts: native or dequant)."),
            click.option("--dtype", type=click.Choice(["auto", "f32", "bf16"]), default="auto", show_default=True,
                         help="Dtype of resident weights, activations and KV cache; auto: f32 (bf16 when the "
                         "resident weights exceed 2 GiB in f32), or bf16 where --ram-budget cannot hold f32."),
            click.option("--kernel-dtype", type=click.Choice(["bf16", "f32"]), default="bf16", show_default=True,
                         help="Activations inside the int4 kernels: bf16 is the fast path, f32 the exact one."),
            click.option("--experts-per-token", "top_k", type=click.IntRange(min=1), default=None,
                         help="Routed experts each token uses per MoE layer (default: the config's top_k_infer; "
                         "at most the top-k the model was trained with, unless --allow-extra-experts)."),
            click.option("--allow-extra-experts", is_flag=True,
                         help="Accept --experts-per-token above the trained top-k (a model not trained so)."),
            click.option("--max-context", type=click.IntRange(min=1), default=None,
                         help="KV cache length (default: the config's max_seq_len capped at 4096, halved down "
                         "to 256 where --ram-budget needs)."),
            click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
                         help="Tokens per forward pass (default: 128, down to 32 where --ram-budget needs)."),
            click.option("--map-weights", type=click.Choice(["auto", "off", "all"]), default="auto",
                         show_default=True,
                         help="Native kernels: compute projections on a read-only map of the container instead "
                         "of a copy in the budget (read through the page cache every token, from disk again "
                         "where memory is short); auto: the fewest, only where --ram-budget cannot hold them "
                         "all; all: every one (as llama.cpp's mmap); off: refuse such budgets."),
            click.option("--no-direct-io", is_flag=True, help="Buffered reads instead of O_DIRECT."),
            click.option("--cache-policy", type=click.Choice(serving_policy_names()), default=None,
                         help="Expert-cache eviction policy (default: next-use, the best on real routing; "
                         "*-per-layer give each MoE layer a fixed share of the slots)."),
            click.option("--prefetch", type=click.Choice(["auto", "off", "predict", "on"]), default="auto",
                         show_default=True,
                         help="Read the next layer's predicted experts ahead (on), or only measure the prediction "
                         "(predict); auto = on for experts of 512 KiB or more with a CPU free beyond --threads, "
                         "where it pays."),
            click.option("--prefetch-threads", type=click.IntRange(min=1), default=2, show_default=True),
            click.option("--threads", type=click.IntRange(min=1), default=None,
                         help="torch intra-op threads (default: torch's choice; 1 is best on a busy shared CPU)."),
        ]
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def _sampling_options(f):
    options = [
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling mass (with --temperature > 0)."),
        click.option("--top-k", "--sample-top-k", "sample_top_k", type=click.IntRange(min=0), default=0,
                     show_default=True,
                     help="Sampling: keep the k most likely tokens (0 = off; experts per token are "
                     "--experts-per-token)."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                     help="Keep tokens at least this fraction as likely as the best (0 = off)."),
        click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0,
                     show_default=True, help="Divide the logits of tokens already in the context (1 = off)."),
        click.option("--seed", type=int, default=None, help="Seed for sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); cut from the output."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


SAMPLING_KEYS = ("temperature", "top_p", "sample_top_k", "min_p", "repetition_penalty", "seed", "stop")


def _sampling(options: dict) -> dict:
    """Pop the sampling options out of `options`, as `Session.stream` keywords."""
    out = {key: options.pop(key) for key in SAMPLING_KEYS}
    out["top_k"] = out.pop("sample_top_k")
    return out


def _split_options(options: dict) -> tuple[object, dict]:
    """(ram_budget, Engine options) from the CLI's engine options; sets torch's threads."""
    import torch

    options = dict(options)
    threads = options.pop("threads")
    if threads:
        torch.set_num_threads(threads)
    options["direct_io"] = not options.pop("no_direct_io")
    return options.pop("ram_budget"), options


def _engine_call(call, container):
    """Run `call()`; errors become one-line click errors, warnings one-line notes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = call()
        except BudgetError as exc:
            raise click.UsageError(str(exc)) from None
        except (StreamError, Int4Error, ValueError, OSError) as exc:
            raise click_error(exc, str(container)) from None
    for w in caught:
        click.echo(f"note: {w.message}", err=True)
    return value


def _open_engine(container, options: dict, **extra):
    from ..engine import Engine  # torch import is slow; keep --help fast

    ram_budget, options = _split_options(options)
    return _engine_call(lambda: Engine.open(container, ram_budget, **options, **extra), container)


@click.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=64, show_default=True)
@engine_options(required_budget=True)
@_sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the text and the stats.")
@click.option("--trace", is_flag=True, help="With --json: include the routing trace.")
@click.option("--trace-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the routing trace to this file (ROUTING_TRACE.md; .gz compresses) for policy-study.")
def generate(container, prompt, max_new_tokens, as_json, trace, trace_out, **options):
    """Continue PROMPT with the model in CONTAINER (greedy unless --temperature is given)."""
    sampling = _sampling(options)
    engine = _open_engine(container, options, record_trace=trace or trace_out is not None)
    with engine:

        def show(piece: str) -> None:
            if not as_json:
                click.echo(piece, nl=False)
                sys.stdout.flush()

        try:
            result = engine.generate(prompt, max_new_tokens, on_text=show, **sampling)
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


@click.command()
@click.argument("container", type=click.Path(exists=True, dir_okay=False))
@click.option("--system", default=None, help="Optional system message.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@engine_options(required_budget=True)
@_sampling_options
def chat(container, system, max_new_tokens, **options):
    """Chat with the model in CONTAINER (its chat template, else ChatML). The KV cache is kept
    across turns: each turn prefills only its new tokens. An empty line, /exit or EOF ends."""
    sampling = _sampling(options)
    engine = _open_engine(container, options)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    with engine:
        session = engine.chat_session()
        while True:
            if interactive:
                click.echo("you> ", nl=False, err=True)
            line = sys.stdin.readline()
            if not line or not line.strip() or line.strip() == "/exit":
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            click.echo("colibri> ", nl=False)
            try:
                result = session.reply(messages, max_new_tokens, **sampling,
                                       on_text=lambda piece: (click.echo(piece, nl=False), sys.stdout.flush()))
            except (StreamError, Int4Error, ValueError) as exc:
                raise click_error(exc) from None
            click.echo()
            messages.append({"role": "assistant", "content": result.text})
            s = engine.stats
            click.echo(f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tok/s, prefilled "
                       f"{result.prefilled_tokens} of {result.prompt_tokens} prompt tokens, "
                       f"hit rate {s.hit_rate:.1%}, read {format_size(s.bytes_read)}]", err=True)


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
        "experts_per_token": engine.top_k,
        "dtype": engine.opened_plan.to_dict()["dtype"],
        "max_context": engine.max_context,
        "prefill_chunk": engine.prefill_chunk,
    }


def _print_summary(engine, result) -> None:
    s = engine.stats
    os_read = "n/a" if s.bytes_read_os is None else format_size(s.bytes_read_os)
    click.echo(
        f"[{len(result.token_ids)} tokens ({result.finish_reason}), TTFT {result.prefill_seconds:.2f} s, "
        f"{result.tokens_per_s:.1f} tok/s; hits {s.hits} misses {s.misses} ({s.hit_rate:.1%}), "
        f"read {format_size(s.bytes_read)} (OS read_bytes {os_read}: {s.io_agreement}), evictions {s.evictions}; "
        f"I/O {s.io_seconds:.2f} s, expert compute {s.compute_seconds:.2f} s; resident {format_size(s.resident_bytes)}, "
        f"cache {format_size(s.cache_bytes)} of {format_size(s.cache_capacity_bytes)}; {s.io_mode} I/O]",
        err=True,
    )
    if engine.opened_plan.degraded:  # what the budget cost (a shorter context, projections read from the file)
        click.echo(f"[to fit the budget: {', '.join(engine.opened_plan.degraded)}]", err=True)
