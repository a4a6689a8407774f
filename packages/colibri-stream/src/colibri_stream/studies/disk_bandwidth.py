"""O_DIRECT read bandwidth of the disk holding a container, at the engine's read size.

The bound a streaming engine is judged against: reading blob-sized, blob-aligned ranges of the
container itself with O_DIRECT (the engine's own `BlobReader`, one `preadv` per blob into a
page-aligned buffer), in a shuffled order like cache misses, on one thread like the demand
path. Measured in the same run as the engine so that both see the same disk and the same
neighbours. Trade-off: a shuffled order is slightly pessimistic against a sequential scan (no
readahead exists with O_DIRECT anyway), and optimistic against misses interleaved with compute.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from ..io.direct_io import AlignedBuffer, BlobReader


@dataclass(frozen=True)
class DiskBandwidth:
    bytes_read: int
    seconds: float
    read_size: int
    reads: int
    mode: str  # "direct" or "buffered"
    filesystem: str

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "disk_bandwidth_mb_s": round(self.bytes_per_s / 1e6, 2),
            "read_size": self.read_size,
            "reads": self.reads,
            "io_mode": self.mode,
            "filesystem": self.filesystem,
        }


def measure_read_bandwidth(
    path: str | os.PathLike,
    offsets: list[int],
    read_size: int,
    max_bytes: int = 256 * 1024 * 1024,
    seed: int = 0,
) -> DiskBandwidth:
    """Read up to `max_bytes` of `path` as blobs of `read_size` at (a shuffled sample of)
    `offsets`, with O_DIRECT when the filesystem allows it."""
    if read_size <= 0 or not offsets:
        raise ValueError("measure_read_bandwidth needs a positive read size and at least one offset")
    order = list(offsets)
    random.Random(seed).shuffle(order)
    order = order[: max(1, max_bytes // read_size)]
    reader = BlobReader(path, direct=True)
    buffer = AlignedBuffer(read_size)
    try:
        started = time.perf_counter()
        for offset in order:
            reader.read_into(buffer.view, offset, read_size)
        seconds = time.perf_counter() - started
    finally:
        buffer.close()
        reader.close()
    return DiskBandwidth(
        len(order) * read_size, seconds, read_size, len(order), reader.mode, reader.filesystem
    )
