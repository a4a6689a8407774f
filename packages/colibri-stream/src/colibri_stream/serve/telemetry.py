"""The `colibri` extension object: what streaming the experts cost one request.

Every response (OpenAI chat, completions and responses; Anthropic messages) carries, beside
`usage`, an object `colibri` with the engine's own counters (STATS.md) taken over the request's
lifetime, and the request's own timings:

| key | meaning |
|---|---|
| `expert_hits`, `expert_misses`, `expert_hit_rate` | routed-expert lookups served by the cache / read from disk |
| `bytes_read` | bytes the engine read for expert blobs (misses and prefetches) |
| `bytes_read_os` | `/proc/self/io` `read_bytes` grown over the same window (null where unreadable) |
| `io_wait_seconds` | time the model's thread spent reading blobs or waiting on prefetches |
| `compute_seconds`, `forward_seconds` | routed-expert matmuls; whole forward passes |
| `prefill_tokens`, `decode_tokens`, `forward_passes` | tokens run as prompt / one at a time; passes |
| `ttft_seconds`, `seconds` | request start to its first token; to its last |
| `tokens_per_s` | generated tokens (all choices) / `seconds` |
| `concurrent_requests` | the most other requests in flight at once during this one |

The engine's counters are shared by every request (one expert cache): when
`concurrent_requests` is 0 the figures are this request's alone; otherwise they include the
passes of the requests that ran beside it (forward passes interleave token by token), and say so.
The delta is two snapshots of `StreamStats`, O(1) per request.
"""

from __future__ import annotations

import threading
import time

COUNTERS = ("hits", "misses", "bytes_read", "io_seconds", "compute_seconds", "forward_seconds",
            "prefill_tokens", "decode_tokens", "steps")


class InFlight:
    """The server's count of requests in flight, and each request's peak of others beside it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}  # request id -> most others seen in flight
        self._next = 0

    def enter(self) -> int:
        with self._lock:
            ident, self._next = self._next, self._next + 1
            for other in self._open:
                self._open[other] = max(self._open[other], len(self._open))
            self._open[ident] = len(self._open)
            return ident

    def leave(self, ident: int) -> int:
        with self._lock:
            return self._open.pop(ident, 0)


class RequestTelemetry:
    """Snapshots the engine's stats when a request starts; `mark_token()` at each token,
    `finish(generated)` at the end gives the `colibri` object."""

    def __init__(self, engine, in_flight: InFlight | None = None):
        self.engine, self.in_flight = engine, in_flight
        self.began = time.perf_counter()
        self.first_token: float | None = None
        self.before = self._counters()
        self.ident = in_flight.enter() if in_flight is not None else None
        self.report: dict | None = None

    def _counters(self) -> dict:
        stats = self.engine.stats
        out = {name: getattr(stats, name) for name in COUNTERS}
        out["bytes_read_os"] = stats.bytes_read_os
        return out

    def mark_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def finish(self, generated: int) -> dict:
        if self.report is not None:
            return self.report
        seconds = time.perf_counter() - self.began
        after = self._counters()
        delta = {k: after[k] - self.before[k] for k in COUNTERS}
        os_bytes = None
        if after["bytes_read_os"] is not None and self.before["bytes_read_os"] is not None:
            os_bytes = after["bytes_read_os"] - self.before["bytes_read_os"]
        others = self.in_flight.leave(self.ident) if self.in_flight is not None else 0
        lookups = delta["hits"] + delta["misses"]
        self.report = {
            "expert_hits": delta["hits"], "expert_misses": delta["misses"],
            "expert_hit_rate": round(delta["hits"] / lookups, 6) if lookups else None,
            "bytes_read": delta["bytes_read"], "bytes_read_os": os_bytes,
            "io_wait_seconds": round(delta["io_seconds"], 6),
            "compute_seconds": round(delta["compute_seconds"], 6),
            "forward_seconds": round(delta["forward_seconds"], 6),
            "prefill_tokens": delta["prefill_tokens"], "decode_tokens": delta["decode_tokens"],
            "forward_passes": delta["steps"],
            "ttft_seconds": round(self.first_token - self.began, 6) if self.first_token is not None else None,
            "seconds": round(seconds, 6),
            "tokens_per_s": round(generated / seconds, 4) if seconds > 0 else 0.0,
            "concurrent_requests": others,
        }
        return self.report
