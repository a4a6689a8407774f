"""Offline cache replay on a routing trace: any `CachePolicy`, and Belady's optimal MIN.

The engine's routing trace (stats.py, `record_trace=True`) lists, per forward pass and MoE
layer, the distinct experts requested in order: exactly the cache's access sequence. Replaying
it with another policy or capacity answers "what would the hit rate have been" without running
the model, and Belady's MIN (evict the expert whose next use is farthest away) gives the ceiling
for any policy of that capacity, which is what a cache policy should be compared against.

`replay(LRUPolicy(), trace, capacity)` reproduces the live engine's hits and misses exactly
(tested), so offline numbers and live numbers are the same quantity. MIN runs in
O(n log n) with a heap of next-use positions and lazy deletion.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..cache.policy import CachePolicy, ExpertKey
from ..traces.events import TraceEvent

_NEVER = float("inf")


@dataclass(frozen=True)
class ReplayResult:
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def access_sequence(trace: Iterable[TraceEvent]) -> list[ExpertKey]:
    """The flat sequence of (layer, expert) accesses a trace describes."""
    return [(event.layer, expert) for event in trace for expert in event.experts]


def replay(policy: CachePolicy, trace: Sequence[TraceEvent], capacity: int) -> ReplayResult:
    """Hits and misses of `policy` with `capacity` slots on `trace` (starting empty)."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    cached: set[ExpertKey] = set()
    policy.bind(capacity, sorted({event.layer for event in trace}))
    hits = misses = 0
    step = None
    for event in trace:
        if event.step != step:
            step = event.step
            policy.begin_step(step)
        for expert in event.experts:
            key = (event.layer, expert)
            if key in cached:
                hits += 1
                policy.on_hit(key)
                continue
            misses += 1
            while policy.needs_room(key, len(cached), capacity):
                victim = policy.victim_for(key)
                cached.discard(victim)
                policy.on_remove(victim)
            cached.add(key)
            policy.on_insert(key)
    return ReplayResult(hits, misses)


def belady(trace: Sequence[TraceEvent] | Sequence[ExpertKey], capacity: int) -> ReplayResult:
    """Belady's MIN: the most hits any policy with `capacity` slots can get on this sequence."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    items = list(trace)
    accesses = access_sequence(items) if items and isinstance(items[0], TraceEvent) else items
    next_use = [_NEVER] * len(accesses)
    seen: dict[ExpertKey, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = seen.get(accesses[i], _NEVER)
        seen[accesses[i]] = i
    cached: dict[ExpertKey, float] = {}  # key -> its next use
    heap: list[tuple[float, ExpertKey]] = []  # (-next use, key); stale entries skipped
    hits = misses = 0
    for i, key in enumerate(accesses):
        if key in cached:
            hits += 1
        else:
            misses += 1
            if len(cached) >= capacity:
                while True:
                    negative_next, victim = heapq.heappop(heap)
                    if cached.get(victim) == -negative_next:
                        del cached[victim]
                        break
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return ReplayResult(hits, misses)


def static_oracle(trace: Sequence[TraceEvent], capacity: int) -> ReplayResult:
    """The best *fixed* choice of experts, made knowing the whole trace: the `capacity - 1` most
    used experts stay pinned (their first uses still miss) and the last slot takes every other
    expert in turn, as a demand-paged cache must. It is one policy among all, so MIN bounds it.
    A policy that only learns *which* experts are popular cannot do much better; closing the
    rest of the gap to Belady takes knowing *when* each expert will be used next."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1")
    accesses = access_sequence(trace)
    kept = {key for key, _ in Counter(accesses).most_common(capacity - 1)}
    hits, seen, streamed = 0, set(), None
    for key in accesses:
        if key in kept:
            hits += key in seen
            seen.add(key)
        else:
            hits += key == streamed
            streamed = key
    return ReplayResult(hits, len(accesses) - hits)
