"""One forward pass of the engine's model, with its accounting: what every path that runs the
model (a session's append, a padded batch) shares. Callers hold the engine's lock.

`forward_pass(engine, ids [B, T], kv, keep_from, **model_kwargs)`: counts the step, tells the cache policy, times
it; with `keep_from` the final norm's output is cut to columns [keep_from, T) by a torch forward
hook (colibri-model's forward unchanged), so the vocab projection runs only where logits are
wanted (a chunk wanting none keeps its last column, which the caller drops). `model_kwargs`
(`positions`, `attention_mask`: a batch decode step, batch_decode.py) go to the model's forward. For SmolLM2's 49k
vocabulary that projection is most of a small model's prefill. `finish_passes(engine)`: after the
passes of one call, wait for the prefetch workers, give freed heap back, update the I/O counters.
"""

from __future__ import annotations

import time

import torch


def forward_pass(engine, ids: torch.Tensor, kv, keep_from: int | None = None, **model_kwargs) -> torch.Tensor:
    engine.stats.steps += 1
    engine.cache.policy.begin_step(engine.stats.steps)
    began = time.perf_counter()
    hook = None
    if keep_from is not None and keep_from > 0:
        hook = engine.model.norm.register_forward_hook(_keep_columns(keep_from))
    try:
        logits = engine.model(ids, cache=kv, **model_kwargs).logits
    finally:
        if hook is not None:
            hook.remove()
    engine.stats.forward_seconds += time.perf_counter() - began
    return logits.float()


def finish_passes(engine) -> None:
    if engine.cache.prefetcher is not None:
        engine.cache.prefetcher.drain()
    # Freed verify/repack temporaries stay on the C heap (io/heap.py): give them back once they
    # have grown past the budget's slack. Trimming after every miss cost 27% of tokens/s; the
    # check itself is only made after a slack's worth of reads (RESULTS.md).
    engine.heap_trimmer.maybe_trim(engine.stats.bytes_read)
    engine._update_io()


def _keep_columns(start: int):
    def hook(module, args, output):
        return output[:, start:] if start < output.shape[1] else output[:, -1:]

    return hook
