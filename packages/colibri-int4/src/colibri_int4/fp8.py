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

EXPONENT_BIAS = 7
MAX_VALUE = 448.0


class FP8ConfigError(ValueError):
    """A quantization_config this reader refuses: the field, its value and why."""

    def __init__(self, key: str, value, why: str):
        super().__init__(f"{key}={value!r} is not supported ({why})")
        self.key, self.value, self.why = key, value, why


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


def parse_quantization_config(config: dict) -> tuple[int, int]:
    """The block size `[B0, B1]` of an FP8 block-scaled quantization_config; an `FP8ConfigError`
    (key, value, why) for anything else (another method, format, activation scheme, a
    per-tensor or malformed block size, or a key this reader does not know)."""
    if not isinstance(config, dict):
        raise FP8ConfigError("quantization_config", config, "expected an object")
    method = config.get("quant_method")
    if method != "fp8":
        raise FP8ConfigError("quantization_config.quant_method", method, "only DeepSeek's block-scaled 'fp8' is read")
    fmt = config.get("fmt", "e4m3")  # transformers' FineGrainedFP8Config does not write it: always e4m3
    if fmt != "e4m3":
        raise FP8ConfigError("quantization_config.fmt", fmt, "only 'e4m3' (E4M3FN) is decoded")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise FP8ConfigError("quantization_config.activation_scheme", scheme,
                         "only 'dynamic' (static activation scales would change the forward)")
    block = config.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise FP8ConfigError("quantization_config.weight_block_size", block, "expected two integers >= 1 [rows, cols]")
    # modules_to_not_convert lists the bf16 modules; which weights are FP8 is read from the
    # shards themselves (an F8_E4M3 tensor with its weight_scale_inv), so it is not needed
    known = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
    for key in config:
        if key not in known:
            raise FP8ConfigError(f"quantization_config.{key}", config[key], "a field the FP8 reader does not know")
    return int(block[0]), int(block[1])
