"""Token selection and text assembly for generation: sampling, stop strings, streaming text.

- `SamplingConfig`: greedy when `temperature == 0` (the default), else softmax at the
  temperature restricted to the nucleus (`top_p`): the smallest set of most likely tokens whose
  probabilities sum to at least `top_p`. A seeded `torch.Generator` makes sampling repeatable.
- `decode_loop`: prefill, then sample / decode one token at a time through the engine's public
  incremental API (`reset`, `forward_tokens`, `context_length`), yielding text;
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

import torch
from tokenizers import Tokenizer


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class TokenSampler:
    """Picks the next token from a logits row according to a `SamplingConfig`."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.float().cpu()
        if self.config.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.config.temperature, dim=-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of strictly more likely tokens
            keep = before < self.config.top_p  # always keeps the most likely token
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))


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


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: Literal["stop", "eos", "length"]
    prefill_seconds: float  # time to first token
    decode_seconds: float
    stats: dict = field(default_factory=dict)

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
    engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop: tuple[str, ...],
    stop_ids: set[int],
    result: list | None,
) -> Iterator[str]:
    """The generation loop of `Engine.stream` (engine: its `reset`, `forward_tokens`,
    `context_length`, `max_context`, `tokenizer` and `stats`). Appends a `GenerationResult` to
    `result` at the end."""
    sampler = TokenSampler(sampling)
    assembler = TextAssembler(engine.tokenizer, stop)
    engine.reset()
    finish = "length"
    began = time.perf_counter()
    logits = None
    if max_new_tokens > 0:
        logits = engine.forward_tokens(prompt_ids)
    prefill_seconds = time.perf_counter() - began
    for step in range(max_new_tokens):
        token = sampler(logits)
        if token in stop_ids:
            finish = "eos"
            break
        piece = assembler.add(token)
        if piece:
            yield piece
        if assembler.stopped:
            finish = "stop"
            break
        if step + 1 == max_new_tokens or engine.context_length + 1 > engine.max_context:
            break
        logits = engine.forward_tokens([token])
    tail = assembler.finish()
    if tail:
        yield tail
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
            )
        )
