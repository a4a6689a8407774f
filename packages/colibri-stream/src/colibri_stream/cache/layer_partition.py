"""A per-layer partitioned cache: each MoE layer owns a fixed share of the slots.

`LayerPartitionedPolicy(inner)` gives every MoE layer `capacity // layers` slots (the remainder
spread evenly over the stack) and its own instance of an inner policy; a miss in layer L evicts
only among layer L's experts, and only once L holds its share. This is how llama.cpp's expert
cache and other streaming runtimes partition: no layer can flush another, and a decode step,
which visits the layers in a loop, finds each layer's recent experts where it left them. A
global cache can instead give a popular layer more slots; which one wins is a property of the
routing, measured by `colibri-stream policy-study`.

A partition needs at least one slot per MoE layer (`bind` refuses fewer): a layer with no slot
could not hold the expert it is computing. Every event goes to one layer's inner policy, so
each costs what the inner policy costs on a cache of that layer's size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from .policy import CachePolicy, ExpertKey, nothing_to_evict


def layer_shares(capacity: int, layers: Sequence[int]) -> dict[int, int]:
    """`capacity` slots over `layers`: floor(capacity / n) each, the remainder spread evenly."""
    n = len(layers)
    base, extra = divmod(capacity, n)
    # layer i gets one more where the running share of the remainder crosses an integer
    return {layer: base + ((i + 1) * extra // n - i * extra // n) for i, layer in enumerate(layers)}


class LayerPartitionedPolicy(CachePolicy):
    """Each layer's own `inner()` policy over its own share of the slots."""

    def __init__(self, inner: Callable[[], CachePolicy], name: str | None = None) -> None:
        self._make_inner = inner
        self.name = name or f"{inner().name}-per-layer"
        self.shares: dict[int, int] = {}
        self._inner: dict[int, CachePolicy] = {}
        self._held: dict[int, int] = {}

    def fewest_slots(self, layers: int) -> int:
        return layers  # one per layer

    def bind(self, capacity: int, layers: Sequence[int]) -> None:
        layers = sorted(set(layers))
        if capacity < self.fewest_slots(len(layers)):  # (an all-dense model has no layer and never inserts)
            raise ValueError(
                f"a per-layer cache needs at least one slot per MoE layer ({len(layers)}); the budget gives "
                f"{capacity}: raise the budget or use a global policy"
            )
        self.shares = layer_shares(capacity, layers) if layers else {}
        self._inner = {layer: self._make_inner() for layer in layers}
        for layer, policy in self._inner.items():
            policy.bind(self.shares[layer], [layer])
        self._held = dict.fromkeys(layers, 0)

    def _layer(self, key: ExpertKey) -> int:
        if key[0] not in self._inner:
            known = f"layers {min(self._inner)}..{max(self._inner)}" if self._inner else "no MoE layers"
            raise KeyError(f"expert {key} is of a layer this per-layer cache has no share for ({known})")
        return key[0]

    def begin_step(self, step: int) -> None:
        for policy in self._inner.values():
            policy.begin_step(step)

    def needs_room(self, incoming: ExpertKey, cached: int, capacity: int) -> bool:
        layer = self._layer(incoming)
        return self._held[layer] >= self.shares[layer] or cached >= capacity

    def slots_for_layer(self, layer: int, capacity: int) -> int:
        return self.shares[layer]

    def on_insert(self, key: ExpertKey) -> None:
        layer = self._layer(key)
        self._held[layer] += 1
        self._inner[layer].on_insert(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._inner[self._layer(key)].on_hit(key)

    def on_remove(self, key: ExpertKey) -> None:
        layer = self._layer(key)
        self._held[layer] -= 1
        self._inner[layer].on_remove(key)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        """With no incoming expert to make room for: from the layer furthest over its share."""
        layer = max(self._held, key=lambda i: (self._held[i] - self.shares[i], -i))
        return self._victim_in(layer, pinned)

    def victim_for(self, incoming: ExpertKey, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        return self._victim_in(self._layer(incoming), pinned)

    def _victim_in(self, layer: int, pinned: Collection[ExpertKey]) -> ExpertKey:
        if self._held[layer] == 0:
            raise nothing_to_evict()
        return self._inner[layer].victim(pinned)
