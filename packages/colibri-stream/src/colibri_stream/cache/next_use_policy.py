"""`NextUsePolicy` ("next-use"): evict the expert whose expected next use is furthest per chance of use.

A decode step visits the MoE layers in a loop, so an expert of layer l can next be used only when
the loop reaches l again: `d` layer-steps from now (the layer just computed is furthest; the one
being computed, d = 0, is protected). Whether it is used then is a guess `p` from its own past:

    p = 0.4 * (used at its layer's last visit) + 0.5 * (aged share of its layer's visits it was used in) + 0.1

(reuse by the very next token is the one strong signal of real routing: 40% on Mixtral-8x7B's
held-out trace against 27% if tokens were independent; the aged share, with a half-life of 32
visits of the layer, is its popularity). Expected next use in layer-steps is then
`d + layers * (1 - p) / p`, and the victim is the expert of least *hit density*,
p / expected next use: little chance of a hit per slot-step held. Ties: the larger d, then the
expert used longer ago. Weights and form were chosen on Mixtral's GSM8K routing and reported on
its HumanEval routing (bench/RESULTS.md): 0.51 / 0.64 / 0.79 of Belady at 10 / 25 / 50% of the
experts, against lru-layer's 0.42 / 0.65 / 0.76.

Cost: the aged share is kept lazily (each use adds `growth ** visit` instead of every count
decaying at every visit), so between two visits of a layer its experts' order is fixed. Each
layer keeps the experts not used at its last visit in a heap on (aged count, last use) and the
few used at it (top-k) in a set; its least-dense expert is the better of the heap's top and that
set's minimum, cached until the layer changes. An eviction compares one candidate per layer:
O(layers + top-k) per eviction, O(log n) per other event, independent of the cache's size; a
layer's heap is rebuilt from its live entries when outdated ones outnumber them, so it holds at
most about twice its experts.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Sequence

from .policy import CachePolicy, ExpertKey, nothing_to_evict

USED_LAST_VISIT, SHARE, FLOOR = 0.4, 0.5, 0.1  # p's weights
HALF_LIFE_VISITS = 32.0
RESCALE_AT = 2.0**200
COMPACT_SLACK = 64  # heap entries a layer may hold beyond twice its experts before it is rebuilt


class _Layer:
    """One MoE layer's statistics and its cached experts."""

    __slots__ = ("visit", "weight", "visits", "counts", "step", "recent", "stale", "best")

    def __init__(self) -> None:
        self.visit = 0  # visits so far
        self.weight = 1.0  # growth ** visit, rescaled
        self.visits = 0.0  # aged visit count, in units of `weight`
        self.counts: dict[ExpertKey, float] = {}  # aged uses per expert, in units of `weight`; kept after eviction
        self.step = None  # the forward pass of the last visit
        self.recent: set[ExpertKey] = set()  # cached experts used at the last (or current) visit
        self.stale: list[tuple[float, int, ExpertKey]] = []  # (count, last use, key) of the others
        self.best = None  # cached candidate (p, last use, key), None when to be recomputed


class NextUsePolicy(CachePolicy):
    """Least hit density (p / expected next use in layer-steps); see the module docstring."""

    name = "next-use"

    def __init__(self, half_life: float = HALF_LIFE_VISITS) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0 visits, got {half_life}")
        self.growth = 2.0 ** (1.0 / half_life)
        self._layers: dict[int, _Layer] = {}
        self._position: dict[int, int] = {}  # layer -> its place in the loop
        self._last_visit: dict[ExpertKey, int] = {}
        self._last_use: dict[ExpertKey, int] = {}  # cached keys only
        self._clock = 0
        self._step = None
        self._current = None  # the layer touched last

    def bind(self, capacity: int, layers: Sequence[int]) -> None:
        self._position = {layer: i for i, layer in enumerate(sorted(set(layers)))}

    def begin_step(self, step: int) -> None:
        self._step = step

    # --- statistics ------------------------------------------------------------------------
    def _layer(self, layer: int) -> _Layer:
        state = self._layers.get(layer)
        if state is None:
            state = self._layers[layer] = _Layer()
            if layer not in self._position:  # a layer bind did not name: after the known ones
                self._position[layer] = len(self._position)
        return state

    def _begin_visit(self, layer: int, state: _Layer) -> None:
        state.step = self._step
        state.visit += 1
        state.weight *= self.growth
        state.visits += state.weight
        for key in state.recent:  # no longer used at the last visit: into the ordered part
            heapq.heappush(state.stale, (state.counts[key], self._last_use[key], key))
        state.recent.clear()
        state.best = None
        if state.weight > RESCALE_AT:
            self._rescale(state)
        elif len(state.stale) > 2 * len(state.counts) + COMPACT_SLACK:
            self._compact(state)

    def _compact(self, state: _Layer) -> None:
        # The heap drops its outdated entries only as evictions reach them, so where nothing is
        # evicted (every expert cached) it grew by top-k entries a visit: 143 MB after 2000 tokens
        # of a 48-layer top-8 model. Rebuilt from the live entries, one per cached expert, when
        # outdated ones outnumber them: O(experts of one layer) per that many visits, the same victims.
        state.stale = [(c, self._last_use[k], k) for k, c in state.counts.items() if k in self._last_use]
        heapq.heapify(state.stale)

    def _rescale(self, state: _Layer) -> None:
        # O(experts of one layer), once per ~6400 visits of it
        state.counts = {key: count / state.weight for key, count in state.counts.items()}
        state.visits /= state.weight
        state.weight = 1.0
        state.stale = [(c, self._last_use[k], k) for k, c in state.counts.items() if k in self._last_use]
        heapq.heapify(state.stale)

    def _touch(self, key: ExpertKey) -> None:
        layer = key[0]
        state = self._layer(layer)
        if state.step != self._step or state.visit == 0:
            self._begin_visit(layer, state)
        if self._last_visit.get(key) != state.visit:
            self._last_visit[key] = state.visit
            state.counts[key] = state.counts.get(key, 0.0) + state.weight
        self._clock += 1
        self._last_use[key] = self._clock
        state.recent.add(key)
        state.best = None
        self._current = layer

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_hit(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        if self._last_use.pop(key, None) is not None:
            state = self._layers[key[0]]
            state.recent.discard(key)
            state.best = None

    def chance(self, key: ExpertKey) -> float:
        """p: the estimated chance `key` is used at its layer's next visit."""
        state = self._layers.get(key[0])
        if state is None or not state.visits:
            return FLOOR
        used_last = self._last_visit.get(key) == state.visit
        return USED_LAST_VISIT * used_last + SHARE * state.counts.get(key, 0.0) / state.visits + FLOOR

    # --- eviction --------------------------------------------------------------------------
    def _candidate(self, state: _Layer, pinned: Collection[ExpertKey]):
        """(p, last use, key) of the layer's least likely cached expert not in `pinned`, or None."""
        best = None
        passed = []
        while state.stale:
            count, last_use, key = state.stale[0]
            if self._last_use.get(key) != last_use or key in state.recent or state.counts[key] != count:
                heapq.heappop(state.stale)  # stale entry: used again, evicted or rescaled since
                continue
            if key in pinned:
                passed.append(heapq.heappop(state.stale))
                continue
            best = (self.chance(key), last_use, key)
            break
        for entry in passed:
            heapq.heappush(state.stale, entry)
        for key in state.recent:  # top-k of them
            if key not in pinned:
                option = (self.chance(key), self._last_use[key], key)
                if best is None or option[:2] < best[:2]:
                    best = option
        return best

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        return self._victim(pinned, self._current)

    def victim_for(self, incoming: ExpertKey, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        # the layer being computed is the incoming expert's, even before it is first touched
        self._layer(incoming[0])
        return self._victim(pinned, incoming[0])

    def _victim(self, pinned: Collection[ExpertKey], current: int | None) -> ExpertKey:
        n = len(self._position)
        here = self._position.get(current, 0)
        chosen, chosen_rank = None, None
        for layer, state in self._layers.items():
            if state.best is None:
                state.best = self._candidate(state, ())
            candidate = state.best
            if candidate is not None and candidate[2] in pinned:
                candidate = self._candidate(state, pinned)
            if candidate is None:
                continue
            p, last_use, key = candidate
            distance = (self._position[layer] - here) % n
            expected = distance + n * (1.0 - p) / p
            density = p / expected if expected > 0 else math.inf
            rank = (density, -distance, last_use)
            if chosen_rank is None or rank < chosen_rank:
                chosen, chosen_rank = key, rank
        if chosen is None:
            raise nothing_to_evict()
        return chosen
