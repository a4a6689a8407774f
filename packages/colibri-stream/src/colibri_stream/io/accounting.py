"""Honest I/O accounting: the engine's bytes-read counter against the kernel's `read_bytes`.

`/proc/self/io` has two read counters: `rchar` counts every byte a read syscall returned,
page-cache hits included, while `read_bytes` counts bytes this process caused to be fetched
from storage. With O_DIRECT every expert miss is a storage read, so over a measurement window
the engine's `bytes_read` and the growth of `read_bytes` must agree. When `read_bytes` is much
smaller, misses were served by the page cache (the seed project's withdrawn tokens/s); when it is
much larger, something else in the process read the disk during the window. Either way the
window's throughput is not a disk number, and `IOWindow.contaminated` says so.

The tolerance is relative (2% by default) with a small absolute slack (a few pages of
filesystem metadata, tokenizer or Python imports reading during the window).

Every engine run reports both counters (`StreamStats.bytes_read_os`, `io_agreement`) and names
the direction of a disagreement, because the two directions mean different things:

- "served from page cache" (OS < engine): misses never reached storage (buffered reads of a file
  that is in RAM, e.g. held by another process's mmap; or a tmpfs). Not a disk number.
- "re-read under pressure" (OS > engine): the process read more from storage than its expert
  reads. Under a memory cap that is file pages (torch's libraries, the tokenizer) reclaimed and
  faulted in again: measured 3.6-20.6% above the engine's count under a 1.0 GB cgroup cap
  (bench/RESULTS.md). Without pressure, another reader in the process.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

from ..errors import StreamError

PROC_IO = "/proc/self/io"
CONTAMINATION_TOLERANCE = 0.02
ABSOLUTE_SLACK_BYTES = 64 * 1024


AGREE = "agree"
SERVED_FROM_PAGE_CACHE = "served from page cache"
REREAD_UNDER_PRESSURE = "re-read under pressure"
UNAVAILABLE = "unavailable"  # no /proc/self/io here


class ProcIOUnavailable(StreamError, RuntimeError):
    """This system has no readable /proc/self/io (not Linux, or restricted)."""


def read_proc_io(path: str = PROC_IO) -> dict[str, int]:
    """The counters of /proc/self/io as ints (`rchar`, `read_bytes`, ...)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError as exc:
        raise ProcIOUnavailable(f"cannot read {path}: {exc.strerror}") from None
    return parse_proc_io(text, path)


def parse_proc_io(text: str, path: str = PROC_IO) -> dict[str, int]:
    """The counters of a /proc/<pid>/io text as ints; `path` names it in the error."""
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().isdigit():
            counters[name.strip()] = int(value)
    if "read_bytes" not in counters:
        raise ProcIOUnavailable(f"{path} has no read_bytes line (kernel without task I/O accounting?)")
    return counters


@dataclass
class IOWindow:
    """OS read counters over a window, compared with the engine's count of the same window."""

    bytes_read_engine: int = 0
    bytes_read_os: int = 0
    rchar: int = 0
    tolerance: float = CONTAMINATION_TOLERANCE

    @property
    def disagreement(self) -> float:
        """|os - engine| / engine (0 when both are 0; inf when only the OS read)."""
        if self.bytes_read_engine == 0:
            return 0.0 if self.bytes_read_os <= ABSOLUTE_SLACK_BYTES else float("inf")
        return abs(self.bytes_read_os - self.bytes_read_engine) / self.bytes_read_engine

    @property
    def contaminated(self) -> bool:
        gap = abs(self.bytes_read_os - self.bytes_read_engine)
        return gap > ABSOLUTE_SLACK_BYTES and self.disagreement > self.tolerance

    @property
    def agreement(self) -> str:
        """"agree", "served from page cache" or "re-read under pressure" (module doc)."""
        if not self.contaminated:
            return AGREE
        return SERVED_FROM_PAGE_CACHE if self.bytes_read_os < self.bytes_read_engine else REREAD_UNDER_PRESSURE

    def verdict(self) -> str:
        if not self.contaminated:
            return "ok"
        if self.bytes_read_os < self.bytes_read_engine:
            return (
                f"PAGE-CACHE CONTAMINATION: the engine counted {self.bytes_read_engine} bytes but only "
                f"{self.bytes_read_os} reached storage ({self.disagreement:.1%} apart)"
            )
        return (
            f"EXTRA DISK READS: storage delivered {self.bytes_read_os} bytes, the engine counted "
            f"{self.bytes_read_engine} ({self.disagreement:.1%} apart)"
        )

    def to_dict(self) -> dict:
        return {
            "bytes_read_engine": self.bytes_read_engine,
            "bytes_read_os": self.bytes_read_os,
            "rchar": self.rchar,
            "io_disagreement": round(self.disagreement, 6) if self.disagreement != float("inf") else None,
            "page_cache_contaminated": self.contaminated,
            "io_agreement": self.agreement,
            "io_verdict": self.verdict(),
        }


class IOMeter:
    """`with IOMeter() as m: ...; m.window(engine_bytes)`: the OS counters' growth over the block."""

    def __init__(self, tolerance: float = CONTAMINATION_TOLERANCE):
        self.tolerance = tolerance
        self._start: dict[str, int] = {}
        self._end: dict[str, int] = {}

    def __enter__(self) -> IOMeter:
        self._start = read_proc_io()
        return self

    def __exit__(self, *exc) -> None:
        self._end = read_proc_io()

    def window(self, bytes_read_engine: int) -> IOWindow:
        end = self._end or read_proc_io()
        return IOWindow(
            bytes_read_engine=bytes_read_engine,
            bytes_read_os=end["read_bytes"] - self._start["read_bytes"],
            rchar=end.get("rchar", 0) - self._start.get("rchar", 0),
            tolerance=self.tolerance,
        )


class ReadBytesCounter:
    """The OS `read_bytes` since `rebase()`, or None where /proc/self/io cannot be read.

    The engine asks after every forward, so the file stays open and is read again from offset 0
    (the kernel writes it anew on each read): 3-5 us a reading against 38 us for open, read and
    close (AMD EPYC Zen 3). /proc/self names the process that opened it, so a forked child opens
    its own."""

    def __init__(self, path: str = PROC_IO):
        self.path = path
        self._fd: int | None = None
        self._pid = 0
        self._closer: weakref.finalize | None = None
        self._start: int | None = None
        self.rebase()

    def rebase(self) -> None:
        self._start = self._read()

    def since(self) -> int | None:
        if self._start is None:
            return None
        now = self._read()
        return None if now is None else now - self._start

    def _read(self) -> int | None:
        try:
            if self._fd is None or self._pid != os.getpid():
                self._open()
            text = os.pread(self._fd, 4096, 0).decode("ascii")
            return parse_proc_io(text, self.path)["read_bytes"]
        except (OSError, UnicodeDecodeError, ProcIOUnavailable):
            return None

    def _open(self) -> None:
        if self._closer is not None:
            self._closer()  # the parent's descriptor, or a stale one
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self._pid = os.getpid()
        self._closer = weakref.finalize(self, os.close, self._fd)


def agreement(bytes_read_engine: int, bytes_read_os: int | None, tolerance: float = CONTAMINATION_TOLERANCE) -> str:
    """The `io_agreement` of a run: see `IOWindow.agreement`; "unavailable" without /proc/self/io."""
    if bytes_read_os is None:
        return UNAVAILABLE
    return IOWindow(bytes_read_engine, bytes_read_os, tolerance=tolerance).agreement
