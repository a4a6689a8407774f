"""`manifest.json` of a prepared data directory: which shards, how many tokens, which tokenizer.

A pydantic model with `manifest_version` (spec: TRAINING.md). The trainer reads it to find
the shards and refuses a manifest whose tokenizer does not match the model's vocabulary. While
`prepare` runs, `complete` is false and `progress` records how far the inputs were consumed at
the last finished shard, which is what makes `prepare` resumable.
"""

from __future__ import annotations

import os
from pathlib import Path

from colibri_spec import read_versioned_json
from pydantic import BaseModel, ConfigDict

from ..errors import ManifestError

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = "1.0"


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str
    tokens: int
    documents: int
    sha256: str


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str  # "default" (bundled SmolLM2), a path, or a Hub id
    sha256: str  # of the tokenizer JSON text
    vocab_size: int
    eos_id: int


class PrepareProgress(BaseModel):
    """Where `prepare` stood after its last finished train shard."""

    model_config = ConfigDict(extra="forbid")
    input_index: int = 0  # inputs before this one are fully consumed
    documents_done: int = 0  # documents of inputs[input_index] already consumed
    val_tokens: int = 0  # tokens already appended to the partial validation file
    val_documents: int = 0


class DataManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    manifest_version: str = MANIFEST_VERSION
    kind: str = "pretrain"
    inputs: list[str]
    tokenizer: TokenizerInfo
    shard_tokens: int
    val_fraction: float
    text_field: str = "text"
    train_shards: list[ShardEntry] = []
    val_shard: ShardEntry | None = None
    complete: bool = False
    progress: PrepareProgress = PrepareProgress()

    @property
    def train_tokens(self) -> int:
        return sum(s.tokens for s in self.train_shards)


def read_manifest(directory: str | os.PathLike) -> DataManifest:
    return read_versioned_json(Path(directory) / MANIFEST_FILE, DataManifest, version_key="manifest_version",
                               version=MANIFEST_VERSION, error=ManifestError, what="manifest",
                               missing="not a data directory made by `colibri-model prepare`", reader="colibri-model")


def write_manifest(directory: str | os.PathLike, manifest: DataManifest) -> None:
    path = Path(directory) / MANIFEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def open_data_dir(directory: str | os.PathLike, vocab_size: int | None = None):
    """(train TokenSource, validation TokenSource, manifest) of a finished data directory.

    Checks that prepare finished, that every shard's header agrees with the manifest, and (when
    `vocab_size` is given) that the tokenizer fits the model.
    """
    from .loader import TokenSource
    from .shards import read_shard

    directory = Path(directory)
    manifest = read_manifest(directory)
    if not manifest.complete:
        raise ManifestError(f"{directory}: `prepare` has not finished here (run it again to resume)")
    if vocab_size is not None and manifest.tokenizer.vocab_size > vocab_size:
        raise ManifestError(
            f"{directory}: data tokenized with a {manifest.tokenizer.vocab_size}-token vocabulary, "
            f"the model has {vocab_size}"
        )

    def load(entry: ShardEntry):
        tokens = read_shard(directory / entry.file)
        if len(tokens) != entry.tokens:
            raise ManifestError(f"{directory / entry.file}: {len(tokens)} tokens, manifest says {entry.tokens}")
        return tokens

    train = TokenSource([load(s) for s in manifest.train_shards], None, [s.file for s in manifest.train_shards])
    if manifest.val_shard is None:
        raise ManifestError(f"{directory}: manifest has no validation shard")
    val = TokenSource([load(manifest.val_shard)], None, [manifest.val_shard.file])
    return train, val, manifest
