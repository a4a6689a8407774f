"""The FP8 E4M3FN decoder (DeepSeek's release) against the format's definition and torch's
float8_e4m3fn, the block-scale dequantisation (partial edge blocks, row ranges), and the
quantization_config reader."""

from __future__ import annotations

import math

import numpy as np
import pytest
from colibri_int4.fp8 import (
    E4M3_VALUES,
    MAX_VALUE,
    FP8ConfigError,
    apply_block_scales,
    decode_e4m3,
    dequantize,
    parse_quantization_config,
    scale_shape,
)


def _by_definition(code: int) -> float:
    """E4M3FN from its definition: s eeee mmm, bias 7, no infinities, s.1111.111 NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:  # subnormal: no implicit 1, exponent 1 - bias
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_every_one_of_the_256_codes_decodes_by_the_definition():
    got = decode_e4m3(np.arange(256, dtype=np.uint8))
    assert got.dtype == np.float32
    for code in range(256):
        expected = _by_definition(code)
        if math.isnan(expected):
            assert math.isnan(got[code]), code
        else:
            assert got[code] == expected and math.copysign(1, got[code]) == math.copysign(1, expected), code
    assert [c for c in range(256) if math.isnan(got[c])] == [0x7F, 0xFF]
    assert not np.isinf(got).any()  # no infinities in the fn variant
    assert got[0x7E] == MAX_VALUE == 448 and got[0xFE] == -448
    assert got[0x01] == 2.0 ** -9 and got[0x07] == 7 * 2.0 ** -9  # subnormals
    assert got[0x08] == 2.0 ** -6  # the smallest normal
    assert got[0x38] == 1.0 and got[0x80] == 0 and math.copysign(1, got[0x80]) == -1  # bias 7; -0


def test_every_code_decodes_as_torch_float8_e4m3fn():
    torch = pytest.importorskip("torch")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    reference = codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(decode_e4m3(codes.numpy()), reference)  # NaN == NaN here
    np.testing.assert_array_equal(np.signbit(decode_e4m3(codes.numpy())), np.signbit(reference))


def test_block_scales_with_partial_edge_blocks_and_any_row_range():
    rng = np.random.default_rng(0)
    rows, cols, block = 37, 29, (8, 12)  # edge blocks of 5 rows and 5 columns
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # no NaN codes
    scale = rng.uniform(0.01, 3.0, scale_shape((rows, cols), block)).astype(np.float32)
    assert scale.shape == (5, 3)
    by_element = np.array([[E4M3_VALUES[codes[r, c]] * scale[r // 8, c // 12] for c in range(cols)]
                           for r in range(rows)], np.float32)
    np.testing.assert_array_equal(dequantize(codes, scale, block), by_element)
    for start, stop in ((0, 1), (3, 21), (7, 9), (16, 37), (36, 37)):  # rows not aligned to blocks
        np.testing.assert_array_equal(dequantize(codes[start:stop], scale, block, first_row=start),
                                      by_element[start:stop], err_msg=f"rows {start}:{stop}")
    ones = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(apply_block_scales(ones, np.array([[2.0, 5.0]], np.float32), (4, 2)),
                                  [[2, 2, 5], [2, 2, 5]])


def test_dequantize_matches_torch_on_float8_tensors():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 50, generator=gen) * 3
    fp8 = weight.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, generator=gen) + 0.5  # blocks of [16, 16]: edges of 8 rows, 2 columns
    full = scale.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :50]
    expected = (fp8.float() * full).numpy()
    got = dequantize(fp8.view(torch.uint8).numpy(), scale.numpy(), (16, 16))
    np.testing.assert_array_equal(got, expected)


DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_deepseeks_quantization_config_is_read_and_others_refused_by_name():
    assert parse_quantization_config(DEEPSEEK_V3) == (128, 128)
    assert parse_quantization_config({**DEEPSEEK_V3, "weight_block_size": [16, 24]}) == (16, 24)
    # transformers' FineGrainedFP8Config: no fmt, modules_to_not_convert
    assert parse_quantization_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "modules_to_not_convert": None}) == (128, 128)
    for change, field in (
        (dict(quant_method="gptq"), "quant_method='gptq'"),
        (dict(fmt="e5m2"), "fmt='e5m2'"),
        (dict(activation_scheme="static"), "activation_scheme='static'"),
        (dict(weight_block_size=None), "weight_block_size=None"),
        (dict(weight_block_size=[128]), r"weight_block_size=\[128\]"),
        (dict(weight_block_size=[0, 128]), r"weight_block_size=\[0, 128\]"),
        (dict(weight_block_size=[128.0, 128]), "weight_block_size="),
        (dict(kv_cache_scheme="fp8"), "kv_cache_scheme='fp8'"),
    ):
        with pytest.raises(FP8ConfigError, match=f"quantization_config.{field}"):
            parse_quantization_config({**DEEPSEEK_V3, **change})


def test_bad_codes_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        decode_e4m3(np.zeros(3, np.float32))
