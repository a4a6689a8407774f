"""One request's generation, whatever API asked for it: its choices streamed as (choice index,
`StreamedToken`), the `GenerationResult` of each, the prompt tokens whose KV cache was reused,
and the telemetry (telemetry.py).

- One prompt, one choice: a `Session` (or the pooled chat session, session_pool.py), so a chat
  that resends its conversation prefills only the new turn (`cached_tokens`).
- `n` > 1 and lists of prompts: the package's batched decoding (batch_decode.py): one padded
  prefill of every (prompt, choice) row, then one [rows, 1] pass per step; each distinct expert
  is read once per step for all rows. Choice j of a prompt samples with its own generator seeded
  `seed + j`, so with `seed` set:

  * choice 0 of any `n` is what `n=1` with the same seed gives, and choice j is what `n=1` with
    `seed + j` gives: a row of a batch computes the logits of its prompt alone (batch_decode.py),
    its own generator draws the same numbers, whatever the batch size;
  * "the same logits" means to float rounding: with f32 expert kernels the rows agree to f32
    rounding on every CPU; torch's bf16 int4 kernel rounds a many-row batch differently from one
    row on CPUs with AMX (logprobs ~5e-4 apart), which can flip a sample that sits on a boundary.

  Without `seed`, each choice draws from OS entropy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from ..batch_decode import decode_rows
from ..generation import GenerationResult, RowDecoder, StreamedToken, TokenStream, generation_options
from .telemetry import InFlight, RequestTelemetry


@dataclass
class Spec:
    """What every API's request boils down to (the API modules parse their own field names)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None  # None: none reported; else alternatives per token
    constraint: object | None = None  # a factory of per-row token constraints (constrained.py)

    def session_kwargs(self, choice: int = 0) -> dict:
        seed = None if self.seed is None else self.seed + choice
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, seed=seed, stop=self.stop,
                    logprobs=self.logprobs or 0, constraint=self.constraint)


class Run:
    """A request's generation under way. Iterate `events` to the end; then `results` holds one
    `GenerationResult` per choice (index order) and `telemetry()` the `colibri` object."""

    def __init__(self, engine, events: Iterator[tuple[int, StreamedToken]], results: list,
                 prompt_tokens: list[int] | None, cached_tokens: int, telemetry: RequestTelemetry):
        self.engine, self._results, self.prompt_tokens = engine, results, prompt_tokens
        self.cached_tokens, self._telemetry = cached_tokens, telemetry
        self.events = self._watch(events)

    def _watch(self, events):
        try:
            for item in events:
                self._telemetry.mark_token()
                yield item
        finally:
            self._telemetry.finish(self.completion_tokens())

    @property
    def results(self) -> list[GenerationResult]:
        return [r for r in self._results if r is not None]

    def completion_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    def prompt_token_count(self) -> int:
        """The prompt's tokens (each prompt once, whatever `n`); a session's run says it in its result."""
        if self.prompt_tokens is None:  # known once the run is over
            return sum(r.prompt_tokens for r in self.results)
        return sum(self.prompt_tokens)

    def usage(self) -> dict:
        prompt, completion = self.prompt_token_count(), self.completion_tokens()
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def telemetry(self) -> dict:
        return self._telemetry.finish(self.completion_tokens())


def single(engine, stream: TokenStream, cached_tokens: int, in_flight: InFlight | None,
           telemetry: RequestTelemetry | None = None, prompt_tokens: int | None = None, *,
           tokens: Iterator[StreamedToken] | None = None) -> Run:
    """A run of one choice on a session: `stream` is its `TokenStream`, whose result (its
    `prompt_tokens` the whole prompt, reused prefix included) the run reports once it is over;
    `tokens`, when given, is what to iterate instead (the stream wrapped, e.g. to return a pooled
    session). `telemetry`: one begun earlier (a prefill that ran before the stream did)."""
    telemetry = telemetry or RequestTelemetry(engine, in_flight)
    counted = None if prompt_tokens is None else [prompt_tokens]
    results: list[GenerationResult | None] = [None]

    def events() -> Iterator[tuple[int, StreamedToken]]:
        for token in stream if tokens is None else tokens:
            yield 0, token
        results[0] = stream.result

    return Run(engine, events(), results, counted, cached_tokens, telemetry)


def batched(engine, prompts: list[list[int]], spec: Spec, in_flight: InFlight | None) -> Run:
    """`spec.n` choices of every prompt as batched rows; choice index = prompt index * n + j, as
    OpenAI numbers them. Checked here (a ValueError names a bad option) before any output."""
    base = generation_options(engine.codec, spec.max_tokens, **spec.session_kwargs(0))
    options = [base if spec.seed is None or j == 0 else
               replace(base, sampling=replace(base.sampling, seed=spec.seed + j)) for j in range(spec.n)]
    rows = [(p, options[j]) for p in prompts for j in range(spec.n)]
    limit = engine.max_context
    for p, _ in rows:
        if len(p) >= limit:
            raise ValueError(f"the prompt ({len(p)} tokens) does not fit the engine's max_context={limit}")
    results: list[GenerationResult | None] = [None] * len(rows)
    telemetry = RequestTelemetry(engine, in_flight)

    def events() -> Iterator[tuple[int, StreamedToken]]:
        per_batch = max(1, engine.prefill_chunk)  # a decode step holds no more tokens than the workspace
        for first in range(0, len(rows), per_batch):
            group = rows[first : first + per_batch]
            decoders = [RowDecoder(engine.runner, engine.codec, o, p) for p, o in group]
            done = yield from decode_rows(engine.runner, [p for p, _ in group], decoders, first=first)
            results[first : first + len(group)] = done

    return Run(engine, events(), results, [len(p) for p in prompts], 0, telemetry)  # a prompt counts once


@dataclass
class Answer:
    """What an endpoint hands the HTTP layer: a JSON `body`, or server-sent `events` ((event name
    or None, data) pairs; `done_marker`: end with OpenAI's `data: [DONE]`)."""

    body: dict | None = None
    events: Iterator[tuple[str | None, dict]] | None = None
    done_marker: bool = False


def drain(run) -> None:
    """Run a non-streaming request to its end."""
    for _ in run.events:
        pass


def matched_stop(engine, result: GenerationResult, stops: list[str]) -> str | None:
    """Which stop string ended `result` (the text is cut where it began), for the APIs that
    name it (Anthropic's `stop_sequence`)."""
    if result.finish_reason != "stop":
        return None
    whole = engine.tokenizer.decode(result.token_ids)
    return next((s for s in stops if whole.startswith(s, len(result.text))), None)
