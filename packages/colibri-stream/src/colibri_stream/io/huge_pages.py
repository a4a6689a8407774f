"""Transparent huge pages for the weights a decode token streams every step.

A decode token reads every resident matrix and every chosen expert once: a few hundred MB a
token, each byte once, which is memory-bound work. In 4 KiB pages that stream costs a TLB miss
every 4 KiB (a 24 x 64 Qwen3-MoE shape: ~58,000 a token, far past what the TLB holds), and the
hardware prefetchers stop at each page's end. Where the kernel offers transparent huge pages
only on request (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the default of many
distributions), a buffer asked for with `madvise(MADV_HUGEPAGE)` is backed by 2 MiB pages when
it is first written. Measured on AMD EPYC Zen 4 (bench/RESULTS.md): 8 experts' 1024 x 1024 q4
matrices read cold, 0.257-0.338 -> 0.217-0.266 ms.

The advice is only an optimisation: where it cannot be given (not Linux, THP off, a small buffer)
nothing changes, and no result depends on it. It covers the 2 MiB-aligned part of a buffer and
must be given before the buffer is first written (already-backed pages stay small until the
kernel's background collapse, if ever).

A matrix smaller than a huge page (an attention projection of a 1024-wide model: 0.3-1 MB) never
gets one of its own: `HugePageArena` packs many into one advised buffer, sized exactly beforehand
so that nothing in it is spare.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from ..sizes import aligned

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman-common.h


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask for huge pages under the 2 MiB-aligned part of `tensor`'s bytes (before they are first
    written); returns the bytes advised (0 when none could be: too small, or not supported)."""
    if _MADVISE is None or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first or _MADVISE(first, last - first, MADV_HUGEPAGE) != 0:
        return 0
    return last - first


class HugePageArena:
    """One buffer of `nbytes`, advised for huge pages, that `copy` fills front to back, each copy
    from a cache line on. Sized exactly by the caller (`sizes.aligned` of each copy's total bytes),
    so nothing in it is spare. The views it returns keep the buffer alive."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        advise_huge_pages(self.buffer)
        self.used = 0

    def copy(self, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Torch copies of `arrays` (read-only ones too), one after another from the next cache line
        (each at a multiple of its item size; no gap between arrays whose sizes keep that)."""
        start = cursor = self.used
        places = []
        for array in arrays:
            cursor = -(-cursor // array.itemsize) * array.itemsize
            places.append(cursor)
            cursor += array.nbytes
        if start + aligned(cursor - start) > self.buffer.numel():
            raise ValueError(f"huge-page arena of {self.buffer.numel()} bytes: no room for {cursor - start} "
                             f"more at {start}")
        self.used = start + aligned(cursor - start)
        out = []
        for array, place in zip(arrays, places):
            dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
            view = self.buffer[place : place + array.nbytes].view(dtype).view(array.shape)
            view.numpy()[...] = array  # numpy copies from read-only buffers too
            out.append(view)
        return tuple(out)
