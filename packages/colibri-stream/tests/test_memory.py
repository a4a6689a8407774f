"""The RAM budget holds while the engine opens and runs: no whole-tensor fp32 temporaries while
the resident weights are materialised, and freed heap handed back. (The end-to-end measurement
of peak RSS against the budget is bench/ram_budget.py; its figures are in bench/RESULTS.md.)"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from colibri_int4 import Container
from colibri_stream import Engine, heap, resident


def test_opening_never_holds_a_whole_tensor_in_fp32(tiny, monkeypatch):
    """Python/numpy allocations while opening (tracemalloc sees numpy buffers and the bytes read)
    stay below the largest resident tensor's fp32 size: one tensor's stored bytes plus one
    dequantization block, not the resident region plus a full fp32 copy."""
    with Container.open(tiny[0]) as c:
        largest = max(c.header.tensors, key=lambda t: np.prod(t.shape))
        fp32_bytes = 4 * int(np.prod(largest.shape))
        stored_bytes = max(t.length for t in c.header.tensors)
    # blocks small next to this tiny model's tensors, as 4 MB blocks are next to NanoColibri's
    monkeypatch.setattr(resident, "DEQUANT_BLOCK_BYTES", 256 << 10)
    assert fp32_bytes > stored_bytes + resident.DEQUANT_BLOCK_BYTES  # else the check below proves nothing
    Engine.open(tiny[0], ram_budget="200MB").close()  # first open imports modules lazily: not measured
    tracemalloc.start()
    try:
        Engine.open(tiny[0], ram_budget="200MB").close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < fp32_bytes, (peak, fp32_bytes)


def test_heap_trim_follows_its_threshold():
    free = heap.free_heap_bytes()
    if free is None:
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    assert free >= 0
    assert heap.trim_if_above(1 << 62) is False  # far below the limit: no trim
    assert heap.trim_if_above(-1) is True  # any free heap is above -1: trimmed
