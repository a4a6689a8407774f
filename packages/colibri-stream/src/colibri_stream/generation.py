"""Generation: the decode loop, streaming text with stop strings, and what a run reports.

- `decode_loop`: on a `Session` (session.py), prefill the prompt, then sample (sampling.py) and
  decode one token at a time, yielding a `StreamedToken` (id, text piece, logprob) per step;
  `GenerationResult` is what it reports at the end.
- `TextAssembler`: turns the growing list of generated ids into text pieces for streaming. It
  re-decodes the whole generation each step (byte-level BPE merges and multi-byte characters
  make per-token decoding wrong), holds back an incomplete UTF-8 character (decoded as U+FFFD)
  and any tail that could still become a stop string, and cuts the text at the first stop
  string. Re-decoding is O(n) per token, negligible next to a forward pass for n in the
  thousands.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from tokenizers import Tokenizer

from .sampling import SamplingConfig, TokenSampler, token_logprobs


@dataclass
class TextAssembler:
    """Incremental detokenization with stop strings (see module docstring)."""

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the text already handed out
    text: str = ""
    stopped: bool = False

    def add(self, token_id: int) -> str:
        """Append a token; returns the new text that is safe to show (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stop if s) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._emit(len(self.text))
        self.text = text
        safe = len(text)
        if text.endswith("\ufffd"):
            safe -= 1
        safe -= self._stop_prefix_tail(text[:safe])
        return self._emit(safe)

    def finish(self) -> str:
        """Everything not yet shown (at the end of generation)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece

    def _stop_prefix_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass(frozen=True)
class StreamedToken:
    """One step of a stream: the token `id`, the `text` that became safe to show with it (may be
    empty: an incomplete character or a possible stop string is held back, and shows with a later
    token), its `logprob` under the model and, when asked for, the `top_logprobs` [(id, logprob)].
    A last event with `id=None` carries held-back text when generation ends at an end token."""

    id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: Literal["stop", "eos", "length"]
    prefill_seconds: float  # time to first token
    decode_seconds: float
    stats: dict = field(default_factory=dict)
    prefilled_tokens: int = -1  # prompt tokens actually run (fewer when a session reused its cache)
    tokens: list[StreamedToken] = field(default_factory=list)  # per generated token: id, text, logprobs

    @property
    def logprobs(self) -> list[float]:
        return [t.logprob for t in self.tokens if t.id is not None]

    @property
    def tokens_per_s(self) -> float:
        decoded = max(len(self.token_ids) - 1, 0)  # the first token comes from the prefill
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.prefill_seconds, 6),
            "decode_s": round(self.decode_seconds, 6),
            "tokens_per_s": round(self.tokens_per_s, 4),
            "stats": self.stats,
        }



def decode_loop(
    session,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop: tuple[str, ...],
    stop_ids: set[int],
    result: list | None,
    top_logprobs: int = 0,
) -> Iterator[StreamedToken]:
    """Generation on a `Session` (session.py): append `prompt_ids` to its context (an empty prompt
    continues from the context's last logits), then sample and append one token at a time,
    yielding `StreamedToken`s. The last sampled token is deferred (`Session.defer`: in the
    context, run by whatever comes next), so no pass is spent on logits nobody reads. Appends a
    `GenerationResult` to `result` at the end."""
    engine = session.engine
    sampler = TokenSampler(sampling)
    assembler = TextAssembler(engine.tokenizer, stop)
    history = session.tokens + list(prompt_ids)  # what the repetition penalty looks at
    finish = "length"
    began = time.perf_counter()
    logits, events = None, []
    if max_new_tokens > 0:
        logits = session.append(prompt_ids) if prompt_ids else session.last_logits()
    prefill_seconds = time.perf_counter() - began
    for step in range(max_new_tokens):
        token = sampler(logits, history)
        if token in stop_ids:
            finish = "eos"
            break
        history.append(token)
        logprob, top = token_logprobs(logits, token, top_logprobs)
        piece = assembler.add(token)
        last = assembler.stopped or step + 1 == max_new_tokens or len(session) + 1 > engine.max_context
        if last:
            piece += assembler.finish()
        event = StreamedToken(token, piece, logprob, tuple(top))
        events.append(event)
        yield event
        if assembler.stopped:
            finish = "stop"
            session.defer([token])
            break
        if last:
            session.defer([token])
            break
        logits = session.append([token])
    tail = assembler.finish()
    if tail:
        event = StreamedToken(None, tail)
        events.append(event)
        yield event
    if result is not None:
        result.append(
            GenerationResult(
                assembler.text,
                list(assembler.ids),
                len(prompt_ids),
                finish,
                prefill_seconds,
                time.perf_counter() - began - prefill_seconds,
                engine.stats.to_dict(),
                prefilled_tokens=len(prompt_ids),
                tokens=events,
            )
        )
