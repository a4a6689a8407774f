"""`LFUPolicy` ("lfu"): least frequently used, with aging, in O(log n) per event.

Each expert's use count survives its eviction (an expert that keeps coming back is recognised)
and halves every `half_life` forward passes (old popularity fades); the victim is the cached
expert with the lowest count, ties broken by least recent use.

Halving every count is O(experts) and would reorder nothing, so it is not done: instead each
use adds `2 ** epoch` (epoch = passes // half_life), which ranks keys exactly as halving the
older counts would (every count is the same power of two apart from its halved form, and sums
of powers of two are exact in a float). The victim then comes from a heap of
`(count, last use, key)` entries with lazy deletion (an entry is stale once its key was used
again or left the cache), so an eviction costs O(log n) plus one push back per pinned key
passed over, never a scan of the cache. Counts of uncached experts that fall below 1/64 of a
use are forgotten at each epoch (bounded memory), and the weights are rescaled long before a
float could overflow; both are O(experts) once per `half_life` passes, not per miss.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

from .policy import CachePolicy, ExpertKey, nothing_to_evict

RESCALE_AT = 2.0**256  # weights are divided down past this (floats reach 2 ** 1023)


class LFUPolicy(CachePolicy):
    """Least frequently used with aging; counts persist across evictions."""

    name = "lfu"

    def __init__(self, half_life: int = 64) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1 forward pass, got {half_life}")
        self.half_life = half_life
        self._weight = 1.0  # what one use adds now: 2 ** epoch, rescaled
        self._count: dict[ExpertKey, float] = {}  # in units of `_weight`; kept after eviction
        self._last_use: dict[ExpertKey, int] = {}  # cached keys only
        self._heap: list[tuple[float, int, ExpertKey]] = []  # (count, last use, key)
        self._clock = 0
        self._steps = 0

    def count(self, key: ExpertKey) -> float:
        """The aged use count of `key`, in uses (0.0 for an expert never seen or forgotten)."""
        return self._count.get(key, 0.0) / self._weight

    def begin_step(self, step: int) -> None:
        self._steps += 1
        if self._steps % self.half_life == 0:
            forget_below = self._weight / 64
            self._count = {k: c for k, c in self._count.items() if c >= forget_below or k in self._last_use}
            self._weight *= 2.0
            if self._weight >= RESCALE_AT:
                self._count = {k: c / self._weight for k, c in self._count.items()}
                self._weight = 1.0
                self._rebuild()

    def _touch(self, key: ExpertKey) -> None:
        count = self._count.get(key, 0.0) + self._weight
        self._count[key] = count
        self._clock += 1
        self._last_use[key] = self._clock
        heapq.heappush(self._heap, (count, self._clock, key))
        if len(self._heap) > 2 * len(self._last_use) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._count[k], t, k) for k, t in self._last_use.items()]
        heapq.heapify(self._heap)

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._last_use.pop(key, None)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        passed = []  # valid pinned entries, pushed back afterwards
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[2]
            if self._last_use.get(key) != entry[1]:
                continue  # stale: used again since, or no longer cached
            passed.append(entry)  # the victim's entry too: it goes stale when the cache removes it
            if key not in pinned:
                found = key
                break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        if found is None:
            raise nothing_to_evict()
        return found
