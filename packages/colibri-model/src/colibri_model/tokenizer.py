"""The default tokenizer and how to load another.

Colibri ships SmolLM2's real 49152-token byte-level BPE (Apache-2.0; provenance in
assets/README.md), gzipped inside the package so that nothing is downloaded at run time.
49152 < 65536, so token ids fit the uint16 shards of the data pipeline.
"""

from __future__ import annotations

import gzip
import os
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from .errors import TokenizerError

DEFAULT_TOKENIZER_ASSET = "smollm2-49152.tokenizer.json.gz"
EOS_TOKEN = "<|endoftext|>"  # document separator in pretraining shards
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # chat turns (ChatML-style)


def default_tokenizer_json() -> str:
    data = resources.files("colibri_model").joinpath("assets", DEFAULT_TOKENIZER_ASSET).read_bytes()
    return gzip.decompress(data).decode("utf-8")


def load_tokenizer(source: str | os.PathLike | None = None) -> Tokenizer:
    """Load a tokenizer: None -> the bundled default; a `tokenizer.json` file; a directory
    holding one (e.g. a checkpoint); or a Hugging Face Hub id when online. Raises
    `TokenizerError` (one line naming `source`) when none of these works."""
    if source is None:
        return Tokenizer.from_str(default_tokenizer_json())
    path = Path(source)
    try:
        if path.is_dir():
            candidate = path / "tokenizer.json"
            return Tokenizer.from_file(str(candidate)) if candidate.is_file() else load_tokenizer(None)
        if path.is_file():
            return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise TokenizerError(f"{source}: not a readable tokenizer.json ({str(exc).splitlines()[0]})") from None
    if str(source).startswith((".", "/", "~")) or path.suffix == ".json":
        raise TokenizerError(f"{source}: no such tokenizer file or directory")
    try:
        return Tokenizer.from_pretrained(str(source))
    except Exception as exc:  # Hub, network and validation errors come in many types
        raise TokenizerError(f"{source}: not a tokenizer file or directory, and not loadable as a Hub id "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


def tokenizer_json(tokenizer: Tokenizer) -> str:
    return tokenizer.to_str()
