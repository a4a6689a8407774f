"""The expert cache: a fixed number of slots holding prepared routed experts, under a budget.

The budget decides the number of slots up front (`Budget`, plan.py), so the cache never
allocates beyond it: on a miss it first evicts (the policy picks the victim), then reads the
blob into a page-aligned staging buffer (direct_io.py), verifies its CRC-32, repacks it into
the compute layout (expert_compute.py) and stores it. Peak RAM is therefore
`slots * slot_bytes + staging buffers`, both counted in the budget.

A corrupted or truncated blob raises `ExpertCorruptError` naming (layer, expert); the slot it
would have used stays empty, so nothing half-built is ever computed with.

Prefetch: `prefetch(keys)` loads synchronously; `prefetch.Prefetcher` reads on worker threads
(`fetch_expert` with its own buffers) and hands finished experts to `insert_prefetched` from
the main thread, at the start of the next `get`. Either way the entry is marked: its first use
counts as a hit and `prefetch_used`, eviction before any use as `prefetch_wasted`. The slots
themselves are only touched from the thread that runs the model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

from colibri_int4 import ContainerError, ExpertBlob, ExpertBlobLayout, ExpertEntry

from ..cache.policy import CachePolicy, ExpertKey
from ..cache.slab import ExpertSlab
from ..errors import ExpertCorruptError
from ..io.direct_io import AlignedBuffer, BlobReader
from ..stats import StreamStats

PrepareFn = Callable[[ExpertBlob], object]  # blob -> object with .forward(x) and .nbytes


def fetch_expert(
    reader: BlobReader,
    entry: ExpertEntry,
    layout: ExpertBlobLayout,
    prepare: PrepareFn,
    buffer: AlignedBuffer,
) -> tuple[object, float, float]:
    """Read one blob into `buffer`, verify it and prepare it: (prepared, read s, verify+prepare s).
    Raises `ExpertCorruptError` naming (layer, expert). Safe to call from worker threads (each
    with its own buffer)."""
    layer, expert = entry.layer, entry.expert
    where = f"expert (layer {layer}, expert {expert}) at byte {entry.offset} of {reader.path}"
    started = time.perf_counter()
    try:
        reader.read_into(buffer.view, entry.offset, entry.length)
    except EOFError as exc:
        raise ExpertCorruptError(f"{where}: truncated ({exc})", layer, expert) from None
    except OSError as exc:
        raise ExpertCorruptError(f"{where}: read failed ({exc.strerror})", layer, expert) from None
    read_done = time.perf_counter()
    try:
        blob = ExpertBlob.parse(buffer.view[: entry.length], layout, entry.crc32, where=where)
        prepared = prepare(blob)
    except ContainerError as exc:
        raise ExpertCorruptError(str(exc), layer, expert) from None
    return prepared, read_done - started, time.perf_counter() - read_done


class ExpertCache:
    """`get(layer, expert)` returns a prepared expert, reading it on a miss."""

    def __init__(
        self,
        reader: BlobReader,
        entries: dict[ExpertKey, ExpertEntry],
        layout: ExpertBlobLayout,
        prepare: PrepareFn,
        capacity: int,
        policy: CachePolicy,
        stats: StreamStats,
        slab: ExpertSlab | None = None,
    ):
        if capacity < 1:
            raise ValueError("the expert cache needs at least one slot")
        if slab is not None and slab.slots < capacity:
            raise ValueError(f"a slab of {slab.slots} slots cannot back a cache of {capacity}")
        self.reader, self.entries, self.layout, self.prepare = reader, entries, layout, prepare
        self.capacity, self.policy, self.stats = capacity, policy, stats
        # with a slab, prepared experts (those with move_into) live in its slots (slab.py)
        self.slab = slab
        self._slab_index: dict[ExpertKey, int] = {}
        self._slots: dict[ExpertKey, object] = {}
        self._unused_prefetch: set[ExpertKey] = set()
        # An all-dense model (no layout) has no blobs: a one-page buffer that is never read.
        self._staging = AlignedBuffer(layout.blob_length if layout is not None else 1)
        self.bytes_held = 0
        self.prefetcher = None  # set by prefetch.Prefetcher
        policy.bind(capacity, sorted({key[0] for key in entries}))
        # Every expert fits and the policy evicts only when the cache is full: no victim is ever
        # asked for, so hits need not reach the policy (its bookkeeping was 5% of a decode step of
        # a 24-layer top-8 model at full RAM). Inserts and removals still do.
        self._hits_reach_policy = not (capacity >= len(entries)
                                       and type(policy).needs_room is CachePolicy.needs_room)
        self.generation = 0  # removals so far: whoever keeps a cached expert's addresses checks it

    # --- queries ---------------------------------------------------------------------------
    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[ExpertKey]:
        return list(self._slots)

    @property
    def staging_bytes(self) -> int:
        return self._staging.size

    @property
    def hits_are_plain(self) -> bool:
        """Whether a hit is only a count: every expert stays once read (no victim is ever asked
        for) and no prefetch is at work or unused. A caller that finds cached experts by itself
        (the one-call decode path, which keeps their addresses until `generation` changes) may
        then count its hits with `count_hits` instead of calling `get`."""
        return not self._hits_reach_policy and self.prefetcher is None and not self._unused_prefetch

    def slots_for_layer(self, layer: int) -> int:
        """How many experts of `layer` can be cached at once (a per-layer policy: its share): a
        caller using more of them together must take them one at a time."""
        return self.policy.slots_for_layer(layer, self.capacity)

    def count_hits(self, layer: int, hits: int) -> None:
        """`hits` cached experts of `layer` used without `get` (see `hits_are_plain`)."""
        self.stats.hits += hits
        self.stats.layer(layer).hits += hits

    # --- use -------------------------------------------------------------------------------
    def get(self, layer: int, expert: int, pinned: Collection[ExpertKey] = (),
            hold: Collection[ExpertKey] = ()) -> object:
        """The prepared expert, from a slot (hit) or read from disk (miss). `pinned`: experts a
        prefetched arrival must not evict (the current layer's); `hold`: experts the caller got
        before and still computes with, which this miss must not evict either (their slots would
        be refilled under them); a demand miss may evict any other. LookupError, with the cache
        as it was, when every cached expert is held (fewer slots than the caller holds at once)."""
        key = (layer, expert)
        counters = self.stats.layer(layer)
        if self.prefetcher is not None:
            # a prefetched arrival evicts neither the layer's experts nor the ones held
            protected = pinned if not hold else {*pinned, *hold}
            self.prefetcher.collect(protected)  # store finished prefetches first
            if key not in self._slots and self.prefetcher.is_needed(key):
                # a miss whose read started early (prefetch.issue_needed): counted and inserted
                # as the one-at-a-time path would, at this point of the access sequence
                self._make_room(key, hold)
                self.stats.misses += 1
                counters.misses += 1
                prepared = self.prefetcher.take_needed(key)
                self._insert(key, prepared)
                return prepared
            if key not in self._slots and self.prefetcher.in_flight(key):
                self.prefetcher.take(key, protected)  # needed now: wait for the read issued ahead
        found = self._slots.get(key)
        if found is not None:
            self.stats.hits += 1
            counters.hits += 1
            if key in self._unused_prefetch:
                self._unused_prefetch.discard(key)
                self.stats.prefetch_used += 1
            if self._hits_reach_policy:
                self.policy.on_hit(key)
            return found
        self._make_room(key, hold)  # (before counting: a LookupError leaves the counts as they were)
        self.stats.misses += 1
        counters.misses += 1
        return self._load(key, ())

    def get_layer(self, layer: int, experts: list[int], pinned: Collection[ExpertKey] = ()) -> list[object]:
        """`[get(layer, e, pinned) for e in experts]`, in that order, each miss holding the experts
        got before it (all are used together), with one lookup pass and one count when all are
        cached and no prefetch is at work (a decode step at full RAM). LookupError when the cache
        cannot hold them all at once (more than `slots_for_layer`): use them one at a time then."""
        if self.prefetcher is None and not self._unused_prefetch:
            slots = self._slots
            found = [slots.get((layer, expert)) for expert in experts]
            if all(prepared is not None for prepared in found):
                self.count_hits(layer, len(found))
                if self._hits_reach_policy:
                    for expert in experts:
                        self.policy.on_hit((layer, expert))
                return found
        got, held = [], []
        for expert in experts:
            got.append(self.get(layer, expert, pinned, held))
            held.append((layer, expert))
        return got

    def prefetch(self, keys: Iterable[ExpertKey], pinned: Collection[ExpertKey] = ()) -> int:
        """Load experts not yet cached (without counting hits or misses); returns how many."""
        loaded = 0
        for key in keys:
            if key in self._slots:
                continue
            self._load(key, pinned)
            self._unused_prefetch.add(key)
            self.stats.prefetch_issued += 1
            loaded += 1
        return loaded

    def clear(self) -> None:
        for key in list(self._slots):
            self._remove(key)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.clear()
        self._staging.close()

    # --- internals -------------------------------------------------------------------------
    def _remove(self, key: ExpertKey) -> None:
        self.generation += 1
        prepared = self._slots.pop(key)
        self.bytes_held -= prepared.nbytes
        if key in self._slab_index:
            self.slab.give_back(self._slab_index.pop(key))
        self.policy.on_remove(key)
        if key in self._unused_prefetch:
            self._unused_prefetch.discard(key)
            self.stats.prefetch_wasted += 1
        self._publish()

    def _load(self, key: ExpertKey, pinned: Collection[ExpertKey]) -> object:
        entry = self._entry(key)
        self._make_room(key, pinned)
        prepared, read_seconds, prepare_seconds = fetch_expert(
            self.reader, entry, self.layout, self.prepare, self._staging
        )
        self.stats.io_seconds += read_seconds
        self.stats.verify_seconds += prepare_seconds
        self.stats.bytes_read += entry.length
        self._insert(key, prepared)
        return prepared

    def _entry(self, key: ExpertKey) -> ExpertEntry:
        entry = self.entries.get(key)
        if entry is None:
            raise KeyError(f"no routed expert (layer {key[0]}, expert {key[1]}) in {self.reader.path}")
        return entry

    def _make_room(self, key: ExpertKey, pinned: Collection[ExpertKey]) -> None:
        # `key` is not cached yet, so the policy cannot choose it; `pinned` is passed as given
        # (no copy: this runs on every miss)
        while self.policy.needs_room(key, len(self._slots), self.capacity):
            victim = self.policy.victim_for(key, pinned)
            self._remove(victim)
            self.stats.evictions += 1

    def _insert(self, key: ExpertKey, prepared) -> None:
        if self.slab is not None and hasattr(prepared, "move_into"):
            index = self.slab.take()
            prepared.move_into(self.slab.slot(index))
            self._slab_index[key] = index
        self._slots[key] = prepared
        self.bytes_held += prepared.nbytes
        self.policy.on_insert(key)
        self._publish()

    def insert_prefetched(self, key: ExpertKey, prepared, pinned: Collection[ExpertKey] = ()) -> bool:
        """Store an expert a prefetcher read (its bytes already counted by the caller). Returns
        False, storing nothing, when every cached expert is pinned (counted as wasted)."""
        if key in self._slots:
            return True
        try:
            self._make_room(key, pinned)
        except LookupError:
            self.stats.prefetch_wasted += 1
            return False
        self._insert(key, prepared)
        self._unused_prefetch.add(key)
        return True

    def _publish(self) -> None:
        self.stats.cache_bytes = self.bytes_held
        self.stats.cached_experts = len(self._slots)
