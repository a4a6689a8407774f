"""The learned shuffle repack equals torch's int4-pack converter byte for byte, on every block shape,
on whatever CPU (and `ATEN_CPU_CAPABILITY`) the suite runs, and the fast path is the one taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_stream.compute.int4_repack import (
    PackLayout,
    _fit_runs,
    fast_path_taken,
    layout_for,
    learn_layout,
    pack_for_cpu_kernel,
    reference_pack,
    repack_timings,
    shuffle_pack,
)

needs_kernel = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"), reason="no CPU int4 kernels"
)

# block tails of every height the x86 layouts use (16, 32, 48 rows after 32- or 64-row blocks),
# and the real expert shapes: NanoColibri gate|up and down, Colibri-Micro gate|up
SHAPES = [(16, 64), (32, 256), (48, 64), (64, 128), (80, 64), (96, 192), (112, 64), (128, 64),
          (256, 128), (1024, 1024), (1024, 512), (1536, 1536)]


def _random_packed(rows, cols, seed=0):
    return np.random.default_rng(seed + rows + cols).integers(0, 256, (rows, cols // 2), dtype=np.uint8)


@needs_kernel
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_shuffle_equals_converter_and_is_taken(rows, cols):
    assert fast_path_taken(rows, cols), f"no shuffle layout learned for [{rows}, {cols}] on " \
        f"{torch.backends.cpu.get_cpu_capability()}"
    packed = _random_packed(rows, cols)
    assert torch.equal(shuffle_pack(packed, layout_for(rows, cols)), reference_pack(packed))
    out = pack_for_cpu_kernel(packed)
    packed[:] = 0  # the result must not alias the (reused) staging buffer
    assert torch.equal(out, reference_pack(_random_packed(rows, cols)))


@needs_kernel
def test_kernel_computes_the_same_with_either_pack():
    rows, cols, group = 96, 128, 32
    packed = _random_packed(rows, cols, seed=1)
    sz = torch.stack([torch.rand(cols // group, rows) * 0.1, torch.zeros(cols // group, rows)], -1).to(torch.bfloat16)
    x = torch.randn(3, cols, dtype=torch.bfloat16)
    a = torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack_for_cpu_kernel(packed), group, sz)
    b = torch.ops.aten._weight_int4pack_mm_for_cpu(x, reference_pack(packed), group, sz)
    assert torch.equal(a, b)


def _source_rows_of(block_rows, pairs, rows, cols):
    """What the probe would read off a converter with this (hypothetical) layout."""
    low, high = [], []
    first = 0
    while first < rows:
        height = min(block_rows, rows - first)
        lows, highs = pairs(height)
        for _ in range(cols):
            low += [first + r for r in lows]
            high += [first + r for r in highs]
        first += height
    return np.array(low), np.array(high)


def test_fit_reads_any_row_blocked_layout():
    """A layout no x86 build uses today (128-row blocks, rows b and b + 64 share a byte; a 32-row
    tail of adjacent pairs) is still read correctly, and the shuffle then produces it."""
    def pairs(height):
        if height == 128:
            return list(range(64)), list(range(64, 128))
        return list(range(0, height, 2)), list(range(1, height, 2))

    rows, cols = 288, 8
    low, high = _source_rows_of(128, pairs, rows, cols)
    runs = _fit_runs(low, high, rows, cols)
    assert [(r.first_row, r.count, r.rows) for r in runs] == [(0, 2, 128), (256, 1, 32)]
    assert runs[0].high_rows == tuple(range(64, 128))
    # the shuffle builds exactly those bytes: byte b of column k of a block = rows (low, high)
    packed = _random_packed(rows, cols, seed=3)
    nibbles = np.empty((rows, cols), dtype=np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = packed & 0xF, packed >> 4
    k = np.tile(np.repeat(np.arange(cols), 64), 2)
    k = np.concatenate([k, np.repeat(np.arange(cols), 16)])
    expected = nibbles[low, k] | (nibbles[high, k] << 4)
    got = shuffle_pack(packed, PackLayout(rows, cols, runs)).reshape(-1).numpy()
    np.testing.assert_array_equal(got, expected)


def test_fit_refuses_what_it_cannot_shuffle():
    rows, cols = 64, 4
    low, high = _source_rows_of(64, lambda h: (list(range(32)), list(range(32, 64))), rows, cols)
    assert _fit_runs(low, high, rows, cols) is not None
    swapped = low.copy()
    swapped[[5, 40]] = swapped[[40, 5]]  # one column's pairing differs from the others
    assert _fit_runs(swapped, high, rows, cols) is None
    repeated = low.copy()
    repeated[:32] = 0  # a row appears twice, another never
    assert _fit_runs(repeated, high, rows, cols) is None


def test_odd_shapes_take_the_converter():
    assert learn_layout(15, 64) is None and learn_layout(16, 63) is None


@needs_kernel
def test_timings_report():
    t = repack_timings(64, 128, repeats=1)
    assert t["matches"] and t["converter_ms"] > 0 and t["shuffle_ms"] > 0 and t["block_rows"]


def test_unevenly_spaced_row_pairs_are_gathered():
    """Row pairs that are no strided slice (a future layout) take the gather route, same bytes."""
    from colibri_stream.compute.int4_repack import RowBlocks

    rows, cols = 32, 6
    order = np.random.default_rng(5).permutation(rows)
    run = RowBlocks(0, 1, rows, tuple(order[:16].tolist()), tuple(order[16:].tolist()))
    packed = _random_packed(rows, cols, seed=4)
    nibbles = np.empty((rows, cols), dtype=np.uint8)
    nibbles[:, 0::2], nibbles[:, 1::2] = packed & 0xF, packed >> 4
    k = np.repeat(np.arange(cols), 16)
    expected = nibbles[np.tile(order[:16], cols), k] | (nibbles[np.tile(order[16:], cols), k] << 4)
    got = shuffle_pack(packed, PackLayout(rows, cols, (run,))).reshape(-1).numpy()
    np.testing.assert_array_equal(got, expected)
