"""Fault knobs of the fake Hub: the failures a real Hub shows, injected on purpose.

Each knob is a probability in [0, 1] drawn per request of its kind, plus a queue of one-shot
faults (`inject("commit_500_after_apply", n=2)`) for deterministic tests. Counters record every
fault actually injected, so a chaos run can report them.

| knob                          | effect                                                        |
|-------------------------------|---------------------------------------------------------------|
| commit_drop_request_before_apply | the request dies after its body: nothing applied, no reply |
| commit_drop_reply_after_apply | the commit lands, then the connection closes with no reply    |
| commit_500_after_apply        | the commit lands, then the client gets HTTP 500               |
| commit_504_after_apply        | the commit lands, then the client gets HTTP 504               |
| commit_late_apply             | the client gets 504 at once; the commit applies `late_apply_s` later (lock held) |
| commit_409                    | the commit is refused as if the repo's commit lock were busy  |
| commit_429                    | the commit is refused with 429 and RateLimit / Retry-After    |
| stale_head_read               | every read of `main` (info, refs, commits, tree, paths-info, preupload, resolve) sees an older head |
| commit_drops_file             | the commit lands without one of its files (payload, not RELAY.json) |
| tag_409                       | create_tag answers 409 (ref lock busy) and creates nothing    |
| stale_tags_read               | the refs listing shows the tags as they were before the last  |
| latency_s                     | every request sleeps uniformly in [0, latency_s]               |
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field

KINDS = ("commit_drop_request_before_apply", "commit_drop_reply_after_apply", "commit_500_after_apply",
         "commit_504_after_apply", "commit_late_apply", "commit_409", "commit_429", "stale_head_read",
         "tag_409", "stale_tags_read", "commit_drops_file")


@dataclass
class FaultKnobs:
    commit_drop_request_before_apply: float = 0.0
    commit_drop_reply_after_apply: float = 0.0
    commit_504_after_apply: float = 0.0
    commit_late_apply: float = 0.0
    late_apply_s: float = 1.0
    commit_500_after_apply: float = 0.0
    commit_409: float = 0.0
    commit_429: float = 0.0
    stale_head_read: float = 0.0
    tag_409: float = 0.0
    commit_drops_file: float = 0.0
    stale_tags_read: float = 0.0
    latency_s: float = 0.0
    retry_after_s: int = 1
    seed: int | None = None
    injected: Counter = field(default_factory=Counter)
    _queue: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self._rng.seed(self.seed)

    def set(self, **knobs: float) -> None:
        for name, value in knobs.items():
            if name not in KINDS and name not in ("latency_s", "retry_after_s", "late_apply_s"):
                raise ValueError(f"unknown fault knob {name!r}; known: {', '.join(KINDS)}, latency_s")
            setattr(self, name, value)

    def inject(self, kind: str, n: int = 1) -> None:
        """Force the next `n` requests of `kind` to fail that way."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        with self._lock:
            self._queue[kind] += n

    def fire(self, kind: str) -> bool:
        with self._lock:
            if self._queue[kind] > 0:
                self._queue[kind] -= 1
                hit = True
            else:
                hit = self._rng.random() < getattr(self, kind)
            if hit:
                self.injected[kind] += 1
            return hit

    def delay(self) -> float:
        with self._lock:
            return self._rng.uniform(0, self.latency_s) if self.latency_s > 0 else 0.0

    def as_json(self) -> dict:
        with self._lock:
            return {
                "knobs": {k: getattr(self, k) for k in (*KINDS, "latency_s", "retry_after_s", "late_apply_s")},
                "injected": dict(self.injected),
            }
