"""lm-eval's token-level request rules, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest
from colibri_eval.request_encoding import TokenRequest, encode_requests


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json):
    tokenizers = pytest.importorskip("tokenizers")
    from colibri_eval.adapters.tokenizer_wrappers import TokenizersTokenizer

    return TokenizersTokenizer(tokenizers.Tokenizer.from_file(str(tokenizer_json)))


def test_trailing_space_moves_into_continuation(tokenizer):
    [with_space] = encode_requests(tokenizer, [("The capital of France is ", "Paris")])
    [plain] = encode_requests(tokenizer, [("The capital of France is", " Paris")])
    assert with_space == plain
    assert tokenizer.decode(plain.continuation) == " Paris"


def test_continuation_is_the_tail_of_the_joint_encoding(tokenizer):
    context, continuation = "Question: 2+2=\nAnswer:", " 4 apples"
    [request] = encode_requests(tokenizer, [(context, continuation)])
    whole = tokenizer.encode(context + continuation)
    assert list(request.context) == tokenizer.encode(context)
    assert list(request.continuation) == whole[len(request.context):]


def test_empty_context_gets_the_prefix_token(tokenizer):
    [request] = encode_requests(tokenizer, [("", " hello world")])
    assert request == TokenRequest((tokenizer.prefix_token_id,), tuple(tokenizer.encode(" hello world")))
    assert tokenizer.prefix_token_id == 0  # <|endoftext|>
