"""MXFP4 (OCP Microscaling, FP4 E2M1 elements): how GPT-OSS checkpoints store their routed experts.

A weight matrix `[rows, cols]` (`nn.Linear` layout, `[out, in]`) is stored as two uint8 tensors:

    *_blocks  [..., rows, cols / 32, 16]   two E2M1 codes per byte, low nibble first
    *_scales  [..., rows, cols / 32]       one E8M0 scale per block of 32 consecutive columns

An E2M1 code is 4 bits `s e1 e0 m`: sign, a 2-bit exponent, a 1-bit mantissa, giving
{0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives (`E2M1_VALUES`, index = the code). An E8M0
scale is a power of two, `2 ** (byte - 127)`; byte 255 is NaN in the spec and refused here.
Column `2j` of a block is byte `j`'s low nibble, column `2j + 1` its high nibble, so

    w[r, 32 b + 2 j]     = E2M1_VALUES[blocks[r, b, j] & 15] * 2 ** (scales[r, b] - 127)
    w[r, 32 b + 2 j + 1] = E2M1_VALUES[blocks[r, b, j] >> 4] * 2 ** (scales[r, b] - 127)

`decode_mxfp4` is that formula, exact in fp32 (every product is a small integer times a power
of two within fp32's range for bytes 0..254 after the ~2^-149 subnormal floor). The import
decodes one expert at a time and re-quantizes it to the container's int4/int8/bf16.
`encode_mxfp4` (round to nearest code, the block scale chosen so its largest magnitude fits 6)
exists to build test checkpoints; it is not a writer of any Colibri format.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # elements per shared scale
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E8M0_BIAS = 127
E8M0_NAN = 255


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 `[..., G * 32]` from uint8 `blocks [..., G, 16]` and `scales [..., G]`."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    if scales.size and int(scales.max()) == E8M0_NAN:
        raise ValueError("MXFP4 scale byte 255 (NaN in E8M0) found")
    values = np.empty((*blocks.shape[:-1], BLOCK), dtype=np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - E8M0_BIAS)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def encode_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of fp32 `x [..., cols]` (cols a multiple of 32): each block's scale is
    the smallest power of two with `max |x| / scale <= 6`, each element the nearest code."""
    x = np.ascontiguousarray(x, dtype=np.float32)  # C order in, C order out (astype keeps strides)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs a multiple of {BLOCK} columns, got {x.shape[-1]}")
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(grouped).max(-1)
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-38) / 6.0)), -E8M0_BIAS)
    exponent = np.clip(exponent, -E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS).astype(np.int32)
    scaled = grouped / np.ldexp(np.float32(1), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - E2M1_VALUES[:8]).argmin(-1).astype(np.uint8)  # magnitude 0..7
    codes |= np.where(np.signbit(scaled), 8, 0).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent + E8M0_BIAS).astype(np.uint8))
