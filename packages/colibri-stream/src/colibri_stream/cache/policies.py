"""Eviction policies for the expert cache: ONE registry of every policy, and `make_policy`.

The interface is `policy.CachePolicy` (the events a cache sends and the cost rule every policy
keeps: O(1) or O(log n) per event, no scan of the cache); the policies live by family:

- recency_policies.py: "lru" (global), "lru-layer" (LRU inside the fullest layer), "pinned"
  (a hot set from a warm-up trace, offered to studies only);
- frequency_policy.py: "lfu", least frequently used with aging;
- next_use_policy.py: "next-use", least hit density (chance of use over expected next use, the
  layer loop of a decode step counted);
- layer_partition.py: any of them per layer, each MoE layer owning its share of the slots
  ("lru-per-layer", "lfu-per-layer").

`POLICIES` is the one registry: name -> `PolicySpec` (a factory of a warm-up trace and the
slot count, and whether it needs that trace). The engine's `cache_policy=` names, the CLI's
`--cache-policy` choices (`serving_policy_names()`) and the policy study all read it. Every
policy here is deterministic, so replaying a routing trace offline (cache.replay) gives exactly
the hits the live engine would get, which is how `colibri-stream policy-study` compares them
with Belady's MIN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..traces.events import TraceEvent
from .frequency_policy import LFUPolicy
from .layer_partition import LayerPartitionedPolicy
from .next_use_policy import NextUsePolicy
from .policy import CachePolicy, ExpertKey
from .recency_policies import LayerLRUPolicy, LRUPolicy, PinnedLRUPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CachePolicy",
    "ExpertKey",
    "LFUPolicy",
    "LRUPolicy",
    "LayerLRUPolicy",
    "LayerPartitionedPolicy",
    "NextUsePolicy",
    "PinnedLRUPolicy",
    "PolicySpec",
    "make_policy",
    "serving_policy_names",
]

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
    NextUsePolicy.name: PolicySpec(lambda warmup, slots: NextUsePolicy()),
    "lru-per-layer": PolicySpec(lambda warmup, slots: LayerPartitionedPolicy(LRUPolicy, "lru-per-layer")),
    "lfu-per-layer": PolicySpec(lambda warmup, slots: LayerPartitionedPolicy(LFUPolicy, "lfu-per-layer")),
    PinnedLRUPolicy.name: PolicySpec(lambda warmup, slots: PinnedLRUPolicy.from_trace(warmup, slots), True),
}
# next-use: the best serving policy on real routing (Mixtral-8x7B's HumanEval trace, weights chosen
# on its GSM8K one: 0.51 / 0.64 / 0.79 of Belady at 10 / 25 / 50% of the experts, against lru-layer's
# 0.42 / 0.65 / 0.76 and LFU's 0.42 / 0.54 / 0.73), and on a Qwen3-30B-shaped trace (0.81 against
# 0.77); per-layer partitions lose to the global cache on both
DEFAULT_POLICY = NextUsePolicy.name


def serving_policy_names() -> list[str]:
    """The names the engine and the CLI accept (those that need no warm-up trace)."""
    return [name for name, spec in POLICIES.items() if not spec.needs_warmup_trace]


def make_policy(policy: str | CachePolicy | None) -> CachePolicy:
    """A policy instance from a name ("lru", "lfu", ...), an instance, or None (the default,
    `DEFAULT_POLICY`, chosen by replaying real routing; bench/RESULTS.md has the study)."""
    if isinstance(policy, CachePolicy):
        return policy
    name = DEFAULT_POLICY if policy is None else str(policy).lower()
    if name not in serving_policy_names():
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(serving_policy_names())}")
    return POLICIES[name].factory((), 0)
