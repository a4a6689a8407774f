"""Hand the C heap's free pages back to the OS, so that the RAM budget holds while it runs.

NOTE: glibc keeps memory that numpy and torch free. Its mmap threshold rises to the size of the
largest block freed (up to 32 MB), so the temporaries of every missed expert's verify + repack
(a few MB each) end up on the heap; once freed they stay mapped. Measured with NanoColibri's
shapes under a 938 MB budget (bench/ram_budget.py, RESULTS.md): after 32 tokens, 165 MB of freed
heap held in anonymous RSS, 15% over the budget. `malloc_trim(0)` returns it. It takes about
4 ms on that heap, so the engine calls it after a forward pass only when the free heap passes
the budget's heap slack (`mallinfo2`, 2 us to ask); both are no-ops where glibc is not the
allocator. The slack scales with the expert blob, whose temporaries fill the heap: 32 blobs,
at least 4 MiB (27 MB for NanoColibri; there the peak anonymous RSS stayed within 1% of the
budget, bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes

SLACK_BLOBS = 32
MIN_SLACK_BYTES = 4 << 20


def slack_bytes(blob_length: int) -> int:
    """Free heap the budget allows between trims, for experts of `blob_length` bytes."""
    return max(MIN_SLACK_BYTES, SLACK_BLOBS * blob_length)


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


def trim_if_above(limit: int) -> bool:
    """`release_free_heap()` when more than `limit` bytes are free (always, where the free amount
    is unknown but trimming is possible); True if it trimmed."""
    if _LIBC is None:
        return False
    free = free_heap_bytes()
    if free is not None and free <= limit:
        return False
    release_free_heap()
    return True
