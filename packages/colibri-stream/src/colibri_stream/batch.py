"""Padded batches through the model: prompts (one prefill for all, then a session each), and
continuations of one context (`branch_logits`, what an eval scoring choices needs).

    >>> results = engine.generate(["The sky is", "Once upon a time there"], 32)   # doctest: +SKIP

The prompts are RIGHT-padded to the longest and run as one [B, T] batch through colibri-model's
forward (in column chunks of `prefill_chunk // B`, so a pass holds no more tokens than the
budget's workspace): with causal attention and every row starting at position 0, a row's real
tokens never see its padding, so row i's logits at its last real position are exactly those of
a run of that prompt alone. The MoE layers see all rows' tokens at once, so each distinct expert
is read and run once per chunk for the whole batch (the batch-union of StreamedExperts), which is
what a batch buys when experts stream from disk. Each row's keys and values up to its length are
then copied into its own `Session`.

Decoding is per session, one after the other: decoding B rows in one pass needs each row at its
own position and a padding mask in the attention, which colibri-model's `Attention` (one
`positions` vector for the batch, causal or prefix mask) does not take. Padding tokens (the
row's last token repeated) are routed like real ones: they may read experts no prompt needs and
show in the routing trace; `stats.prefill_tokens` counts only real tokens.
"""

from __future__ import annotations

import time

import torch

from .passes import finish_passes, forward_pass
from .session import Session


@torch.inference_mode()
def branch_logits(session: Session, continuations: list[list[int]], skip: int = 0) -> list[torch.Tensor]:
    """fp32 logits ([len_i - skip, V], on the engine's device) of each continuation run after
    `session`'s context (which may be empty), all in one right-padded batch: every row starts at
    the same position (the context's length) over a copy of the context's keys and values, so a
    row never sees another's tokens or its own padding. The first `skip` positions of every row
    get no logits (the vocab projection is not run there: a forward hook cuts the final norm's
    output). The session itself is left as it was."""
    if not continuations or any(not c for c in continuations):
        raise ValueError("branch_logits needs continuations of at least one token each")
    if not 0 <= skip < min(len(c) for c in continuations):
        raise ValueError(f"skip={skip} must leave every continuation at least one position")
    engine = session.engine
    if len(session):
        session.last_logits()  # runs any deferred token: the context is then all in the KV cache
    past, longest, rows = len(session), max(len(c) for c in continuations), len(continuations)
    if past + longest > engine.max_context:
        raise ValueError(f"{past + longest} tokens exceed the engine's max_context={engine.max_context}")
    ids = torch.tensor([c + [c[-1]] * (longest - len(c)) for c in continuations], dtype=torch.long,
                       device=engine.device)
    kv = engine.model.new_kv_cache(rows, past + longest)
    for layer in range(len(kv.keys) if past else 0):
        kv.keys[layer][:, :, :past] = session.kv.keys[layer][:, :, :past]
        kv.values[layer][:, :, :past] = session.kv.values[layer][:, :, :past]
    kv.length = past
    width = max(1, engine.prefill_chunk // rows)
    pieces = []
    with engine._lock:
        engine.stats.prefill_tokens += sum(len(c) for c in continuations)
        for start in range(0, longest, width):
            cut = skip - start  # columns of this chunk before `skip`: no logits there
            logits = forward_pass(engine, ids[:, start : start + width], kv, cut if cut > 0 else None)
            if cut < width:
                pieces.append(logits)
        finish_passes(engine)
    logits = torch.cat(pieces, 1)
    return [logits[row, : len(c) - skip] for row, c in enumerate(continuations)]



@torch.inference_mode()
def prefill_batch(engine, prompts: list[list[int]]) -> list[Session]:
    """A session per prompt holding it, its last logits ready (`Session.last_logits`)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt of a batch needs at least one token")
    longest = max(len(p) for p in prompts)
    if longest > engine.max_context:
        raise ValueError(f"a prompt of {longest} tokens exceeds the engine's max_context={engine.max_context}")
    rows = len(prompts)
    ids = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in prompts], dtype=torch.long, device=engine.device)
    kv = engine.model.new_kv_cache(rows, longest)
    last: list[torch.Tensor | None] = [None] * rows
    width = max(1, engine.prefill_chunk // rows)
    with engine._lock:
        engine.stats.prefill_tokens += sum(len(p) for p in prompts)
        for start in range(0, longest, width):
            logits = forward_pass(engine, ids[:, start : start + width], kv)
            for row, prompt in enumerate(prompts):
                if start <= len(prompt) - 1 < start + width:
                    last[row] = logits[row, len(prompt) - 1 - start]
        finish_passes(engine)
    sessions = []
    for row, prompt in enumerate(prompts):
        session = engine.session()
        session.kv.load_row([k[row : row + 1] for k in kv.keys], [v[row : row + 1] for v in kv.values], len(prompt))
        session._tokens, session._last = list(prompt), last[row]
        session.prefilled_tokens = len(prompt)
        sessions.append(session)
    return sessions


def generate_batch(engine, prompts, max_new_tokens: int, **kwargs) -> list:
    """`Engine.generate` for a list of prompts (text or ids): a list of `GenerationResult`s."""
    from .generation import GenerationResult

    ids = [engine.encode(p) if isinstance(p, str) else [int(i) for i in p] for p in prompts]
    on_text = kwargs.pop("on_text", None)
    if on_text is not None:
        raise ValueError("on_text is for one prompt; stream each session for a batch")
    began = time.perf_counter()
    sessions = prefill_batch(engine, ids) if max_new_tokens > 0 else [engine.session() for _ in ids]
    prefill_seconds = time.perf_counter() - began
    results: list[GenerationResult] = []
    for session, prompt in zip(sessions, ids):
        result = session.generate((), max_new_tokens, **kwargs) if max_new_tokens > 0 else \
            session.generate(prompt, 0, **kwargs)
        result.prompt_tokens = result.prefilled_tokens = len(prompt)
        result.prefill_seconds += prefill_seconds  # the batch's prefill is every row's time to first token
        results.append(result)
    return results
