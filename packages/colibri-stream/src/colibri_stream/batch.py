"""Padded batches through the model: the prefill of a batch of prompts, continuations of one
context (`branch_logits`), and packed rows under a caller's mask (`packed_logits`, what an eval
scoring many documents' choices at once needs). Decoding a batch: batch_decode.py.

    >>> results = engine.generate(["The sky is", "Once upon a time there"], 32)   # doctest: +SKIP

The prompts are RIGHT-padded to the longest and run as one [B, T] batch through colibri-model's
forward (in column chunks of `prefill_chunk // B`, so a pass holds no more tokens than the
budget's workspace): with causal attention and every row starting at position 0, a row's real
tokens never see its padding, so row i's logits at its last real position are exactly those of
a run of that prompt alone, and the plain causal forward (SDPA's `is_causal` kernel) needs no
mask. The MoE layers see all rows' tokens at once, so each distinct expert is read and run once
per chunk for the whole batch (the batch-union of StreamedExperts), which is what a batch buys
when experts stream from disk. `prefill_rows` leaves the batch's keys and values in a batch KV
cache (what batch_decode.py decodes on; session.py's `prefill_batch` copies each row's into its own
`Session`). Every function takes the `ForwardRunner` (runner.py) and runs under its lock.

Padding tokens (the row's last token repeated) are routed like real ones: they may read experts
no prompt needs and show in the routing trace; `stats.prefill_tokens` counts only real tokens.
"""

from __future__ import annotations

import torch

from .runner import ForwardRunner
from .session_kv import SessionKV


def check_branches(continuations: list[list[int]], skip: int) -> None:
    """ValueError unless every continuation has a token and `skip` leaves each at least one."""
    if not continuations or any(not c for c in continuations):
        raise ValueError("branch_logits needs continuations of at least one token each")
    if not 0 <= skip < min(len(c) for c in continuations):
        raise ValueError(f"skip={skip} must leave every continuation at least one position")


@torch.inference_mode()
def branch_logits(runner: ForwardRunner, context: SessionKV, continuations: list[list[int]],
                  skip: int = 0) -> list[torch.Tensor]:
    """fp32 logits ([len_i - skip, V], on the runner's device) of each continuation run after
    the context whose keys and values `context` holds (which may be empty; a session runs what it
    has deferred first), all in one right-padded batch: every row starts at the same position
    (the context's length) over a copy of the context's keys and values, so a row never sees
    another's tokens or its own padding. The first `skip` positions of every row get no logits
    (the vocab projection is not run there: a forward hook cuts the final norm's output).
    `context` itself is left as it was."""
    check_branches(continuations, skip)
    past, longest, rows = context.length, max(len(c) for c in continuations), len(continuations)
    if past + longest > runner.max_context:
        raise ValueError(f"{past + longest} tokens exceed the engine's max_context={runner.max_context}")
    ids = torch.tensor([c + [c[-1]] * (longest - len(c)) for c in continuations], dtype=torch.long,
                       device=runner.device)
    kv = runner.new_batch_kv(rows, past + longest)
    for layer in range(len(kv.keys) if past else 0):  # what the session holds: a sliding layer's window
        stored = past - context.first_column(layer)
        kv.keys[layer][:, :, :stored] = context.keys[layer][:, :, :stored]
        kv.values[layer][:, :, :stored] = context.values[layer][:, :, :stored]
        kv.first[layer] = context.first_column(layer)
    kv.length = past
    width = max(1, runner.prefill_chunk // rows)
    pieces = []
    with runner.passes():
        runner.stats.prefill_tokens += sum(len(c) for c in continuations)
        for start in range(0, longest, width):
            cut = skip - start  # columns of this chunk before `skip`: no logits there
            logits = runner.forward(ids[:, start : start + width], kv, cut if cut > 0 else None)
            if cut < width:
                pieces.append(logits)
    logits = torch.cat(pieces, 1)
    return [logits[row, : len(c) - skip] for row, c in enumerate(continuations)]


@torch.inference_mode()
def packed_logits(runner: ForwardRunner, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                  rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, V] at `(rows[n], cols[n])` of a [B, T] batch run from an empty context with
    per-row RoPE `positions` [B, T] and a per-query `attention_mask` [B, T, T] (True: query i sees
    key j; colibri-model ANDs the causal rule in). Packed rows: several sequences side by side,
    each masked to see only itself (colibri-eval's packing). The batch runs in column chunks of
    `prefill_chunk // B` over one KV cache, so a pass holds no more tokens than the budget's
    workspace; the vocab projection runs only at the wanted positions (a hook on the final norm).
    Every column counts as a prefill token: the caller's padding is not known here."""
    batch, width = input_ids.shape
    if tuple(positions.shape) != (batch, width) or tuple(attention_mask.shape) != (batch, width, width):
        raise ValueError(f"packed_logits needs positions [B, T] and attention_mask [B, T, T] for ids "
                         f"{list(input_ids.shape)}, got {list(positions.shape)} and {list(attention_mask.shape)}")
    if int(positions.max()) >= runner.max_context:
        raise ValueError(f"position {int(positions.max())} is past the engine's max_context={runner.max_context}")
    device = runner.device
    input_ids, positions, attention_mask = input_ids.to(device), positions.to(device), attention_mask.to(device)
    rows, cols = rows.to(device), cols.to(device)
    kv = runner.new_batch_kv(batch, width)
    chunk = max(1, runner.prefill_chunk // batch)
    out = torch.empty((rows.numel(), runner.model.config.vocab_size), dtype=torch.float32, device=device)
    with runner.passes():
        runner.stats.prefill_tokens += batch * width
        for start in range(0, width, chunk):
            end = min(width, start + chunk)
            wanted = torch.nonzero((cols >= start) & (cols < end)).flatten()
            hook = runner.model.norm.register_forward_hook(_keep_positions(rows[wanted], cols[wanted] - start))
            try:
                logits = runner.forward(input_ids[:, start:end], kv, positions=positions[:, start:end],
                                        attention_mask=attention_mask[:, start:end, :end])
            finally:
                hook.remove()
            if wanted.numel():
                out[wanted] = logits[0]
    return out


def _keep_positions(rows: torch.Tensor, cols: torch.Tensor):
    """A final-norm hook: [B, T, d] -> [1, N, d] at (rows, cols) (one column when none is wanted,
    whose logits the caller drops), so the vocab projection runs N times, not B * T."""
    def hook(module, args, output):
        return output[rows, cols][None] if rows.numel() else output[:1, :1]

    return hook


def checked_longest(runner: ForwardRunner, prompts: list[list[int]]) -> int:
    """The longest prompt's length, once every prompt is known to have a token and fit the context."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt of a batch needs at least one token")
    longest = max(len(p) for p in prompts)
    if longest > runner.max_context:
        raise ValueError(f"a prompt of {longest} tokens exceeds the engine's max_context={runner.max_context}")
    return longest


def prefill_rows(runner: ForwardRunner, prompts: list[list[int]], kv) -> list[torch.Tensor]:
    """Run the right-padded batch through `kv` (a KV cache of len(prompts) rows, empty) in chunks
    of `prefill_chunk // B` columns; returns each row's fp32 logits after its last real token."""
    longest, rows = checked_longest(runner, prompts), len(prompts)
    ids = torch.tensor([p + [p[-1]] * (longest - len(p)) for p in prompts], dtype=torch.long, device=runner.device)
    last: list[torch.Tensor | None] = [None] * rows
    width = max(1, runner.prefill_chunk // rows)
    with runner.passes():
        runner.stats.prefill_tokens += sum(len(p) for p in prompts)
        for start in range(0, longest, width):
            logits = runner.forward(ids[:, start : start + width], kv)
            for row, prompt in enumerate(prompts):
                if start <= len(prompt) - 1 < start + width:
                    last[row] = logits[row, len(prompt) - 1 - start]
    return last
