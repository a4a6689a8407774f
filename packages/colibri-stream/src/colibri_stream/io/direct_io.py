"""Reading expert blobs from disk around the page cache: O_DIRECT into page-aligned buffers.

A cache miss is one `os.preadv` of one blob (offset and length are multiples of 4096 by the
container format) into an anonymous `mmap` buffer, which the kernel hands out page-aligned, as
O_DIRECT requires; colibri-int4's `read_into` is the loop that finishes a short read. O_DIRECT makes every miss a real storage read, so the runtime's bytes-read
counter and the OS's `/proc/self/io` `read_bytes` agree and a benchmark cannot be flattered by
the page cache (the seed project's mistake).

Where O_DIRECT is refused (tmpfs and some network or FUSE filesystems reject the open or the
first read with EINVAL), the reader falls back to buffered reads followed by
`posix_fadvise(DONTNEED)` on the range just read, so the page cache does not keep a second copy
of what the expert cache already holds; it says so once through `warnings` and reports
`mode == "buffered"`. Trade-off: buffered reads can still be served by pages cached before the
engine started (e.g. right after an export), so only `mode == "direct"` numbers are honest
cold-read numbers. At open we ask the kernel to drop the file's cached pages as well.

NOTE: since Linux 6.6 tmpfs accepts O_DIRECT, but a tmpfs file lives in RAM: no read ever
reaches storage. `filesystem_type` finds the file's filesystem (from /proc/self/mounts) and the
reader says so once for tmpfs/ramfs, so a benchmark on /dev/shm cannot pass as a disk number.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings

from colibri_int4 import read_into

PAGE = 4096


class IOFallbackWarning(RuntimeWarning):
    """O_DIRECT is not available for this file; reads are buffered (+ fadvise DONTNEED)."""


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: str | os.PathLike) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...), or "unknown"."""
    target = os.path.realpath(path)
    best, fs_type = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, fs_type = mount_point, fields[2]
    except OSError:
        pass
    return fs_type


class AlignedBuffer:
    """A page-aligned, writable byte buffer backed by an anonymous mmap (never swapped to a file)."""

    def __init__(self, size: int):
        self.size = -(-size // PAGE) * PAGE
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            # A numpy view of the buffer is still alive (e.g. held by an exception's traceback);
            # the mapping is unmapped when that last reference goes.
            pass


class BlobReader:
    """Positional reads of aligned ranges of one file, O_DIRECT when the filesystem allows it.

    Thread-safe: `read_into` only uses `os.preadv` (which releases the GIL) and a locked counter,
    so prefetch threads can share one reader.
    """

    def __init__(self, path: str | os.PathLike, direct: bool = True):
        self.path = os.fspath(path)
        self.bytes_read = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._fd = -1
        self.mode = "buffered"
        self.filesystem = filesystem_type(self.path)
        self.fallback_reason: str | None = "O_DIRECT disabled by the caller" if not direct else None
        if self.filesystem in RAM_FILESYSTEMS:
            warnings.warn(
                f"{self.path} is on {self.filesystem}: reads are served from RAM, never from storage",
                IOFallbackWarning,
                stacklevel=3,
            )
        if direct:
            self._try_direct()
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDONLY)
            self._drop_cached_pages(0, 0)
            warnings.warn(
                f"{self.path}: O_DIRECT unavailable ({self.fallback_reason}); using buffered reads "
                "with posix_fadvise(DONTNEED), so misses may be served by the page cache",
                IOFallbackWarning,
                stacklevel=3,
            )

    def _try_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            self.fallback_reason = "this platform has no O_DIRECT"
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | flag)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            self.fallback_reason = f"open with O_DIRECT failed: {exc.strerror}"
            return
        probe = AlignedBuffer(PAGE)
        try:
            # Some filesystems accept the flag at open and refuse the first read.
            os.preadv(fd, [probe.view], 0)
        except OSError as exc:
            os.close(fd)
            self.fallback_reason = f"O_DIRECT read failed: {exc.strerror}"
            return
        finally:
            probe.close()
        self._fd, self.mode = fd, "direct"

    def _drop_cached_pages(self, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def read_into(self, buffer: memoryview, offset: int, length: int) -> None:
        """Fill `buffer[:length]` from file bytes [offset, offset + length); raises EOFError
        if the file ends first. With O_DIRECT, offset, length and buffer must be 4096-aligned."""
        read_into(self._fd, buffer[:length], offset, self.path)  # colibri-int4's one preadv loop
        if self.mode == "buffered":
            self._drop_cached_pages(offset, length)
        with self._lock:
            self.bytes_read += length
            self.reads += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
