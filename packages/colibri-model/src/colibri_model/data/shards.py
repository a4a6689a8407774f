"""Token shards: one flat array of uint16 token ids behind a 32-byte header (spec: TRAINING.md).

    offset  size  field
    0       8     magic b"CLBTOKS\\0"
    8       2     format major (uint16, little-endian)   = 1
    10      2     format minor                           = 0
    12      2     dtype code (1 = uint16)
    14      2     reserved (0)
    16      8     token count (uint64)
    24      8     document count (uint64)
    32      2*n   tokens

Documents are separated by the EOS token (appended after every document), so the boundaries
live in the token stream itself and packing needs no side index. uint16 halves the disk and
page-cache footprint of int32 and is enough for any vocabulary up to 65536 (ours is 49152).
Shards are read with `numpy.memmap`: a loader touches only the pages of the sequences it
draws, so a 100M-token shard costs no RAM up front. Writes go to a temporary name and are
renamed into place, so a shard either exists whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from colibri_spec import require_major

from ..errors import ShardFormatError

MAGIC = b"CLBTOKS\0"
FORMAT_MAJOR, FORMAT_MINOR = 1, 0
DTYPE_UINT16 = 1
HEADER = struct.Struct("<8sHHHHQQ")  # 32 bytes
HEADER_SIZE = HEADER.size
MAX_VOCAB = 65536


@dataclass(frozen=True)
class ShardHeader:
    token_count: int
    document_count: int
    version: str = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"


def write_shard(path: str | os.PathLike, tokens: np.ndarray, document_count: int) -> str:
    """Write `tokens` (any integer array, values < 65536) atomically; returns the file's sha256."""
    path = Path(path)
    tokens = np.ascontiguousarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= MAX_VOCAB):
        raise ShardFormatError(f"{path}: token ids must lie in [0, {MAX_VOCAB}) to fit uint16")
    data = tokens.astype("<u2", copy=False).tobytes()
    header = HEADER.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR, DTYPE_UINT16, 0, tokens.size, document_count)
    digest = hashlib.sha256(header)
    digest.update(data)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest.hexdigest()


def read_header(path: str | os.PathLike) -> ShardHeader:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
        size = path.stat().st_size
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot read token shard ({exc.strerror})") from None
    if len(raw) < HEADER_SIZE:
        raise ShardFormatError(f"{path}: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte shard header")
    magic, major, minor, dtype, _, count, docs = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ShardFormatError(f"{path}: not a Colibri token shard (magic {magic!r}, expected {MAGIC!r})")
    require_major(f"{major}.{minor}", f"{FORMAT_MAJOR}.{FORMAT_MINOR}", key="shard format version", where=str(path),
                  reader="colibri-model", error=ShardFormatError)
    if dtype != DTYPE_UINT16:
        raise ShardFormatError(f"{path}: unknown token dtype code {dtype} (1 = uint16)")
    expected = HEADER_SIZE + 2 * count
    if size != expected:
        raise ShardFormatError(
            f"{path}: file has {size} bytes but its header promises {count} tokens ({expected} bytes); truncated?"
        )
    return ShardHeader(token_count=count, document_count=docs, version=f"{major}.{minor}")


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """The shard's tokens as a read-only uint16 memmap (validated header first)."""
    header = read_header(path)
    if header.token_count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_SIZE, shape=(header.token_count,))

