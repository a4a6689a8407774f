"""Generation: the decode loop, streaming text with stop strings, and what a run reports.

- `RowDecoder`: the per-token rules of one generation (sampling.py's sampler, end ids, stop
  strings, max tokens, the context's end), shared by a session and by each row of a batch.
- `decode_loop`: on a `Session` (session.py), prefill the prompt, then decode one token at a
  time, yielding a `StreamedToken` (id, text piece, logprob) per step; `GenerationResult` is
  what it returns at the end, which `TokenStream` (what `Session.stream` hands out) keeps as
  its `result` once the stream is exhausted.
- `TextCodec`: the tokenizer and the ids that end a generation, what sessions and batches need
  of the text side.
- `TextAssembler`: turns the growing list of generated ids into text pieces for streaming. It
  re-decodes the whole generation each step (byte-level BPE merges and multi-byte characters
  make per-token decoding wrong), holds back an incomplete UTF-8 character (decoded as U+FFFD)
  and any tail that could still become a stop string, and cuts the text at the first stop
  string. Re-decoding is O(n) per token, negligible next to a forward pass for n in the
  thousands.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenizers import Tokenizer

from .runner import ForwardRunner
from .sampling import SamplingConfig, TokenSampler, token_logprobs


@dataclass(frozen=True)
class TextCodec:
    """Text <-> token ids for a served model: its `tokenizer` and the `end_token_ids` that end a
    generation by default."""

    tokenizer: Tokenizer
    end_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


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



@dataclass(frozen=True)
class GenerationOptions:
    """What one generation is asked for, checked once (`generation_options`)."""

    max_new_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    logprobs: int  # alternatives reported per token
    # A factory of per-row token constraints (the server's grammars, serve/constrained.py): each
    # row calls it once and gets an object with `mask(logits) -> logits` (disallowed tokens at
    # -inf; applied before sampling, never to the reported logprobs) and `accept(token_id)`.
    constraint: Callable[[], Any] | None = None


def generation_options(codec: TextCodec, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                       seed: int | None = None, stop: Sequence[str] = (),
                       stop_token_ids: Sequence[int] | None = None, logprobs: int = 0,
                       constraint: Callable[[], Any] | None = None) -> GenerationOptions:
    """`Session.stream`'s keywords (and a batch's, batch_decode.py) checked: ValueError names the
    bad one; end ids default to the codec's `end_token_ids`."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
        raise ValueError(f"logprobs must be an integer >= 0 (alternatives per token), got {logprobs!r}")
    if isinstance(stop, str):
        stop = (stop,)
    sampling = SamplingConfig(temperature, top_p, seed, top_k, min_p, repetition_penalty)
    ends = codec.end_token_ids if stop_token_ids is None else stop_token_ids
    return GenerationOptions(max_new_tokens, sampling, tuple(stop), frozenset(int(i) for i in ends), logprobs,
                             constraint)


class RowDecoder:
    """The per-token rules of one generation, whatever runs the model: sample (sampling.py), stop
    at an end id, a stop string, `max_new_tokens` or the context's end, and say which token to run
    next. `decode_loop` drives one on a `Session`; a batch drives one per row (batch_decode.py),
    so a row of a batch follows exactly the rules of a prompt alone.

    `step(logits)` takes the logits after the context and returns the `StreamedToken` to show (or
    None at an end token); then `next_token` is the token to run before the next step, or None
    when the generation is over (`finish` says why; `deferred` is the last token, in the context
    but not run)."""

    def __init__(self, runner: ForwardRunner, codec: TextCodec, options: GenerationOptions, context: list[int]):
        self.runner, self.sampler = runner, TokenSampler(options.sampling)  # its own RNG, seeded alike
        self.assembler = TextAssembler(codec.tokenizer, options.stop)
        self.stop_ids, self.max_new_tokens = options.stop_ids, options.max_new_tokens
        self.top_logprobs = options.logprobs
        self.history = list(context)  # what the repetition penalty looks at
        self.context_length = len(context)  # positions the model has run (or will, before the next step)
        self.events: list[StreamedToken] = []
        self.finish: Literal["stop", "eos", "length"] = "length"
        self.next_token: int | None = None
        self.deferred: int | None = None
        self.done = self.max_new_tokens <= 0
        self.constraint = options.constraint() if options.constraint is not None else None

    def step(self, logits) -> StreamedToken | None:
        step, self.next_token = len(self.assembler.ids), None
        if self.constraint is None:
            token = self.sampler(logits, self.history)
        else:  # the grammar narrows the choice; the logprobs below stay the model's own
            token = self.sampler(self.constraint.mask(logits), self.history)
            self.constraint.accept(token)
        if token in self.stop_ids:
            self.finish, self.done = "eos", True
            return None
        self.history.append(token)
        logprob, top = token_logprobs(logits, token, self.top_logprobs)
        piece = self.assembler.add(token)
        last = (self.assembler.stopped or step + 1 == self.max_new_tokens
                or self.context_length + 1 > self.runner.max_context)
        if last:
            piece += self.assembler.finish()
            self.finish = "stop" if self.assembler.stopped else "length"
            self.deferred, self.done = token, True
        else:
            self.next_token = token
            self.context_length += 1
        event = StreamedToken(token, piece, logprob, tuple(top))
        self.events.append(event)
        return event

    def tail(self) -> StreamedToken | None:
        """At the end: held-back text (an end token cut a possible stop string short), as an event."""
        text = self.assembler.finish()
        if not text:
            return None
        event = StreamedToken(None, text)
        self.events.append(event)
        return event

    def result(self, prompt_tokens: int, prefill_seconds: float, decode_seconds: float) -> GenerationResult:
        return GenerationResult(self.assembler.text, list(self.assembler.ids), prompt_tokens, self.finish,
                                prefill_seconds, decode_seconds, self.runner.stats.to_dict(),
                                prefilled_tokens=prompt_tokens, tokens=self.events)


class TokenStream(Iterator[StreamedToken]):
    """The `StreamedToken`s of one generation; once they are exhausted, `result` is the
    `GenerationResult` (None before, or when the consumer stopped early)."""

    def __init__(self, tokens: Generator[StreamedToken, None, GenerationResult], sink: list | None = None):
        """`sink`: a list that also receives the result (the 0.2 series' `result=` argument)."""
        self._tokens = tokens
        self._sink = sink
        self.result: GenerationResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> StreamedToken:
        try:
            return next(self._tokens)
        except StopIteration as end:
            if end.value is not None:  # a spent generator stops again with no value
                self.result = end.value
                if self._sink is not None:
                    self._sink.append(end.value)
            raise

    def close(self) -> None:
        self._tokens.close()


def result_sink(result: list | None) -> list | None:
    """The deprecated `result=` list of `stream`, warned about once per call."""
    if result is not None:
        warnings.warn("stream(result=[...]) is deprecated: the returned TokenStream holds the GenerationResult "
                      "as .result once exhausted", DeprecationWarning, stacklevel=3)
    return result


def decode_loop(session, prompt_ids: list[int],
                options: GenerationOptions) -> Generator[StreamedToken, None, GenerationResult]:
    """Generation on a `Session` (session.py): append `prompt_ids` to its context (an empty prompt
    continues from the context's last logits), then sample and append one token at a time
    (`RowDecoder`), yielding `StreamedToken`s. The last sampled token is deferred
    (`Session.defer`: in the context, run by whatever comes next), so no pass is spent on logits
    nobody reads. Returns the `GenerationResult`."""
    row = RowDecoder(session.runner, session.codec, options, session.tokens + list(prompt_ids))
    began = time.perf_counter()
    logits = None
    if not row.done:
        logits = session.append(prompt_ids) if prompt_ids else session.last_logits()
    prefill_seconds = time.perf_counter() - began
    with session.runner.generating():  # concurrent sessions' steps may run as one pass (runner.py)
        while not row.done:
            event = row.step(logits)
            if event is not None:
                yield event
            if row.deferred is not None:
                session.defer([row.deferred])
            if row.next_token is None:
                break
            logits = session.append([row.next_token])
    tail = row.tail()
    if tail is not None:
        yield tail
    return row.result(len(prompt_ids), prefill_seconds, time.perf_counter() - began - prefill_seconds)
