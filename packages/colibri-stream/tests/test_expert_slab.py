"""The slab: every cached int4 expert lives in one allocation made at open, slots reused in place."""

from __future__ import annotations

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.cache.slab import ALIGN, ExpertSlab, place
from colibri_stream.compute.expert_compute import Int4Expert, prepared_nbytes

from .test_expert_compute import make_blob


def test_slab_hands_out_disjoint_aligned_slots():
    slab = ExpertSlab(3, 100)
    assert slab.slot_bytes == 128 and slab.storage.numel() == 3 * 128
    taken = [slab.take() for _ in range(3)]
    assert taken == [0, 1, 2] and slab.free_slots == 0
    with pytest.raises(LookupError, match="evict before inserting"):
        slab.take()
    slab.give_back(1)
    assert slab.take() == 1
    pointers = [slab.slot(i).data_ptr() for i in range(3)]
    assert [b - a for a, b in zip(pointers, pointers[1:])] == [128, 128]
    with pytest.raises(ValueError, match="slots >= 1"):
        ExpertSlab(0, 10)


def test_place_copies_into_aligned_views():
    slot = torch.zeros(1024, dtype=torch.uint8)
    parts = {"a": torch.arange(10, dtype=torch.uint8), "b": torch.randn(3, 5, dtype=torch.bfloat16),
             "c": torch.randn(7)}
    placed = place(parts, slot)
    for name, tensor in parts.items():
        view = placed[name]
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and torch.equal(view, tensor)
        assert (view.data_ptr() - slot.data_ptr()) % ALIGN == 0
    with pytest.raises(ValueError, match="c .* does not fit a 140-byte slot"):
        place(parts, torch.zeros(140, dtype=torch.uint8))


def test_int4_expert_computes_the_same_from_a_slot():
    blob, layout = make_blob(128, 256, QuantScheme(group_size=32))
    expert = Int4Expert(blob, torch.bfloat16)
    assert expert.nbytes == prepared_nbytes(layout, 128, 256, "int4", torch.bfloat16)
    x = torch.randn(5, 128)
    before = expert.forward(x)
    slab = ExpertSlab(2, expert.nbytes)
    slot = slab.slot(1)
    expert.move_into(slot)
    assert torch.equal(expert.forward(x), before)
    for part in (expert.gate_up, expert.gate_up_sz, expert.down, expert.down_sz):
        assert slot.data_ptr() <= part.data_ptr() < slot.data_ptr() + slab.slot_bytes


def test_engine_with_and_without_slab_agree_under_eviction(tiny, minimum_budget):
    options = dict(compute="int4", kernel_dtype="f32", cache_policy="lru")
    base = minimum_budget(tiny[0], **options)
    budget = base + 4 * Engine.plan(tiny[0], **options).slot_bytes  # 5 of 48 experts: constant eviction
    runs = {}
    for slab in (False, True):
        with Engine.open(tiny[0], ram_budget=budget, slab=slab, **options) as eng:
            ids = eng.encode("A slab of slots, reused in place")
            logits = eng.logits(ids)
            tokens = eng.generate("The lamp", 24, stop_token_ids=[]).token_ids
            cache = eng.cache
            assert (cache.slab is not None) == slab and eng.stats.evictions > 20
            if slab:  # every cached expert sits in the slab; free + used slots = capacity
                lo = cache.slab.storage.data_ptr()
                hi = lo + cache.slab.storage.numel()
                assert all(lo <= cache._slots[k].gate_up.data_ptr() < hi for k in cache.keys())
                assert cache.slab.free_slots + len(cache) == cache.capacity == eng.budget.slots
                assert cache.bytes_held <= eng.budget.cache_capacity_bytes
            runs[slab] = (logits, tokens, eng.stats.misses)
    assert torch.equal(runs[True][0], runs[False][0]) and runs[True][1:] == runs[False][1:]


def test_dequant_path_keeps_per_expert_tensors(tiny):
    with Engine.open(tiny[0], ram_budget="200MB", compute="dequant") as eng:
        assert eng.cache.slab is None
        eng.generate("Hi", 2, stop_token_ids=[])
