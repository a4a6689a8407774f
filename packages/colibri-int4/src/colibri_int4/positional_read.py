"""The one read-until-done loop: fill a buffer from a file offset with `os.preadv`.

A single `preadv` may return fewer bytes than asked (a signal after some data, network and FUSE
filesystems, Linux's cap of 2 GiB - 4 KiB per call), so every reader of this package, and
colibri-stream's O_DIRECT `BlobReader`, loops here until the buffer is full; 0 bytes means the
file ended early, which is an `EOFError` naming the source and the byte. EINTR is retried by
Python itself (PEP 475).

NOTE: with O_DIRECT the offset and length of every call must stay 4096-aligned. Linux returns a
short O_DIRECT read only at end of file, so the loop's second call (at an unaligned offset)
never happens on a healthy file; if it did, the kernel's EINVAL would surface as `OSError`.
"""

from __future__ import annotations

import os


def read_into(fd: int, buffer, offset: int, what: str = "file") -> None:
    """Fill all of `buffer` (writable, byte-addressable: bytearray, mmap, memoryview) with the
    bytes of `fd` from `offset` on. Raises `EOFError` naming `what` if the file ends first."""
    view = memoryview(buffer).cast("B")
    length, done = len(view), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"{what}: file ends at byte {offset + done}, wanted {length} bytes at {offset}")
        done += n


def read_exact(fd: int, length: int, offset: int, what: str = "file") -> bytearray:
    """`length` bytes of `fd` at `offset` in a new buffer (see `read_into`)."""
    buf = bytearray(length)
    read_into(fd, buf, offset, what)
    return buf
