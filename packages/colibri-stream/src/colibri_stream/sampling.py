"""Choosing the next token from a logits row: the samplers, and the logprobs reported.

`SamplingConfig` applies, in this order (transformers' order, so its settings mean the same here):

1. `repetition_penalty` p (1 = off): every token already in the context (prompt and generated)
   has its logit divided by p where positive, multiplied by p where negative;
2. greedy when `temperature == 0` (the argmax of the penalised logits; the filters below
   cannot change an argmax), else the logits are divided by `temperature`;
3. `top_k` (0 = off): keep the k largest logits (ties with the k-th kept);
4. `top_p` (1 = off): keep the smallest set of most likely tokens whose probabilities sum to at
   least `top_p` (the most likely token always stays);
5. `min_p` (0 = off): keep tokens whose probability is at least `min_p` times the largest;
6. draw from the softmax of what is kept, with a `torch.Generator` seeded by `seed` (repeatable;
   unseeded: from OS entropy).

Logprobs (`token_logprobs`) are the model's own: log-softmax of the raw logits, before penalty,
temperature and filters (what the OpenAI API reports), for the chosen token and optionally the
`n` most likely.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, context: Iterable[int], penalty: float) -> torch.Tensor:
    if penalty == 1.0:
        return logits
    seen = torch.tensor(sorted(set(context)), dtype=torch.long)
    if seen.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[seen]
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filtered_logits(logits: torch.Tensor, config: SamplingConfig, context: Iterable[int] = ()) -> torch.Tensor:
    """Steps 1 and 3-5 on fp32 logits at the temperature: what is dropped becomes -inf."""
    logits = apply_repetition_penalty(logits.float().cpu(), context, config.repetition_penalty)
    logits = logits / (config.temperature or 1.0)
    if 0 < config.top_k < logits.numel():
        kth = torch.topk(logits, config.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of strictly more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before >= config.top_p  # the most likely token has before == 0: kept
        logits = logits.masked_fill(drop, float("-inf"))
    if config.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < config.min_p * probs.max(), float("-inf"))
    return logits


class TokenSampler:
    """Picks the next token from a logits row according to a `SamplingConfig`."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def distribution(self, logits: torch.Tensor, context: Iterable[int] = ()) -> torch.Tensor:
        """The probabilities a sampled token is drawn from (one-hot when greedy)."""
        if self.config.greedy:
            penalised = apply_repetition_penalty(logits.float().cpu(), context, self.config.repetition_penalty)
            return torch.nn.functional.one_hot(torch.argmax(penalised), logits.numel()).float()
        return torch.softmax(filtered_logits(logits, self.config, context), dim=-1)

    def __call__(self, logits: torch.Tensor, context: Iterable[int] = ()) -> int:
        if self.config.greedy:
            penalised = apply_repetition_penalty(logits.float().cpu(), context, self.config.repetition_penalty)
            return int(torch.argmax(penalised))
        probs = self.distribution(logits, context)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int = 0) -> tuple[float, list[tuple[int, float]]]:
    """(log p(token), the `top_n` most likely (id, log p), best first) under the raw logits."""
    logp = torch.log_softmax(logits.float().cpu(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.numel()))
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(logp[token]), top
