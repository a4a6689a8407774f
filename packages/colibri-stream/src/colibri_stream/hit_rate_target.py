"""The smallest budget whose expert cache reaches a hit rate on a routing trace.

The cache's hits depend only on the access sequence, the policy and the slot count (every
policy here is deterministic; cache/replay.py reproduces the live engine exactly), so a recorded
routing trace (traces/ROUTING_TRACE.md) answers "how much RAM for 80% hits" without running the
model: replay the trace with the serving policy at a slot count, and binary-search the count.

NOTE: binary search assumes the hit rate grows with the slots. That holds for LRU (a stack
algorithm: a bigger cache always holds what a smaller one would) but not provably for LFU with
aging, whose ranking ties can flip; the answer is therefore replayed once more and reported
with the hit rate it really reaches, never just the target. A target above what even a cache of
every expert reaches (the first use of each expert always misses) is reported as unreachable,
with that ceiling.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from .cache.policies import CachePolicy, make_policy
from .cache.replay import replay
from .plan import Plan
from .traces.events import TraceEvent
from .traces.routing_trace import RoutingTrace


@dataclass(frozen=True)
class HitRateTarget:
    """The answer for one target.

    Attributes:
        target: the hit rate asked for, in [0, 1].
        policy: the cache policy replayed.
        slots, budget: the smallest slot count (and its RAM budget) that reaches the target;
            None when unreachable.
        hit_rate: what the trace's replay reaches at `slots` (at every expert when unreachable).
        ceiling: the hit rate with a slot for every expert (only first uses miss).
        accesses: expert lookups in the trace.
    """

    target: float
    policy: str
    slots: int | None
    budget: int | None
    hit_rate: float
    ceiling: float
    accesses: int
    trace_top_k: int

    @property
    def reachable(self) -> bool:
        return self.slots is not None

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "policy": self.policy,
            "reachable": self.reachable,
            "slots": self.slots,
            "budget": self.budget,
            "hit_rate": round(self.hit_rate, 6),
            "ceiling": round(self.ceiling, 6),
            "accesses": self.accesses,
            "trace_top_k": self.trace_top_k,
        }


def budget_for_hit_rate(plan: Plan, trace: RoutingTrace, target: float,
                        policy: str | CachePolicy | None = None, source: str = "the trace") -> HitRateTarget:
    """Replay `trace` under `policy` (default: the engine's) and find the least budget of `plan`
    whose cache reaches `target`. Raises ValueError when the trace is of another model shape."""
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"hit-rate target must be in [0, 1], got {target}")
    f = plan.footprint
    header = trace.header
    n_moe_layers = f.total_experts // f.n_experts if f.n_experts else 0
    if (header.n_moe_layers, header.n_experts) != (n_moe_layers, f.n_experts):
        raise ValueError(
            f"{source}: routing trace of {header.n_moe_layers} MoE layers x {header.n_experts} experts, "
            f"but {plan.path} has {n_moe_layers} x {f.n_experts}"
        )
    events: Sequence[TraceEvent] = trace.events
    if not events:
        raise ValueError(f"{source}: the routing trace has no events")
    template = make_policy(policy)

    def hit_rate(slots: int) -> float:
        return replay(copy.deepcopy(template), events, slots).hit_rate

    low, high = max(1, f.working_set_slots), max(1, f.total_experts)
    low = max(low, template.fewest_slots(n_moe_layers))  # a per-layer cache needs one slot per layer
    ceiling = hit_rate(high)
    accesses = sum(len(e.experts) for e in events)
    if ceiling < target:
        return HitRateTarget(target, template.name, None, None, ceiling, ceiling, accesses, header.top_k)
    while low < high:  # the least slot count reaching the target (see NOTE on monotonicity)
        middle = (low + high) // 2
        if hit_rate(middle) >= target:
            high = middle
        else:
            low = middle + 1
    reached = hit_rate(low)
    return HitRateTarget(target, template.name, low, plan.budget_for_slots(low), reached, ceiling, accesses,
                         header.top_k)
