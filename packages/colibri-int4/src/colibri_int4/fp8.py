"""FP8 E4M3 (the `e4m3fn` variant) with 2-D block scales: how DeepSeek-V3/R1's own release
stores its linear weights (quantization_config `{"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`).

A weight `X.weight [rows, cols]` (`nn.Linear` layout, `[out, in]`) is stored as

    X.weight            F8_E4M3  [rows, cols]                        one code per byte
    X.weight_scale_inv  F32      [ceil(rows / B0), ceil(cols / B1)]  one scale per B0 x B1 block

with `[B0, B1] = weight_block_size`; the last block of a row or column is smaller when the
shape is not a multiple. The weight is

    w[r, c] = E4M3_VALUES[code[r, c]] * weight_scale_inv[r // B0, c // B1]

(the name says "inverse" because the quantizer divided by it). An E4M3FN code is 8 bits
`s eeee mmm`, exponent bias 7, no infinities: exponent 1..15 gives `(1 + m/8) * 2 ** (e - 7)`,
exponent 0 the subnormals `m/8 * 2 ** -6`, and only `s 1111 111` (0x7F, 0xFF) is NaN, so the
largest value is 0x7E = 448. `E4M3_VALUES` is the 256-entry table (index = the code), exact in
fp32. The product is taken in fp32 (what DeepSeek's own fp8_cast_bf16.py computes before it
rounds to bf16); the import then quantizes it to the container's int4, int8 or bf16.
"""

from __future__ import annotations

import numpy as np
from colibri_spec.hf_config.quantization import FP8ConfigError, parse_quantization_config

# The quantization_config side (which fp8 configs are read) is colibri-spec's HF config mapping.
__all__ = ["E4M3_VALUES", "FP8ConfigError", "apply_block_scales", "decode_e4m3", "dequantize", "parse_quantization_config",
           "scale_shape"]

EXPONENT_BIAS = 7
MAX_VALUE = 448.0


def _e4m3fn_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - EXPONENT_BIAS)
    subnormal = mantissa / 8 * 2.0 ** (1 - EXPONENT_BIAS)
    values = sign * np.where(exponent == 0, subnormal, normal)
    nan = (codes & 0x7F) == 0x7F
    values[nan] = np.copysign(np.nan, sign[nan])  # 0xFF is -NaN, as torch decodes it
    return values.astype(np.float32)


E4M3_VALUES = _e4m3fn_table()


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """fp32 values of uint8 E4M3FN codes (same shape); 0x7F and 0xFF decode to NaN."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"E4M3 codes must be uint8, got {codes.dtype}")
    return E4M3_VALUES[codes]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `weight_scale_inv` shape of a 2-D weight `shape` with blocks `block`."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def apply_block_scales(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], first_row: int = 0) -> np.ndarray:
    """Multiply decoded rows `values [n, cols]` (rows `first_row .. first_row + n` of the weight)
    in place by their blocks' scales; `scale_inv` is the weight's whole `[R, C]` scale tensor.
    Works one row block at a time: the extra memory is one scale row of `cols` floats."""
    n, cols = values.shape
    b0, b1 = block
    row = 0
    while row < n:
        block_row = (first_row + row) // b0
        stop = min(n, (block_row + 1) * b0 - first_row)  # the end of this row block (or of `values`)
        values[row:stop] *= np.repeat(scale_inv[block_row], b1)[:cols]
        row = stop
    return values


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], first_row: int = 0) -> np.ndarray:
    """fp32 weight rows from their uint8 codes `[n, cols]` and the weight's `scale_inv`."""
    return apply_block_scales(decode_e4m3(codes), np.asarray(scale_inv, dtype=np.float32), block, first_row)
