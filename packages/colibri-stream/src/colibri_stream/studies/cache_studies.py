"""The cache studies on top of the budget sweep (bench.py): policies, prefetch, warm runs.

- `policy_study`: every policy of cache.policies.POLICIES replayed offline on two routing traces
  of the same model, one from *tuning* text (which also warms up the pinning policy) and one from
  *held-out* text, plus a uniformly random trace of the same shape (the worst case), each against
  Belady's MIN at the same number of slots. Replay is exact: routing does not depend on what the
  cache holds, and `replay(LRUPolicy(), ...)` reproduces the live engine's hits (tested in
  test_cache_replay.py). The default policy is the best on held-out text, never on the tuning
  trace, and LRU keeps the title unless another wins by more than `margin`. Each policy and
  Belady also report their hits by MoE layer (`per_layer`, `belady_per_layer`), from the same
  replays.
- `prefetch_study`: live runs with prefetch off / predict / on at one budget, interleaved, cold
  each time, reading held-out text one token per forward pass: tokens/s (median), accuracy one
  layer ahead, useful and wasted prefetches.
- `warm_run`: every expert cached (budget 100%, one pass to fill, then a measured pass): the
  share of wall time spent outside the model's forward compute (I/O, CRC/repack, sampling,
  Python glue), which the issue wants under 25%.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from ..cache.policies import POLICIES
from ..cache.replay import ReplayResult, belady, replay, static_oracle
from ..engine import Engine
from ..io.accounting import IOMeter
from ..traces.events import TraceEvent


def routing_trace(container: str | Path, prompts: Sequence[str], max_new_tokens: int,
                  **engine_options) -> tuple[list[TraceEvent], dict]:
    """The routing trace of greedy generation after each prompt (one engine, budget 100%)."""
    full = Engine.plan(container, **engine_options).full_budget
    with Engine.open(container, ram_budget=full, record_trace=True, **engine_options) as eng:
        for prompt in prompts:
            eng.generate(prompt, max_new_tokens, stop_token_ids=[])
        shape = {"total_experts": eng.budget.total_experts, "n_experts": eng.config.n_experts,
                 "top_k": eng.top_k}
        return list(eng.stats.trace), shape


def text_trace(container: str | Path, texts: Sequence[str], max_tokens: int = 256,
               **engine_options) -> tuple[list[TraceEvent], dict]:
    """The routing trace of reading real `texts` one token per forward pass (teacher forcing).

    Each token is its own step, exactly the access pattern of decoding that text, but driven by
    real text rather than by a small model's own (often repetitive) continuations."""
    options = {**engine_options, "prefill_chunk": 1, "max_context": max_tokens}
    full = Engine.plan(container, **options).full_budget
    with Engine.open(container, ram_budget=full, record_trace=True, **options) as eng:
        for text in texts:
            eng.logits(eng.encode(text)[:max_tokens])
        shape = {"total_experts": eng.budget.total_experts, "n_experts": eng.config.n_experts,
                 "top_k": eng.top_k}
        return list(eng.stats.trace), shape


def random_trace_like(trace: Sequence[TraceEvent], n_experts: int, seed: int = 0) -> list[TraceEvent]:
    """Same steps, layers and experts-per-event as `trace`, experts drawn uniformly at random."""
    rng = random.Random(seed)
    return [TraceEvent(e.step, e.layer, tuple(sorted(rng.sample(range(n_experts), len(e.experts)))))
            for e in trace]


def shuffled_steps(trace: Sequence[TraceEvent], seed: int = 0) -> list[TraceEvent]:
    """The same forward passes in a random order, each pass's routing intact: expert popularity
    is kept, any dependence between consecutive tokens is destroyed."""
    passes: dict[int, list[TraceEvent]] = {}
    for event in trace:
        passes.setdefault(event.step, []).append(event)
    order = list(passes)
    random.Random(seed).shuffle(order)
    return [TraceEvent(i, e.layer, e.experts) for i, step in enumerate(order) for e in passes[step]]


def policy_study(tuning: Sequence[TraceEvent], heldout: Sequence[TraceEvent], total_experts: int,
                 n_experts: int, top_k: int, fractions: Sequence[float], margin: float = 0.005) -> dict:
    """Hit rates of each policy and of Belady on the tuning, held-out, shuffled and random traces.

    The shuffled trace measures temporal locality: if Belady (and every policy) does about as
    well with the held-out passes in random order, routing is close to the independent
    reference model, under which the best online policy keeps the most popular experts (A0,
    Aho, Denning and Ullman 1971), i.e. about the static oracle, whatever it knows about time.

    Per budget and trace, `belady_per_layer` and each policy's `per_layer` map the layer (as a
    string: JSON keys) to {"hits", "misses", "hit_rate"}; Belady's are the layers' shares of the
    one globally optimal run (cache.replay)."""
    traces = {"tuning": tuning, "heldout": heldout, "shuffled": shuffled_steps(heldout),
              "random": random_trace_like(heldout, n_experts)}
    rows = []
    for fraction in fractions:
        capacity = max(top_k, round(fraction * total_experts))
        row: dict = {"budget_fraction": fraction, "cache_slots": capacity}
        for name, trace in traces.items():
            optimal = belady(trace, capacity, per_layer=True)
            ceiling = optimal.hit_rate
            row[name] = {"belady_hit_rate": round(ceiling, 6),
                         "static_oracle_hit_rate": round(static_oracle(trace, capacity).hit_rate, 6),
                         "belady_per_layer": _per_layer(optimal)}
            for policy_name, spec in POLICIES.items():
                # the warm-up trace is always the tuning trace: pinning never sees held-out text
                try:
                    result = replay(spec.factory(tuning, capacity), trace, capacity, per_layer=True)
                except ValueError as exc:  # a per-layer cache with fewer slots than layers
                    row[name][policy_name] = {"hit_rate": None, "vs_belady": None, "refused": str(exc)}
                    continue
                hit = result.hit_rate
                row[name][policy_name] = {"hit_rate": round(hit, 6),
                                          "vs_belady": round(hit / ceiling, 4) if ceiling else None,
                                          "per_layer": _per_layer(result)}
        rows.append(row)

    def mean_heldout(policy_name: str) -> float:  # a budget a policy refuses counts as no hits
        return statistics.fmean(r["heldout"][policy_name]["hit_rate"] or 0.0 for r in rows)

    scores = {name: round(mean_heldout(name), 6) for name in POLICIES}
    best = max(scores, key=scores.get)
    default = best if scores[best] > scores["lru"] + margin else "lru"
    return {"points": rows, "heldout_mean_hit_rate": scores, "default_policy": default,
            "trace_accesses": {k: sum(len(e.experts) for e in t) for k, t in traces.items()}}


def _per_layer(result: ReplayResult) -> dict[str, dict]:
    return {str(layer): {"hits": r.hits, "misses": r.misses, "hit_rate": round(r.hit_rate, 6)}
            for layer, r in result.per_layer.items()}


def format_policy_study(study: dict, heldout_name: str = "held-out trace") -> list[str]:
    """The policy study as table lines: per budget, Belady, the static oracle and every policy
    on the held-out trace (hit rate, and its ratio to Belady's), then random routing."""
    lines = [f"policies on the {heldout_name} (hit rate, vs Belady in brackets):"]
    for p in study["points"]:
        held = p["heldout"]
        cells = [f"{name} n/a (fewer slots than layers)" if held[name]["hit_rate"] is None else
                 f"{name} {held[name]['hit_rate']:.3f} ({held[name]['vs_belady'] or 0:.2f})" for name in POLICIES]
        lines.append(f"  {p['budget_fraction']:>5.0%} slots {p['cache_slots']:>5}: belady "
                     f"{held['belady_hit_rate']:.3f}, static oracle {held['static_oracle_hit_rate']:.3f} | "
                     + " | ".join(cells))
        shuffled, rand = p["shuffled"], p["random"]
        kept = shuffled["belady_hit_rate"] / held["belady_hit_rate"] if held["belady_hit_rate"] else 0.0
        lines.append(f"  {'':>5} same passes shuffled: belady {shuffled['belady_hit_rate']:.3f} "
                     f"(x{kept:.2f}; near 1: no temporal locality to exploit), lfu "
                     f"{shuffled['lfu']['hit_rate']:.3f}, lru {shuffled['lru']['hit_rate']:.3f} | random routing: "
                     f"belady {rand['belady_hit_rate']:.3f}, lru {rand['lru']['hit_rate']:.3f}")
    lines.append(f"  default policy chosen on the held-out trace: {study['default_policy']}")
    return lines


def _cold_run(container, ram_budget: int, texts: Sequence[str], max_tokens: int, **engine_options) -> dict:
    """A cold engine reads each text one token per forward pass (decode-shaped steps on real
    text); tokens/s is tokens over the wall time of those passes."""
    options = {**engine_options, "prefill_chunk": 1, "max_context": max_tokens}
    with Engine.open(container, ram_budget=ram_budget, **options) as eng:
        tokens, seconds = 0, 0.0
        with IOMeter() as meter:
            for text in texts:
                ids = eng.encode(text)[:max_tokens]
                started = time.perf_counter()
                eng.logits(ids)
                seconds += time.perf_counter() - started
                tokens += len(ids)
        stats = eng.stats.to_dict()
        io = meter.window(stats["bytes_read"])
    return {"tokens_per_s": tokens / seconds if seconds else 0.0, "tokens": tokens, "stats": stats, **io.to_dict()}


def budget_for_fraction(container, fraction: float, **engine_options) -> tuple[int, int]:
    """(ram budget, slots) whose cache holds `fraction` of the routed experts (at least top_k)."""
    plan = Engine.plan(container, **engine_options)
    slots = max(plan.footprint.working_set_slots, round(fraction * plan.total_experts))
    return plan.budget_for_slots(slots), slots


def prefetch_study(container, texts: Sequence[str], fraction: float, repeats: int, max_tokens: int,
                   threads: int = 2, log=print, **engine_options) -> dict:
    """Prefetch off / predict / on at one budget fraction, `repeats` interleaved cold runs each."""
    runs: dict[str, list[dict]] = {"off": [], "predict": [], "on": []}
    for repeat in range(repeats):
        for mode in runs:
            opts = {**engine_options, "prefetch": mode, "prefetch_threads": threads}
            budget, _ = budget_for_fraction(container, fraction, **opts, prefill_chunk=1, max_context=max_tokens)
            started = time.perf_counter()
            run = _cold_run(container, budget, texts, max_tokens, **opts)
            runs[mode].append(run)
            log(f"  prefetch {mode} run {repeat + 1}/{repeats}: {run['tokens_per_s']:.2f} tok/s, "
                f"hit {run['stats']['hit_rate']:.3f} ({time.perf_counter() - started:.1f} s)")
    out: dict = {"budget_fraction": fraction, "threads": threads}
    for mode, mode_runs in runs.items():
        s = [r["stats"] for r in mode_runs]
        out[mode] = {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in mode_runs), 4),
            "tokens_per_s_runs": [round(r["tokens_per_s"], 4) for r in mode_runs],
            "hit_rate": s[0]["hit_rate"],
            "prefetch_accuracy": s[0]["prefetch_accuracy"],
            "prefetch_issued": s[0]["prefetch_issued"],
            "prefetch_used": s[0]["prefetch_used"],
            "prefetch_wasted": s[0]["prefetch_wasted"],
            # per MoE layer: the share of its experts predicted one layer ahead (precision too:
            # the guess has as many experts as the layer uses), and its hit rate
            "per_layer": {layer: {"prefetch_accuracy": c["prefetch_accuracy"], "hit_rate": c["hit_rate"]}
                          for layer, c in s[0]["per_layer"].items()},
            "bytes_read_per_token": round(statistics.median(r["bytes_read_engine"] / r["tokens"] for r in mode_runs)),
            "bytes_read_engine": sum(r["bytes_read_engine"] for r in mode_runs),
            "bytes_read_os": sum(r["bytes_read_os"] for r in mode_runs),
            "page_cache_contaminated": any(r["page_cache_contaminated"] for r in mode_runs),
        }
    off = out["off"]["tokens_per_s"]
    out["speedup_on_vs_off"] = round(out["on"]["tokens_per_s"] / off, 4) if off else None
    out["keep_prefetch"] = bool(off and out["on"]["tokens_per_s"] > off)
    return out


def warm_run(container, prompts: Sequence[str], max_new_tokens: int, **engine_options) -> dict:
    """Fill the cache with every expert, then measure a pass: time outside compute."""
    full = Engine.plan(container, **engine_options).full_budget
    with Engine.open(container, ram_budget=full, **engine_options) as eng:
        for prompt in prompts:  # fill
            eng.generate(prompt, max_new_tokens, stop_token_ids=[])
        eng.cache.prefetch([k for k in eng.cache.entries if k not in eng.cache])  # every expert
        eng.reset_stats()
        started = time.perf_counter()
        decoded = 0
        for prompt in prompts:
            result = eng.generate(prompt, max_new_tokens, stop_token_ids=[])
            decoded += max(len(result.token_ids) - 1, 0)
        wall = time.perf_counter() - started
        s = eng.stats
        compute = s.forward_seconds - s.io_seconds - s.verify_seconds
        return {
            "misses": s.misses,
            "hits": s.hits,
            "wall_s": round(wall, 4),
            "forward_s": round(s.forward_seconds, 4),
            "routed_expert_compute_s": round(s.compute_seconds, 4),
            "io_s": round(s.io_seconds, 6),
            "outside_compute_fraction": round(1 - compute / wall, 4) if wall else None,
            "decode_tokens_per_s": round(decoded / wall, 3) if wall else None,
        }
