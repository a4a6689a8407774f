"""Eviction policies for the expert cache, behind a small interface.

The cache owns the slots and the bytes; a policy only decides *which* cached expert to drop
when a new one needs a slot. The cache tells the policy about every event:

    on_insert(key)            an expert was loaded into a slot (after a miss or a prefetch)
    on_hit(key)               a cached expert was used again
    on_remove(key)            an expert left the cache (evicted or invalidated)
    begin_step(step)          a new forward pass (one decode token, or one prefill chunk)
    victim(pinned) -> key     choose an expert to evict, never one in `pinned`

Keys are `(layer, expert)` tuples. A policy sees one global key space, so per-layer policies
are a matter of how `victim` ranks keys (e.g. prefer the layer just computed). LRU lives here
as the simplest policy (O(1) per event with an OrderedDict); the default, LFU with aging, and
the others are in policies.py, chosen by measurement (`make_policy`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection

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


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy}


def make_policy(policy: str | CachePolicy | None) -> CachePolicy:
    """A policy instance from a name ("lru", "lfu", ...), an instance, or None (the default).

    The default is LFU with aging (policies.py), the best on held-out text, never on the tuning
    trace: at a 25% budget 0.65 of Belady's hit rate against LRU's 0.50 on the 1500-step routing
    model (0.81 vs 0.66 on the 250-step one; bench/RESULTS.md, issue 9).
    """
    if policy is None:
        from .policies import LFUPolicy  # policies.py builds on this module

        return LFUPolicy()
    if isinstance(policy, CachePolicy):
        return policy
    try:
        return POLICIES[str(policy).lower()]()
    except KeyError:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}") from None
