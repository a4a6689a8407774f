"""`colibri-stream policy-study`: eviction policies replayed on a routing trace file.

    colibri-stream generate model.coli --prompt "..." --ram-budget 1GiB --trace-out held.jsonl
    colibri-stream policy-study held.jsonl --tuning tune.jsonl --budgets 10%,25%,50%
    colibri-stream policy-study other-moe.jsonl.gz --json

The trace (ROUTING_TRACE.md) can come from any MoE runtime, so a policy can be judged on a
real model's routing without serving that model here. Without `--tuning`, the first half of
the trace's steps tunes (warms up the pinning policy) and the second half is held out, so the
default policy is never chosen on the text that tuned it.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .bench_cli import percentages
from .bench_studies import format_policy_study, policy_study
from .routing_trace import TraceFormatError, read_trace


@click.command("policy-study")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tuning", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A trace of other text from the same model to tune on (default: TRACE's first half).")
@click.option("--budgets", default="10%,25%,50%", show_default=True,
              help="Comma-separated percentages of the routed experts the cache holds.")
@click.option("--json", "as_json", is_flag=True, help="Print the study as JSON.")
def policy_study_command(trace: Path, tuning: Path | None, budgets: str, as_json: bool) -> None:
    """Replay every eviction policy on the routing TRACE against Belady's MIN and the static oracle."""
    fractions = [float(label[:-1]) / 100 for label in percentages(budgets)]
    try:
        held = read_trace(trace)
        tune = read_trace(tuning) if tuning else None
    except TraceFormatError as exc:
        raise click.ClickException(str(exc)) from None
    h = held.header
    if tune is not None:
        shape = (tune.header.n_moe_layers, tune.header.n_experts, tune.header.top_k)
        if shape != (h.n_moe_layers, h.n_experts, h.top_k):
            raise click.ClickException(
                f"{tuning}: shape (layers, experts, top_k) {shape} differs from {trace}'s "
                f"{(h.n_moe_layers, h.n_experts, h.top_k)}: the traces come from different models")
        tuning_events, heldout_events = tune.events, held.events
        split = "tuning trace " + str(tuning)
    else:
        tuning_events, heldout_events = held.split(0.5)
        if not heldout_events:
            raise click.ClickException(f"{trace}: one step only; give --tuning, or a trace of several steps")
        split = "first half of the steps"
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
