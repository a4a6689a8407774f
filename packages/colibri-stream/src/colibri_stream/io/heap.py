"""Hand the C heap's free pages back to the OS, so that the RAM budget holds while it runs.

NOTE: glibc keeps memory that numpy and torch free. Its mmap threshold rises to the size of the
largest block freed (up to 32 MB), so the temporaries of every missed expert's verify + repack
(a few MB each) end up on the heap; once freed they stay mapped. Measured with NanoColibri's
shapes under a 938 MB budget (bench/ram_budget.py, RESULTS.md): after 32 tokens, 165 MB of freed
heap held in anonymous RSS, 15% over the budget. `malloc_trim(0)` returns it. It takes about
4 ms on that heap, so the engine calls it after a forward pass only when the free heap has grown
past the budget's heap slack since the last trim (`HeapTrimmer`; asking `mallinfo2` walks the
free lists, 2 us on a fresh heap but 2 ms on a fragmented one, so it is asked only after a
slack's worth of reads). Both are no-ops where glibc is not the allocator. The slack scales with
the expert blob, whose temporaries fill the heap: 32 blobs, at least 4 MiB (27 MB for
NanoColibri). With the cache's experts in a slab (cache/slab.py) the peak anonymous RSS stays
at or below 0.98 of the budget (bench/RESULTS.md). The native kernel computes a missed expert
from the bytes read, with no repack: measured on a 24-layer x 64-expert container (0.84 MB
blobs, 9 slots, 5,799 misses over a 20-token prefill and 24 decode steps, no trim), malloc's
free heap grew by 4.7 MB at most, under 6 blobs; its slack is 8 blobs (`NATIVE_SLACK_BLOBS`).
"""

from __future__ import annotations

import ctypes

SLACK_BLOBS = 32
NATIVE_SLACK_BLOBS = 8
MIN_SLACK_BYTES = 4 << 20


def slack_bytes(blob_length: int, compute: str = "int4") -> int:
    """Free heap the budget allows between trims, for experts of `blob_length` bytes computed by
    `compute` ("native" makes no repack temporaries)."""
    blobs = NATIVE_SLACK_BLOBS if compute == "native" else SLACK_BLOBS
    return max(MIN_SLACK_BYTES, blobs * blob_length)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim  # noqa: B018 - probe: AttributeError where glibc is not the allocator
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
        libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _glibc()


def release_free_heap() -> None:
    """Return every free page of every malloc arena to the OS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def free_heap_bytes() -> int | None:
    """Bytes malloc holds free in its arenas, or None where that cannot be asked."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    return int(_LIBC.mallinfo2().fordblks)


class HeapTrimmer:
    """Trims once the free heap has grown by more than `limit` bytes since the last trim.

    NOTE: `mallinfo2` still counts chunks whose pages `malloc_trim` has handed back (they stay
    on malloc's free lists), so an absolute threshold fires on every call once a process has
    freed a lot (a closed engine, say): measured, a 0.4 s warm run spent 0.19 s in 128 trims that
    released nothing. The baseline is the free heap right after the last trim, lowered whenever
    the heap reuses free memory (those pages are resident again)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.baseline = free_heap_bytes() or 0
        self.trims = 0
        self._read_at_check = 0

    def maybe_trim(self, bytes_read: int) -> bool:
        """`release_free_heap()` if enough new free heap has accumulated; True if it trimmed.
        Where the free amount cannot be asked but trimming is possible, always trims.

        `bytes_read` (the engine's counter) gates the check itself: asking `mallinfo2` walks
        malloc's free lists, 2 ms on a fragmented heap (measured: a third of a warm run's wall
        time when asked after every pass). The heap grows by the temporaries of reading experts,
        so it is asked only once `limit` more bytes have been read since it was last asked."""
        if bytes_read < self._read_at_check:  # the counter was reset
            self._read_at_check = 0
        if _LIBC is None or bytes_read - self._read_at_check < self.limit:
            return False
        self._read_at_check = bytes_read
        free = free_heap_bytes()
        if free is not None:
            self.baseline = min(self.baseline, free)
            if free - self.baseline <= self.limit:
                return False
        release_free_heap()
        self.baseline = free_heap_bytes() or 0
        self.trims += 1
        return True
