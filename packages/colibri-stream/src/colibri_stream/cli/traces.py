"""Routing traces on the command line: record one from a transformers MoE, import another
runtime's routing dump, study policies on one.

    colibri-stream generate model.coli --prompt "..." --ram-budget 1GiB --trace-out held.jsonl
    colibri-stream trace-hf allenai/OLMoE-1B-7B-0924 --text heldout.txt --out olmoe.jsonl.gz
    colibri-stream trace-import vllm_hook.jsonl --out vllm.jsonl.gz --n-experts 64
    colibri-stream policy-study held.jsonl --tuning tune.jsonl --budgets 10%,25%,50%
    colibri-stream policy-study olmoe.jsonl.gz --json

The trace (ROUTING_TRACE.md) can come from any MoE runtime, so a policy can be judged on a
real model's routing without serving that model here. Without `--tuning`, the first half of
the trace's requests tunes (warms up the pinning policy) and the rest is held out, so the
default policy is never chosen on the text that tuned it; a trace without request ids (or of
one request) is cut at the middle step instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..exit_status import InputError
from ..sizes import budget_share
from ..traces.routing_dumps import FORMATS, DumpFormatError, import_dump
from ..traces.routing_trace import TraceFormatError, read_trace, write_trace
from .bench_suite import percentages

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "f32": "float32"}


@click.command("trace-hf")
@click.argument("model")
@click.option("--text", "texts", type=click.Path(exists=True, dir_okay=False, path_type=Path), multiple=True,
              required=True, help="A UTF-8 text file to read (repeatable); each is cut into --max-tokens windows.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The routing trace to write (ROUTING_TRACE.md; a .gz name compresses).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per forward pass (a window of text); each token is one step of the trace.")
@click.option("--dtype", type=click.Choice(list(_DTYPES)), default="auto", show_default=True,
              help="Weights dtype (auto: the checkpoint's).")
@click.option("--device", default="cpu", show_default=True,
              help="torch device to run the model on (cpu, cuda, ...), or auto: spread it over the GPUs, CPU "
                   "and disk with accelerate's device_map, for a model larger than one device.")
def trace_hf(model: str, texts: tuple[Path, ...], out: Path, max_tokens: int, dtype: str, device: str) -> None:
    """Record the routing of a transformers MoE MODEL (a local directory, or a Hub id when online)
    reading the --text files, one step per token, as a routing trace for policy-study."""
    try:
        import transformers
    except ImportError:
        raise InputError("trace-hf needs transformers >= 5: pip install 'colibri-stream[hf]'") from None
    from ..traces.hf_routing import NoRouterError, record_routing, token_windows

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        if device == "auto":
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=_DTYPES[dtype], device_map="auto")
        else:
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=_DTYPES[dtype]).to(device)
        hf_model.eval()
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: e.g. an unknown --device
        raise InputError(f"{model}: cannot load ({str(exc).splitlines()[0]})") from None
    windows = []
    for path in texts:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        windows += token_windows(tokenizer(text, add_special_tokens=False)["input_ids"], max_tokens)
    if not windows:
        raise InputError("the --text files hold no tokens")
    try:
        trace = record_routing(hf_model, windows)
    except NoRouterError as exc:
        raise InputError(f"{model}: {exc}") from None
    try:
        write_trace(out, trace.events, n_moe_layers=trace.n_moe_layers, n_experts=trace.n_experts,
                    top_k=trace.top_k, model=model,
                    source="trace-hf: " + ", ".join(p.name for p in texts) + f", {max_tokens}-token windows")
    except OSError as exc:
        raise InputError(f"{out}: cannot write the trace ({exc.strerror or exc})") from None
    click.echo(f"{out}: {trace.tokens} tokens x {trace.n_moe_layers} MoE layers, {trace.n_experts} experts, "
               f"top-{trace.top_k}")


@click.command("trace-import")
@click.argument("dump", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--format", "dump_format", type=click.Choice(["auto", *FORMATS]), default="auto", show_default=True,
              help="jsonl: one object per token and layer (vLLM / SGLang hooks); llama-cpp: 'route <step> <layer> "
                   "<experts...>' lines in a log; csv: a header naming step/token, layer and expert columns; auto: "
                   "tell from the content.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The routing trace to write (ROUTING_TRACE.md; a .gz name compresses).")
@click.option("--n-experts", type=click.IntRange(min=1), default=None,
              help="Routed experts per MoE layer (default: the largest expert id + 1, noted in the trace).")
@click.option("--experts-per-token", "top_k", type=click.IntRange(min=1), default=None,
              help="Routed experts each token uses per layer, the trace's top_k (default: the most common count "
                   "per token in the dump).")
@click.option("--n-moe-layers", type=click.IntRange(min=1), default=None,
              help="MoE layers of the model (default: the distinct layers in the dump).")
@click.option("--layer-offset", type=int, default=0, show_default=True,
              help="Added to every layer number: the trace numbers the model's blocks, so a dump that counted "
                   "MoE layers from 0 on a model whose first block is dense needs 1.")
@click.option("--model", default="", help="The model that produced the dump (free text, kept in the trace).")
def trace_import(dump: Path, dump_format: str, out: Path, n_experts: int | None, top_k: int | None,
                 n_moe_layers: int | None, layer_offset: int, model: str) -> None:
    """Import the routing DUMP of another runtime (vLLM, SGLang, llama.cpp, a CSV) as a routing
    trace for policy-study. Each distinct (request, token) is one step; records that share a
    request, token and layer (a prefill chunk under one index) are one pass, their experts merged."""
    try:
        imported = import_dump(dump, dump_format, n_experts=n_experts, top_k=top_k, n_moe_layers=n_moe_layers,
                               layer_offset=layer_offset)
    except DumpFormatError as exc:
        raise InputError(str(exc)) from None
    source = "; ".join([f"trace-import --format {imported.format} of {dump.name}", *imported.notes])
    try:
        write_trace(out, imported.events, n_moe_layers=imported.n_moe_layers, n_experts=imported.n_experts,
                    top_k=imported.top_k, model=model, source=source)
    except OSError as exc:
        raise InputError(f"{out}: cannot write the trace ({exc.strerror or exc})") from None
    requests = f", {imported.requests} requests" if imported.requests else ""
    click.echo(f"{out}: {imported.steps} steps{requests} x {imported.n_moe_layers} MoE layers, "
               f"{imported.n_experts} experts, top-{imported.top_k} ({imported.format})")
    for note in imported.notes:
        click.echo(f"  {note}")


@click.command("policy-study")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tuning", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A trace of other text from the same model to tune on (default: TRACE's first half of "
                   "requests, or of steps when it names no requests).")
@click.option("--budgets", default="10%,25%,50%", show_default=True,
              help="Comma-separated percentages of the routed experts the cache holds.")
@click.option("--json", "as_json", is_flag=True, help="Print the study as JSON.")
def policy_study_command(trace: Path, tuning: Path | None, budgets: str, as_json: bool) -> None:
    """Replay every eviction policy on the routing TRACE against Belady's MIN and the static oracle."""
    fractions = [budget_share(label) for label in percentages(budgets)]
    try:
        held = read_trace(trace)
        tune = read_trace(tuning) if tuning else None
    except TraceFormatError as exc:
        raise InputError(str(exc)) from None
    h = held.header
    if tune is not None:
        shape = (tune.header.n_moe_layers, tune.header.n_experts, tune.header.top_k)
        if shape != (h.n_moe_layers, h.n_experts, h.top_k):
            raise InputError(
                f"{tuning}: shape (layers, experts, top_k) {shape} differs from {trace}'s "
                f"{(h.n_moe_layers, h.n_experts, h.top_k)}: the traces come from different models")
        tuning_events, heldout_events = tune.events, held.events
        split = "tuning trace " + str(tuning)
    else:
        tuning_events, heldout_events = held.split(0.5)
        if not heldout_events:
            raise InputError(f"{trace}: one step only; give --tuning, or a trace of several steps")
        requests = held.requests
        tuning_requests = len({e.request for e in tuning_events})
        split = (f"first {tuning_requests} of its {len(requests)} requests" if len(requests) > 1
                 else "first half of the steps")
    from ..studies.cache_studies import format_policy_study, policy_study  # studies load only when run

    study = policy_study(tuning_events, heldout_events, h.total_experts, h.n_experts, h.top_k, fractions)
    study["trace"] = {"path": str(trace), "model": h.model, "source": h.source, "n_moe_layers": h.n_moe_layers,
                      "n_experts": h.n_experts, "top_k": h.top_k, "tuned_on": split}
    if as_json:
        click.echo(json.dumps(study, indent=1))
        return
    click.echo(f"{trace}: {h.model or 'model not named'}; {h.n_moe_layers} MoE layers x {h.n_experts} experts, "
               f"top-{h.top_k}; {study['trace_accesses']['heldout']} held-out accesses, tuned on the {split}")
    for line in format_policy_study(study):
        click.echo(line)
