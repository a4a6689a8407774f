"""Two tokenizer wrappers with lm-eval's semantics (no special tokens when encoding, except
a BOS for Gemma-family HF models, as lm-eval's hf backend does).

``HFTokenizer`` wraps a transformers tokenizer (prefix token: BOS if it has one, else EOS, as
lm-eval's hf backend); ``TokenizersTokenizer`` wraps a bare ``tokenizers.Tokenizer`` (the
colibri checkpoints), where the prefix and end-of-text token is ``<|endoftext|>``, the
document separator of the pretraining shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HFTokenizer:
    def __init__(self, tokenizer: Any, add_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        # lm-eval's hf backend adds special tokens (BOS) only for the Gemma family
        self.add_special_tokens = add_special_tokens
        eos = tokenizer.eos_token_id
        bos = tokenizer.bos_token_id
        self.eot_token_id = eos if eos is not None else bos
        self.prefix_token_id = bos if bos is not None else eos

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


class TokenizersTokenizer:
    def __init__(self, tokenizer: Any, end_of_text: str = "<|endoftext|>") -> None:
        self.tokenizer = tokenizer
        token_id = tokenizer.token_to_id(end_of_text)
        if token_id is None:
            raise ValueError(f"tokenizer has no {end_of_text!r} token")
        self.eot_token_id = token_id
        self.prefix_token_id = token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
