"""Continuous batching of sessions: the decode steps that sessions on different threads ask for
at the same time run as ONE forward pass of [B, 1] tokens.

A server streams each request on its own thread and session (one KV cache each). Run one at a
time, eight streaming clients share one client's tokens/s: every decode step reads the experts
its token routes to, and at full RAM a decode step is bound by reading weights. Run together,
each distinct expert of the step is read once for all B tokens (StreamedExperts' batch-union),
and the dense layers and the LM head see B rows at once.

How the steps meet (flat combining, no scheduler thread): a session's decode token goes into a
queue; one waiting thread becomes the step's leader, takes the runner's lock, waits until every
session that is generating (`DecodeCombiner.generating`, entered by the decode loop) has queued
its token or `gather_s` has passed, and runs the queued tokens (at most `prefill_chunk`, the
workspace the budget holds) as one pass; the others wait for their logits and go on sampling on
their own threads. A session arriving while a step runs joins the next one: requests enter and
leave the batch between steps, whatever their lengths. A long prompt's prefill runs chunk by
chunk, and between its chunks the decode steps queued meanwhile run (`serve_waiting`), so the
streams already generating keep getting tokens while a new request reads its prompt.

What each row computes: its own attention over its own KV cache (`SessionRows` stands for the
B caches; every attention layer runs its rows one at a time, so a row's attention is the code
and the bits of the session alone, sliding windows and latent caches included; a layer with a
`forward_rows`, the native decode attention, takes the rows' projections at once and the rest
row by row); every other layer (norms, router, experts, shared expert, LM head) takes the B
rows at once. With the native kernels (`compute="native"`, what auto picks on AVX2 CPUs) each row
gets the bits it gets alone, in steps of up to 16 sessions (the router routes that many rows one
by one: compute/native_decode.py, `RowwiseRouter`; tested: tests/test_step_combiner.py), so an
answer does not depend on who else is being served; with torch's kernels, or more rows, they
agree to float rounding, as a batch of prompts does (batch_decode.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_GATHER_S = 0.005
"""How long a step's leader waits for generating sessions that have not queued their token yet
(a thread still sampling or writing its last token to a client). Waiting ends as soon as all
have queued: the bound only matters when one is slow, and then costs the others this per step."""


LOCK_POLL_S = 0.002
"""How often a step's leader retries the runner's lock while another pass holds it (it is woken
at once when a prefill runs its step between chunks)."""


class SessionRows:
    """The KV caches of B sessions as the cache of one [B, 1] pass through colibri-model's forward.

    The model reads `length` (the pass's first position, for its RoPE tables) and adds the pass's
    tokens to it at the end, which adds them to every row; attention layers take `rows` one by one
    (`install_row_attention`). Positions are given to the forward explicitly, one per row."""

    def __init__(self, caches: list):
        self.rows = caches

    @property
    def length(self) -> int:
        return max(kv.length for kv in self.rows)

    @length.setter
    def length(self, value: int) -> None:
        added = value - self.length
        for kv in self.rows:
            kv.length += added


class _RowwiseAttention:
    """Mixed into an attention layer's class: a `SessionRows` cache runs each row alone, with the
    row's own cache and position (1-D, as a session's pass gives it); anything else as before."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache=None, attention_mask=None):
        if not isinstance(cache, SessionRows):
            return super().forward(x, positions, cache, attention_mask)
        if attention_mask is not None or x.shape[1] != 1 or positions.shape != (x.shape[0], 1):
            raise ValueError("a SessionRows pass is one token per row, with a position per row and no mask")
        together = getattr(super(), "forward_rows", None)  # a layer that can take the rows' projections at once
        if together is not None and (out := together(x, positions, cache.rows)) is not None:
            return out
        return torch.cat([super(_RowwiseAttention, self).forward(x[i : i + 1], positions[i], kv, None)
                          for i, kv in enumerate(cache.rows)])


_ROWWISE_CLASSES: dict[type, type] = {}


def install_row_attention(model: nn.Module) -> None:
    """Let every attention layer of `model` (colibri-model's `layers[i].attn`, whatever its class)
    take a `SessionRows` cache. Same parameters and names; only each module's class changes, to a
    subclass of the one it had. Idempotent."""
    for block in model.layers:
        kind = type(block.attn)
        if issubclass(kind, _RowwiseAttention):
            continue
        if kind not in _ROWWISE_CLASSES:
            _ROWWISE_CLASSES[kind] = type(f"Rowwise{kind.__name__}", (_RowwiseAttention, kind), {})
        block.attn.__class__ = _ROWWISE_CLASSES[kind]


@dataclass
class _Step:
    """One session's decode token waiting for its pass, and what the pass gave it."""

    kv: object
    token: int
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class DecodeCombiner:
    """Runs concurrent sessions' decode steps as one pass (module docstring). `run_rows(caches,
    tokens)` is the pass itself: fp32 logits [B, V] for one token after each cache, on the
    caller's lock; the combiner takes `lock` (the runner's) around it."""

    def __init__(self, lock, run_rows, max_rows: int, gather_s: float = DEFAULT_GATHER_S):
        self.lock, self.run_rows, self.max_rows, self.gather_s = lock, run_rows, max(1, max_rows), gather_s
        self._queue: list[_Step] = []
        self._state = threading.Condition()
        self._leading = False
        self._generating = 0
        self.passes = 0  # combined passes run, and the rows they held (rows / passes: the mean batch)
        self.rows = 0

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around a session's decode loop: while inside, a step's leader waits (up to `gather_s`)
        for this session's next token before it runs the step."""
        with self._state:
            self._generating += 1
        try:
            yield
        finally:
            with self._state:
                self._generating -= 1
                self._state.notify_all()  # a leader may be waiting for this session

    def step(self, kv, token: int) -> torch.Tensor:
        """The fp32 logits [V] after `token` appended to `kv` (its room reserved by the caller),
        computed in a pass with whatever other sessions queued theirs meanwhile."""
        mine = _Step(kv, token)
        with self._state:
            self._queue.append(mine)
            self._state.notify_all()
        while True:
            with self._state:
                while not mine.done and self._leading:
                    self._state.wait()
                if mine.done:
                    break
                self._leading = True
            self._lead(mine)  # runs this step, unless another pass took it or more than a pass takes were queued
        if mine.error is not None:
            raise mine.error
        return mine.logits

    def serve_waiting(self) -> None:
        """Run the decode steps queued now, without waiting for more: called between the chunks of
        a long prefill by the thread running it (which holds `lock`), so streams that are
        generating get a token per chunk instead of stalling for the whole prompt."""
        with self._state:
            batch, self._queue = self._queue[: self.max_rows], self._queue[self.max_rows :]
        self._run(batch)

    def _lead(self, mine: _Step) -> None:
        batch: list[_Step] = []
        try:
            if not self._lock_unless_served(mine):
                return
            try:
                batch = self._gather(mine)
                self._run(batch, mark=False)
            finally:
                self.lock.release()
        finally:
            with self._state:
                for s in batch:
                    s.done = True
                self._leading = False
                self._state.notify_all()

    def _lock_unless_served(self, mine: _Step) -> bool:
        """Take `lock`, or return False as soon as `mine` is done without it: a prefill holding the
        lock runs queued steps between its chunks (`serve_waiting`), and a leader blocked on the
        lock would not see its step done until the whole prompt had run."""
        while not self.lock.acquire(blocking=False):
            with self._state:
                if mine.done:
                    return False
                self._state.wait(LOCK_POLL_S)
        return True

    def _run(self, batch: list[_Step], mark: bool = True) -> None:
        """One pass of `batch` (the caller holds `lock`); `mark`: set the steps done and wake them."""
        if not batch:
            return
        self.passes += 1
        self.rows += len(batch)
        try:
            logits = self.run_rows([s.kv for s in batch], [s.token for s in batch])
            for i, s in enumerate(batch):
                s.logits = logits[i]
        except BaseException as exc:  # every row of the pass sees why it failed
            for s in batch:
                s.error = exc
        if mark:
            with self._state:
                for s in batch:
                    s.done = True
                self._state.notify_all()

    def _gather(self, mine: _Step) -> list[_Step]:
        """The leader's batch: wait until every generating session has queued (or `gather_s`),
        then take the queue's first `max_rows` steps, oldest first; none when a prefill's
        `serve_waiting` already ran the leader's own step while it waited for the lock."""
        deadline = time.monotonic() + self.gather_s
        with self._state:
            if mine.done:
                return []
            while len(self._queue) < min(self._generating, self.max_rows):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state.wait(left)
            batch, self._queue = self._queue[: self.max_rows], self._queue[self.max_rows :]
        return batch
