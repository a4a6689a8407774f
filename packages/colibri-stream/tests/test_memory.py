"""The RAM budget holds while the engine opens and runs: no whole-tensor fp32 temporaries while
the resident weights are materialised, and freed heap handed back. (The end-to-end measurement
of peak RSS against the budget is bench/ram_budget.py; its figures are in bench/RESULTS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from colibri_int4 import Container
from colibri_stream import Engine, assembly, resident
from colibri_stream.footprint import TOKENIZER_BYTES_PER_TOKEN
from colibri_stream.io import heap


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


def test_a_native_open_copies_each_projection_from_the_files_map(tiny, monkeypatch):
    """Under compute="native" each projection's stored bytes are copied into the huge-page arena
    from a map of the file (clean page cache), so no read buffer of a whole projection is held
    beside its copy: building the model allocates less than the largest projection's bytes."""
    with Container.open(tiny[0]) as c:
        largest = max(t.length for t in c.header.tensors if t.name.endswith(("proj.weight", "lm_head.weight")))
    peaks = []

    def measured_build(*args, **kwargs):
        tracemalloc.start()
        try:
            return resident.build_model(*args, **kwargs)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(assembly, "build_model", measured_build)
    Engine.open(tiny[0], ram_budget="200MB", compute="native").close()
    assert len(peaks) == 1 and peaks[0] < largest / 2, (peaks, largest)


def test_the_rotary_tables_hold_the_kv_caches_positions(tiny):
    """The engine builds rotary tables of `max_context` rows, not of the config's max_seq_len
    (40,960 positions of head_dim 64 would hold 21 MB, outside the plan)."""
    with Engine.open(tiny[0], ram_budget="200MB", max_context=48) as engine:
        assert engine.config.max_seq_len > 48
        engine.generate("Hello there", max_new_tokens=2)
        assert {block.attn.rope.max_len for block in engine.model.layers} == {48}


def test_heap_trim_follows_its_threshold():
    free = heap.free_heap_bytes()
    if free is None:
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    assert free >= 0
    assert heap.HeapTrimmer(1 << 62).maybe_trim(1 << 63) is False  # far below the limit: no trim
    eager = heap.HeapTrimmer(-1)
    assert eager.maybe_trim(0) is True and eager.trims == 1  # any growth is above -1: trimmed


def test_trimmer_measures_growth_since_its_last_trim(monkeypatch):
    """mallinfo2 keeps counting chunks whose pages were already handed back, so the trimmer
    compares with the free heap after its last trim, not with zero."""
    free = {"now": 50 << 20}
    trims = []
    monkeypatch.setattr(heap, "_LIBC", object())  # as if glibc were there
    monkeypatch.setattr(heap, "free_heap_bytes", lambda: free["now"])
    monkeypatch.setattr(heap, "release_free_heap", lambda: trims.append(free["now"]))
    trimmer = heap.HeapTrimmer(4 << 20)  # 50 MB already free (a closed engine's holes)
    read = iter(range(4 << 20, 100 << 20, 4 << 20))  # 4 MB more read before each check: always asks
    assert trimmer.maybe_trim(next(read)) is False and trims == []  # old holes: nothing new to give back
    free["now"] = 53 << 20
    assert trimmer.maybe_trim(next(read)) is False  # 3 MB of new free heap: within the slack
    free["now"] = 60 << 20
    assert trimmer.maybe_trim(next(read)) is True and trims == [60 << 20]  # 10 MB new: trimmed
    assert trimmer.maybe_trim(next(read)) is False  # nothing new since
    free["now"] = 20 << 20  # the heap reused free memory: those pages are resident again
    assert trimmer.maybe_trim(next(read)) is False
    free["now"] = 25 << 20
    assert trimmer.maybe_trim(next(read)) is True  # 5 MB freed again on top of the new low


def test_trimmer_asks_only_after_enough_reads(monkeypatch):
    asked = []
    monkeypatch.setattr(heap, "_LIBC", object())
    monkeypatch.setattr(heap, "free_heap_bytes", lambda: asked.append(1) or 0)
    monkeypatch.setattr(heap, "release_free_heap", lambda: None)
    trimmer = heap.HeapTrimmer(1000)
    asked.clear()
    for bytes_read in (0, 10, 999):  # a warm cache reads nothing: mallinfo2 is not walked
        trimmer.maybe_trim(bytes_read)
    assert asked == []
    trimmer.maybe_trim(1000)
    assert len(asked) == 1
    trimmer.maybe_trim(5)  # stats were reset: counting starts again from 0
    trimmer.maybe_trim(999)
    assert len(asked) == 1
    trimmer.maybe_trim(1006)
    assert len(asked) == 2


def test_the_plan_counts_what_a_loaded_tokenizer_keeps():
    """A fresh process loads the bundled tokenizer as the engine does (then gives the parse's freed
    heap back): what its anonymous RSS keeps fits the plan's count for that vocabulary, while the
    load itself passes through more (which the engine frees before allocating anything else)."""
    if heap.free_heap_bytes() is None:
        pytest.skip("malloc_trim and mallinfo2 need glibc >= 2.33")
    script = textwrap.dedent("""
        import json
        from colibri_model import load_tokenizer
        from colibri_stream.io.heap import release_free_heap
        from colibri_stream.io.memory_cap import rss_anon_bytes
        release_free_heap()
        before = rss_anon_bytes()
        tokenizer = load_tokenizer(None)
        loaded = rss_anon_bytes()
        release_free_heap()
        print(json.dumps([tokenizer.get_vocab_size(), loaded - before, rss_anon_bytes() - before]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    vocab, loaded, kept = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < kept <= TOKENIZER_BYTES_PER_TOKEN * vocab < loaded, (vocab, loaded, kept)


def test_the_native_kernels_heap_slack_is_smaller_than_a_repacking_routes():
    blob = 1 << 20
    assert heap.slack_bytes(blob, "native") == heap.NATIVE_SLACK_BLOBS * blob < heap.slack_bytes(blob, "int4")
    assert heap.slack_bytes(1024, "native") == heap.MIN_SLACK_BYTES  # tiny experts: the floor
