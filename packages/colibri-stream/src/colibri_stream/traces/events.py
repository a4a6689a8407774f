"""`TraceEvent`: one forward pass's expert requests in one MoE layer, the unit of every trace.

The engine records them (`record_trace=True`), routing trace files hold them (ROUTING_TRACE.md),
and the cache replay and policy studies consume them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TraceEvent:
    """The distinct experts one forward pass (`step`) requested in one MoE layer, in order.

    `request` optionally names the request (prompt, conversation) the pass served, so a trace
    of several requests can be split between them (`RoutingTrace.split`); None when unknown
    or when the pass batched several requests."""

    step: int
    layer: int
    experts: tuple[int, ...]
    request: int | None = None
