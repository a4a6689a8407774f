"""`colibri-stream bench`: tokens/s under a sweep of RAM budgets, measured so it cannot lie.

Discipline (issue: the seed's numbers were page-cache hits, not disk reads):
- misses are O_DIRECT reads, and every run compares the engine's bytes-read counter with the
  bytes `/proc/self/io` says reached storage (`read_bytes`, not `rchar`); a disagreement over
  2% marks the point `contaminated` (the page cache served misses) and the table says so;
- each point's hit rate is shown beside Belady's optimum replayed on the same routing trace
  with the same number of slots, the ceiling for any cache policy;
- disk bandwidth is measured in the same run, reading the container's blobs with O_DIRECT at
  the engine's read size (one blob per read, shuffled), giving the I/O bound on decode speed:
  `bandwidth / missed bytes per token`;
- every point is run `runs` times, interleaved across budgets (noise on a shared machine hits
  all points alike), each run on a fresh engine (cold cache); medians are reported.

Budgets are given as percentages of the routed experts' prepared size ("25%" = a quarter of the
experts fit) on top of the fixed part (resident + KV + workspace + staging), or as sizes ("600MB").
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

from ..cache.replay import belady
from ..engine import Engine
from ..io.accounting import IOWindow, ProcIOUnavailable, read_proc_io
from ..sizes import budget_share
from ..studies.disk_bandwidth import measure_read_bandwidth

# 2.0: `lru_vs_belady` became `hit_vs_belady` (the engine's policy, LFU by default, is not
# always LRU), None when prefetch is on; each point names its `policy` and `prefetch` mode.
# 2.1: each point adds `prefill_tokens_per_s` (prompt tokens over the time to first token) beside
# the decode `tokens_per_s`, as llama-bench reports pp and tg apart; a prompt may be token ids.
BENCH_VERSION = "2.1"


def os_read_bytes() -> int | None:
    """Bytes this process caused to be fetched from storage (`/proc/self/io` read_bytes), or None."""
    try:
        return read_proc_io()["read_bytes"]
    except ProcIOUnavailable:
        return None


def measure_disk_bandwidth(engine: Engine, max_bytes: int = 256 << 20, seed: int = 0) -> dict:
    """O_DIRECT read bandwidth of the container's expert blobs, one blob per read, shuffled."""
    offsets = [entry.offset for entry in engine.container.header.experts.entries]
    before = os_read_bytes()
    measured = measure_read_bandwidth(engine.path, offsets, engine.container.blob_length, max_bytes, seed)
    after = os_read_bytes()
    return {
        "bytes": measured.bytes_read,
        "seconds": round(measured.seconds, 6),
        "bytes_per_s": measured.bytes_per_s,
        "io_mode": measured.mode,
        "bytes_read_os": None if before is None or after is None else after - before,
    }


@dataclass
class BenchPoint:
    label: str
    ram_budget: int
    cache_slots: int
    total_experts: int
    tokens_per_s: float = 0.0  # decode: tokens after the first over the time they took
    prefill_tokens_per_s: float = 0.0  # prompt tokens over the time to the first token
    ttft_s: float = 0.0
    hit_rate: float = 0.0
    belady_hit_rate: float = 0.0
    hit_vs_belady: float | None = 0.0  # None with prefetch on: read-ahead hits are not demand hits
    policy: str = ""
    prefetch: str = ""
    bytes_read_engine: int = 0
    bytes_read_os: int | None = None
    contaminated: bool = False
    bytes_read_per_token: float = 0.0
    io_bound_tokens_per_s: float | None = None
    io_seconds: float = 0.0
    compute_seconds: float = 0.0
    forward_seconds: float = 0.0
    prefetch_accuracy: float = 0.0
    io_mode: str = ""
    runs: list[dict] = field(default_factory=list)


def _budget_for(fraction: float, plan) -> int:
    """The budget whose cache holds `fraction` of the experts (at least one layer's working set)."""
    return plan.budget_for_slots(round(fraction * plan.total_experts))


def run_bench(
    path,
    budgets: list[str],
    prompt: str | list[int],
    max_new_tokens: int = 32,
    runs: int = 3,
    bandwidth_bytes: int = 256 << 20,
    **engine_options,
) -> dict:
    """Run the sweep; returns the JSON-ready report (see module docstring). `prompt`: text, or
    token ids (a prompt of a given length, as llama-bench's `-p`)."""
    engine_options = {**engine_options, "record_trace": True}
    plan = Engine.plan(path, **engine_options)
    with Engine.open(path, ram_budget=plan.full_budget, **engine_options) as probe:
        points = []
        for spec in budgets:
            text = str(spec).strip()
            share = budget_share(text)
            budget = text if share is None else _budget_for(share, plan)
            points.append((text, budget))
        bandwidth = measure_disk_bandwidth(probe, bandwidth_bytes)
        prompt_ids = list(prompt) if isinstance(prompt, list) else probe.encode(prompt)
        expert_bytes = probe.container.expert_bytes
    results = {label: BenchPoint(label, 0, 0, 0) for label, _ in points}
    for _ in range(runs):  # interleaved: run r of every point before run r + 1 of any
        for label, budget in points:
            results[label].runs.append(_one_run(path, budget, prompt_ids, max_new_tokens, engine_options))
    report_points = [_summarise(results[label], bandwidth["bytes_per_s"]) for label, _ in points]
    return {
        "bench_version": BENCH_VERSION,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "processor": platform.processor(),
        },
        "container": str(path),
        "expert_bytes_on_disk": expert_bytes,
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": max_new_tokens,
        "runs": runs,
        "disk_bandwidth": bandwidth,
        "points": [asdict(p) for p in report_points],
    }


def _one_run(path, budget, prompt_ids, max_new_tokens, engine_options) -> dict:
    with Engine.open(path, ram_budget=budget, **engine_options) as eng:
        before = os_read_bytes()
        result = eng.generate(prompt_ids, max_new_tokens, stop_token_ids=[])
        after = os_read_bytes()
        s = eng.stats
        optimal = belady(s.trace, eng.budget.slots)
        return {
            "ram_budget": eng.budget.ram_budget,
            "cache_slots": eng.budget.slots,
            "total_experts": eng.budget.total_experts,
            "tokens_per_s": result.tokens_per_s,
            "prefill_tokens_per_s": len(prompt_ids) / result.prefill_seconds if result.prefill_seconds else 0.0,
            "ttft_s": result.prefill_seconds,
            "new_tokens": len(result.token_ids),
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": s.hit_rate,
            "belady_hit_rate": optimal.hit_rate,
            "bytes_read_engine": s.bytes_read,
            "bytes_read_os": None if before is None or after is None else after - before,
            "io_seconds": s.io_seconds,
            "compute_seconds": s.compute_seconds,
            "forward_seconds": s.forward_seconds,
            "prefetch_accuracy": s.prefetch_accuracy,
            "io_mode": s.io_mode,
            "policy": s.policy,
            "prefetch": s.prefetch,
        }


def _summarise(point: BenchPoint, bandwidth: float) -> BenchPoint:
    runs = point.runs
    first = runs[0]

    def median(key):
        return statistics.median(r[key] for r in runs)

    point.ram_budget, point.cache_slots, point.total_experts = (
        first["ram_budget"],
        first["cache_slots"],
        first["total_experts"],
    )
    point.tokens_per_s, point.ttft_s = median("tokens_per_s"), median("ttft_s")
    point.prefill_tokens_per_s = median("prefill_tokens_per_s")
    point.hit_rate, point.belady_hit_rate = median("hit_rate"), median("belady_hit_rate")
    point.policy, point.prefetch = first["policy"], first["prefetch"]
    # Belady's MIN bounds demand paging; prefetched experts count as hits without a demand miss
    point.hit_vs_belady = (
        None if point.prefetch == "on" else point.hit_rate / point.belady_hit_rate if point.belady_hit_rate else 1.0
    )
    point.bytes_read_engine = sum(r["bytes_read_engine"] for r in runs)
    os_bytes = [r["bytes_read_os"] for r in runs]
    point.bytes_read_os = None if None in os_bytes else sum(os_bytes)
    if point.bytes_read_os is not None:
        point.contaminated = IOWindow(point.bytes_read_engine, point.bytes_read_os).contaminated
    tokens = sum(r["new_tokens"] for r in runs)
    point.bytes_read_per_token = point.bytes_read_engine / tokens if tokens else 0.0
    # Decode-only I/O bound: misses per decoded token at the measured bandwidth (prefill excluded
    # would need per-phase counters; including it makes the bound conservative).
    point.io_bound_tokens_per_s = (
        bandwidth / point.bytes_read_per_token if point.bytes_read_per_token else None
    )
    point.io_seconds, point.compute_seconds = median("io_seconds"), median("compute_seconds")
    point.forward_seconds, point.prefetch_accuracy = median("forward_seconds"), median("prefetch_accuracy")
    point.io_mode = first["io_mode"]
    return point


def format_table(report: dict) -> str:
    bw = report["disk_bandwidth"]
    lines = [
        f"disk: {bw['bytes_per_s'] / 1e6:.0f} MB/s O_DIRECT ({bw['io_mode']}), "
        f"experts on disk {report['expert_bytes_on_disk'] / 1e6:.1f} MB, runs {report['runs']} (medians); "
        f"pp: prefill of {report['prompt_tokens']} tokens, tg: decode of {report['max_new_tokens']}",
        f"{'budget':>10} {'slots':>7} {'pp t/s':>7} {'tg t/s':>7} {'TTFT s':>7} {'hit':>6} {'belady':>6} {'ratio':>6} "
        f"{'MB/tok':>7} {'IO-bound':>9} {'engine MB':>10} {'OS MB':>8}  check",
    ]
    for p in report["points"]:
        os_mb = "n/a" if p["bytes_read_os"] is None else f"{p['bytes_read_os'] / 1e6:.1f}"
        check = (
            "PAGE-CACHE CONTAMINATION"
            if p["contaminated"]
            else ("ok" if p["io_mode"] == "direct" else "buffered")
        )
        bound = "-" if p["io_bound_tokens_per_s"] is None else f"{p['io_bound_tokens_per_s']:.1f}"
        ratio = "-" if p["hit_vs_belady"] is None else f"{p['hit_vs_belady']:.2f}"
        lines.append(
            f"{p['label']:>10} {p['cache_slots']:>3}/{p['total_experts']:<3} {p['prefill_tokens_per_s']:>7.1f} "
            f"{p['tokens_per_s']:>7.2f} "
            f"{p['ttft_s']:>7.3f} {p['hit_rate']:>6.1%} {p['belady_hit_rate']:>6.1%} {ratio:>6} "
            f"{p['bytes_read_per_token'] / 1e6:>7.2f} {bound:>9} {p['bytes_read_engine'] / 1e6:>10.1f} {os_mb:>8}  {check}"
        )
    return "\n".join(lines)
