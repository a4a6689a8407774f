"""`colibri-stream plan`: the budget plan of a container, or of a Hugging Face config.json before any
download, from the header alone (plan.py): min / full budgets, the split at a budget, the budget for
a hit-rate target on a routing trace."""

from __future__ import annotations

import json
from pathlib import Path

import click
from colibri_int4 import Int4Error

from ..exit_status import click_error
from ..sizes import format_size
from .run import _engine_call, _split_options, engine_options


@click.command()
@click.argument("container", type=click.Path(exists=True))
@engine_options(required_budget=False)
@click.option("--quant", type=click.Choice(["int4", "int8", "bf16"]), default=None,
              help="With an HF config: the import-hf --quant to plan for (default int4).")
@click.option("--group", type=click.Choice(["32", "64", "128"]), default=None,
              help="With an HF config: the import-hf --group (default 64).")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A routing trace (ROUTING_TRACE.md) to size the cache for --hit-rate.")
@click.option("--hit-rate", type=click.FloatRange(0, 1), default=None,
              help="With --trace: the expert-cache hit rate to reach; prints the least budget that does.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(container, quant, group, trace_path, hit_rate, as_json, **options):
    """Which budgets CONTAINER runs at, from its header alone (nothing is built): the minimum, the
    budget that caches every expert, the one reaching --hit-rate on --trace, and with --ram-budget
    how that budget is split.

    CONTAINER may also be a Hugging Face config.json, or a checkpoint directory holding one (no
    weights needed): the plan is then of the container `colibri-int4 import-hf DIR OUT --quant
    Q --group G` would write, with its size for every --quant."""
    from colibri_int4.import_hf import is_hf_config, planned_container, sizes_by_quant

    from ..engine import Engine
    from ..io.memory_cap import RUNTIME_FILE_BYTES, process_anon_bytes

    if (trace_path is None) != (hit_rate is None):
        raise click.UsageError("--trace and --hit-rate go together")
    hf = is_hf_config(container)
    if not hf and (quant or group):
        raise click.UsageError("--quant and --group plan an HF config.json; a container's are in its header")
    ram_budget, options = _split_options(options)
    source, sizes = container, None
    if hf:
        quant, group = quant or "int4", int(group or 64)
        try:  # the messages name the config.json and its field
            source, sizes = planned_container(container, quant, group), sizes_by_quant(container, group)
        except Int4Error as exc:
            raise click_error(exc) from None
    result = _engine_call(lambda: Engine.plan(source, ram_budget, trace=trace_path, hit_rate=hit_rate,
                                              **options), container)
    process = process_anon_bytes()
    if as_json:
        out = result.to_dict()
        out["kv_cache_by_context"] = {str(n): result.kv_cache_at(n) for n in _kv_contexts(result)}
        if result.sliding_kv is not None:  # plan 1.0's windowed figure: what the cache now holds (PLAN.md)
            out["kv_cache_windowed_by_context"] = dict(out["kv_cache_by_context"])
        if sizes is not None:
            out["hf_config"], out["quant"], out["group"] = str(result.path), quant, group
            out["container_size_by_quant"] = {q: e.file_size for q, e in sizes.items()}
        out["process_charged_bytes"] = process
        out["runtime_file_bytes"] = RUNTIME_FILE_BYTES
        click.echo(json.dumps(out))
        return
    if sizes is not None:
        click.echo(f"{result.path}: planned for `colibri-int4 import-hf --quant {quant} --group {group}` (no weights "
                   "read); container size " + ", ".join(f"{q} {format_size(e.file_size)}" for q, e in sizes.items()))
    for line in describe_plan(result, process, RUNTIME_FILE_BYTES):
        click.echo(line)


def _kv_contexts(p) -> list[int]:
    """Context lengths to show the KV cache at: 2k, 8k, 32k and the config's, up to the config's."""
    limit = max(p.max_seq_len, p.footprint.max_context)
    return sorted({n for n in (2048, 8192, 32768) if n < limit} | {p.footprint.max_context, limit})


def describe_plan(p, process_bytes: int, runtime_file_bytes: int) -> list[str]:
    from ..footprint import dtype_name

    f = p.footprint
    size = format_size
    lines = [
        f"{Path(p.path).name}: {f.total_experts} routed experts, {size(f.slot_bytes)} each in RAM "
        f"({size(p.expert_bytes_on_disk)} on disk); {f.describe()}, top_k {f.top_k}, prefetch {p.prefetch}",
        f"fixed part {size(f.fixed_bytes)}: resident {size(f.resident_bytes)} ("
        + ", ".join(f"{k} {size(v)}" for k, v in sorted(f.resident_by_dtype.items()))
        + (f"; mapped from the container {size(f.mapped_bytes)}" if f.mapped_bytes else "")
        + (f", {len(f.mapped_projections)} projections among it" if f.mapped_projections else "")
        + f"), KV cache {size(f.kv_cache_bytes)}, workspace {size(f.workspace_bytes)}, staging "
        f"{size(f.staging_bytes)}, tokenizer {size(f.tokenizer_bytes)}, heap slack {size(f.heap_slack_bytes)}",
        f"minimum budget  {size(p.min_budget):>10} ({p.min_budget} bytes): one layer's working set "
        f"({f.working_set_slots} x {size(f.slot_bytes)})",
        f"full budget     {size(p.full_budget):>10} ({p.full_budget} bytes): every expert cached",
    ]
    lines.append(f"KV cache ({dtype_name(f.dtype)}, {size(p.kv_bytes_per_token)} per token): "
                 + ", ".join(f"{n} tokens {size(p.kv_cache_at(n))}" for n in _kv_contexts(p)))
    if (s := p.sliding_kv) is not None:
        lines.append(f"  the {s.layers} sliding-window layers of {s.total_layers} (window {s.window}) keep at most "
                     f"{s.positions} positions each (window - 1 + 2 x prefill chunk {s.prefill_chunk}); keeping every "
                     "position they would take "
                     + ", ".join(f"{n} tokens {size(p.full_kv_cache_at(n))}" for n in _kv_contexts(p)))
    if p.defaults:
        lines.append("defaults for a model this size: " + "; ".join(p.defaults))
    if p.smallest_budget != p.min_budget:
        lines.append(f"smallest budget {size(p.smallest_budget):>10} ({p.smallest_budget} bytes): with the unset "
                     f"defaults stepped down ({p.smallest_choice})")
    if p.smallest_mapped_budget is not None:
        lines.append(f"mapped budget   {size(p.smallest_mapped_budget):>10} ({p.smallest_mapped_budget} bytes): with "
                     "every projection computed on the container's map (--map-weights auto maps the fewest a "
                     "budget needs; they are read through the page cache every token)")
    if p.target is not None:
        t = p.target
        if t.reachable:
            lines.append(f"hit rate {t.target:.0%} ({t.policy}, {t.accesses} lookups in the trace): "
                         f"{size(t.budget):>10} ({t.budget} bytes) = {t.slots} slots, reaching {t.hit_rate:.1%} "
                         f"(ceiling {t.ceiling:.1%})")
        else:
            lines.append(f"hit rate {t.target:.0%}: unreachable on this trace; a cache of every expert "
                         f"reaches {t.ceiling:.1%} (first uses always miss)")
    if p.memory_cap is not None:
        lines.append(f"auto: {p.memory_cap.describe()}")
    if p.budget is not None:
        lines.append(p.budget.describe())
        if p.degraded:
            lines.append("defaults stepped down to fit: " + ", ".join(p.degraded))
    lines.append(f"under a memory cgroup: this process already holds {size(process_bytes)} (interpreter, "
                 f"torch; anonymous + file-backed), a run touches about {size(runtime_file_bytes)} more library "
                 "pages: `--ram-budget auto` counts both and a margin (io/memory_cap.py)")
    return lines
