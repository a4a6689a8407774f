"""Eviction cost at real size: every serving policy replayed on a Qwen3-30B-A3B-shaped trace.

Qwen3-30B-A3B routes each token to 8 of 128 experts in each of 48 MoE layers: 384 expert uses
per token, and at 25% of the experts a cache of 1536 slots that evicts on most misses. The
trace is synthetic but structured like real routing (per-layer Zipf popularity, and a share of
each token's experts carried over from the token before, as Mixtral's real traces show), or a
real one with `--trace`. Each policy is replayed cold, timed, and compared with Belady's MIN.

    python bench/policy_replay_scale.py [--tokens 300] [--share 0.25] [--trace T.jsonl.gz] [--json]

The figure to read is `seconds` per policy (and `us_per_access`): the replay is the cache's own
event sequence, so it is the eviction work the live engine does on that routing, minus I/O.
Run it with PYTHONPATH pointing at an older checkout's colibri-stream/src to time the old code
on the same trace (the trace depends only on the arguments).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from colibri_stream.cache.policies import POLICIES, serving_policy_names
from colibri_stream.cache.replay import belady, replay
from colibri_stream.traces.events import TraceEvent
from colibri_stream.traces.routing_trace import read_trace


def qwen3_like_trace(tokens: int, layers: int = 48, experts: int = 128, top_k: int = 8,
                     zipf: float = 0.8, carry: float = 0.3, seed: int = 0) -> list[TraceEvent]:
    """`tokens` decode steps: each layer draws top_k distinct experts, a `carry` share from the
    previous token's set in that layer, the rest by a per-layer Zipf popularity."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(experts)]
    orders = [rng.sample(range(experts), experts) for _ in range(layers)]  # who is popular where
    previous: list[list[int]] = [[] for _ in range(layers)]
    events = []
    for step in range(tokens):
        for layer in range(layers):
            chosen: set[int] = set()
            for expert in previous[layer]:
                if len(chosen) < top_k and rng.random() < carry:
                    chosen.add(expert)
            while len(chosen) < top_k:
                chosen.add(orders[layer][rng.choices(range(experts), weights)[0]])
            previous[layer] = sorted(chosen)
            events.append(TraceEvent(step, layer + 1, tuple(previous[layer])))  # block 0 is dense
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--share", type=float, default=0.25, help="cache size as a share of all experts")
    parser.add_argument("--trace", default=None, help="replay this routing trace instead of the synthetic one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.trace:
        trace = read_trace(args.trace)
        events, total = trace.events, trace.header.n_moe_layers * trace.header.n_experts
    else:
        events, total = qwen3_like_trace(args.tokens), 48 * 128
    capacity = max(1, round(args.share * total))
    accesses = sum(len(e.experts) for e in events)
    ceiling = belady(events, capacity).hit_rate
    report = {"experts": total, "slots": capacity, "accesses": accesses, "belady": round(ceiling, 4),
              "policies": {}}
    for name in serving_policy_names():
        policy = POLICIES[name].factory((), capacity)
        started = time.perf_counter()
        result = replay(policy, events, capacity)
        seconds = time.perf_counter() - started
        report["policies"][name] = {
            "seconds": round(seconds, 3), "us_per_access": round(1e6 * seconds / accesses, 2),
            "hit_rate": round(result.hit_rate, 4), "of_belady": round(result.hit_rate / ceiling, 3) if ceiling else None,
            "misses": result.misses,
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{accesses} accesses, {capacity} of {total} slots, Belady {ceiling:.3f}")
    for name, r in report["policies"].items():
        print(f"  {name:14s} {r['seconds']:8.3f} s  {r['us_per_access']:7.2f} us/access  "
              f"hit {r['hit_rate']:.3f} ({r['of_belady']} of Belady)")


if __name__ == "__main__":
    main()
