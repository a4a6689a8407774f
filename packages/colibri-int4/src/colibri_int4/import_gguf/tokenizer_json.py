"""The tokenizer a GGUF's `tokenizer.*` metadata describes, as a Hugging Face tokenizer.json
(the container carries one; FORMAT.md), plus the chat template and special tokens.

A GGUF stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges, each token's type
(1 normal, 3 control, 4 user-defined), the special token ids and the pre-tokenizer by name
(`tokenizer.ggml.pre`). Byte-level BPE (`tokenizer.ggml.model` = "gpt2": SmolLM2, Qwen, OLMoE,
Llama 3) is written here as plain JSON (no `tokenizers` import): the vocabulary and merges as
the file has them, control tokens as special added tokens and user-defined ones as plain added
tokens (both matched whole, as llama.cpp does), and the pre-tokenizer split that llama.cpp's
`llm_tokenizer_bpe` applies for that name, in the regex of the model's own tokenizer.json.
Pre-tokenizer names not listed here are refused by name.

Sentencepiece vocabularies ("llama": Llama 2, Mistral, Mixtral) store scores, not merges: the
tokenizer is the BPE with byte fallback that transformers builds for them, its merges recovered
from the vocabulary and scores as transformers' `generate_merges` does (every split of a token
into two tokens, best score first), "▁" for spaces and a BOS prepended unless the file says not.
"""

from __future__ import annotations

import json

from ..errors import GGUFImportError
from ..header import TokenizerConfig

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split_then_bytes(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "trim_offsets": False, "use_regex": False}]}


# tokenizer.ggml.pre -> (pre_tokenizer, ignore_merges), as llama.cpp's llm_tokenizer_bpe splits
PRE_TOKENIZERS = {
    "gpt-2": (_BYTE_LEVEL, False), "olmo": (_BYTE_LEVEL, False),  # GPT-2's own regex
    # every digit alone, then GPT-2's regex
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
               False),
    "qwen2": (_split_then_bytes(_QWEN2), False), "deepseek-r1-qwen": (_split_then_bytes(_QWEN2), False),
    "llama-bpe": (_split_then_bytes(_LLAMA3), True),  # llama.cpp ignores merges for whole-word tokens here
    "gpt-4o": (_split_then_bytes(_GPT4O), False),  # o200k: GPT-OSS
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _get(metadata: dict, key: str, where: str, kind: type | tuple):
    value = metadata.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise GGUFImportError(f"{where}: metadata key '{key}' is missing or not a {getattr(kind, '__name__', kind)}")
    return value


def tokenizer_from_gguf(metadata: dict, where: str) -> tuple[bytes, TokenizerConfig]:
    """(tokenizer.json bytes, chat template and special tokens) of a GGUF's tokenizer metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece(metadata, where)
    if model != "gpt2":
        raise GGUFImportError(
            f"{where}: metadata key 'tokenizer.ggml.model' = {model!r} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece BPE)"
        )
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFImportError(
            f"{where}: metadata key 'tokenizer.ggml.pre' = {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = _get(metadata, "tokenizer.ggml.tokens", where, list)
    merges = _get(metadata, "tokenizer.ggml.merges", where, list)
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFImportError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        # a token outside the byte alphabet is one llama.cpp stored raw: spell its bytes
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, index)
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise GGUFImportError(f"{where}: tokenizer.ggml.merges entry {merge!r} is not two tokens")
        pairs.append(parts)
    added = [
        {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind == CONTROL}
        for index, (token, kind) in enumerate(zip(tokens, types))
        if token and (kind == CONTROL and set(token) <= alphabet or kind == USER_DEFINED and vocab.get(token) == index)
    ]
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    config = _tokenizer_config(metadata, tokens, where, add_bos_default=False)
    document = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": pre_tokenizer, "post_processor": _bos_processor(metadata, tokens, config),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": pairs},
    }
    return json.dumps(document, ensure_ascii=False).encode("utf-8"), config


def _sentencepiece(metadata: dict, where: str) -> tuple[bytes, TokenizerConfig]:
    tokens = _get(metadata, "tokenizer.ggml.tokens", where, list)
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise GGUFImportError(f"{where}: metadata key 'tokenizer.ggml.scores' is missing or not one score per token")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFImportError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = metadata.get("tokenizer.ggml.merges")
    pairs = [m.split(" ", 1) for m in merges] if isinstance(merges, list) else _merges_from_scores(vocab, tokens, scores)
    added = [
        {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind != USER_DEFINED}
        for index, (token, kind) in enumerate(zip(tokens, types)) if kind in (UNKNOWN, CONTROL, USER_DEFINED) and token
    ]
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    config = _tokenizer_config(metadata, tokens, where, add_bos_default=True)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    document = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first" if prefix else "never",
                          "split": False},
        "post_processor": _bos_processor(metadata, tokens, config),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens)
                  else None, "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": pairs},
    }
    return json.dumps(document, ensure_ascii=False).encode("utf-8"), config


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[list[str]]:
    """transformers' `generate_merges` with scores: every split of a token into two tokens, ranked by
    the merged token's score (best first), then by the pieces' lengths; ties keep vocabulary order."""
    found = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in found]


def _bos_processor(metadata: dict, tokens: list[str], config: TokenizerConfig) -> dict | None:
    """A post-processor that prepends BOS, as llama.cpp does when `add_bos_token` says so."""
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if not config.add_bos_token or not isinstance(bos, int):
        return None
    first = {"SpecialToken": {"id": tokens[bos], "type_id": 0}}
    return {"type": "TemplateProcessing", "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": tokens[bos], "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}


def _tokenizer_config(metadata: dict, tokens: list[str], where: str, add_bos_default: bool) -> TokenizerConfig:
    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise GGUFImportError(f"{where}: metadata key 'tokenizer.ggml.{key}' = {index!r} is not a token id")
        return tokens[index]

    # llama.cpp ends a generation on eos and on the end-of-turn / end-of-message tokens
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if token(key) is not None and metadata[f"tokenizer.ggml.{key}"] not in eos_ids:
            eos_ids.append(metadata[f"tokenizer.ggml.{key}"])
    template = metadata.get("tokenizer.chat_template")
    try:
        return TokenizerConfig(
            chat_template=template if isinstance(template, str) else None, bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"), pad_token=token("padding_token_id"), eos_token_ids=eos_ids,
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        )
    except ValueError as exc:
        raise GGUFImportError(f"{where}: tokenizer settings: {str(exc).splitlines()[0]}") from None
