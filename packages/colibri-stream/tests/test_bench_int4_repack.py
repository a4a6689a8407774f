"""The shuffle repack equals torch's int4-pack converter byte for byte, on every block shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_stream.int4_repack import (
    pack_for_cpu_kernel,
    reference_pack,
    repack_timings,
    shuffle_matches_converter,
    shuffle_pack,
)

needs_kernel = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"), reason="no CPU int4 kernels"
)


@needs_kernel
@pytest.mark.parametrize("rows, cols", [(16, 64), (32, 256), (48, 64), (64, 128), (96, 192), (128, 64), (256, 128)])
def test_shuffle_equals_converter(rows, cols):
    packed = np.random.default_rng(rows + cols).integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    assert torch.equal(shuffle_pack(packed), reference_pack(packed))
    assert shuffle_matches_converter(rows, cols)
    out = pack_for_cpu_kernel(packed)
    packed[:] = 0  # the result must not alias the (reused) staging buffer
    assert torch.equal(out, reference_pack(np.random.default_rng(rows + cols).integers(
        0, 256, (rows, cols // 2), dtype=np.uint8)))


@needs_kernel
def test_kernel_computes_the_same_with_either_pack():
    rows, cols, group = 64, 128, 32
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    sz = torch.stack([torch.rand(cols // group, rows) * 0.1, torch.zeros(cols // group, rows)], -1).to(torch.bfloat16)
    x = torch.randn(3, cols, dtype=torch.bfloat16)
    a = torch.ops.aten._weight_int4pack_mm_for_cpu(x, shuffle_pack(packed), group, sz)
    b = torch.ops.aten._weight_int4pack_mm_for_cpu(x, reference_pack(packed), group, sz)
    assert torch.equal(a, b)


@needs_kernel
def test_timings_report():
    t = repack_timings(64, 128, repeats=1)
    assert t["matches"] and t["converter_ms"] > 0 and t["shuffle_ms"] > 0
