"""The O(log n) policies against readable references that scan every cached expert.

Each reference is the obvious definition (a full scan per eviction); the registry's policies
must choose the same victim at every eviction of long random event sequences with pinned sets,
and a partitioned cache must keep every layer inside its share."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from colibri_stream import LayerPartitionedPolicy, replay
from colibri_stream.cache.layer_partition import layer_shares
from colibri_stream.cache.policies import POLICIES, LayerLRUPolicy, LFUPolicy, LRUPolicy, PinnedLRUPolicy
from colibri_stream.traces.events import TraceEvent


class ScanLFU:
    """LFU by definition: halve every count each half_life passes, evict the lowest count
    (ties: least recently used), scanning every cached key."""

    def __init__(self, half_life=64):
        self.half_life, self.count, self.recency, self.steps = half_life, {}, OrderedDict(), 0

    def begin_step(self, step):
        self.steps += 1
        if self.steps % self.half_life == 0:
            self.count = {k: c / 2 for k, c in self.count.items() if c >= 1 / 64 or k in self.recency}

    def touch(self, key):
        self.count[key] = self.count.get(key, 0.0) + 1.0
        self.recency[key] = None
        self.recency.move_to_end(key)

    on_insert = on_hit = touch

    def on_remove(self, key):
        self.recency.pop(key, None)

    def victim(self, pinned=()):
        candidates = [k for k in self.recency if k not in pinned]  # oldest first
        if not candidates:
            raise LookupError
        return min(candidates, key=lambda k: self.count.get(k, 0.0))  # min keeps the first on ties


class ScanLayerLRU:
    def __init__(self):
        self.order = OrderedDict()

    def begin_step(self, step):
        pass

    def on_insert(self, key):
        self.order[key] = None
        self.order.move_to_end(key)

    on_hit = on_insert

    def on_remove(self, key):
        self.order.pop(key, None)

    def victim(self, pinned=()):
        sizes = {}
        for layer, _ in self.order:
            sizes[layer] = sizes.get(layer, 0) + 1
        for layer in sorted(sizes, key=lambda i: (-sizes[i], i)):
            for key in self.order:
                if key[0] == layer and key not in pinned:
                    return key
        raise LookupError


class ScanPinnedLRU(ScanLayerLRU):
    def __init__(self, hot):
        super().__init__()
        self.hot = set(hot)

    def victim(self, pinned=()):
        for want_hot in (False, True):
            for key in self.order:
                if key not in pinned and (key in self.hot) == want_hot:
                    return key
        raise LookupError


def same_victim(fast, slow, incoming, pinned):
    want = slow.victim(pinned)  # LookupError when everything is pinned
    assert fast.victim(pinned) == want
    return want


def drive(fast, slow, seed, layers=5, experts=12, capacity=17, passes=400, pick=same_victim):
    """Random routing through a cache of `capacity` slots; at each eviction `pick` checks the two
    policies against each other and returns the victim, with the running layer's experts sometimes
    pinned (as a prefetched arrival does). Returns the number of evictions."""
    rng = random.Random(seed)
    cached: set = set()
    evictions = 0
    for step in range(passes):
        fast.begin_step(step)
        slow.begin_step(step)
        for layer in range(layers):
            hot = [rng.randrange(3) for _ in range(2)]  # a skewed layer: three popular experts
            wanted = {rng.choice(hot) if rng.random() < 0.6 else rng.randrange(experts) for _ in range(3)}
            pinned = {(layer, e) for e in wanted} if rng.random() < 0.5 else set()
            for expert in sorted(wanted):
                key = (layer, expert)
                if key in cached:
                    fast.on_hit(key)
                    slow.on_hit(key)
                    continue
                while len(cached) >= capacity:
                    try:
                        want = pick(fast, slow, key, pinned)
                    except LookupError:
                        with pytest.raises(LookupError):
                            fast.victim(pinned)
                        pinned = set()
                        continue
                    assert want in cached and want not in pinned, (step, layer, evictions)
                    cached.discard(want)
                    fast.on_remove(want)
                    slow.on_remove(want)
                    evictions += 1
                cached.add(key)
                fast.on_insert(key)
                slow.on_insert(key)
    assert evictions > passes  # the sequence really exercised eviction
    return evictions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lfu_chooses_the_victims_of_a_full_scan(seed):
    drive(LFUPolicy(half_life=8), ScanLFU(half_life=8), seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_lfu_rescales_its_weights_and_still_agrees(seed):
    import colibri_stream.cache.frequency_policy as frequency

    original = frequency.RESCALE_AT
    frequency.RESCALE_AT = 2.0**6  # rescale every few epochs instead of every 256
    try:
        drive(LFUPolicy(half_life=3), ScanLFU(half_life=3), seed)
    finally:
        frequency.RESCALE_AT = original


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_lru_chooses_the_victims_of_a_full_scan(seed):
    drive(LayerLRUPolicy(), ScanLayerLRU(), seed)


def test_pinned_lru_chooses_the_victims_of_a_full_scan():
    hot = [(layer, e) for layer in range(5) for e in (0, 1)]
    drive(PinnedLRUPolicy(hot), ScanPinnedLRU(hot), seed=4)


def test_layer_shares_spread_the_remainder_and_sum_to_capacity():
    shares = layer_shares(70, list(range(1, 33)))
    assert sum(shares.values()) == 70 and set(shares.values()) == {2, 3}
    assert layer_shares(64, list(range(32))) == dict.fromkeys(range(32), 2)
    ones = [layer for layer, n in layer_shares(40, list(range(32))).items() if n == 2]
    assert len(ones) == 8 and max(b - a for a, b in zip(ones, ones[1:])) == 4  # spread, not bunched


def test_a_partitioned_cache_evicts_inside_the_incoming_layer():
    policy = LayerPartitionedPolicy(LRUPolicy)
    policy.bind(5, [1, 2])
    assert policy.shares == {1: 2, 2: 3} and policy.name == "lru-per-layer"
    for key in [(1, 0), (1, 1), (2, 0)]:
        policy.on_insert(key)
    assert not policy.needs_room((2, 1), cached=3, capacity=5)  # layer 2 has room
    assert policy.needs_room((1, 2), cached=3, capacity=5)  # layer 1 holds its 2
    assert policy.victim_for((1, 2)) == (1, 0)
    assert policy.victim_for((1, 2), pinned={(1, 0)}) == (1, 1)
    with pytest.raises(LookupError):
        policy.victim_for((1, 2), pinned={(1, 0), (1, 1)})
    with pytest.raises(KeyError, match="layers 1..2"):
        policy.needs_room((7, 0), 3, 5)
    with pytest.raises(ValueError, match="one slot per MoE layer"):
        LayerPartitionedPolicy(LRUPolicy).bind(3, [1, 2, 3, 4])
    LayerPartitionedPolicy(LRUPolicy).bind(1, [])  # an all-dense model: no layer, nothing to refuse


@pytest.mark.parametrize("name", ["lru-per-layer", "lfu-per-layer"])
def test_a_partitioned_replay_never_lets_a_layer_exceed_its_share(name):
    rng = random.Random(5)
    trace = [TraceEvent(s, layer, tuple(sorted(rng.sample(range(16), 2)))) for s in range(200) for layer in (1, 2, 3)]
    policy = POLICIES[name].factory((), 10)
    held: dict[int, int] = {}
    original_insert, original_remove = policy.on_insert, policy.on_remove

    def on_insert(key):
        held[key[0]] = held.get(key[0], 0) + 1
        assert held[key[0]] <= policy.shares[key[0]]
        original_insert(key)

    def on_remove(key):
        held[key[0]] -= 1
        original_remove(key)

    policy.on_insert, policy.on_remove = on_insert, on_remove
    result = replay(policy, trace, 10)
    assert policy.shares == {1: 3, 2: 3, 3: 4} and sum(held.values()) == 10
    assert 0 < result.hits < result.hits + result.misses


def test_a_cache_smaller_than_one_token_warns_and_a_partitioned_one_still_hits(tiny, minimum_budget):
    import warnings

    from colibri_stream import Engine, SmallCacheWarning

    base = minimum_budget(tiny[0])
    plan = Engine.plan(tiny[0], base)
    layers = plan.footprint.total_experts // plan.footprint.n_experts
    budget = base + (layers - 1 - plan.budget.slots) * plan.slot_bytes  # one slot short of a token
    with pytest.warns(SmallCacheWarning, match=f"fewer than one decode token uses .{layers} MoE layers x top-1"):
        with Engine.open(tiny[0], ram_budget=budget, cache_policy="lru") as eng:
            assert eng.budget.slots == layers - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallCacheWarning)
        with Engine.open(tiny[0], ram_budget="200MB", cache_policy="lru") as eng:
            pass
    with pytest.raises(ValueError, match="one slot per MoE layer"):
        Engine.open(tiny[0], ram_budget=budget, cache_policy="lru-per-layer")
    with Engine.open(tiny[0], ram_budget=budget + 2 * plan.slot_bytes, cache_policy="lru-per-layer") as eng:
        eng.generate("Once upon a time there was", 12, stop_token_ids=[])
        assert eng.stats.policy == "lru-per-layer" and eng.stats.hits > 0


def test_the_policy_study_marks_a_budget_a_per_layer_cache_refuses():
    from colibri_stream.studies.cache_studies import format_policy_study, policy_study

    rng = random.Random(2)
    trace = [TraceEvent(s, layer, (rng.randrange(8),)) for s in range(60) for layer in (1, 2, 3, 4)]
    study = policy_study(trace[:120], trace[120:], total_experts=32, n_experts=8, top_k=1, fractions=[0.1, 0.5])
    small, large = study["points"]
    assert small["cache_slots"] == 3 and small["heldout"]["lru-per-layer"]["hit_rate"] is None
    assert "one slot per MoE layer" in small["heldout"]["lru-per-layer"]["refused"]
    assert large["heldout"]["lru-per-layer"]["hit_rate"] > 0
    assert any("lru-per-layer n/a" in line for line in format_policy_study(study))


class ScanNextUse:
    """next-use by definition: every count decays at each visit of its layer, and each eviction
    scores every cached expert (density p / (d + L (1 - p) / p))."""

    def __init__(self, layers, half_life=32.0):
        self.position = {layer: i for i, layer in enumerate(layers)}
        self.decay = 0.5 ** (1.0 / half_life)
        self.freq, self.visits, self.visit, self.last_visit, self.seen = {}, {}, {}, {}, {}
        self.last_use, self.clock, self.step, self.current = {}, 0, None, None

    def begin_step(self, step):
        self.step = step

    def touch(self, key):
        layer = key[0]
        if self.seen.get(layer, "never") != self.step or layer not in self.visit:
            self.seen[layer] = self.step
            self.visit[layer] = self.visit.get(layer, 0) + 1
            self.visits[layer] = self.visits.get(layer, 0.0) * self.decay + 1.0
            for k in self.freq:
                if k[0] == layer:
                    self.freq[k] *= self.decay
        if self.last_visit.get(key) != self.visit[layer]:
            self.last_visit[key] = self.visit[layer]
            self.freq[key] = self.freq.get(key, 0.0) + 1.0
        self.clock += 1
        self.last_use[key] = self.clock
        self.current = layer

    on_insert = on_hit = touch

    def on_remove(self, key):
        self.last_use.pop(key, None)

    def density(self, key, current):
        layer = key[0]
        p = 0.4 * (self.last_visit[key] == self.visit[layer]) + 0.5 * self.freq[key] / self.visits[layer] + 0.1
        n = len(self.position)
        d = (self.position[layer] - self.position[current]) % n
        expected = d + n * (1 - p) / p
        return p / expected if expected > 0 else float("inf")

    def victim_for(self, incoming, pinned=()):
        keys = [k for k in self.last_use if k not in pinned]
        if not keys:
            raise LookupError
        return min(keys, key=lambda k: self.density(k, incoming[0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_use_chooses_a_least_dense_expert_as_a_full_scan_does(seed):
    from colibri_stream.cache.policies import NextUsePolicy

    layers = list(range(5))
    fast, slow = NextUsePolicy(half_life=4.0), ScanNextUse(layers, half_life=4.0)
    fast.bind(17, layers)
    same = [0]

    def least_dense(fast, slow, incoming, pinned):
        best = slow.victim_for(incoming, pinned)  # LookupError when everything is pinned
        chosen = fast.victim_for(incoming, pinned)
        # the same expert, or one of equal density (ties go by age, not by the scan's order)
        assert slow.density(chosen, incoming[0]) == pytest.approx(slow.density(best, incoming[0]), rel=1e-9)
        same[0] += chosen == best
        return chosen

    evictions = drive(fast, slow, seed, pick=least_dense)
    assert same[0] > 0.5 * evictions


def test_next_use_holds_a_bounded_heap_where_nothing_is_evicted_and_picks_the_same_victims(monkeypatch):
    """Every expert cached (full RAM): each visit adds the last visit's experts to their layer's heap
    and no eviction ever pops the outdated entries, so the heap is rebuilt from its live ones; the
    rebuilt heap picks the victims the unbounded one picks."""
    import random

    from colibri_stream.cache import next_use_policy
    from colibri_stream.cache.policies import NextUsePolicy

    def run(policy: NextUsePolicy) -> tuple[int, list]:
        rng = random.Random(0)
        for step in range(600):
            policy.begin_step(step)
            for layer in range(6):
                for expert in rng.sample(range(32), 4):
                    key = (layer, expert)
                    policy.on_hit(key) if key in policy._last_use else policy.on_insert(key)
        entries = sum(len(state.stale) for state in policy._layers.values())
        victims = []
        for _ in range(40):
            victim = policy.victim()
            victims.append(victim)
            policy.on_remove(victim)
        return entries, victims

    bounded, victims = run(NextUsePolicy())
    assert bounded <= 6 * (2 * 32 + next_use_policy.COMPACT_SLACK)  # not 600 visits x 4 a layer
    monkeypatch.setattr(next_use_policy, "COMPACT_SLACK", 10**9)
    unbounded, expected = run(NextUsePolicy())
    assert unbounded > 6 * 500 and victims == expected
