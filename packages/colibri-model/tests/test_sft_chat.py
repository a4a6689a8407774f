"""The ChatML-style template and its assistant-only loss mask, checked token by token."""

from __future__ import annotations

import json

import numpy as np
import pytest
from colibri_model.chat import ChatFormatError, encode_chat, format_chat
from colibri_model.corpus import chat_file
from colibri_model.data import IGNORE_INDEX, PackedLoader
from colibri_model.data.sft import load_chat_sources, read_conversations
from colibri_model.data.sources import DataSourceError
from colibri_model.tokenizer import load_tokenizer

TOK = load_tokenizer()
IM_START, IM_END, EOS = (TOK.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course.\nAnything else?"},
    {"role": "user", "content": "No."},
    {"role": "assistant", "content": "Bye!"},
]


def expected_mask(ids: list[int]) -> list[int]:
    """An independent reading of the template: walk the tokens as a state machine."""
    mask, role, state, header = [], None, "outside", []
    for token in ids:
        if token == IM_START:
            state, header = "header", []
            mask.append(0)
        elif state == "header":
            header.append(token)
            text = TOK.decode(header)
            if text.endswith("\n"):
                role, state = text[:-1], "content"
            mask.append(0)
        elif token == IM_END:
            mask.append(1 if role == "assistant" else 0)
            state = "outside"
        else:
            mask.append(1 if state == "content" and role == "assistant" else 0)
    return mask


def test_template_text_and_mask_token_by_token():
    ids, mask = encode_chat(CONVERSATION, TOK)
    assert TOK.decode(ids, skip_special_tokens=False) == format_chat(CONVERSATION)
    assert format_chat(CONVERSATION).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert len(mask) == len(ids)
    assert mask == expected_mask(ids)
    trained = [t for t, m in zip(ids, mask, strict=False) if m]
    assert TOK.decode(trained, skip_special_tokens=False) == "4, of course.\nAnything else?<|im_end|>Bye!<|im_end|>"
    assert sum(1 for t, m in zip(ids, mask, strict=False) if m and t == IM_END) == 2


def test_generation_prompt_is_untrained_assistant_header():
    ids, mask = encode_chat(CONVERSATION[:2], TOK, add_generation_prompt=True)
    assert TOK.decode(ids, skip_special_tokens=False).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert sum(mask) == 0


def test_bad_conversations_are_refused(tmp_path):
    with pytest.raises(ChatFormatError, match="role 'bot'"):
        encode_chat([{"role": "bot", "content": "x"}], TOK)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + '{"messages": 3}\n')
    with pytest.raises(DataSourceError, match=r"bad.jsonl:2: `messages` must be a non-empty list"):
        read_conversations(bad)


def test_bundled_chat_sample_packs_with_masked_targets():
    rows = read_conversations(chat_file())
    assert len(rows) == 800
    train, val = load_chat_sources([chat_file()], TOK, val_fraction=0.05)
    ids, mask = np.asarray(train.tokens[0]), np.asarray(train.loss_masks[0])
    assert ids.dtype == np.uint16 and ids.shape == mask.shape and 0 < mask.mean() < 1
    assert (mask[ids == IM_START] == 0).all() and (mask[ids == EOS] == 0).all()
    assert len(val.tokens[0]) > 0
    # a target is kept exactly where the next token's mask is 1, and then it is that token
    loader = PackedLoader(train, seq_len=128, seed=0)
    (shard, start), = loader.next_windows(1)
    x, y = loader.gather([(shard, start)])
    assert x[0].tolist() == ids[start:start + 128].tolist()
    m = mask[start + 1:start + 129].astype(bool)
    kept = y[0] != IGNORE_INDEX
    assert kept.tolist() == m.tolist()
    assert y[0][kept].tolist() == ids[start + 1:start + 129][m].tolist()
