"""Constrained decoding: `response_format` (`json_object`, `json_schema`) and forced tool calls,
enforced token by token with llguidance (`pip install colibri-stream[serve]`).

Why llguidance (README, "Constrained decoding"): it installs as one abi3 wheel with no
dependencies (xgrammar brings triton and transformers, outlines-core builds a whole-vocabulary
index per schema up front); it reads the container's tokenizer.json as it is (`LLTokenizer`,
byte-level BPE included) with no transformers; and it computes each step's mask lazily from an
Earley parser over the token trie, ~1 ms per token for the 49k-token vocabulary here
(bench/constrained_decoding.py measures the overhead against free decoding).

A `Grammar` is compiled once per request and is a factory of `RowConstraint`s, one per choice
(generation.py's `GenerationOptions.constraint`): each row's `mask(logits)` sets the tokens the
grammar forbids to -inf before the sampler draws, and `accept(token)` advances its parser. The
logprobs a response reports stay the model's own (of the raw logits). When the grammar is
complete only the end tokens remain allowed, so the reply ends with `finish_reason` "stop";
`max_tokens` can still cut a reply short ("length"), as OpenAI's does.

JSON is generated compact (no free whitespace): a small or random model otherwise fills the
answer with blank lines the grammar allows.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from .errors import bad, unsupported

COMPACT = {"whitespace_flexible": False}


class Grammars:
    """The llguidance view of an engine's tokenizer (built once, ~0.3 s for 49k tokens)."""

    def __init__(self, engine):
        self.engine = engine
        self._tokenizer = None

    def tokenizer(self):
        if self._tokenizer is None:
            llguidance = _llguidance()
            self._tokenizer = llguidance.LLTokenizer(self.engine.tokenizer.to_str(),
                                                     eos_token=list(self.engine.end_token_ids))
        return self._tokenizer

    def json_schema(self, schema: dict, param: str) -> Grammar:
        llguidance = _llguidance()
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
        except (ValueError, TypeError) as exc:
            raise bad(f"'{param}' is not a usable JSON schema: {exc}", param) from None
        return self._compiled(text, param)

    def lark(self, source: str, param: str) -> Grammar:
        return self._compiled(_llguidance().LLMatcher.grammar_from_lark(source), param)

    def tool_call(self, body_schema: dict, param: str = "tool_choice") -> Grammar:
        """One `<tool_call>` block (tool_calls.py's format) whose JSON matches `body_schema`."""
        schema = dict(body_schema, **{"x-guidance": COMPACT})
        return self.lark('start: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json ' + json.dumps(schema), param)

    def _compiled(self, text: str, param: str) -> Grammar:
        llguidance = _llguidance()
        ok, _, messages = _validated(llguidance, text, self.tokenizer())
        if not ok:
            raise bad(f"'{param}' cannot be enforced: {messages}", param)
        return Grammar(self, text)


def _validated(llguidance, text: str, tokenizer):
    is_error, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    return (not is_error), warnings, "; ".join(warnings) if isinstance(warnings, list) else str(warnings)


class Grammar:
    def __init__(self, grammars: Grammars, text: str):
        self.grammars, self.text = grammars, text

    def __call__(self) -> RowConstraint:
        return RowConstraint(_llguidance().LLMatcher(self.grammars.tokenizer(), self.text, log_level=0))


class RowConstraint:
    """One choice's parser state (see the module docstring)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(logits.numel(), dtype=torch.bool)
        n = min(len(bits), logits.numel())  # ids past the tokenizer's (a padded vocabulary) stay forbidden
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        return logits.float().cpu().masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))


def response_format(body: dict, grammars: Grammars) -> Grammar | None:
    """OpenAI chat's `response_format`: text (no constraint), json_object, json_schema."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return grammars.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        inner = spec.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                      "response_format")
        return grammars.json_schema(schema, "response_format")
    raise bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise unsupported("response_format", "constrained decoding needs llguidance "
                                             "(pip install 'colibri-stream[serve]')") from None
    return llguidance
