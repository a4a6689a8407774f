"""Prefetch: predict the next MoE layer's experts and read them while this layer computes.

Prediction applies the *next* layer's norm and router (its weights and selection bias, top_k)
to this layer's residual stream plus this layer's shared-expert output, `h + shared(x)`: the
residual changes little from one layer to the next, so the next router's choice on it is a good
guess (an open C engine reports 71.6% one layer ahead on OLMoE). Adding the shared expert, which
colibri-model runs before the routed ones, and using the next layer's own norm gain are what a
cheap guess can know of the next layer's input before the routed experts have run: on held-out
text (bench/RESULTS.md) that raised accuracy over the router-on-this-layer's-input guess.
Forward hooks on each MoE block's `ffn_norm` (input: h) and `moe.shared` (output) hand the
predictor those tensors. `RoutingPredictor` makes the guess and measures it: when the next layer
runs, the share of its actual experts that were predicted is `prefetch_accuracy`.

`Prefetcher` reads predicted experts on worker threads (`fetch_expert`: O_DIRECT read, CRC,
repack, each worker with its own page-aligned buffer), at most `threads` at a time. Finished
experts wait in their futures until the model's thread next asks the cache for anything; then
they are stored (`ExpertCache.insert_prefetched`), never evicting the experts the current layer
is using. A demand for an expert still in flight waits for that read instead of issuing another.

The same workers also read ahead what is *known*: when a forward pass needs several experts in
one layer (a prefill chunk, or top_k > 1), `issue_needed` starts reading its upcoming misses
while the model's thread computes the cached ones. Those reads are demand misses that merely
started early: `take_needed` hands the expert to the cache, which counts a miss and inserts it
exactly where the one-at-a-time path would have, so hit rates, evictions and the routing trace
are the same with or without read-ahead (tested).

RAM: each worker's staging buffer plus one prepared expert per in-flight read; the budget counts
both (`threads * (blob + slot)`). Modes: "off"; "predict" (measure accuracy, read nothing);
"on". Whether "on" pays depends on disk latency vs compute per layer: measure (bench).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from queue import SimpleQueue

import torch

from ..cache.expert_cache import ExpertCache, fetch_expert
from ..cache.policies import ExpertKey
from ..io.direct_io import AlignedBuffer
from ..stats import StreamStats


class Prefetcher:
    def __init__(self, cache: ExpertCache, threads: int):
        if threads < 1:
            raise ValueError("prefetch needs at least one thread")
        self.cache, self.stats, self.threads = cache, cache.stats, threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="colibri-prefetch")
        self._buffers: SimpleQueue[AlignedBuffer] = SimpleQueue()
        self._all_buffers = [AlignedBuffer(cache.layout.blob_length) for _ in range(threads)]
        for buffer in self._all_buffers:
            self._buffers.put(buffer)
        self._inflight: dict[ExpertKey, Future] = {}
        self._needed: set[ExpertKey] = set()  # in-flight reads the current layer is known to need
        self.needed_issued = 0  # reads started by issue_needed (demand misses started early)
        cache.prefetcher = self

    @property
    def staging_bytes(self) -> int:
        return sum(b.size for b in self._all_buffers)

    def in_flight(self, key: ExpertKey) -> bool:
        return key in self._inflight

    def issue(self, keys: list[ExpertKey]) -> int:
        """Start reading guessed keys not cached or in flight, up to the thread count; returns how many."""
        started = self._start(keys)
        self.stats.prefetch_issued += len(started)
        return len(started)

    def issue_needed(self, keys: list[ExpertKey]) -> int:
        """Start reading experts the running layer will ask for (not cached, not in flight), up to
        the thread count; they are taken with `take_needed`, never stored as prefetches."""
        started = self._start(keys)
        self._needed.update(started)
        self.needed_issued += len(started)
        return len(started)

    def _start(self, keys: list[ExpertKey]) -> list[ExpertKey]:
        started = []
        for key in keys:
            if len(self._inflight) >= self.threads:
                break
            if key in self.cache or key in self._inflight or key not in self.cache.entries:
                continue
            buffer = self._buffers.get()  # never blocks: one buffer per possible in-flight read
            self._inflight[key] = self._pool.submit(self._work, self.cache.entries[key], buffer)
            started.append(key)
        return started

    def is_needed(self, key: ExpertKey) -> bool:
        return key in self._needed

    def take_needed(self, key: ExpertKey):
        """Wait for a read started by `issue_needed` and return the prepared expert (raising the
        read's error, as a demand read would); the wait counts as I/O time, the bytes as read."""
        self._needed.discard(key)
        prepared, _read_seconds, _prepare_seconds = self._wait(key).result()
        self.stats.bytes_read += self.cache.entries[key].length
        return prepared

    def _work(self, entry, buffer: AlignedBuffer):
        try:
            return fetch_expert(self.cache.reader, entry, self.cache.layout, self.cache.prepare, buffer)
        finally:
            self._buffers.put(buffer)

    def collect(self, pinned: Collection[ExpertKey] = ()) -> None:
        """Store every finished prefetch in the cache (a failed one is dropped: a demand read
        of that expert will raise the error itself)."""
        for key in [k for k, f in self._inflight.items() if f.done() and k not in self._needed]:
            self._store(key, self._inflight.pop(key), pinned)

    def take(self, key: ExpertKey, pinned: Collection[ExpertKey] = ()) -> None:
        """Wait for an in-flight read of `key` and store it; the wait counts as I/O time."""
        self._store(key, self._wait(key), pinned)

    def _wait(self, key: ExpertKey) -> Future:
        """Take `key`'s read out of flight once it has finished; the wait counts as I/O time."""
        future = self._inflight.pop(key)
        started = time.perf_counter()
        future.exception()  # wait without raising here
        self.stats.io_seconds += time.perf_counter() - started
        return future

    def drain(self) -> None:
        """Wait for every read still in flight and store it. The engine calls this when a forward
        pass ends, so every byte a pass read is counted by the time it returns (a read left
        running would reach /proc/self/io before the engine's counter)."""
        for key in list(self._inflight):
            if key in self._needed:  # only left over when a layer failed: count the bytes, drop it
                try:
                    self.take_needed(key)
                except Exception:  # noqa: BLE001 - the layer already raised this read's error
                    pass
            else:
                self.take(key)

    def _store(self, key: ExpertKey, future: Future, pinned: Collection[ExpertKey]) -> None:
        if future.exception() is not None:
            self.stats.prefetch_wasted += 1
            return
        prepared, _read_seconds, _prepare_seconds = future.result()
        self.stats.bytes_read += self.cache.entries[key].length
        self.cache.insert_prefetched(key, prepared, pinned)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._inflight.clear()
        self._needed.clear()
        for buffer in self._all_buffers:
            buffer.close()


class RoutingPredictor:
    """Guesses layer i+1's experts while layer i's routed experts are fetched and computed.

    `blocks` maps each MoE layer index to its colibri-model `Block` (for `ffn_norm`, `moe.router`
    and `moe.shared`); the predictor hooks them to see the residual and the shared output.
    """

    def __init__(
        self,
        blocks: dict[int, torch.nn.Module],
        top_k: int,
        stats: StreamStats,
        prefetcher: Prefetcher | None,
    ):
        self.blocks, self.top_k, self.stats, self.prefetcher = blocks, top_k, stats, prefetcher
        self._predicted: dict[int, set[int]] = {}
        self._residual: dict[int, torch.Tensor] = {}
        self._shared: dict[int, torch.Tensor] = {}
        self._hooks = []
        for index, block in blocks.items():
            self._hooks.append(block.ffn_norm.register_forward_pre_hook(partial(self._keep_residual, index)))
            if block.moe.shared is not None:
                self._hooks.append(block.moe.shared.register_forward_hook(partial(self._keep_shared, index)))

    def _keep_residual(self, layer: int, _module, args) -> None:
        self._residual[layer] = args[0]

    def _keep_shared(self, layer: int, _module, _args, output) -> None:
        self._shared[layer] = output

    def before_layer(self, layer: int, x: torch.Tensor, distinct: list[int]) -> None:
        """Called by layer `layer`'s backend with its input and actual experts."""
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            correct = len(predicted.intersection(distinct))
            counters = self.stats.layer(layer)
            self.stats.prefetch_actual += len(distinct)
            self.stats.prefetch_correct += correct
            counters.prefetch_actual += len(distinct)
            counters.prefetch_correct += correct
        residual, shared = self._residual.pop(layer, None), self._shared.pop(layer, None)
        following = self.blocks.get(layer + 1)
        if following is None:
            return
        with torch.no_grad():
            if residual is None:  # the backend ran outside a Block: guess from its own input
                guess_input = x
            else:
                state = residual.reshape(-1, residual.shape[-1])
                if shared is not None:
                    state = state + shared.reshape(state.shape)
                # .forward, not __call__: the guess must not fire this predictor's own hook on
                # the next layer's norm (the real pass would overwrite it, but only by luck)
                guess_input = following.ffn_norm.forward(state)
            ids, _, _ = following.moe.router(guess_input, self.top_k)
        guess = torch.unique(ids).tolist()
        self._predicted[layer + 1] = set(guess)
        if self.prefetcher is not None:
            self.prefetcher.issue([(layer + 1, e) for e in guess])

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._residual.clear()
        self._shared.clear()
