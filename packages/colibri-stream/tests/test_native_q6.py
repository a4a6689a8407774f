"""The native kernel on q6 matrices (a 6-bit LM head, colibri-int4 FORMAT.md): the products against
the int8-activation definition at each CPU level, a row's bits whatever else shares the call, the
dense path's dequantized rows, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from colibri_stream.compute import native_kernel
from colibri_stream.compute.native_kernel import QuantizedActivations, q6_matmul

from .test_native_kernel import LEVELS, _q8_definition


def pack_q6(codes: np.ndarray) -> np.ndarray:
    """codes [rows, cols] in 0..63 -> the q6 data [rows, cols * 3 / 4], written from the spec's
    words (lows in q4's nibble order, then per 64-column span 16 bytes of top bits)."""
    rows, cols = codes.shape
    low, top = codes & 15, codes >> 4
    lows = (low[:, 0::2] | (low[:, 1::2] << 4)).astype(np.uint8)
    highs = np.zeros((rows, cols // 4), dtype=np.uint8)
    for span in range(cols // 64):
        for i in range(16):
            c = 64 * span
            highs[:, 16 * span + i] = (top[:, c + 2 * i] | top[:, c + 2 * i + 1] << 2
                                       | top[:, c + 32 + 2 * i] << 4 | top[:, c + 33 + 2 * i] << 6)
    return np.concatenate([lows, highs], axis=1)


def random_q6(rows: int, cols: int, group: int, rng, fp16: bool):
    codes = rng.integers(0, 64, (rows, cols))
    codes[0, :64] = 63  # the largest codes: every int16 sum of the AVX2 path at its bound
    dtype = torch.float16 if fp16 else torch.bfloat16
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, (rows, cols // group)).astype(np.float32)).to(dtype)
    weight = (codes - 32) * np.repeat(scales.double().numpy(), group, 1)
    return torch.from_numpy(pack_q6(codes)), scales.view(torch.int16), weight


def test_the_spec_packing_of_one_span():
    codes = np.arange(64)[None, :]  # column c holds code c
    data = pack_q6(codes)[0]
    assert data[0] == 0x10 and data[31] == (62 & 15 | (63 & 15) << 4)  # columns 0, 1 and 62, 63 in the lows
    # highs byte 0: the top bits of columns 0, 1, 32, 33 (codes 0, 1, 32, 33: tops 0, 0, 2, 2)
    assert data[32] == 2 << 4 | 2 << 6


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("group", "fp16", "cols"), [(32, False, 512), (64, True, 512), (128, False, 1024),
                                                     (32, True, 576), (64, False, 576)])  # 576: a last step of two
def test_q6_matmul_is_the_q6_times_q8_definition(level, group, fp16, cols):
    rng = np.random.default_rng(group + cols)
    rows = 45  # 16-row blocks with a short one, and weight rows left over from groups of four
    data, scales, weight = random_q6(rows, cols, group, rng, fp16)
    x = torch.from_numpy(rng.normal(0, 1, (5, cols)).astype(np.float32))
    q, xscale = _q8_definition(x.double().numpy())
    expected = (q * xscale[..., None].astype(np.float64)).reshape(5, cols) @ weight.T
    got = q6_matmul(QuantizedActivations(x), data, scales, group, fp16, level=level).double().numpy()
    assert np.abs(got - expected).max() < 1e-5 * max(1.0, np.abs(expected).max())


def test_a_row_is_the_same_bits_alone_in_a_batch_and_on_two_threads():
    rng = np.random.default_rng(3)
    data, scales, _ = random_q6(70, 1024, 32, rng, False)
    x = torch.from_numpy(rng.normal(0, 1, (6, 1024)).astype(np.float32))
    threads = torch.get_num_threads()
    try:
        for level in LEVELS:
            torch.set_num_threads(1)
            together = q6_matmul(QuantizedActivations(x), data, scales, 32, level=level)
            for row in range(6):
                alone = q6_matmul(QuantizedActivations(x[row:row + 1]), data, scales, 32, level=level)
                assert torch.equal(alone[0], together[row])
            torch.set_num_threads(2)
            assert torch.equal(q6_matmul(QuantizedActivations(x), data, scales, 32, level=level), together)
        if len(LEVELS) > 2:  # level 2 runs the AVX2 path for q6: the same bits
            assert torch.equal(q6_matmul(QuantizedActivations(x), data, scales, 32, level=1),
                               q6_matmul(QuantizedActivations(x), data, scales, 32, level=2))
    finally:
        torch.set_num_threads(threads)


def test_many_rows_take_the_exact_dequantized_rows(monkeypatch):
    rng = np.random.default_rng(5)
    data, scales, weight = random_q6(40, 576, 64, rng, True)
    monkeypatch.setattr(native_kernel, "DEQUANT_BLOCK_WEIGHTS", 7 * 576)  # several blocks, the last one short
    monkeypatch.setattr(native_kernel, "DENSE_FROM_ROWS", 16)
    x = torch.from_numpy(rng.normal(0, 1, (17, 576)).astype(np.float32))
    got = native_kernel.matmul(x, data, scales, None, 64, "q6", True).double().numpy()
    expected = x.double().numpy() @ weight.T  # the stored weights exactly, f32 activations
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())
    block = torch.empty(40, 576)
    assert native_kernel._library().colibri_dequantize_rows(data.data_ptr(), native_kernel.DEQUANTIZE_KINDS["q6"],
                                                            scales.data_ptr(), None, 1, 576, 64, 0, 40,
                                                            block.data_ptr()) == 0
    assert np.array_equal(block.double().numpy(), weight)  # (c - 32) x scale is exact in f32


def test_a_q6_matrix_that_does_not_fit_is_refused():
    rng = np.random.default_rng(9)
    data, scales, _ = random_q6(8, 256, 32, rng, False)
    x = QuantizedActivations(torch.zeros(1, 256))
    with pytest.raises(ValueError, match="q6 matrix"):
        q6_matmul(x, data[:, :-16], scales, 32)  # a row 16 bytes short
    with pytest.raises(ValueError, match="multiple of 64"):
        q6_matmul(QuantizedActivations(torch.zeros(1, 96)), torch.zeros(8, 72, dtype=torch.uint8),
                  torch.zeros(8, 3, dtype=torch.int16), 32)
