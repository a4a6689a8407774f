"""`Session`: one context (token ids and their KV cache) on a shared `ForwardRunner` (runner.py),
the model an `Engine` serves; `prefill_batch`: a session per prompt, prefilled as one batch.

    >>> s = engine.session()                                   # doctest: +SKIP
    >>> logits = s.append(engine.encode("The capital of"))   # fp32 [V], after the last token
    >>> branch = s.fork()                                     # an independent copy of the context
    >>> branch.append([engine.encode(" France")[0]], all_logits=True)   # [1, V]
    >>> s.truncate(3); len(s)                                 # keep the first 3 tokens
    >>> for tok in s.stream(" Paris is", 16, temperature=0.7, top_k=40, seed=1):
    ...     print(tok.id, repr(tok.text), tok.logprob)

Threads: the engine's weights, expert cache, prefetcher and stats are shared by all its sessions;
every forward pass takes the runner's lock (one pass at a time, whichever session it is for),
while each session's KV cache and token list are its own. So any number of sessions may be used
from any number of threads, one thread per session at a time (a Session itself is not
synchronised: do not drive one session from two threads at once).

Memory: a session's KV cache grows with its context (session_kv.py; a sliding-window layer's
stops at its window plus two prefill chunks); the engine's budget holds one full `max_context`
of it, so sessions beyond the first, together longer than that, cost up to `kv_bytes_per_token`
per token on top of the budget. A truncate further back than a sliding layer still holds keys
for (more than a prefill chunk, once its window is full) costs a re-run of the kept tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .batch import branch_logits, check_branches, checked_longest, prefill_rows
from .generation import GenerationResult, TextCodec, TokenStream, decode_loop, generation_options, result_sink
from .runner import ForwardRunner
from .session_kv import SessionKV


class Session:
    """A context on `runner`; `codec` turns text prompts into ids. Built empty (what
    `Engine.session()` does) or holding `tokens` whose keys and values `kv` already holds, with
    `last_logits` after them if known, and `pending` tokens in the context not yet run (`defer`);
    `prefilled_tokens` counts the tokens this session has run through the model."""

    def __init__(self, runner: ForwardRunner, codec: TextCodec, kv: SessionKV | None = None,
                 tokens: Sequence[int] = (), last_logits: torch.Tensor | None = None, *,
                 pending: Sequence[int] = (), prefilled_tokens: int = 0):
        self.runner, self.codec = runner, codec
        self.kv = kv if kv is not None else runner.new_session_kv()
        self._tokens = list(tokens)
        self._last = last_logits  # fp32 logits after the last token; None when unknown
        self._pending = list(pending)  # in the context, not yet run (see `defer`)
        self.prefilled_tokens = prefilled_tokens  # tokens this session has run through the model

    # --- the context ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.kv.length + len(self._pending)

    @property
    def tokens(self) -> list[int]:
        """The token ids of the context (a copy)."""
        return list(self._tokens)

    def append(self, ids: Sequence[int] | torch.Tensor, *, all_logits: bool = False) -> torch.Tensor:
        """Run `ids` after the context and keep them in it; returns fp32 logits on the runner's
        device: of the last position ([V]) or, with `all_logits`, of each new one ([len(ids), V])."""
        ids = ids.flatten().tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        if not ids:
            raise ValueError("append() needs at least one token")
        return self._run(ids, all_logits)

    def _run(self, ids: list[int], all_logits: bool) -> torch.Tensor:
        pending, run = len(self._pending), self._pending + ids
        logits = self.runner.run(self.kv, run, all_logits)
        self._tokens.extend(ids)
        self._pending = []
        self.prefilled_tokens += len(run)
        self._last = logits[-1] if all_logits else logits
        return logits[pending:] if all_logits else logits

    def defer(self, ids: Sequence[int]) -> None:
        """Add `ids` to the context without running them yet: the next `append` (or
        `last_logits`) runs them first. Generation ends this way: its last token is in the context
        but nothing has read its logits yet."""
        ids = [int(i) for i in ids]
        self._tokens.extend(ids)
        self._pending.extend(ids)
        self._last = None

    def last_logits(self) -> torch.Tensor:
        """The logits after the context's last token (running what is pending, or re-running the
        last token if a truncate dropped them)."""
        if self._pending:
            return self._run([], all_logits=False)
        if self._last is None:
            if not self._tokens:
                raise ValueError("the session is empty: append a prompt first")
            last = self._tokens[-1]
            self.truncate(len(self) - 1)
            self.append([last])
        return self._last

    def fork(self) -> Session:
        """An independent session starting from a copy of this context (its own KV cache)."""
        return Session(self.runner, self.codec, self.kv.copy(), self._tokens, self._last, pending=self._pending)

    def branch_logits(self, continuations: Sequence[Sequence[int]], skip: int = 0) -> list[torch.Tensor]:
        """fp32 logits of each continuation after this context ([len_i - skip, V] each: none for
        the first `skip` positions), run as one padded batch over a copy of the context's KV
        cache (batch.py); the session is unchanged. The same numbers as
        `fork().append(c, all_logits=True)[skip:]` per continuation, in one pass."""
        continuations = [[int(i) for i in c] for c in continuations]
        check_branches(continuations, skip)
        if len(self):
            self.last_logits()  # runs any deferred token: the context is then all in the KV cache
        return branch_logits(self.runner, self.kv, continuations, skip)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the context (0 empties it)."""
        if not 0 <= length <= len(self):
            raise ValueError(f"truncate({length}): the session holds {len(self)} tokens")
        if length == len(self):
            return
        if length <= self.kv.length and not self.kv.can_truncate(length):
            # a sliding-window layer has dropped keys the next position would see (session_kv.py):
            # the kept tokens run again, on a fresh cache, when the context is next used
            self._pending = self._tokens[:length]
            self.kv = self.runner.new_session_kv()
        elif length <= self.kv.length:
            self.kv.length = length
            self._pending = []
        else:
            del self._pending[length - self.kv.length :]
        del self._tokens[length:]
        self._last = None

    def reset(self) -> None:
        self.truncate(0)

    # --- generation ---------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int] = (), max_new_tokens: int = 128, *, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
               seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] | None = None,
               logprobs: int = 0, constraint=None, result: list | None = None) -> TokenStream:
        """Append `prompt` (text or ids; empty: continue the context) and yield a `StreamedToken`
        (id, text piece, logprob, and the `logprobs` most likely alternatives) per new token, up to
        `max_new_tokens`. Sampling (sampling.py): greedy unless `temperature > 0`; `top_k`,
        `top_p`, `min_p`, `repetition_penalty`, `seed`. Stops at an end token (`stop_token_ids`,
        default the codec's `end_token_ids`, the engine's) or at the first `stop` string (cut from the text).
        `constraint`: a factory of per-row token constraints (`GenerationOptions.constraint`).
        The session keeps the context it generated (the last token deferred: `defer`), so the
        next call continues it. The returned `TokenStream` holds the `GenerationResult` as its
        `result` once it is exhausted (`result=[]`, deprecated, also receives it)."""
        prompt_ids = self.codec.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not prompt_ids and not self._tokens:
            raise ValueError("the prompt is empty")
        options = generation_options(self.codec, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                     min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=stop,
                                     stop_token_ids=stop_token_ids, logprobs=logprobs, constraint=constraint)
        if len(self) + len(prompt_ids) > self.runner.max_context:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens after {len(self)} in the context) does not "
                             f"fit the engine's max_context={self.runner.max_context}")
        return TokenStream(decode_loop(self, prompt_ids, options), result_sink(result))

    def stream_text(self, prompt: str | Sequence[int] = (), max_new_tokens: int = 128, **kwargs) -> Iterator[str]:
        """`stream`, text pieces only (empty pieces skipped)."""
        for token in self.stream(prompt, max_new_tokens, **kwargs):
            if token.text:
                yield token.text

    def generate(self, prompt: str | Sequence[int] = (), max_new_tokens: int = 128, *, on_text=None,
                 on_token=None, **kwargs) -> GenerationResult:
        """`stream` to the end; `on_text(piece)` / `on_token(StreamedToken)` see it as it goes."""
        tokens = self.stream(prompt, max_new_tokens, **kwargs)
        for token in tokens:
            if on_token is not None:
                on_token(token)
            if on_text is not None and token.text:
                on_text(token.text)
        return tokens.result


@torch.inference_mode()
def prefill_batch(runner: ForwardRunner, codec: TextCodec, prompts: list[list[int]]) -> list[Session]:
    """A session per prompt holding it, its last logits ready (`Session.last_logits`), all run as
    one right-padded batch (batch.py): the batch's keys and values up to each row's length are
    copied into the row's own session."""
    kv = runner.new_batch_kv(len(prompts), checked_longest(runner, prompts))
    last = prefill_rows(runner, prompts, kv)
    sessions = []
    for row, prompt in enumerate(prompts):
        own = runner.new_session_kv()
        own.load_row([k[row : row + 1] for k in kv.keys], [v[row : row + 1] for v in kv.values], len(prompt))
        sessions.append(Session(runner, codec, own, prompt, last[row], prefilled_tokens=len(prompt)))
    return sessions
