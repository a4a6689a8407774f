"""Colibri's ChatML-style chat template and the assistant-only loss mask of SFT.

    <|im_start|>system\\n{content}<|im_end|>\\n      (optional)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n

The loss mask is 1 exactly on the tokens of each assistant `content` and on the `<|im_end|>`
that closes it (so the model learns when to stop), and 0 on every header, on user and system
turns, and on the newline after `<|im_end|>`. Each piece is encoded on its own and the ids are
concatenated, so the mask boundaries are exact token boundaries (a BPE merge can never straddle
a role header and its content) and a generation prompt ending in `<|im_start|>assistant\\n`
tokenizes exactly as it did in training. The tokens are SmolLM2's special ids, but the
template (no default system line) is ours.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from .errors import ChatFormatError
from .tokenizer import IM_END, IM_START

ROLES = ("system", "user", "assistant")


def validate_messages(messages, where: str = "conversation") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: `messages` must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ChatFormatError(f"{where}: message {i} needs a string `content`")
        if message.get("role") not in ROLES:
            raise ChatFormatError(f"{where}: message {i} has role {message.get('role')!r}; use one of {ROLES}")
    return messages


def format_chat(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as template text (for display or for tokenizers that need a string)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _pieces(messages: Sequence[dict]) -> list[tuple[str, int]]:
    """(text, trained) pieces in order; each piece is tokenized separately."""
    pieces: list[tuple[str, int]] = []
    for m in messages:
        trained = 1 if m["role"] == "assistant" else 0
        pieces += [(f"{IM_START}{m['role']}\n", 0), (m["content"], trained), (IM_END, trained), ("\n", 0)]
    return pieces


def encode_chat_batch(conversations: Sequence[Sequence[dict]], tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """Encode many conversations at once: a (token ids, loss mask) pair per conversation."""
    all_pieces = [_pieces(c) for c in conversations]
    flat = [text for pieces in all_pieces for text, _ in pieces]
    encodings = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    out, cursor = [], 0
    for pieces in all_pieces:
        ids: list[int] = []
        mask: list[int] = []
        for _, trained in pieces:
            piece_ids = encodings[cursor].ids
            cursor += 1
            ids += piece_ids
            mask += [trained] * len(piece_ids)
        out.append((ids, mask))
    return out


def encode_chat(messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Token ids and the assistant-only loss mask (1 = trained) of one conversation.

    Example:
        >>> ids, mask = encode_chat([{"role": "user", "content": "Hi"},
        ...                          {"role": "assistant", "content": "Hello!"}], load_tokenizer())
    """
    ids, mask = encode_chat_batch([validate_messages(list(messages))], tokenizer)[0]
    if add_generation_prompt:
        prompt = tokenizer.encode(f"{IM_START}assistant\n", add_special_tokens=False).ids
        ids, mask = ids + prompt, mask + [0] * len(prompt)
    return ids, mask
