"""The MXFP4 decoder (GPT-OSS experts) against a table computed by hand, and decode(encode(x))
against the E2M1 grid."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_int4.mxfp4 import E2M1_VALUES, decode_mxfp4, encode_mxfp4


def test_every_code_and_both_nibbles_decode_as_the_hand_table():
    # one block of 32: bytes 0x10, 0x32, ..., 0xFE put code 2j in the low nibble, 2j+1 in the high
    blocks = np.array([[(2 * j) | ((2 * j + 1) << 4) for j in range(8)] * 2], dtype=np.uint8)
    by_hand = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6] * 2
    np.testing.assert_array_equal(decode_mxfp4(blocks, np.array([127], np.uint8)), np.array(by_hand, np.float32))
    # scale byte 129 = 2^2, 124 = 2^-3
    np.testing.assert_array_equal(decode_mxfp4(blocks, np.array([129], np.uint8)), 4 * np.array(by_hand, np.float32))
    assert decode_mxfp4(blocks, np.array([124], np.uint8))[15] == -6 / 8
    one = np.zeros((1, 16), np.uint8)
    one[0, 0] = 0x7F  # low nibble 0xF = -6, high nibble 0x7 = +6
    assert decode_mxfp4(one, np.array([128], np.uint8))[:2].tolist() == [-12.0, 12.0]


def test_shapes_rows_and_blocks_are_laid_out_as_gpt_oss_stores_them():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)  # [experts, rows, cols/32, 16]
    scales = rng.integers(120, 135, (3, 5, 2), dtype=np.uint8)
    w = decode_mxfp4(blocks, scales)
    assert w.shape == (3, 5, 64)
    e, r, b, j = 2, 4, 1, 7
    assert w[e, r, 32 * b + 2 * j + 1] == E2M1_VALUES[blocks[e, r, b, j] >> 4] * 2.0 ** (int(scales[e, r, b]) - 127)


def test_decode_of_encode_lands_on_the_e2m1_grid_of_each_block():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 96)) * np.array([1e-3, 0.1, 3.0, 50.0])[:, None]).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    blocks, scales = encode_mxfp4(x)
    assert blocks.shape == (4, 3, 16) and scales.shape == (4, 3)
    y = decode_mxfp4(blocks, scales)
    step = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).repeat(32, axis=1)
    on_grid = y / step
    assert np.isin(np.abs(on_grid), E2M1_VALUES[:8]).all()  # every value a code times its block scale
    assert (np.abs(on_grid).reshape(4, 3, 32).max(-1)[1:] >= 3).all()  # the scale is the tight one (max in (3, 6])
    grid = E2M1_VALUES[:8]
    for value, got, s in zip(x.ravel(), y.ravel(), step.ravel(), strict=True):  # nearest grid point
        assert abs(got - value) <= np.abs(grid * s - abs(value)).min() + 1e-12
    np.testing.assert_array_equal(decode_mxfp4(*encode_mxfp4(y)), y)  # grid values survive exactly


def test_bad_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="do not match scales"):
        decode_mxfp4(np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        decode_mxfp4(np.zeros((2, 16), np.float32), np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="255"):
        decode_mxfp4(np.zeros((1, 16), np.uint8), np.array([255], np.uint8))
