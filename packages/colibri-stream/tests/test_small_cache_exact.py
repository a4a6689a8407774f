"""A cache too small for more than one token's experts gives the bits of one holding every expert.

A decode token computes its top-k experts of a layer together (one kernel pass over all of them),
so every one must stay in its slot until the pass: a miss must not evict an expert the token got
before it, or the slab slot is refilled under it and the pass runs another expert's weights. Where
the cache cannot hold the token's experts at once (a per-layer share smaller than top-k), they
run one at a time instead, with the same bits. Checked here with top-2 routing at the smallest
budgets, for every serving policy and for a policy that would evict exactly the held expert.
"""

from __future__ import annotations

from collections.abc import Collection

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.cache.policies import serving_policy_names
from colibri_stream.cache.policy import CachePolicy, ExpertKey, nothing_to_evict

from .conftest import build_container

PROMPT = [(i * 37) % 500 + 3 for i in range(12)]
STEPS = 12


@pytest.fixture(scope="module")
def top2(tmp_path_factory):
    """The tiny model serving top-2 (3 MoE layers x 16 experts), int4 experts, int8 resident."""
    container, _ = build_container(tmp_path_factory.mktemp("top2"), QuantScheme(group_size=32, resident_dtype="int8"),
                                   seed=5, top_k_infer=2)
    return container


class NewestFirst(CachePolicy):
    """Evicts the expert inserted last: the one a token just got, unless it is held."""

    name = "newest-first"

    def __init__(self):
        self.order: list[ExpertKey] = []

    def on_insert(self, key):
        self.order.append(key)

    def on_hit(self, key):
        pass

    def on_remove(self, key):
        self.order.remove(key)

    def victim(self, pinned: Collection[ExpertKey] = ()) -> ExpertKey:
        for key in reversed(self.order):
            if key not in pinned:
                return key
        raise nothing_to_evict()


def teacher_forced(engine: Engine) -> list[torch.Tensor]:
    """The logits after the prompt and after each of STEPS fixed tokens, one decode step each."""
    session = engine.session()
    session.append(PROMPT)
    out = [session.last_logits().clone()]
    for token in range(40, 40 + STEPS):
        session.append([token])
        out.append(session.last_logits().clone())
    return out


def _open(container, budget, policy, compute, dtype="f32", prefetch="off"):
    return Engine.open(container, ram_budget=budget, cache_policy=policy, compute=compute, dtype=dtype,
                       max_context=64, prefill_chunk=8, prefetch=prefetch)


@pytest.mark.parametrize("compute", ["native", "int4"])
def test_every_policy_at_its_smallest_cache_gives_the_full_cache_bits(top2, compute):
    with _open(top2, "400MB", None, compute) as full:
        expected = teacher_forced(full)
        slot = full.budget.slot_bytes
        uses = full.stats.hits + full.stats.misses
    plan = Engine.plan(top2, compute=compute, dtype="f32", max_context=64, prefill_chunk=8, prefetch="off")
    for policy in serving_policy_names() + [NewestFirst()]:
        name = getattr(policy, "name", policy)
        # a global cache at its least (top-k = 2 slots); a per-layer one at one slot per layer (3):
        # a share of 1 < top-2, so each token's experts of a layer run one at a time
        slots = 3 if str(name).endswith("per-layer") else 2
        with _open(top2, plan.min_budget + (slots - 2) * slot, policy, compute) as small:
            assert small.budget.slots == slots
            got = teacher_forced(small)
            assert small.stats.evictions > 0
            assert small.stats.hits + small.stats.misses == uses, name  # each use counted once, either way
        for step, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), (name, step, float((a - b).abs().max()))


def test_a_bf16_engine_at_its_smallest_cache_gives_the_full_cache_bits(top2):
    with _open(top2, "400MB", None, "native", "bf16") as full:
        expected = teacher_forced(full)
    plan = Engine.plan(top2, compute="native", dtype="bf16", max_context=64, prefill_chunk=8, prefetch="off")
    with _open(top2, plan.min_budget, NewestFirst(), "native", "bf16") as small:
        got = teacher_forced(small)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_miss_never_evicts_an_expert_the_caller_holds(top2):
    plan = Engine.plan(top2, compute="native", dtype="f32", max_context=64, prefill_chunk=8, prefetch="off")
    with _open(top2, plan.min_budget, NewestFirst(), "native") as eng:
        cache = eng.cache
        assert cache.capacity == 2
        first, second = cache.get_layer(1, [3, 7])
        # the newest-first policy would have evicted expert 3 for expert 7: it was held instead
        assert (1, 3) in cache and (1, 7) in cache
        assert cache.get(1, 3) is first and cache.get(1, 7) is second
        # holding both slots, a third expert has nowhere to go: refused, the cache as it was
        misses = eng.stats.misses
        with pytest.raises(LookupError):
            cache.get(2, 0, hold=[(1, 3), (1, 7)])
        assert eng.stats.misses == misses and set(cache.keys()) == {(1, 3), (1, 7)}
        with pytest.raises(LookupError):
            cache.get_layer(2, [0, 1, 2])  # three experts at once in two slots


def test_a_decode_step_of_several_rows_at_the_smallest_cache_gives_the_full_cache_bits(top2):
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    ids = torch.tensor([[1, 4], [4, 9], [2, 11]])  # five distinct experts, top-2 a row
    gates = torch.rand(3, 2)
    outs = []
    for budget, policy in (("400MB", None), (None, NewestFirst()), (None, "lru-per-layer")):
        if budget is None:
            plan = Engine.plan(top2, compute="native", dtype="f32", max_context=64, prefill_chunk=8, prefetch="off")
            budget = plan.min_budget + (plan.slot_bytes if policy == "lru-per-layer" else 0)
        with _open(top2, budget, policy, "native") as eng:
            outs.append(eng.model.layers[2].moe.experts(x, ids, gates))
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


@pytest.mark.parametrize("policy", ["lru", "newest-first"])
def test_prefetched_arrivals_at_the_smallest_cache_keep_the_full_cache_bits(top2, policy):
    """With the read-ahead workers on (needed reads started early, guesses of the next layer), at
    the smallest cache: the same bits."""
    with _open(top2, "400MB", None, "native") as full:
        expected = teacher_forced(full)
    plan = Engine.plan(top2, compute="native", dtype="f32", max_context=64, prefill_chunk=8, prefetch="on")
    chosen = NewestFirst() if policy == "newest-first" else policy
    with _open(top2, plan.min_budget, chosen, "native", prefetch="on") as small:
        assert small.opened_plan.prefetch == "on" and small.budget.slots == 2
        got = teacher_forced(small)
        assert small.stats.prefetch_issued + small.stats.misses > 0
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_prefetched_arrival_never_evicts_an_expert_the_caller_holds(top2):
    plan = Engine.plan(top2, compute="native", dtype="f32", max_context=64, prefill_chunk=8, prefetch="on")
    with _open(top2, plan.min_budget, NewestFirst(), "native", prefetch="on") as eng:
        cache = eng.cache
        cache.clear()
        cache.get(2, 0)
        held = cache.get(1, 3)  # the newest: the victim the policy would choose
        assert cache.prefetcher.issue([(1, 7)]) == 1  # a guessed read, in flight or done
        cache.get(1, 7, hold=[(1, 3)])  # stored on arrival, then used
        assert set(cache.keys()) == {(1, 3), (1, 7)} and cache.get(1, 3) is held
