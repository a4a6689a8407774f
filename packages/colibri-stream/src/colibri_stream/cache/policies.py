"""Eviction policies for the expert cache: the interface, every policy, ONE registry.

The cache owns the slots and the bytes; a policy only decides *which* cached expert to drop
when a new one needs a slot. The cache tells the policy about every event:

    on_insert(key)            an expert was loaded into a slot (after a miss or a prefetch)
    on_hit(key)               a cached expert was used again
    on_remove(key)            an expert left the cache (evicted or invalidated)
    begin_step(step)          a new forward pass (one decode token, or one prefill chunk)
    victim(pinned) -> key     choose an expert to evict, never one in `pinned`

Keys are `(layer, expert)` tuples. A policy sees one global key space, so per-layer policies
are a matter of how `victim` ranks keys (e.g. prefer the layer just computed).

- `LRUPolicy` ("lru"): least recently used over all layers (O(1) per event, an OrderedDict).
- `LayerLRUPolicy` ("lru-layer"): LRU inside each MoE layer, with the slots shared out evenly:
  the victim is the least recently used expert of the layer holding the most slots. It stops
  one layer with many distinct experts (a long prefill) from flushing the others.
- `LFUPolicy` ("lfu", the default): frequency-aware. Each expert's use count survives its
  eviction (so an expert that keeps coming back is recognised) and decays by half every
  `half_life` forward passes (so old popularity fades); the victim is the cached expert with
  the lowest count, ties broken by least recent use.
- `PinnedLRUPolicy` ("pinned"): pins the hottest experts of a warm-up routing trace
  (`from_trace`), which are evicted only when nothing else can be; the rest is LRU. It needs a
  trace, so it is offered to studies (`POLICIES`) but not by name to the engine.

`POLICIES` is the one registry: name -> `PolicySpec` (a factory of a warm-up trace and the
slot count, and whether it needs that trace). The engine's `cache_policy=` names, the CLI's
`--cache-policy` choices (`serving_policy_names()`) and the policy study all read it.

Cost: `victim` scans the cached keys (O(slots)) for the layer and frequency policies; at a few
thousand slots that is microseconds against a millisecond-scale disk read. Every policy here
is deterministic, so replaying a routing trace offline (cache.replay) gives exactly the hits
the live engine would get, which is how `colibri-stream bench` compares them with Belady's MIN.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from ..traces.events import TraceEvent

ExpertKey = tuple[int, int]  # (layer, expert)


class CachePolicy(ABC):
    """Chooses eviction victims; see the module docstring for the event protocol."""

    name = "policy"

    def begin_step(self, step: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """Called before each forward pass; policies with time decay use it."""

    @abstractmethod
    def on_insert(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def on_hit(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def on_remove(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        """A cached key not in `pinned`; raises LookupError if there is none."""


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
        for key in self._order:
            if key not in pinned:
                return key
        raise LookupError("every cached expert is pinned; nothing can be evicted")


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


PolicyFactory = Callable[[Sequence[TraceEvent], int], CachePolicy]


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: `factory(warm-up trace, slots)`, and whether it needs that trace."""

    factory: PolicyFactory
    needs_warmup_trace: bool = False


POLICIES: dict[str, PolicySpec] = {
    LRUPolicy.name: PolicySpec(lambda warmup, slots: LRUPolicy()),
    LayerLRUPolicy.name: PolicySpec(lambda warmup, slots: LayerLRUPolicy()),
    LFUPolicy.name: PolicySpec(lambda warmup, slots: LFUPolicy()),
    PinnedLRUPolicy.name: PolicySpec(lambda warmup, slots: PinnedLRUPolicy.from_trace(warmup, slots), True),
}
DEFAULT_POLICY = LFUPolicy.name


def serving_policy_names() -> list[str]:
    """The names the engine and the CLI accept (those that need no warm-up trace)."""
    return [name for name, spec in POLICIES.items() if not spec.needs_warmup_trace]


def make_policy(policy: str | CachePolicy | None) -> CachePolicy:
    """A policy instance from a name ("lru", "lfu", ...), an instance, or None (the default).

    The default is LFU with aging, the best on held-out text, never on the tuning trace: at a
    25% budget 0.65 of Belady's hit rate against LRU's 0.50 on the 1500-step routing model
    (0.81 vs 0.66 on the 250-step one; bench/RESULTS.md, issue 9).
    """
    if isinstance(policy, CachePolicy):
        return policy
    name = DEFAULT_POLICY if policy is None else str(policy).lower()
    if name not in serving_policy_names():
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(serving_policy_names())}")
    return POLICIES[name].factory((), 0)
