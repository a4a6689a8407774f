"""Recency-ordered policies: global LRU, LRU inside each layer, and LRU with a pinned hot set.

- `LRUPolicy` ("lru"): least recently used over all layers (an OrderedDict, O(1) per event).
- `LayerLRUPolicy` ("lru-layer"): LRU inside each MoE layer; the victim is the least recently
  used expert of the layer holding the most slots (ties: the lowest layer index). It stops one
  layer with many distinct experts (a long prefill) from flushing the others. The fullest layer
  comes from a heap of (-size, layer) entries with lazy deletion: O(log layers) per eviction.
- `PinnedLRUPolicy` ("pinned"): pins the hottest experts of a warm-up routing trace
  (`from_trace`), evicted only when nothing else can be; the rest is LRU. The hot and the
  other experts keep separate orders, so a victim never walks past the hot set.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence

from ..traces.events import TraceEvent
from .policy import CachePolicy, ExpertKey, nothing_to_evict


def _oldest_unpinned(order: OrderedDict[ExpertKey, None], pinned: Collection[ExpertKey]) -> ExpertKey | None:
    # skips at most len(pinned) keys: the pinned ones are the only ones passed over
    for key in order:
        if key not in pinned:
            return key
    return None


class LRUPolicy(CachePolicy):
    """Least recently used, over all layers at once."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        key = _oldest_unpinned(self._order, pinned)
        if key is None:
            raise nothing_to_evict()
        return key


class LayerLRUPolicy(CachePolicy):
    """LRU per layer; evicts from the layer that holds the most experts."""

    name = "lru-layer"

    def __init__(self) -> None:
        self._layers: dict[int, OrderedDict[ExpertKey, None]] = {}
        self._fullest: list[tuple[int, int]] = []  # (-size, layer); stale when size changed

    def _size_changed(self, layer: int) -> None:
        heapq.heappush(self._fullest, (-len(self._layers[layer]), layer))
        if len(self._fullest) > 4 * len(self._layers) + 64:  # drop the stale entries
            self._fullest = [(-len(o), i) for i, o in self._layers.items() if o]
            heapq.heapify(self._fullest)

    def on_insert(self, key: ExpertKey) -> None:
        order = self._layers.setdefault(key[0], OrderedDict())
        known = key in order
        order[key] = None
        order.move_to_end(key)
        if not known:
            self._size_changed(key[0])

    def on_hit(self, key: ExpertKey) -> None:
        self._layers[key[0]].move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        order = self._layers.get(key[0])
        if order is not None and key in order:
            del order[key]
            self._size_changed(key[0])

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        passed: list[tuple[int, int]] = []  # valid entries looked at, pushed back afterwards
        found = None
        while self._fullest and found is None:
            entry = heapq.heappop(self._fullest)
            order = self._layers.get(entry[1])
            if order is None or len(order) != -entry[0] or not order:
                continue  # stale: the layer's size has changed since
            passed.append(entry)
            found = _oldest_unpinned(order, pinned)  # None when the whole layer is pinned
        for entry in passed:
            heapq.heappush(self._fullest, entry)
        if found is None:
            raise nothing_to_evict()
        return found


class PinnedLRUPolicy(CachePolicy):
    """LRU that keeps `hot` experts unless only they are left to evict."""

    name = "pinned"

    def __init__(self, hot: Iterable[ExpertKey] = ()) -> None:
        self.hot = frozenset(hot)
        self._cold: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._hot: OrderedDict[ExpertKey, None] = OrderedDict()

    @classmethod
    def from_trace(cls, warmup: Sequence[TraceEvent], capacity: int, share: float = 0.5) -> PinnedLRUPolicy:
        """Pin the `share * capacity` experts used most often in a warm-up trace."""
        if not 0 <= share <= 1:
            raise ValueError(f"share must lie in [0, 1], got {share}")
        counts = Counter((e.layer, x) for e in warmup for x in e.experts)
        n = int(capacity * share)
        # most_common is stable on ties (first seen first), so the choice is deterministic
        return cls(key for key, _ in counts.most_common(n))

    def _order_of(self, key: ExpertKey) -> OrderedDict[ExpertKey, None]:
        return self._hot if key in self.hot else self._cold

    def on_insert(self, key: ExpertKey) -> None:
        order = self._order_of(key)
        order[key] = None
        order.move_to_end(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._order_of(key).move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._order_of(key).pop(key, None)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        key = _oldest_unpinned(self._cold, pinned)
        if key is None:
            key = _oldest_unpinned(self._hot, pinned)
        if key is None:
            raise nothing_to_evict()
        return key
