"""Train a small byte-level BPE tokenizer (the `tokenizers` trainer) for CPU-scale runs.

Why: at the tiny preset the bundled 49152-token SmolLM2 vocabulary makes the LM head (and its
softmax) about 75% of a training step. A 2048-4096 token BPE trained on the text a run uses
keeps the head small, so CPU experiments spend their time in the layers they study.

The result is an ordinary `tokenizer.json` with the same shape as the bundled one: byte-level
pre-tokenizer and decoder (every UTF-8 string round-trips), no normaliser, and the special
tokens `<|endoftext|>` (id 0, the document separator the data pipeline requires),
`<|im_start|>` and `<|im_end|>` (chat turns), so `prepare --tokenizer`, SFT and colibri-eval take
it as they take the default.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .data.shards import MAX_VOCAB  # token ids must fit the uint16 shards
from .tokenizer import EOS_TOKEN, IM_END, IM_START, TokenizerError

SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
BYTE_ALPHABET = 256  # byte-level BPE starts from every byte
TEXT_SUFFIXES = (".txt", ".md")


def text_files(inputs: list[str | os.PathLike]) -> list[Path]:
    """The .txt/.md files named by INPUTS (files, or directories searched recursively), in order.

    Raises TokenizerError naming the first input that is missing, not text, or an empty directory.
    """
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
            if not found:
                raise TokenizerError(f"{path}: directory holds no {'/'.join(TEXT_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in TEXT_SUFFIXES:
                raise TokenizerError(f"{path}: not a text file (expected {' or '.join(TEXT_SUFFIXES)})")
            files.append(path)
        else:
            raise TokenizerError(f"{path}: no such file or directory")
    if not files:
        raise TokenizerError("no input text given")
    return files


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8-sig")  # the bundled Frankenstein starts with a BOM
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return text


def train_bpe_tokenizer(inputs: list[str | os.PathLike], vocab_size: int = 4096,
                        min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (specials included) trained on INPUTS' text."""
    smallest = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if not smallest <= vocab_size <= MAX_VOCAB:
        raise TokenizerError(f"vocab_size {vocab_size}: must be between {smallest} (256 bytes + "
                             f"{len(SPECIAL_TOKENS)} special tokens) and {MAX_VOCAB} (uint16 shards)")
    files = text_files(inputs)
    texts = [(path, _read_text(path)) for path in files]
    empty = [str(path) for path, text in texts if not text.strip()]
    if len(empty) == len(texts):
        raise TokenizerError(f"{', '.join(empty)}: no text to train on")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )

    def paragraphs():
        for _, text in texts:
            # Paragraph-sized pieces keep the trainer's word counts small without changing them.
            yield from text.split("\n\n")

    tokenizer.train_from_iterator(paragraphs(), trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: str | os.PathLike) -> Path:
    """Write `tokenizer.json` to OUT (a .json path, or a directory that gets OUT/tokenizer.json)."""
    out = Path(out)
    target = out if out.suffix == ".json" else out / "tokenizer.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, target)
    return target
