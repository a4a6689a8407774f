"""Direct I/O with its fallback, the cache's accounting and policy interface, batch-union reads."""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from colibri_int4 import Container
from colibri_stream import BlobReader, CachePolicy, Engine, IOFallbackWarning, LRUPolicy
from colibri_stream.io.direct_io import AlignedBuffer

TMPFS = Path("/dev/shm")


def test_direct_reads_on_a_real_filesystem(tiny):
    with Container.open(tiny[0]) as c:
        entry = c.expert_entry(1, 3)
        expected = c.read_expert(1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IOFallbackWarning)  # tmp_path is on ext4 here: no fallback
        reader = BlobReader(tiny[0])
    buffer = AlignedBuffer(entry.length)
    try:
        if reader.mode != "direct":
            pytest.skip(f"O_DIRECT unavailable where pytest puts tmp files: {reader.fallback_reason}")
        reader.read_into(buffer.view, entry.offset, entry.length)
        assert reader.bytes_read == entry.length and reader.reads == 1
        assert bytes(buffer.view[:16]) == Path(tiny[0]).read_bytes()[entry.offset : entry.offset + 16]
        assert expected["gate"].shape == (64, 64)
    finally:
        reader.close()
        buffer.close()


def test_refused_o_direct_falls_back_to_buffered_and_says_so_once(tiny, monkeypatch):
    """Simulate a filesystem that refuses O_DIRECT at open (EINVAL), as older tmpfs does."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Engine.open(tiny[0], ram_budget="200MB") as eng:
            eng.logits(torch.arange(40))
            eng.logits(torch.arange(40, 80))
            assert eng.stats.io_mode == "buffered"
            assert eng.stats.bytes_read == eng.stats.misses * eng.container.blob_length > 0
    fallbacks = [w for w in caught if issubclass(w.category, IOFallbackWarning)]
    assert len(fallbacks) == 1 and "O_DIRECT unavailable" in str(fallbacks[0].message)


def test_blob_reader_finishes_short_reads_and_names_the_file_at_eof(tiny, monkeypatch):
    """BlobReader uses colibri-int4's read_into: a preadv that returns 1000 bytes at a time
    still fills the blob, counted once; a range past the end is an EOFError naming the file."""
    with Container.open(tiny[0]) as c:
        entry = c.expert_entry(2, 5)
    expected = Path(tiny[0]).read_bytes()[entry.offset : entry.offset + entry.length]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IOFallbackWarning)
        reader = BlobReader(tiny[0], direct=False)  # buffered: a short O_DIRECT read must stay aligned
    buffer = AlignedBuffer(entry.length + 8192)
    real, calls = os.preadv, []

    def short_preadv(fd, buffers, offset):
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    try:
        reader.read_into(buffer.view, entry.offset, entry.length)
        assert bytes(buffer.view[: entry.length]) == expected
        assert len(calls) == -(-entry.length // 1000) and (reader.reads, reader.bytes_read) == (1, entry.length)
        end = os.path.getsize(tiny[0])
        with pytest.raises(EOFError, match=rf"tiny\.coli: file ends at byte {end}"):
            reader.read_into(buffer.view, end - 4096, 8192)
        assert reader.reads == 1  # a failed read is not counted
    finally:
        reader.close()
        buffer.close()


def test_buffered_mode_on_request_gives_the_same_logits(tiny):
    ids = torch.arange(300, 340)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IOFallbackWarning)
        with Engine.open(tiny[0], ram_budget="200MB", direct_io=False) as eng:
            buffered = eng.logits(ids)
            assert eng.reader.mode == "buffered"
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        assert torch.equal(eng.logits(ids), buffered)


@pytest.mark.skipif(not TMPFS.is_dir(), reason="no tmpfs at /dev/shm")
def test_tmpfs_is_named_as_ram_backed(tiny):
    path = TMPFS / f"colibri-stream-test-{os.getpid()}.coli"
    shutil.copy(tiny[0], path)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader = BlobReader(path)
            reader.close()
        assert reader.filesystem == "tmpfs"
        assert any("served from RAM" in str(w.message) for w in caught)
    finally:
        path.unlink()


def test_prefill_reads_each_distinct_expert_once_per_layer(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", record_trace=True, prefill_chunk=256) as eng:
        eng.logits(torch.arange(200, 400))
        stats = eng.stats
        assert stats.steps == 1
        for event in stats.trace:
            assert stats.layers[event.layer].misses == len(event.experts)  # one read per distinct expert
            assert list(event.experts) == sorted(set(event.experts))
        assert stats.hits == 0 and stats.bytes_read == stats.misses * eng.container.blob_length


def test_lru_policy_order():
    lru = LRUPolicy()
    for key in [(1, 0), (1, 1), (2, 0)]:
        lru.on_insert(key)
    lru.on_hit((1, 0))
    assert lru.victim() == (1, 1)
    assert lru.victim(pinned={(1, 1)}) == (2, 0)
    lru.on_remove((1, 1))
    assert lru.victim() == (2, 0)
    with pytest.raises(LookupError):
        lru.victim(pinned={(1, 0), (2, 0)})


class MostRecentlyUsed(CachePolicy):
    """A deliberately different policy, to show that policies plug in."""

    name = "mru"

    def __init__(self):
        self.order: list = []
        self.steps: list[int] = []

    def begin_step(self, step):
        self.steps.append(step)

    def on_insert(self, key):
        self.order.append(key)

    def on_hit(self, key):
        self.order.remove(key)
        self.order.append(key)

    def on_remove(self, key):
        self.order.remove(key)

    def victim(self, pinned=()):
        return next(k for k in reversed(self.order) if k not in pinned)


def test_custom_policy_plugs_in_and_changes_behaviour(tiny, minimum_budget):
    base = minimum_budget(tiny[0], prefill_chunk=1)
    budget = base + 5 * Engine.plan(tiny[0], prefill_chunk=1).slot_bytes  # 6 slots
    ids = torch.arange(500, 560)
    results = {}
    for policy in ("lru", MostRecentlyUsed()):
        with Engine.open(tiny[0], ram_budget=budget, cache_policy=policy, prefill_chunk=1) as eng:
            logits = eng.logits(ids)
            results[eng.stats.policy] = (logits, eng.stats.hits, eng.stats.evictions, eng.cache.keys())
            assert len(eng.cache) <= eng.budget.slots == 6
            if not isinstance(policy, str):
                assert policy.steps == list(range(1, 61))
    (lru_logits, lru_hits, _, lru_keys), (mru_logits, mru_hits, _, mru_keys) = results["lru"], results["mru"]
    assert torch.equal(lru_logits, mru_logits)  # the policy changes what is cached, never the math
    assert lru_keys != mru_keys and lru_hits != mru_hits


def test_prefetch_counts_used_and_wasted(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", record_trace=True) as eng:
        eng.cache.prefetch([(1, e) for e in range(16)])
        assert eng.stats.prefetch_issued == 16 and eng.stats.misses == 0
        eng.logits(torch.arange(10, 20))
        used = eng.stats.prefetch_used
        layer1 = {x for e in eng.stats.trace if e.layer == 1 for x in e.experts}
        assert used == len(layer1) and eng.stats.layers[1].misses == 0
        eng.cache.clear()
        assert eng.stats.prefetch_wasted == 16 - used


class CountingLRU(LRUPolicy):
    def __init__(self):
        super().__init__()
        self.hits_seen = 0

    def on_hit(self, key):
        self.hits_seen += 1
        super().on_hit(key)


def test_hits_reach_the_policy_only_where_it_may_have_to_evict(tiny, minimum_budget):
    """A cache that holds every expert never asks for a victim, so its hits skip the policy; a
    smaller one tells the policy of every hit. Same logits either way."""
    six_slots = minimum_budget(tiny[0], prefill_chunk=1) + 5 * Engine.plan(tiny[0], prefill_chunk=1).slot_bytes
    ids = torch.arange(100, 140)
    logits = []
    for budget, told in (("200MB", False), (six_slots, True)):
        policy = CountingLRU()
        with Engine.open(tiny[0], ram_budget=budget, cache_policy=policy, prefill_chunk=1) as eng:
            assert (eng.budget.slots >= len(eng.cache.entries)) is not told
            logits.append(eng.logits(ids))
            assert eng.stats.hits > 0
            assert policy.hits_seen == (eng.stats.hits if told else 0)
            assert sum(layer.hits for layer in eng.stats.layers.values()) == eng.stats.hits
    assert torch.equal(*logits)
