"""Extra eviction policies: their choices on hand-made sequences, Belady as their ceiling, and
exact agreement between the live engine and the offline replay the benchmark relies on."""

from __future__ import annotations

import pytest
from colibri_stream import Engine, belady, replay
from colibri_stream.cache.policies import POLICIES, LayerLRUPolicy, LFUPolicy, PinnedLRUPolicy
from colibri_stream.traces.events import TraceEvent


def events(*steps):
    """steps: lists of (layer, expert) accesses, one list per forward pass."""
    return [TraceEvent(s, layer, (expert,)) for s, accesses in enumerate(steps) for layer, expert in accesses]


def test_layer_lru_evicts_from_the_fullest_layer():
    policy = LayerLRUPolicy()
    for key in [(1, 0), (1, 1), (1, 2), (2, 0)]:
        policy.on_insert(key)
    policy.on_hit((1, 0))
    assert policy.victim() == (1, 1)  # layer 1 holds 3, its least recent is (1, 1)
    assert policy.victim(pinned={(1, 1), (1, 2), (1, 0)}) == (2, 0)
    policy.on_remove((1, 1))
    policy.on_remove((1, 2))
    assert policy.victim() in {(1, 0), (2, 0)}
    with pytest.raises(LookupError):
        policy.victim(pinned={(1, 0), (2, 0)})


def test_lfu_keeps_frequent_experts_and_ages_counts():
    policy = LFUPolicy(half_life=2)
    cached = set()
    for key in [(1, 0), (1, 0), (1, 0), (1, 1)]:
        (policy.on_hit if key in cached else policy.on_insert)(key)
        cached.add(key)
    policy.on_insert((1, 2))
    assert policy.victim() == (1, 1)  # count 1, older than (1, 2)
    policy.on_remove((1, 1))
    policy.on_insert((1, 1))  # comes back: its count survived eviction -> 2
    assert policy.count((1, 1)) == 2.0
    assert policy.victim() == (1, 2)
    assert policy.count((1, 0)) == 3.0
    policy.begin_step(1)
    policy.begin_step(2)
    assert policy.count((1, 0)) == 1.5  # halved once per half_life passes
    policy.on_hit((1, 2))  # 1/2 + 1: now above (1, 1)'s 2/2
    assert policy.victim() == (1, 1)
    assert policy.victim(pinned={(1, 1)}) == (1, 0)  # 1.5 each: the one used longer ago
    with pytest.raises(LookupError):
        policy.victim(pinned={(1, 0), (1, 1), (1, 2)})
    with pytest.raises(ValueError):
        LFUPolicy(half_life=0)


def test_pinned_policy_pins_the_warmup_hot_set():
    warmup = events([(1, 5)], [(1, 5)], [(1, 5)], [(1, 3)], [(1, 3)], [(1, 7)])
    policy = PinnedLRUPolicy.from_trace(warmup, capacity=4, share=0.5)
    assert policy.hot == {(1, 5), (1, 3)}
    for key in [(1, 5), (1, 3), (1, 7), (1, 8)]:
        policy.on_insert(key)
    assert policy.victim() == (1, 7)  # (1, 5) is older but pinned
    assert policy.victim(pinned={(1, 7), (1, 8)}) == (1, 5)  # only pinned ones left: plain LRU
    with pytest.raises(ValueError):
        PinnedLRUPolicy.from_trace(warmup, 4, share=1.5)


def test_every_policy_is_bounded_by_belady():
    import random

    rng = random.Random(3)
    # skewed routing: a hot set per layer plus noise
    trace = [TraceEvent(s, layer, tuple(sorted({rng.choice([0, 1, 2]) if rng.random() < 0.7 else rng.randrange(16)})))
             for s in range(300) for layer in (1, 2, 3)]
    for capacity in (3, 8, 20):
        ceiling = belady(trace, capacity)
        for name, spec in POLICIES.items():
            got = replay(spec.factory(trace[:150], capacity), trace, capacity)
            assert got.hits + got.misses == ceiling.hits + ceiling.misses
            assert got.hits <= ceiling.hits, (name, capacity)


@pytest.mark.parametrize("name", ["lru-layer", "lfu", "next-use", "lru-per-layer", "pinned"])
def test_live_engine_matches_offline_replay(tiny, minimum_budget, name):
    prompt = list(range(300, 340))
    with Engine.open(tiny[0], ram_budget="200MB", record_trace=True) as eng:
        eng.generate(prompt, 12, stop_token_ids=[])
        warmup = list(eng.stats.trace)
    base = minimum_budget(tiny[0])
    plan = Engine.plan(tiny[0], base)
    budget, capacity = base + 9 * plan.slot_bytes, plan.budget.slots + 9
    policy = POLICIES[name].factory(warmup, capacity)
    with Engine.open(tiny[0], ram_budget=budget, cache_policy=policy, record_trace=True) as eng:
        assert eng.budget.slots == capacity
        eng.generate(prompt[::-1], 12, stop_token_ids=[])
        live, trace = eng.stats, list(eng.stats.trace)
    offline = replay(POLICIES[name].factory(warmup, capacity), trace, capacity)
    assert (offline.hits, offline.misses) == (live.hits, live.misses)
    assert live.misses > capacity  # the budget really forced evictions


def test_policies_are_available_by_name(tiny):
    from colibri_stream import POLICIES, make_policy

    assert {"lru", "lfu", "lru-layer"} <= set(POLICIES)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with Engine.open(tiny[0], ram_budget="200MB", cache_policy="lru-layer") as eng:
        assert eng.stats.policy == "lru-layer"
        eng.generate("hello", 2, stop_token_ids=[])


def test_one_registry_feeds_engine_cli_and_studies():
    from colibri_stream import make_policy, serving_policy_names
    from colibri_stream.cli import main

    # the engine's names are the registry's minus those that need a warm-up trace
    assert set(serving_policy_names()) == {n for n, s in POLICIES.items() if not s.needs_warmup_trace}
    assert "pinned" in POLICIES and "pinned" not in serving_policy_names()
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("pinned")
    # the CLI offers exactly the serving names
    option = next(p for p in main.commands["generate"].params if p.name == "cache_policy")
    assert list(option.type.choices) == serving_policy_names()
