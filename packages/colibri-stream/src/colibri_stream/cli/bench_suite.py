"""`colibri-stream bench-suite`: every streaming measurement in one run, JSON + a table.

    colibri-stream bench-suite --workdir /var/tmp/colibri-bench --json-out bench.json
    colibri-stream bench-suite --workload trained --workload random --repeats 3

Workloads:
- `trained`: a model trained on the bundled prose (trained_workload.py, cached in WORKDIR),
  generating after held-out passages: realistic routing.
- `random`: a random-weight container of the same shapes (synthetic_container.py): routing with
  no locality, the worst case.
- `micro`: a random-weight Colibri-Micro container (~3.7 GB, written to WORKDIR and deleted
  afterwards): far larger than any budget, so the run is disk-bound.
- `nano`: the same for NanoColibri's shapes (~1.4 GB, 0.84 MB experts): with `micro`, the
  evidence for prefetch "auto" (prefetch off vs on at the first budget).

Each workload runs the budget sweep of studies/bench.py (`run_bench`: interleaved runs, Belady on the
same trace, O_DIRECT bandwidth, /proc/self/io check); `trained` adds the policy study (tuning
vs held-out text), the prefetch study and a warm run (studies/cache_studies.py). WORKDIR must be on a
real disk: on tmpfs no read reaches storage and the command refuses.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click

from ..errors import SizeFormatError
from ..exit_status import EXIT_CHECK_FAILED
from ..io.direct_io import RAM_FILESYSTEMS, filesystem_type
from ..sizes import budget_share

WORKLOADS = ("trained", "random", "nano", "micro")
SUITE_VERSION = "1.0"


def percentages(budgets: str, option: str = "--budgets") -> list[str]:
    """"10%,25%" -> ["10%", "25%"], each checked to lie in (0%, 100%]."""
    labels = [b.strip() for b in budgets.split(",") if b.strip()]
    if not labels:
        raise click.BadParameter("give at least one percentage, e.g. 25%", param_hint=option)
    for label in labels:
        try:
            ok = budget_share(label) is not None
        except SizeFormatError:
            ok = False
        if not ok:
            raise click.BadParameter(f"{label!r} is not a percentage in (0%, 100%]", param_hint=option)
    return labels


def _log(message: str) -> None:
    click.echo(message, err=True)


def _sweep(container, budgets, prompt, max_new_tokens, repeats, bandwidth_bytes, **options) -> dict:
    from ..studies.bench import run_bench

    report = run_bench(container, budgets, prompt, max_new_tokens, repeats, bandwidth_bytes, **options)
    bandwidth = report["disk_bandwidth"]["bytes_per_s"]
    for point in report["points"]:
        if options.get("prefetch") == "on":  # reads happen on workers: io_seconds counts only waits
            point["engine_read_mb_s"] = point["read_efficiency"] = None
            continue
        io_s = sum(r["io_seconds"] for r in point["runs"])
        engine_rate = point["bytes_read_engine"] / io_s if io_s > 0 else None
        point["engine_read_mb_s"] = round(engine_rate / 1e6, 2) if engine_rate else None
        point["read_efficiency"] = round(engine_rate / bandwidth, 4) if engine_rate and bandwidth else None
    return report


def run_suite(workdir: Path, workloads: tuple[str, ...], budgets: list[str], repeats: int,
              max_new_tokens: int, train_steps: int, bandwidth_mb: int) -> dict:
    from ..studies.cache_studies import policy_study, prefetch_study, text_trace, warm_run
    from ..studies.synthetic_container import synthetic_container
    from ..studies.trained_workload import ROUTING_MODEL, heldout_prompts, train_routing_model, tuning_prompts

    fractions = [budget_share(b) for b in budgets if b.endswith("%")]
    text_tokens = 256  # tokens of each passage read one per forward pass (policy, prefetch studies)
    out: dict = {"suite_version": SUITE_VERSION, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "workdir": str(workdir), "filesystem": filesystem_type(workdir), "workloads": {}}
    heldout = heldout_prompts(4, 600)
    bandwidth_bytes = bandwidth_mb << 20
    if "trained" in workloads or "random" in workloads:
        _log(f"training the routing model ({train_steps} steps; cached in {workdir / 'routing'}) ...")
        trained = train_routing_model(workdir / "routing", steps=train_steps)
    if "trained" in workloads:
        _log("trained workload: budget sweep on held-out text")
        sweep = _sweep(trained.container, budgets, heldout[0], max_new_tokens, repeats, bandwidth_bytes,
                       prefetch="predict", prefill_chunk=128)
        _log("trained workload: policy study (tuning vs held-out traces)")
        tune_trace, shape = text_trace(trained.container, tuning_prompts(4, 1500), text_tokens)
        held_trace, _ = text_trace(trained.container, heldout_prompts(4, 1500), text_tokens)
        trace_files = _save_traces(workdir / "traces", {"tuning": tune_trace, "heldout": held_trace}, shape,
                                   trained.container, text_tokens)
        policies = policy_study(tune_trace, held_trace, shape["total_experts"], shape["n_experts"], shape["top_k"],
                                fractions or [0.25])
        _log("trained workload: prefetch study at 25%")
        prefetch = prefetch_study(trained.container, heldout_prompts(2, 1500), 0.25, repeats, text_tokens, log=_log)
        _log("trained workload: warm run")
        warm = warm_run(trained.container, heldout[:2], max_new_tokens)
        out["workloads"]["trained"] = {"container": str(trained.container), "train_steps": trained.steps,
                                       "val_loss": trained.val_loss, "sweep": sweep, "policies": policies, "traces": trace_files,
                                       "prefetch": prefetch, "warm": warm}
    if "random" in workloads:
        _log("random workload: random-weight container of the same shapes")
        with synthetic_container(workdir, "tiny", seed=1, **ROUTING_MODEL) as path:
            sweep = _sweep(path, budgets, heldout[0], max_new_tokens, repeats, bandwidth_bytes, prefetch="predict")
        out["workloads"]["random"] = {"sweep": sweep}
    for shape in ("nano", "micro"):  # real shapes, random weights: large experts read from disk
        if shape not in workloads:
            continue
        _log(f"{shape} workload: writing a random Colibri-{shape.capitalize()} container ...")
        started = time.perf_counter()
        with synthetic_container(workdir, shape) as path:
            written = time.perf_counter() - started
            size = path.stat().st_size
            disk_budgets = [b for b in budgets if b in ("10%", "25%")] or budgets[:1]
            options = dict(dtype="bf16", max_context=256, prefill_chunk=64)
            args = (heldout[0][:200], min(max_new_tokens, 8), max(1, min(repeats, 2)), bandwidth_bytes)
            sweep = _sweep(path, disk_budgets, *args, prefetch="off", **options)  # reads on this thread
            _log(f"{shape} workload: the same first budget with prefetch on (2 threads)")
            with_prefetch = _sweep(path, disk_budgets[:1], *args, prefetch="on", prefetch_threads=2, **options)
        out["workloads"][shape] = {"container_bytes": size, "write_seconds": round(written, 1), "sweep": sweep,
                                   "sweep_prefetch_on": with_prefetch}
    out["goals"] = goals(out)
    return out


def _save_traces(directory: Path, traces: dict, shape: dict, container: Path, tokens: int) -> dict[str, str]:
    """Keep the policy study's traces, so `colibri-stream policy-study` can replay them later."""
    from ..traces.routing_trace import write_trace

    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, events in traces.items():
        path = directory / f"trained-{name}.jsonl.gz"
        write_trace(path, events, n_moe_layers=shape["total_experts"] // shape["n_experts"], n_experts=shape["n_experts"],
                    top_k=shape["top_k"], model=str(container),
                    source=f"{name} passages of the bundled prose, {tokens} tokens each, one token per pass")
        out[name] = str(path)
    return out


def goals(report: dict) -> dict:
    """The issue's four goals, measured value against target (None when not measured)."""
    w = report["workloads"]
    g: dict = {}
    trained = w.get("trained")
    if trained:
        at25 = next((p for p in trained["policies"]["points"] if abs(p["budget_fraction"] - 0.25) < 1e-9), None)
        if at25:
            default = trained["policies"]["default_policy"]
            held = at25["heldout"]
            g["hit_rate_vs_belady_at_25pct"] = {
                "target": 0.90, "lru": held["lru"]["vs_belady"], default: held[default]["vs_belady"],
                # the best fixed set in hindsight: how far popularity alone can go
                "static_oracle": round(held["static_oracle_hit_rate"] / held["belady_hit_rate"], 4)
                if held["belady_hit_rate"] else None,
                # Belady with the same passes in random order: near 1 = no temporal locality to exploit
                "belady_shuffled": round(at25["shuffled"]["belady_hit_rate"] / held["belady_hit_rate"], 4)
                if held["belady_hit_rate"] else None,
            }
        g["warm_outside_compute_fraction"] = {"target_below": 0.25,
                                              "measured": trained["warm"]["outside_compute_fraction"]}
        pf = trained["prefetch"]
        g["prefetch_accuracy"] = {"target": 0.72, "measured": pf["predict"]["prefetch_accuracy"],
                                  "speedup_on_vs_off": pf["speedup_on_vs_off"]}
    micro = w.get("micro")
    if micro:
        eff = [p["read_efficiency"] for p in micro["sweep"]["points"] if p.get("read_efficiency")]
        g["disk_read_efficiency"] = {"target": 0.85, "measured": round(statistics.median(eff), 4) if eff else None,
                                     "disk_mb_s": round(micro["sweep"]["disk_bandwidth"]["bytes_per_s"] / 1e6, 1)}
    for shape in ("nano", "micro"):
        if shape in w:
            off, on = w[shape]["sweep"]["points"][0], w[shape]["sweep_prefetch_on"]["points"][0]
            g[f"{shape}_prefetch_speedup"] = round(on["tokens_per_s"] / off["tokens_per_s"], 4) if off["tokens_per_s"] else None
    contaminated = [name for name, v in w.items() if any(p["contaminated"] for p in v["sweep"]["points"])]
    g["page_cache_contaminated_workloads"] = contaminated
    return g


def format_suite(report: dict) -> str:
    from ..studies.bench import format_table
    from ..studies.cache_studies import format_policy_study

    lines = [f"colibri-stream bench-suite {report['date_utc']} (workdir on {report['filesystem']})"]
    for name, w in report["workloads"].items():
        lines += ["", f"== {name} ==", format_table(w["sweep"])]
        if "sweep_prefetch_on" in w:
            lines += ["with prefetch on (2 threads):", format_table(w["sweep_prefetch_on"])]
        if "policies" in w:
            lines += format_policy_study(w["policies"], "held-out text")
        if "prefetch" in w:
            pf = w["prefetch"]
            lines.append(f"prefetch at {pf['budget_fraction']:.0%}: off {pf['off']['tokens_per_s']:.2f} tok/s, "
                         f"on {pf['on']['tokens_per_s']:.2f} tok/s (x{pf['speedup_on_vs_off']}), accuracy "
                         f"{pf['predict']['prefetch_accuracy']:.3f}, used {pf['on']['prefetch_used']} / wasted "
                         f"{pf['on']['prefetch_wasted']} of {pf['on']['prefetch_issued']}")
        if "warm" in w:
            lines.append(f"warm run: {w['warm']['outside_compute_fraction']:.1%} of wall time outside compute "
                         f"({w['warm']['misses']} misses)")
    lines += ["", "goals: " + json.dumps(report["goals"])]
    return "\n".join(lines)


@click.command("bench-suite")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path("/var/tmp/colibri-bench"),
              show_default=True, help="Where containers and the trained model live (a real disk, not tmpfs).")
@click.option("--workload", "workloads", type=click.Choice(WORKLOADS), multiple=True,
              help="Repeatable; default: trained and random (micro writes 3.7 GB: ask for it).")
@click.option("--budgets", default="10%,25%,50%,100%", show_default=True,
              help="Comma-separated percentages of the routed experts that fit in the cache.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved cold runs per point (medians reported).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--train-steps", type=click.IntRange(min=1), default=1500, show_default=True,
              help="Optimizer steps of the routing model (cached per step count).")
@click.option("--bandwidth-mb", type=click.IntRange(min=1), default=256, show_default=True,
              help="MB read with O_DIRECT to measure the disk's bandwidth.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch threads.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the JSON report here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
def bench_suite(workdir, workloads, budgets, repeats, max_new_tokens, train_steps, bandwidth_mb, threads,
                json_out, as_json):
    """Budget sweeps with Belady and disk-honesty checks, the policy and prefetch studies, a warm run."""
    import torch

    labels = percentages(budgets)
    fs = filesystem_type(workdir)  # checked before creating anything
    if fs in RAM_FILESYSTEMS:
        raise click.BadParameter(f"{workdir} is on {fs}: reads never reach storage; use a directory on a disk",
                                 param_hint="--workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    report = run_suite(workdir, tuple(workloads) or ("trained", "random"), labels, repeats, max_new_tokens,
                       train_steps, bandwidth_mb)
    text = json.dumps(report, indent=1)
    if json_out:
        json_out.write_text(text + "\n")
    click.echo(text if as_json else format_suite(report))
    if report["goals"]["page_cache_contaminated_workloads"]:
        click.echo("WARNING: page-cache contamination in " + ", ".join(report["goals"]["page_cache_contaminated_workloads"])
                   + ": those tokens/s are not disk numbers", err=True)
        sys.exit(EXIT_CHECK_FAILED)
