"""Generation for a batch of prompts: one padded prefill (batch.py), then every row decoded
together, one forward pass of [B, 1] tokens per step.

    >>> results = engine.generate(["The sky is", "Once upon a time there"], 32)   # doctest: +SKIP

The batch's KV cache keeps the right-padded prefill: columns 0..longest-1 hold each row's prompt
(then, for a shorter row, its padding). Decode step s writes every row's new token to the next
shared column, longest + s, at the row's own position len_i + s (RoPE), and colibri-model's
`attention_mask` hides row i's padding columns len_i..longest-1; so row i's logits are those of
its prompt run alone (to fp32 rounding), and greedy rows pick the same tokens.

Each row has its own `RowDecoder` (generation.py): its own sampler and RNG (seeded alike, so a
seeded row draws what the prompt alone draws), stop strings, end ids, max tokens and context
end, the same rules as `Session.stream`.

Finished rows LEAVE the batch (`KVCache.select_rows` copies the rows still going) rather than
being fed a pad and ignored: a pad would still be routed, so it would read and run experts no
live row needs, and cost a token of compute per step, which is what a batch of unequal
generations spends most when many rows finish early. The copy happens at most B - 1 times.

What the batch buys: the MoE layers see the B tokens of a step at once, so each distinct expert
of a step is fetched and run once for the batch (StreamedExperts' batch-union); one-by-one
decoding reads an expert once per row that routes to it (when the cache does not hold it).
`bench/batch_decode.py` measures it. `stats.decode_tokens` counts one per real token, `steps`
one per pass. `stream_batch` yields each row's tokens as they come (the server's list of
prompts); `generate_batch` (`Engine.generate` with a list) runs it to the end. Each takes the
`ForwardRunner` (runner.py) and the `TextCodec` (generation.py), never the engine. The results
are what the generators return (`StopIteration.value`, or `x = yield from ...`), in prompt order.

Memory: the batch KV cache holds B x (longest + the most tokens a row can still run) positions,
beyond the budget's one `max_context` (as extra sessions are), on every layer: a sliding-window
layer keeps all its columns here (a short row's window reaches back past the padding after its
prompt), unlike a session's cache (session_kv.py). A batch of more prompts than
`prefill_chunk` runs as several batches of at most `prefill_chunk` rows, so a decode step holds
no more tokens than the budget's workspace.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from .batch import checked_longest, prefill_rows
from .generation import GenerationResult, RowDecoder, StreamedToken, TextCodec, generation_options
from .runner import ForwardRunner

BatchEvents = Generator[tuple[int, StreamedToken], None, list[GenerationResult]]
"""(row index, `StreamedToken`) as the rows produce them; returns one `GenerationResult` per row."""


def stream_batch(runner: ForwardRunner, codec: TextCodec, prompts, max_new_tokens: int, **kwargs) -> BatchEvents:
    """A list of prompts (text or ids) generated as one batch, streamed: yields (prompt index,
    `StreamedToken`) as the rows produce them and returns the `GenerationResult`s in prompt order.
    The prompts and keywords (`Session.stream`'s) are checked here, before any output; more
    prompts than `prefill_chunk` run as consecutive batches."""
    if kwargs.pop("on_text", None) is not None:
        raise ValueError("on_text is for one prompt; stream each session for a batch")
    ids = [codec.encode(p) if isinstance(p, str) else [int(i) for i in p] for p in prompts]
    options = generation_options(codec, max_new_tokens, **kwargs)
    checked_longest(runner, ids)

    def batches() -> BatchEvents:
        results: list[GenerationResult] = []
        rows_per_batch = max(1, runner.prefill_chunk)
        for first in range(0, len(ids), rows_per_batch):
            group = ids[first : first + rows_per_batch]
            rows = [RowDecoder(runner, codec, options, p) for p in group]
            results += yield from decode_rows(runner, group, rows, first=first)
        return results

    return batches()


def generate_batch(runner: ForwardRunner, codec: TextCodec, prompts, max_new_tokens: int,
                   **kwargs) -> list[GenerationResult]:
    """`Engine.generate` for a list of prompts (text or ids): a list of `GenerationResult`s, in
    order, each as the prompt alone would give (the sampling keywords apply to every row)."""
    events = stream_batch(runner, codec, prompts, max_new_tokens, **kwargs)
    while True:
        try:
            next(events)
        except StopIteration as end:
            return end.value


@torch.inference_mode()
def decode_rows(runner: ForwardRunner, prompts: list[list[int]], rows: list[RowDecoder], *,
                first: int = 0) -> BatchEvents:
    """Prefill `prompts` as one padded batch, then step every unfinished row's `RowDecoder`
    together (see the module docstring), yielding (first + row, event); returns the rows'
    `GenerationResult`s, in row order (`first`: the index of row 0 in the caller's numbering)."""
    began = time.perf_counter()
    if all(row.done for row in rows):  # max_new_tokens 0: nothing to run
        return [row.result(len(p), 0.0, 0.0) for row, p in zip(rows, prompts)]
    longest = checked_longest(runner, prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=runner.device)
    # a row runs at most max_new_tokens - 1 sampled tokens, and none past the context's end
    runs = max(min(row.max_new_tokens - 1, runner.max_context - len(p)) for row, p in zip(rows, prompts))
    kv = runner.new_batch_kv(len(prompts), longest + max(runs, 0))
    for block in runner.model.layers:  # one RoPE table for every step (the model grows it lazily)
        block.attn.rope.ensure(kv.max_len, runner.device)
    # True = a real key: the prompt's columns, and every decode column (each row's own token)
    real = torch.arange(kv.max_len, device=runner.device)[None, :] < lengths[:, None]
    real[:, longest:] = True
    logits = torch.stack(prefill_rows(runner, prompts, kv)).cpu()
    prefill_seconds = time.perf_counter() - began
    live = list(range(len(rows)))  # batch row -> prompt index, in the KV cache's row order
    results: list[GenerationResult | None] = [None] * len(rows)
    step = 0
    while live:
        for i, r in enumerate(live):
            if not rows[r].done and (event := rows[r].step(logits[i])) is not None:
                yield first + r, event
        going = [i for i, r in enumerate(live) if rows[r].next_token is not None]
        for r in live:
            if rows[r].next_token is None:
                if (tail := rows[r].tail()) is not None:
                    yield first + r, tail
                decode_seconds = time.perf_counter() - began - prefill_seconds
                results[r] = rows[r].result(len(prompts[r]), prefill_seconds, decode_seconds)
        if not going:
            break
        if len(going) < len(live):
            keep = torch.tensor(going, device=runner.device)
            kv.select_rows(keep)
            lengths, real = lengths[keep], real[keep]
            live = [live[i] for i in going]
        tokens = torch.tensor([[rows[r].next_token] for r in live], dtype=torch.long, device=runner.device)
        with runner.passes():  # per pass, as a session's append: other sessions run between steps
            runner.stats.decode_tokens += len(live)
            out = runner.forward(tokens, kv, positions=(lengths + step)[:, None],
                                 attention_mask=real[:, : kv.length + 1])
        logits = out[:, -1].cpu()
        step += 1
    return results
