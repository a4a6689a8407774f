"""`ForwardRunner`: the served model and everything a forward pass shares, for whatever runs it
(a session's append, a padded batch, a batch decode step). The engine builds one and is the
user's facade over it; sessions and batches take the runner, never the engine.

What it holds: colibri-model's model, the expert cache (with its policy and prefetcher), the
run's `stats`, the one lock every forward pass holds (the weights, cache, prefetcher and stats
are shared by all sessions: one pass at a time), and the I/O accounting (the OS `read_bytes`
counter the stats are checked against, the heap trimmer).

- `forward(ids [B, T], kv, keep_from, **model_kwargs)`: one pass, with its accounting: counts
  the step, tells the cache policy, times it; with `keep_from` the final norm's output is cut to
  columns [keep_from, T) by a torch forward hook (colibri-model's forward unchanged), so the
  vocab projection runs only where logits are wanted (a chunk wanting none keeps its last
  column, which the caller drops). For SmolLM2's 49k vocabulary that projection is most of a
  small model's prefill. `model_kwargs` (`positions`, `attention_mask`: a batch decode step,
  batch_decode.py) go to the model's forward.
- `passes()`: the lock around the passes of one call, then `finish()`: wait for the prefetch
  workers, give freed heap back, update the I/O counters.
- `run(kv, ids, all_logits)`: a session's tokens through its KV cache in chunks of
  `prefill_chunk`; with `batch_sessions` on, one decode token joins the decode tokens other
  sessions ask for at the same time in one [B, 1] pass (step_combiner.py: continuous batching).
- `generating()`: around a session's decode loop, so a combined step waits for its token.
- `hidden_states(ids)`: the final norm's output for every position (embeddings).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from colibri_model import ColibriForCausalLM, KVCache

from .cache.expert_cache import ExpertCache
from .io.accounting import ReadBytesCounter, agreement
from .io.heap import HeapTrimmer
from .session_kv import SessionKV
from .stats import StreamStats
from .step_combiner import DecodeCombiner, SessionRows, install_row_attention


class ForwardRunner:
    """The model as served: `model`, `cache`, `stats`, `lock`, the I/O accounting and the limits
    a pass keeps to (`max_context`, `prefill_chunk`, `device`, `dtype`: activations and KV caches).
    `batch_sessions`: combine concurrent sessions' decode steps into one pass (step_combiner.py)."""

    def __init__(self, model: ColibriForCausalLM, cache: ExpertCache, stats: StreamStats, heap_trimmer: HeapTrimmer, *,
                 max_context: int, prefill_chunk: int, device, dtype: torch.dtype = torch.float32,
                 batch_sessions: bool = False):
        self.model, self.cache, self.stats, self.heap_trimmer = model, cache, stats, heap_trimmer
        self.max_context, self.prefill_chunk, self.device, self.dtype = max_context, prefill_chunk, device, dtype
        # reentrant: a caller holding it for a batch may run helpers that take it again
        self.lock = threading.RLock()
        # a decode step holds no more tokens than a prefill chunk: the workspace the budget holds
        self.combiner = DecodeCombiner(self.lock, self._run_rows, max_rows=prefill_chunk)
        self.batch_sessions = batch_sessions
        install_row_attention(model)
        self.os_reads = ReadBytesCounter()  # from here on, every storage read is the run's
        self.update_io()

    # --- accounting -------------------------------------------------------------------------
    def update_io(self) -> None:
        """Bring `stats.bytes_read_os` and the engine/OS agreement up to date."""
        self.stats.bytes_read_os = self.os_reads.since()
        self.stats.io_agreement = agreement(self.stats.bytes_read, self.stats.bytes_read_os)

    def reset_stats(self) -> None:
        """Start a new measurement window (counters and the OS read_bytes baseline alike)."""
        with self.lock:
            self.stats.reset()
            self.os_reads.rebase()
            self.update_io()

    # --- KV caches --------------------------------------------------------------------------
    def new_session_kv(self) -> SessionKV:
        return SessionKV.for_model(self.model.config, self.max_context, self.device, self.dtype,
                                   prefill_chunk=self.prefill_chunk)

    def new_batch_kv(self, rows: int, length: int):
        """colibri-model's KV cache of `rows` rows and `length` columns (a padded batch's)."""
        return KVCache(self.model.config, rows, length, self.device, self.dtype)

    # --- passes -----------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, kv, keep_from: int | None = None, **model_kwargs) -> torch.Tensor:
        """One forward pass (see the module docstring); the caller holds `lock` (`passes()`)."""
        self.stats.steps += 1
        self.cache.policy.begin_step(self.stats.steps)
        began = time.perf_counter()
        hook = None
        if keep_from is not None and keep_from > 0:
            hook = self.model.norm.register_forward_hook(_keep_columns(keep_from))
        try:
            logits = self.model(ids, cache=kv, **model_kwargs).logits
        finally:
            if hook is not None:
                hook.remove()
        self.stats.forward_seconds += time.perf_counter() - began
        return logits.float()

    def finish(self) -> None:
        """After the passes of one call: prefetch drained, heap trimmed, I/O counters updated."""
        if self.cache.prefetcher is not None:
            self.cache.prefetcher.drain()
        # Freed verify/repack temporaries stay on the C heap (io/heap.py): give them back once they
        # have grown past the budget's slack. Trimming after every miss cost 27% of tokens/s; the
        # check itself is only made after a slack's worth of reads (RESULTS.md).
        self.heap_trimmer.maybe_trim(self.stats.bytes_read)
        self.update_io()

    @contextmanager
    def passes(self) -> Iterator[None]:
        """The lock around one call's passes, and `finish()` after them."""
        with self.lock:
            yield
            self.finish()

    @torch.inference_mode()
    def run(self, kv: SessionKV, ids: list[int], all_logits: bool) -> torch.Tensor:
        """Run `ids` after what `kv` holds, in chunks of `prefill_chunk`, under the lock; returns
        fp32 logits of the last position ([V]) or of every one ([T, V]). One token after a
        non-empty context counts as a decode step, anything else as prefill
        (`stats.decode_tokens` / `prefill_tokens`)."""
        if not ids:
            raise ValueError("a forward pass needs at least one token")
        if self.batch_sessions and len(ids) == 1 and kv.length > 0 and not all_logits:
            if kv.length + 1 > self.max_context:
                raise ValueError(f"{kv.length + 1} tokens exceed the engine's max_context={self.max_context}")
            kv.reserve(kv.length + 1)
            return self.combiner.step(kv, ids[0])
        with self.passes():
            if kv.length + len(ids) > self.max_context:
                raise ValueError(f"{kv.length + len(ids)} tokens exceed the engine's max_context={self.max_context}")
            kv.reserve(kv.length + len(ids))
            if len(ids) == 1 and kv.length > 0:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += len(ids)
            outputs = []
            for start in range(0, len(ids), self.prefill_chunk):
                if start and self.batch_sessions:  # streams generating meanwhile get their token between chunks
                    self.combiner.serve_waiting()
                chunk = torch.tensor([ids[start : start + self.prefill_chunk]], dtype=torch.long, device=self.device)
                logits = self.forward(chunk, kv, None if all_logits else chunk.shape[1] - 1)[0]
                outputs.append(logits if all_logits else logits[-1])
        return torch.cat(outputs, 0) if all_logits else outputs[-1]

    @torch.inference_mode()
    def hidden_states(self, ids: list[int]) -> torch.Tensor:
        """colibri-model's final-norm output, fp32 [len(ids), d], for `ids` on a fresh KV cache in
        chunks of `prefill_chunk` (counted as prefill); the vocab projection runs on one column
        of each chunk, not on every position."""
        if not ids:
            raise ValueError("hidden states need at least one token")
        if len(ids) > self.max_context:
            raise ValueError(f"{len(ids)} tokens exceed the engine's max_context={self.max_context}")
        kv = self.new_session_kv()
        kv.reserve(len(ids))
        captured: list[torch.Tensor] = []

        def keep(module, args, output):
            captured.append(output[0].float())
            return output[:, -1:]

        with self.passes():
            self.stats.prefill_tokens += len(ids)
            hook = self.model.norm.register_forward_hook(keep)
            try:
                for start in range(0, len(ids), self.prefill_chunk):
                    chunk = torch.tensor([ids[start : start + self.prefill_chunk]], dtype=torch.long, device=self.device)
                    self.forward(chunk, kv)
            finally:
                hook.remove()
        return torch.cat(captured)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Around a session's decode loop: a combined step waits for this session's tokens."""
        if not self.batch_sessions:
            yield
            return
        with self.combiner.generating():
            yield

    @torch.inference_mode()
    def _run_rows(self, caches: list, tokens: list[int]) -> torch.Tensor:
        """One decode token after each of `caches` (their room reserved), as one [B, 1] pass:
        fp32 logits [B, V]. One row runs as a session's own pass does."""
        with self.passes():
            self.stats.decode_tokens += len(caches)
            ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=self.device)
            if len(caches) == 1:
                return self.forward(ids, caches[0])[:, -1]
            positions = torch.tensor([[kv.length] for kv in caches], dtype=torch.long, device=self.device)
            return self.forward(ids, SessionRows(caches), positions=positions)[:, -1]


def _keep_columns(start: int):
    def hook(module, args, output):
        return output[:, start:] if start < output.shape[1] else output[:, -1:]

    return hook
