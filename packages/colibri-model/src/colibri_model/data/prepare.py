"""`colibri-model prepare`: documents -> uint16 token shards + a held-out validation shard.

Pipeline: inputs (files, directories, Hub ids) -> documents in a fixed order -> batched BPE
encoding (`tokenizers`' Rust threads) -> each document + EOS appended to the train buffer or,
if its content hash falls under `val_fraction`, to the validation stream -> a train shard is
written whenever the buffer reaches `shard_tokens` (shards end on document boundaries, so they
are a little larger than the target).

All or nothing: the shards are written into `OUT.partial` beside `OUT`, which is renamed to
`OUT` only when complete, so `OUT` never holds half a data set and a failed run never blocks a
retry with other arguments (the retry discards the unfinished `OUT.partial`; a run that ends in
an error about its settings, e.g. no validation document, removes it at once). An `OUT` that
already holds a finished prepare is returned as is for the same inputs and settings and refused
(one line) for others.

Resumable: after every train shard the manifest in `OUT.partial` records how far the inputs
were consumed and how many validation tokens were flushed. An interrupted run restarted with
the same arguments truncates the partial validation file to that count, ignores shards beyond
the manifest, and skips the consumed documents. Assigning validation documents by a hash of
their text (not by position) keeps the split stable when inputs are appended or re-ordered.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..tokenizer import EOS_TOKEN, load_tokenizer
from .manifest import (
    MANIFEST_FILE,
    DataManifest,
    ManifestError,
    PrepareProgress,
    ShardEntry,
    TokenizerInfo,
    read_manifest,
    write_manifest,
)
from .shards import MAX_VOCAB, write_shard
from .sources import expand_inputs, iter_documents

VAL_PARTIAL = "val.partial"
VAL_SHARD = "val.bin"


def train_shard_name(index: int) -> str:
    return f"train_{index:05d}.bin"


def tokenizer_info(source: str | None):
    """(tokenizer, TokenizerInfo) for a tokenizer source (None = the bundled default)."""
    tokenizer = load_tokenizer(source)
    text = tokenizer.to_str()
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ManifestError(f"tokenizer {source or 'default'}: has no {EOS_TOKEN} token to separate documents")
    if tokenizer.get_vocab_size() > MAX_VOCAB:
        raise ManifestError(f"tokenizer {source}: vocabulary {tokenizer.get_vocab_size()} does not fit uint16 shards")
    info = TokenizerInfo(
        source=str(source) if source else "default",
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=eos,
    )
    return tokenizer, info


def is_validation(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def partial_dir(out: str | os.PathLike) -> Path:
    """Where `prepare` writes until the data set is complete (renamed to `out` then)."""
    out = Path(out).resolve()  # "." and "data/" have a name too
    return out.with_name(out.name + ".partial")


def _same_settings(old: DataManifest, fresh: DataManifest) -> bool:
    return (old.inputs, old.tokenizer.sha256, old.shard_tokens, old.val_fraction, old.text_field) == (
        fresh.inputs, fresh.tokenizer.sha256, fresh.shard_tokens, fresh.val_fraction, fresh.text_field)


def _resume(work: Path, old: DataManifest) -> DataManifest:
    if not old.complete:
        with open(work / VAL_PARTIAL, "r+b" if (work / VAL_PARTIAL).exists() else "w+b") as f:
            f.truncate(2 * old.progress.val_tokens)
    return old


def _start_or_resume(out: Path, fresh: DataManifest) -> tuple[DataManifest, Path]:
    """(manifest, directory to write into): `out` itself when it holds a finished prepare (or an
    unfinished one from before `OUT.partial` existed), else `OUT.partial`."""
    if (out / MANIFEST_FILE).exists():
        old = read_manifest(out)
        if _same_settings(old, fresh):
            return _resume(out, old), out
        state = "a finished prepare" if old.complete else "an unfinished prepare"
        raise ManifestError(f"{out}: holds {state} of other inputs or settings; choose another --out "
                            f"(or delete {out} to redo it)")
    if out.exists() and any(out.iterdir()):
        raise ManifestError(f"{out}: directory is not empty and holds no {MANIFEST_FILE}; choose an empty --out")
    work = partial_dir(out)
    if (work / MANIFEST_FILE).exists():
        try:
            old = read_manifest(work)
        except ManifestError:
            old = None
        if old is not None and _same_settings(old, fresh):
            return _resume(work, old), work
        shutil.rmtree(work)  # left by a failed or interrupted run with other arguments: start afresh
    elif work.exists() and any(work.iterdir()):
        raise ManifestError(f"{work}: is not an unfinished prepare (no {MANIFEST_FILE}); move it away")
    work.mkdir(parents=True, exist_ok=True)
    (work / VAL_PARTIAL).write_bytes(b"")
    write_manifest(work, fresh)
    return fresh, work


def _publish(work: Path, out: Path) -> None:
    if work != out:
        os.replace(work, out)  # replaces an empty `out` directory too (rename(2))


def _settings_error(work: Path, out: Path, message: str) -> ManifestError:
    """An error no retry with the same arguments can avoid: the unfinished data is useless."""
    if work != out:
        shutil.rmtree(work, ignore_errors=True)
    return ManifestError(message)


def prepare(
    inputs: list[str],
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | None = None,
    shard_tokens: int = 100_000_000,
    val_fraction: float = 0.01,
    max_val_tokens: int = 10_000_000,
    text_field: str = "text",
    text_doc_chars: int = 4000,
    hf_config: str | None = None,
    hf_split: str = "train",
    progress: bool = True,
    batch_documents: int = 256,
) -> DataManifest:
    """Tokenize `inputs` into `out_dir` (resuming an unfinished run there). Returns the manifest.

    Example:
        >>> from colibri_model.corpus import prose_files
        >>> manifest = prepare([str(p) for p in prose_files()], "data/prose", shard_tokens=200_000)
    """
    if not 0 <= val_fraction < 1:
        raise ManifestError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    if shard_tokens <= 0:
        raise ManifestError(f"shard_tokens must be positive, got {shard_tokens}")
    out = Path(out_dir)
    expanded = expand_inputs(list(inputs))
    tok, info = tokenizer_info(tokenizer)
    fresh = DataManifest(inputs=expanded, tokenizer=info, shard_tokens=shard_tokens,
                         val_fraction=val_fraction, text_field=text_field)
    manifest, work = _start_or_resume(out, fresh)
    if manifest.complete:
        _publish(work, out)  # a no-op unless a run stopped between its last write and the rename
        return manifest

    state = manifest.progress.model_copy()
    buffer: list[np.ndarray] = []
    buffered = buffered_docs = 0
    val_pending: list[np.ndarray] = []
    val_tokens, val_docs = state.val_tokens, state.val_documents
    bar = tqdm(desc="prepare", unit=" tok", unit_scale=True, disable=not progress,
               initial=manifest.train_tokens + val_tokens)

    def flush_val() -> None:
        if val_pending:
            with open(work / VAL_PARTIAL, "ab") as f:
                f.write(np.concatenate(val_pending).astype("<u2").tobytes())
            val_pending.clear()

    def flush_train(input_index: int, documents_done: int) -> None:
        nonlocal buffer, buffered, buffered_docs
        name = train_shard_name(len(manifest.train_shards))
        tokens = np.concatenate(buffer)
        digest = write_shard(work / name, tokens, buffered_docs)
        manifest.train_shards.append(ShardEntry(file=name, tokens=int(tokens.size), documents=buffered_docs,
                                                sha256=digest))
        flush_val()
        manifest.progress = PrepareProgress(input_index=input_index, documents_done=documents_done,
                                            val_tokens=val_tokens, val_documents=val_docs)
        write_manifest(work, manifest)
        buffer, buffered, buffered_docs = [], 0, 0

    eos = np.array([info.eos_id], dtype=np.uint16)
    for input_index in range(state.input_index, len(expanded)):
        skip = state.documents_done if input_index == state.input_index else 0
        done = skip
        docs = iter_documents(expanded[input_index], text_field=text_field, text_doc_chars=text_doc_chars,
                              hf_config=hf_config, hf_split=hf_split, skip=skip)
        while True:
            batch = list(itertools.islice(docs, batch_documents))
            if not batch:
                break
            encodings = tok.encode_batch(batch, add_special_tokens=False)
            for text, encoding in zip(batch, encodings, strict=False):
                done += 1
                ids = np.concatenate([np.asarray(encoding.ids, dtype=np.uint16), eos])
                bar.update(ids.size)
                if val_tokens < max_val_tokens and is_validation(text, val_fraction):
                    val_pending.append(ids)
                    val_tokens += ids.size
                    val_docs += 1
                    continue
                buffer.append(ids)
                buffered += ids.size
                buffered_docs += 1
                if buffered >= shard_tokens:
                    flush_train(input_index, done)
    if buffer:
        flush_train(len(expanded), 0)
    flush_val()
    bar.close()
    if not manifest.train_shards:
        raise _settings_error(work, out, f"{out}: the inputs held no training text")
    if val_tokens == 0:
        raise _settings_error(work, out, f"{out}: no document fell into the validation split; raise --val-fraction "
                              f"(now {val_fraction}) or lower --text-doc-chars")
    val = np.fromfile(work / VAL_PARTIAL, dtype="<u2")
    digest = write_shard(work / VAL_SHARD, val, val_docs)
    manifest.val_shard = ShardEntry(file=VAL_SHARD, tokens=int(val.size), documents=val_docs, sha256=digest)
    manifest.progress = PrepareProgress(input_index=len(expanded), val_tokens=val_tokens, val_documents=val_docs)
    manifest.complete = True
    (work / VAL_PARTIAL).unlink(missing_ok=True)
    write_manifest(work, manifest)
    _publish(work, out)
    return manifest
