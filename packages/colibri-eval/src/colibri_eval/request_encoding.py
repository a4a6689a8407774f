"""Strings to token requests, exactly as lm-eval's ``TemplateLM.loglikelihood`` does it.

- A context's trailing whitespace moves to the front of the continuation (so " Paris" is
  scored as one token, not "" + " Paris" split oddly);
- continuation tokens = tok(context + continuation)[len(tok(context)):], which keeps the
  tokenizer's merges across the boundary identical to scoring the whole string;
- an empty context becomes the model's prefix token (BOS if it has one, else EOS) and the
  continuation is tokenized alone;
- no special tokens are added (lm-eval's default ``add_bos_token=False`` for causal LMs).

Contexts repeat across choices, so their encodings are memoised per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class TextTokenizer(Protocol):
    """What the scorer needs from a tokenizer."""

    prefix_token_id: int  # used as the context of an empty-context request
    eot_token_id: int  # end of text, stops generation

    def encode(self, text: str) -> list[int]: ...  # no special tokens

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class TokenRequest:
    context: tuple[int, ...]
    continuation: tuple[int, ...]


def encode_requests(tokenizer: TextTokenizer, pairs: Sequence[tuple[str, str]]) -> list[TokenRequest]:
    """Encode (context, continuation) string pairs with lm-eval's rules."""
    memo: dict[str, list[int]] = {}

    def encode(text: str) -> list[int]:
        if text not in memo:
            memo[text] = tokenizer.encode(text)
        return memo[text]

    out = []
    for context, continuation in pairs:
        if context == "":
            out.append(TokenRequest((tokenizer.prefix_token_id,), tuple(tokenizer.encode(continuation))))
            continue
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        context_ids = encode(context)
        whole = tokenizer.encode(context + continuation)
        out.append(TokenRequest(tuple(context_ids), tuple(whole[len(context_ids):])))
    return out
