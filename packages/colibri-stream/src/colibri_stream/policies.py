"""More eviction policies for the expert cache, against `cache_policy.CachePolicy`.

- `LayerLRUPolicy` ("lru-layer"): LRU inside each MoE layer, with the slots shared out evenly:
  the victim is the least recently used expert of the layer holding the most slots. It stops
  one layer with many distinct experts (a long prefill) from flushing the others.
- `LFUPolicy` ("lfu"): frequency-aware. Each expert's use count survives its eviction (so an
  expert that keeps coming back is recognised) and decays by half every `half_life` forward
  passes (so old popularity fades); the victim is the cached expert with the lowest count,
  ties broken by least recent use.
- `PinnedLRUPolicy` ("pinned"): pins the hottest experts of a warm-up routing trace
  (`from_trace`), which are evicted only when nothing else can be; the rest is LRU.

The parameter-free ones register their names in `cache_policy.POLICIES` when this module is
imported (the package imports it), so `Engine.open(..., cache_policy="lfu")` works.

Cost: `victim` scans the cached keys (O(slots)) for the layer and frequency policies; at a few
thousand slots that is microseconds against a millisecond-scale disk read. Every policy here
is deterministic, so replaying a routing trace offline (cache_replay.replay) gives exactly the
hits the live engine would get, which is how `colibri-stream bench` compares them with
Belady's MIN.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

from .cache_policy import POLICIES, CachePolicy, ExpertKey, LRUPolicy
from .stats import TraceEvent


class LayerLRUPolicy(CachePolicy):
    """LRU per layer; evicts from the layer that holds the most experts."""

    name = "lru-layer"

    def __init__(self) -> None:
        self._layers: dict[int, OrderedDict[ExpertKey, None]] = {}

    def on_insert(self, key: ExpertKey) -> None:
        order = self._layers.setdefault(key[0], OrderedDict())
        order[key] = None
        order.move_to_end(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._layers[key[0]].move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        order = self._layers.get(key[0])
        if order is not None:
            order.pop(key, None)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        # Largest layer first; among equals, the layer whose LRU entry is oldest is unknowable
        # without a global clock, so ties go to the lowest layer index (deterministic).
        for _, layer in sorted(((-len(o), i) for i, o in self._layers.items())):
            for key in self._layers[layer]:
                if key not in pinned:
                    return key
        raise LookupError("every cached expert is pinned; nothing can be evicted")


class LFUPolicy(CachePolicy):
    """Least frequently used with aging; counts persist across evictions."""

    name = "lfu"

    def __init__(self, half_life: int = 64) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1 forward pass, got {half_life}")
        self.half_life = half_life
        self._count: dict[ExpertKey, float] = {}
        self._recency: OrderedDict[ExpertKey, None] = OrderedDict()  # cached keys, oldest first
        self._steps = 0

    def begin_step(self, step: int) -> None:
        self._steps += 1
        if self._steps % self.half_life == 0:
            self._count = {k: c / 2 for k, c in self._count.items() if c >= 1 / 64 or k in self._recency}

    def _touch(self, key: ExpertKey) -> None:
        self._count[key] = self._count.get(key, 0.0) + 1.0
        self._recency[key] = None
        self._recency.move_to_end(key)

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._recency.pop(key, None)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        best, best_count = None, float("inf")
        for key in self._recency:  # oldest first, so strict < keeps the least recent on ties
            if key in pinned:
                continue
            count = self._count.get(key, 0.0)
            if count < best_count:
                best, best_count = key, count
        if best is None:
            raise LookupError("every cached expert is pinned; nothing can be evicted")
        return best


class PinnedLRUPolicy(LRUPolicy):
    """LRU that keeps `hot` experts unless only they are left to evict."""

    name = "pinned"

    def __init__(self, hot: Iterable[ExpertKey] = ()) -> None:
        super().__init__()
        self.hot = frozenset(hot)

    @classmethod
    def from_trace(cls, warmup: Sequence[TraceEvent], capacity: int, share: float = 0.5) -> PinnedLRUPolicy:
        """Pin the `share * capacity` experts used most often in a warm-up trace."""
        if not 0 <= share <= 1:
            raise ValueError(f"share must lie in [0, 1], got {share}")
        counts = Counter((e.layer, x) for e in warmup for x in e.experts)
        n = int(capacity * share)
        # most_common is stable on ties (first seen first), so the choice is deterministic
        return cls(key for key, _ in counts.most_common(n))

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        for key in self._order:
            if key not in pinned and key not in self.hot:
                return key
        return super().victim(pinned)


# Make the parameter-free policies available by name to `Engine.open(cache_policy="lfu")`.
POLICIES.setdefault(LayerLRUPolicy.name, LayerLRUPolicy)
POLICIES.setdefault(LFUPolicy.name, LFUPolicy)

PolicyFactory = Callable[[Sequence[TraceEvent], int], CachePolicy]

# name -> factory(warm-up trace, capacity): the policies the benchmark compares.
BENCH_POLICIES: dict[str, PolicyFactory] = {
    "lru": lambda warmup, capacity: LRUPolicy(),
    "lru-layer": lambda warmup, capacity: LayerLRUPolicy(),
    "lfu": lambda warmup, capacity: LFUPolicy(),
    "pinned": lambda warmup, capacity: PinnedLRUPolicy.from_trace(warmup, capacity),
}
