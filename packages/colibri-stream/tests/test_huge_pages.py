"""Huge-page advice for the streamed weights: the advised range, the copy's values, the arena that
packs a model's projections into one advised buffer, and that the kernel backs an advised buffer
with huge pages where it offers them on request."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.cache.slab import ExpertSlab
from colibri_stream.compute.native_linear import NativeLinear
from colibri_stream.io.huge_pages import HUGE_PAGE, HugePageArena, advise_huge_pages
from colibri_stream.sizes import CACHE_LINE, aligned

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where it has none."""
    if not sys.platform.startswith("linux") or not THP.exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _aligned_interior(tensor: torch.Tensor) -> int:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return max(0, end // HUGE_PAGE * HUGE_PAGE - -(-start // HUGE_PAGE) * HUGE_PAGE)


def _huge_bytes_at(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mappings over `tensor`'s bytes (from /proc/self/smaps; the advice
    splits the buffer's mapping at the advised range)."""
    start = tensor.data_ptr()
    end, total, overlaps = start + tensor.numel() * tensor.element_size(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            overlaps = low < end and start < high
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(_thp_mode() is None, reason="no transparent huge pages in this kernel (not Linux)")
def test_a_large_buffer_is_advised_over_its_aligned_interior_and_a_small_one_not_at_all():
    large = torch.empty(9 * HUGE_PAGE, dtype=torch.uint8)
    assert advise_huge_pages(large) == _aligned_interior(large) >= 7 * HUGE_PAGE
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0
    assert advise_huge_pages(torch.empty(0, dtype=torch.uint8)) == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="this kernel backs no buffer with huge pages")
def test_an_advised_buffer_is_backed_by_huge_pages_once_written():
    buffer = torch.empty(16 * HUGE_PAGE, dtype=torch.uint8)
    assert advise_huge_pages(buffer) > 0
    buffer.fill_(1)
    assert _huge_bytes_at(buffer) >= HUGE_PAGE


def test_an_arena_copy_holds_the_values_dtype_and_shape_of_a_read_only_array():
    rng = np.random.default_rng(0)
    arrays = (rng.integers(0, 256, (3000, 1024)).astype(np.uint8), rng.normal(size=(7, 5)).astype(np.float32),
              rng.integers(-128, 128, (4096, 513)).astype(np.int8))
    arena = HugePageArena(sum(aligned(a.nbytes) for a in arrays))
    for array in arrays:
        array.setflags(write=False)  # a read buffer of the container
        (copy,) = arena.copy(array)
        assert copy.shape == array.shape and copy.numpy().dtype == array.dtype
        assert np.array_equal(copy.numpy(), array)
        assert copy.data_ptr() != array.ctypes.data


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only where huge pages come on request does this show the advice")
def test_the_expert_slab_asks_for_huge_pages_before_its_first_slot_is_written():
    slab = ExpertSlab(slots=12, slot_bytes=HUGE_PAGE)
    for _ in range(2):
        slab.slot(slab.take()).fill_(3)
    assert _huge_bytes_at(slab.storage) >= HUGE_PAGE


def test_the_arena_packs_copies_at_cache_lines_with_their_values_and_refuses_past_its_end():
    rng = np.random.default_rng(1)
    groups = [(rng.integers(0, 256, (48, 16)).astype(np.uint8), rng.integers(0, 1 << 16, (48, 1)).astype(np.uint16)
               .view(np.int16)),
              (rng.integers(-128, 128, (5, 7)).astype(np.int8),),  # 35 bytes: the next copy starts at 64
              (rng.normal(size=(3, 3)).astype(np.float32), rng.integers(-9, 9, 3).astype(np.int16))]
    sizes = [sum(a.nbytes for a in g) for g in groups]
    arena = HugePageArena(sum(aligned(n) for n in sizes))
    base, start = arena.buffer.data_ptr(), 0
    for group, size in zip(groups, sizes):
        copies = arena.copy(*group)
        assert copies[0].data_ptr() - base == start and start % CACHE_LINE == 0
        for copy, array in zip(copies, group):
            assert copy.shape == array.shape and copy.numpy().dtype == array.dtype
            assert np.array_equal(copy.numpy(), array)
            assert copy.untyped_storage().data_ptr() == base  # views of the one buffer
        # the parts of one copy follow one another with no gap where their sizes allow
        assert copies[-1].data_ptr() + copies[-1].nbytes - copies[0].data_ptr() == size
        start += aligned(size)
    assert arena.used == arena.buffer.numel()  # sized exactly: nothing spare
    with pytest.raises(ValueError, match="no room for 1 more"):
        arena.copy(np.zeros(1, dtype=np.uint8))


@pytest.mark.parametrize("resident_dtype", ["int4", "int8"])
def test_a_native_engine_holds_every_projection_in_one_arena_of_exactly_the_planned_bytes(tmp_path, resident_dtype):
    from .conftest import build_container

    container, _ = build_container(tmp_path, QuantScheme(group_size=32, resident_dtype=resident_dtype,
                                                         embed_dtype="int8"))
    with Engine.open(container, ram_budget="200MB", compute="native") as eng:
        natives = [m for m in eng.model.modules() if isinstance(m, NativeLinear)]
        assert eng.model.lm_head in natives and len(natives) > 4 * eng.config.n_layers
        buffers = [b for m in natives for b in m.buffers()]
        storages = {b.untyped_storage().data_ptr() for b in buffers}
        assert len(storages) == 1  # one arena for the projections, the head, their scales and zeros
        arena_size = buffers[0].untyped_storage().nbytes()
        planned = Engine.plan(container, compute="native").footprint.resident_by_dtype
        assert arena_size == sum(planned.get(e, 0) for e in ("q4", "q8")) > 0  # the plan counts the arena
        assert arena_size == sum(aligned(sum(b.nbytes for b in m.buffers())) for m in natives)  # nothing spare
