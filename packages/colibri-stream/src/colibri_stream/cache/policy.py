"""The eviction-policy interface the expert cache and the offline replay both drive.

The cache owns the slots and the bytes; a policy only decides *which* cached expert to drop
when a new one needs a slot. The cache tells the policy about every event:

    bind(capacity, layers)        once, before any other event: the slot count and the MoE layers
    fewest_slots(layers)          the smallest cache the policy can run with (1; a partition: layers)
    begin_step(step)              a new forward pass (one decode token, or one prefill chunk)
    on_insert(key)                an expert was loaded into a slot (after a miss or a prefetch)
    on_hit(key)                   a cached expert was used again
    on_remove(key)                an expert left the cache (evicted or invalidated)
    needs_room(incoming, cached)  must something be evicted before `incoming` is stored?
    slots_for_layer(layer, cap)   how many of one layer's experts fit at once (a partition: its share)
    victim_for(incoming, pinned)  the expert to evict for `incoming`, never one in `pinned`;
                                  by default `victim(pinned)`, which is all most policies define

Keys are `(layer, expert)` tuples. A policy sees one global key space; a per-layer policy is a
matter of how `victim` ranks keys, and a partitioned cache (layer_partition.py) of how
`needs_room` counts a layer's share.

Cost rule: every event is O(1) or O(log n) amortised in the number of cached experts, and
`victim` skips at most `len(pinned)` candidates (the running layer's experts, top-k of them):
it never scans the cache, and allocates nothing that grows with it. A real-size model (48 MoE
layers x 128 experts, thousands of slots) evicts hundreds of times per token on this path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

ExpertKey = tuple[int, int]  # (layer, expert)


class CachePolicy(ABC):
    """Chooses eviction victims; see the module docstring for the event protocol."""

    name = "policy"

    def bind(self, capacity: int, layers: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """Called once before any event with the cache's slot count and its MoE layer indices."""

    def begin_step(self, step: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """Called before each forward pass; policies with time decay use it."""

    def fewest_slots(self, layers: int) -> int:
        """The smallest cache this policy can run with, for a model of `layers` MoE layers."""
        return 1

    def needs_room(self, incoming: ExpertKey, cached: int, capacity: int) -> bool:
        """Whether a victim must go before `incoming` (not cached) is stored; a global cache
        evicts only when full."""
        return cached >= capacity

    def slots_for_layer(self, layer: int, capacity: int) -> int:
        """How many experts of `layer` the cache can hold at once: all its slots for a global
        policy (a partitioned one: the layer's share)."""
        return capacity

    @abstractmethod
    def on_insert(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def on_hit(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def on_remove(self, key: ExpertKey) -> None: ...

    @abstractmethod
    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        """A cached key not in `pinned`; raises LookupError if there is none."""

    def victim_for(self, incoming: ExpertKey, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        """The victim that makes room for `incoming` (not cached); a partitioned policy picks it
        in `incoming`'s share."""
        return self.victim(pinned)


def nothing_to_evict() -> LookupError:
    return LookupError("every cached expert is pinned; nothing can be evicted")
