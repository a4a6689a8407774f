"""What the engine did: cache hits and misses, bytes read, time in I/O vs compute, memory.

One mutable `StreamStats` per engine, updated in place by the expert cache and the streamed
experts; `to_dict()` gives a JSON-ready snapshot (the CLI's `--json` and the benchmarks read
it); `reset()` starts a new measurement window without touching the cache's contents.

The stats JSON is declared once, here: each dataclass field says how it is reported
(`count`, `seconds`, `megabytes`, `setting`, or not at all) and each derived figure is a
`reported` property. `to_dict()` walks that declaration, and report.py builds the reader's
pydantic models from the same walk (`report_fields`), so writer and reader cannot drift apart;
STATS.md documents every key and a test holds the two sets equal.

The optional routing trace records, per forward pass ("step") and MoE layer, the distinct
experts requested in the order they were requested: exactly the access sequence the cache
saw, which an offline replay (Belady's MIN, other policies) needs to compare hit rates on the
same routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from .traces.events import TraceEvent

STATS_VERSION = "1.1"  # of `to_dict()`; see STATS.md. 1.1 added the per-layer prefetch figures and the OS byte count.
MB = 1e6


# --- the declaration vocabulary ------------------------------------------------------------
# `since`: the stats version that added the key; a reader defaults it in older reports.
def count(since: str = "1.0"):
    """An int counter, zeroed by `reset()`, reported under its own name."""
    return field(default=0, metadata={"report": "count", "since": since})


def seconds():
    """A float time counter, zeroed by `reset()`, reported rounded to microseconds."""
    return field(default=0.0, metadata={"report": "seconds", "since": "1.0"})


def measured(kind: Any, default: Any, since: str):
    """A value measured over the window (cleared by `reset()`), reported under its name as `kind`."""
    return field(default=default, metadata={"report": "measured", "kind": kind, "since": since})


def megabytes():
    """A current size in bytes, kept by `reset()`, reported as `NAME_mb` (10^6 bytes)."""
    return field(default=0, metadata={"report": "megabytes", "since": "1.0", "kept": True})


def setting(default: Any = "", *, reported: bool = True):
    """A mode or current value set by the engine, kept by `reset()`."""
    return field(default=default, metadata={"report": "setting" if reported else None, "since": "1.0", "kept": True})


class reported:  # noqa: N801 - used as a decorator, like `property`
    """A derived figure (a read-only property) that `to_dict()` writes under its name."""

    def __init__(self, kind: type, since: str = "1.0"):
        self.kind, self.since = kind, since

    def __call__(self, compute: Callable[[Any], Any]) -> reported:
        self.compute = compute
        self.__doc__ = compute.__doc__
        return self

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else self.compute(obj)

    def __set__(self, obj, value) -> None:  # read-only, like a property
        raise AttributeError(f"{self.name} is derived from the counters")


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


@dataclass(frozen=True)
class ReportedField:
    """One key of the stats JSON: its name, the type a reader validates, and when it appeared."""

    key: str
    kind: Any
    since: str
    value: Callable[[Any], Any]
    optional: bool = False  # written only on request (`to_dict(include_trace=True)`); reader default None


def report_fields(cls: type) -> list[ReportedField]:
    """The JSON keys `cls.to_dict()` writes, in order, from the declaration on `cls`."""
    out = []
    for f in fields(cls):
        how, since = f.metadata.get("report"), f.metadata.get("since", "1.0")
        if how in ("count", "setting"):
            out.append(ReportedField(f.name, type(f.default), since, lambda s, n=f.name: getattr(s, n)))
        elif how == "measured":
            out.append(ReportedField(f.name, f.metadata["kind"], since, lambda s, n=f.name: getattr(s, n)))
        elif how == "seconds":
            out.append(ReportedField(f.name, float, since, lambda s, n=f.name: round(getattr(s, n), 6)))
        elif how == "megabytes":
            key = f.name.removesuffix("_bytes") + "_mb"
            out.append(ReportedField(key, float, since, lambda s, n=f.name: round(getattr(s, n) / MB, 3)))
        elif how == "per_layer":
            out.append(ReportedField("per_layer_hit_rate", dict[str, float], since,
                                     lambda s: {str(i): round(c.hit_rate, 6) for i, c in sorted(s.layers.items())}))
            out.append(ReportedField("per_layer", dict[str, LayerCounters], since,
                                     lambda s: {str(i): c.to_dict() for i, c in sorted(s.layers.items())}))
        elif how == "trace":  # [[step, layer, [experts...]], ...]
            out.append(ReportedField("trace", list[tuple[int, int, list[int]]] | None, since,
                                     lambda s: [[e.step, e.layer, list(e.experts)] for e in s.trace], optional=True))
    for name, attr in vars(cls).items():
        if isinstance(attr, reported):
            out.append(ReportedField(name, attr.kind, attr.since, lambda s, n=name: round(getattr(s, n), 6)))
    return out


def _snapshot(obj, include_optional: bool = False) -> dict:
    return {f.key: f.value(obj) for f in report_fields(type(obj)) if include_optional or not f.optional}


# --- the stats ---------------------------------------------------------------------------------
@dataclass
class LayerCounters:
    """One MoE layer's share of the `StreamStats` counters of the same names."""

    hits: int = count()
    misses: int = count()
    prefetch_actual: int = count(since="1.1")
    prefetch_correct: int = count(since="1.1")

    @reported(float, since="1.1")
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.hits + self.misses)

    @reported(float, since="1.1")
    def prefetch_accuracy(self) -> float:
        return _ratio(self.prefetch_correct, self.prefetch_actual)

    def to_dict(self) -> dict:
        return _snapshot(self)


@dataclass
class StreamStats:
    """Counters of one engine since the last `reset()` (memory figures are current values)."""

    hits: int = count()
    misses: int = count()
    bytes_read: int = count()
    # /proc/self/io read_bytes over the same window (None: the OS gives none) and the verdict on the
    # two: "agree" | "served from page cache" | "re-read under pressure" | "unavailable" (io/accounting.py)
    bytes_read_os: int | None = measured(int | None, None, since="1.1")
    io_agreement: str = measured(str, "", since="1.1")
    evictions: int = count()
    prefetch_issued: int = count()
    prefetch_used: int = count()
    prefetch_wasted: int = count()
    prefetch_actual: int = count()  # experts the layers used where a prediction had been made
    prefetch_correct: int = count()  # of those, how many had been predicted one layer ahead
    io_seconds: float = seconds()  # reading blobs (misses and prefetches that the compute waited for)
    verify_seconds: float = seconds()  # CRC-32 + repacking into the compute layout
    compute_seconds: float = seconds()  # routed-expert matmuls
    forward_seconds: float = seconds()  # whole forward passes (attention, shared experts, head included)
    prefill_tokens: int = count()
    decode_tokens: int = count()
    steps: int = count()
    layers: dict[int, LayerCounters] = field(default_factory=dict, metadata={"report": "per_layer", "since": "1.0"})
    # memory, set by the engine (current, not reset)
    ram_budget_bytes: int = megabytes()
    resident_bytes: int = megabytes()
    kv_cache_bytes: int = megabytes()
    staging_bytes: int = megabytes()
    workspace_bytes: int = megabytes()
    cache_capacity_bytes: int = megabytes()
    cache_bytes: int = megabytes()
    cache_slots: int = setting(0)
    cached_experts: int = setting(0)
    io_mode: str = setting()  # "direct" (O_DIRECT) or "buffered" (fallback)
    filesystem: str = setting()  # of the container file; "tmpfs" means no read reaches storage
    compute_mode: str = setting()
    policy: str = setting()
    prefetch: str = setting("off")
    record_trace: bool = setting(False, reported=False)
    trace: list[TraceEvent] = field(default_factory=list, metadata={"report": "trace", "since": "1.0"})

    def layer(self, index: int) -> LayerCounters:
        counters = self.layers.get(index)
        if counters is None:
            counters = self.layers[index] = LayerCounters()
        return counters

    @reported(float)
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.hits + self.misses)

    @reported(float)
    def prefetch_accuracy(self) -> float:
        return _ratio(self.prefetch_correct, self.prefetch_actual)

    def reset(self) -> None:
        """Zero the counters and the trace (memory figures and modes are kept)."""
        keep = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("kept")}
        self.__dict__.update(StreamStats(**keep).__dict__)

    def to_dict(self, include_trace: bool = False) -> dict:
        return {"stats_version": STATS_VERSION, **_snapshot(self, include_optional=include_trace)}
