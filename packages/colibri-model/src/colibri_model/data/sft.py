"""SFT data: chat JSONL (`{"messages": [...]}`, smol-smoltalk's shape) -> packed token streams.

Each conversation is rendered with the chat template of chat.py, followed by EOS (mask 0), and
the conversations are concatenated into one token array with a parallel loss mask. The packed
loader then slices it exactly like pretraining shards, with targets outside assistant turns set
to -100. A conversation goes to the validation stream when the hash of its JSON line falls
under `val_fraction` (stable under re-ordering). Everything is held in memory: smol-smoltalk
(~460k conversations, ~0.3B tokens) fits in about 1 GB as uint16 + uint8.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..chat import ChatFormatError, encode_chat_batch, validate_messages
from ..tokenizer import EOS_TOKEN
from .loader import TokenSource
from .prepare import is_validation
from .sources import DataSourceError, jsonl_rows


def read_conversations(path: str | os.PathLike) -> list[tuple[str, list[dict]]]:
    """(raw line, messages) for each non-empty line; an error names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"{path}: no such chat JSONL file")
    rows = []
    for number, line, row in jsonl_rows(path):
        try:
            messages = validate_messages(row.get("messages") if isinstance(row, dict) else None, f"{path}:{number}")
        except ChatFormatError as exc:
            raise DataSourceError(str(exc)) from None
        rows.append((line, messages))
    if not rows:
        raise DataSourceError(f"{path}: holds no conversations")
    return rows


def _stream(conversations: list[list[dict]], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids_parts, mask_parts = [], []
    for start in range(0, len(conversations), 512):
        for ids, mask in encode_chat_batch(conversations[start:start + 512], tokenizer):
            ids_parts.append(np.asarray(ids + [eos], dtype=np.uint16))
            mask_parts.append(np.asarray(mask + [0], dtype=np.uint8))
    if not ids_parts:
        return np.zeros(0, np.uint16), np.zeros(0, np.uint8)
    return np.concatenate(ids_parts), np.concatenate(mask_parts)


def load_chat_sources(paths: list[str | os.PathLike], tokenizer: Tokenizer,
                      val_fraction: float = 0.05) -> tuple[TokenSource, TokenSource]:
    """(train, validation) token sources for SFT from one or more chat JSONL files."""
    train, val = [], []
    for path in paths:
        for line, messages in read_conversations(path):
            (val if is_validation(line, val_fraction) else train).append(messages)
    if not train or not val:
        raise DataSourceError(
            f"{', '.join(map(str, paths))}: {len(train)} training and {len(val)} validation conversations; "
            f"need at least one of each (adjust --val-fraction, now {val_fraction})"
        )
    train_ids, train_mask = _stream(train, tokenizer)
    val_ids, val_mask = _stream(val, tokenizer)
    return (TokenSource([train_ids], [train_mask], ["sft-train"]),
            TokenSource([val_ids], [val_mask], ["sft-val"]))
