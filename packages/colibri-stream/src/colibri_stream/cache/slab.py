"""One allocation for every cache slot, made when the engine opens.

Why: a cached expert allocated on the C heap sits between the verify/repack temporaries of
the misses around it. When it is evicted it leaves a hole, and glibc keeps the heap at its
high-water mark until trimmed, so RSS crept over the budget during a pass (1.005 of it at
+10% of the experts, bench/RESULTS.md). With a slab the cache's bytes live in one block that
never moves or grows; the heap holds only one miss's temporaries, which the next miss reuses.

The slab is virtual memory until a slot is first written (torch.empty of a large size is an
anonymous mmap), so an engine that never fills its cache never pays for it. It asks for huge
pages (io/huge_pages.py): a decode token streams its experts from it, and in 4 KiB pages that
stream is a TLB miss every 4 KiB. Slots are handed out from the first, so the pages written run
at most one 2 MiB page past the slots in use. A slot is reused in place after an eviction:
whoever still holds the evicted expert would see the new one's bytes. The engine never does
(each expert is computed before the next is fetched, and the current layer's experts are pinned
against prefetched arrivals); code that keeps experts from `ExpertCache.get` across later `get`
calls must not use a slab.
"""

from __future__ import annotations

import torch

from ..io.huge_pages import advise_huge_pages
from ..sizes import CACHE_LINE, aligned

ALIGN = CACHE_LINE  # every part of a slot starts on a cache line


class ExpertSlab:
    """`slots` fixed-size byte ranges of one uint8 tensor, handed out and taken back by index."""

    def __init__(self, slots: int, slot_bytes: int):
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a slab needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}")
        self.slots, self.slot_bytes = slots, aligned(slot_bytes)
        self.storage = torch.empty(slots * self.slot_bytes, dtype=torch.uint8)
        advise_huge_pages(self.storage)  # before any slot is written: a decode token streams its experts
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise LookupError("every slab slot is in use: evict before inserting")
        return self._free.pop()

    def give_back(self, index: int) -> None:
        self._free.append(index)

    def slot(self, index: int) -> torch.Tensor:
        start = index * self.slot_bytes
        return self.storage[start : start + self.slot_bytes]


def place(tensors: dict[str, torch.Tensor], slot: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copy each tensor into consecutive aligned ranges of `slot` (uint8); returns views there
    with the same dtypes and shapes."""
    out, offset = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if offset + nbytes > slot.numel():
            raise ValueError(f"{name} ({nbytes} bytes at offset {offset}) does not fit a {slot.numel()}-byte slot")
        view = slot[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        out[name] = view
        offset += aligned(nbytes)
    return out
