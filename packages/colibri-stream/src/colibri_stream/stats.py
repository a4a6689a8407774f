"""What the engine did: cache hits and misses, bytes read, time in I/O vs compute, memory.

One mutable `StreamStats` per engine, updated in place by the expert cache and the streamed
experts; `to_dict()` gives a JSON-ready snapshot (the CLI's `--json` and the benchmark read
it); `reset()` starts a new measurement window without touching the cache's contents.

The optional routing trace records, per forward pass ("step") and MoE layer, the distinct
experts requested in the order they were requested: exactly the access sequence the cache
saw, which an offline replay (Belady's MIN, other policies) needs to compare hit rates on the
same routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .traces.events import TraceEvent

STATS_VERSION = "1.1"  # of `to_dict()`; see STATS.md


@dataclass
class LayerCounters:
    """One MoE layer's share of the `StreamStats` counters of the same names."""

    hits: int = 0
    misses: int = 0
    prefetch_actual: int = 0
    prefetch_correct: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_correct / self.prefetch_actual if self.prefetch_actual else 0.0


@dataclass
class StreamStats:
    """Counters of one engine since the last `reset()` (memory figures are current values)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_read_os: int | None = None  # /proc/self/io read_bytes over the same window (None: unavailable)
    io_agreement: str = ""  # "agree" | "served from page cache" | "re-read under pressure" (io/accounting.py)
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_actual: int = 0  # experts the layers used where a prediction had been made
    prefetch_correct: int = 0  # of those, how many had been predicted one layer ahead
    io_seconds: float = 0.0  # reading blobs (misses and prefetches that the compute waited for)
    verify_seconds: float = 0.0  # CRC-32 + repacking into the compute layout
    compute_seconds: float = 0.0  # routed-expert matmuls
    forward_seconds: float = 0.0  # whole forward passes (attention, shared experts, head included)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    layers: dict[int, LayerCounters] = field(default_factory=dict)
    # memory, set by the engine (current, not reset)
    ram_budget_bytes: int = 0
    resident_bytes: int = 0
    kv_cache_bytes: int = 0
    staging_bytes: int = 0
    workspace_bytes: int = 0
    cache_capacity_bytes: int = 0
    cache_bytes: int = 0
    cache_slots: int = 0
    cached_experts: int = 0
    io_mode: str = ""  # "direct" (O_DIRECT) or "buffered" (fallback)
    filesystem: str = ""  # of the container file; "tmpfs" means no read reaches storage
    compute_mode: str = ""
    policy: str = ""
    prefetch: str = "off"
    record_trace: bool = False
    trace: list[TraceEvent] = field(default_factory=list)

    def layer(self, index: int) -> LayerCounters:
        counters = self.layers.get(index)
        if counters is None:
            counters = self.layers[index] = LayerCounters()
        return counters

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_correct / self.prefetch_actual if self.prefetch_actual else 0.0

    def reset(self) -> None:
        """Zero the counters and the trace (memory figures and modes are kept)."""
        keep = {
            name: getattr(self, name)
            for name in (
                "ram_budget_bytes",
                "resident_bytes",
                "kv_cache_bytes",
                "staging_bytes",
                "workspace_bytes",
                "cache_capacity_bytes",
                "cache_bytes",
                "cache_slots",
                "cached_experts",
                "io_mode",
                "filesystem",
                "compute_mode",
                "policy",
                "record_trace",
                "prefetch",
            )
        }
        fresh = StreamStats(**keep)
        self.__dict__.update(fresh.__dict__)

    def to_dict(self, include_trace: bool = False) -> dict:
        mb = 1e6
        out = {
            "stats_version": STATS_VERSION,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 6),
            "bytes_read": self.bytes_read,
            "bytes_read_os": self.bytes_read_os,
            "io_agreement": self.io_agreement,
            "evictions": self.evictions,
            "prefetch_issued": self.prefetch_issued,
            "prefetch_used": self.prefetch_used,
            "prefetch_wasted": self.prefetch_wasted,
            "prefetch_accuracy": round(self.prefetch_accuracy, 6),
            "prefetch_actual": self.prefetch_actual,
            "prefetch_correct": self.prefetch_correct,
            "io_seconds": round(self.io_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "compute_seconds": round(self.compute_seconds, 6),
            "forward_seconds": round(self.forward_seconds, 6),
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "steps": self.steps,
            "per_layer_hit_rate": {str(i): round(c.hit_rate, 6) for i, c in sorted(self.layers.items())},
            "per_layer": {
                str(i): {"hits": c.hits, "misses": c.misses} for i, c in sorted(self.layers.items())
            },
            "ram_budget_mb": round(self.ram_budget_bytes / mb, 3),
            "resident_mb": round(self.resident_bytes / mb, 3),
            "kv_cache_mb": round(self.kv_cache_bytes / mb, 3),
            "staging_mb": round(self.staging_bytes / mb, 3),
            "workspace_mb": round(self.workspace_bytes / mb, 3),
            "cache_capacity_mb": round(self.cache_capacity_bytes / mb, 3),
            "cache_mb": round(self.cache_bytes / mb, 3),
            "cache_slots": self.cache_slots,
            "cached_experts": self.cached_experts,
            "io_mode": self.io_mode,
            "filesystem": self.filesystem,
            "compute_mode": self.compute_mode,
            "policy": self.policy,
            "prefetch": self.prefetch,
        }
        if include_trace:
            out["trace"] = [[e.step, e.layer, list(e.experts)] for e in self.trace]
        return out
