"""Group-wise int4 / int8 quantization and bfloat16 conversion, in plain numpy.

- int4 (`q4`): groups of G consecutive input columns share a 16-bit scale (and a 16-bit float
  zero when asymmetric); nibbles dequantize as `(q - 8) * s (+ z)`, torch's int4pack
  convention. Symmetric groups use llama.cpp's Q4_0 rule (scale = signed max-magnitude / -8),
  which keeps the largest weight exact and gives 16 levels instead of 15. Asymmetric groups span
  min..max in 15 steps, or keep the grid their values already lie on (`_grid_steps`: weights
  decoded from a 4-bit file).
- int8 (`q8`): symmetric, `s = absmax / 127` per group.
- bf16: numpy has no bfloat16, so we carry bit patterns as uint16 and convert with
  round-to-nearest-even; exact in the bf16 -> fp32 direction.

Quantizers work on row blocks of about 4M elements, so a 49152 x 1024 embedding needs tens of
MB of temporaries, not several copies of the matrix. Quantization divides by the *stored*
(rounded) scale and zero, so rounding of the 16-bit scale is absorbed where it can be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scheme import ScaleDtype

_BLOCK_ELEMENTS = 1 << 22
_GRID_SAMPLE = 256  # groups looked at before sorting a block's groups (`_grid_steps`)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 -> bfloat16 bit patterns (uint16), round to nearest even; in chunks, so converting
    a 200 MB embedding needs ~16 MB of temporaries on top of input and output."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(flat.shape, dtype=np.uint16)
    for start in range(0, flat.size, _BLOCK_ELEMENTS):
        bits = flat[start : start + _BLOCK_ELEMENTS]
        rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
        out[start : start + _BLOCK_ELEMENTS] = (bits + rounding) >> 16
    return out.reshape(np.shape(values))


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> fp32, exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def encode_half(values: np.ndarray, dtype: ScaleDtype) -> np.ndarray:
    """fp32 -> 16-bit patterns of `dtype` ("bf16" or "fp16")."""
    if dtype == "bf16":
        return f32_to_bf16_bits(values)
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def decode_half(bits: np.ndarray, dtype: ScaleDtype) -> np.ndarray:
    """16-bit patterns of `dtype` -> fp32."""
    if dtype == "bf16":
        return bf16_bits_to_f32(bits)
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


@dataclass
class QuantizedMatrix:
    """A quantized `[rows, cols]` matrix. `data` is uint8 `[rows, cols/2]` nibbles (q4) or int8
    `[rows, cols]` (q8); `scales` / `zeros` are uint16 bit patterns `[rows, cols/G]`."""

    data: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None

    def sections(self) -> list[np.ndarray]:
        """The byte sections in file order (FORMAT.md: data | scales | zeros)."""
        parts = [self.data, self.scales]
        if self.zeros is not None:
            parts.append(self.zeros)
        return parts


def _check_matrix(weight: np.ndarray, group_size: int) -> tuple[int, int]:
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    if cols % group_size != 0:
        raise ValueError(f"in_features {cols} is not a multiple of the group size {group_size}")
    return rows, cols


def _row_blocks(rows: int, cols: int):
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def quantize_q4(
    weight: np.ndarray, group_size: int, symmetric: bool, scale_dtype: ScaleDtype
) -> QuantizedMatrix:
    """Group-wise int4 quantization of a `[rows, cols]` float matrix (see module docstring)."""
    rows, cols = _check_matrix(weight, group_size)
    n_groups = cols // group_size
    packed = np.empty((rows, cols // 2), dtype=np.uint8)
    scales = np.empty((rows, n_groups), dtype=np.uint16)
    zeros = None if symmetric else np.empty((rows, n_groups), dtype=np.uint16)
    for lo, hi in _row_blocks(rows, cols):
        groups = np.asarray(weight[lo:hi], dtype=np.float32).reshape(hi - lo, n_groups, group_size)
        if symmetric:
            pick = np.argmax(np.abs(groups), axis=-1)[..., None]
            extreme = np.take_along_axis(groups, pick, axis=-1)[..., 0]
            scale_bits = encode_half(extreme / -8.0, scale_dtype)
            scale = decode_half(scale_bits, scale_dtype)
            offset = np.zeros_like(scale)
        else:
            low, high = groups.min(axis=-1), groups.max(axis=-1)
            scale_bits = encode_half(_grid_steps(groups, low, high), scale_dtype)
            scale = decode_half(scale_bits, scale_dtype)
            zero_bits = encode_half(low + 8.0 * scale, scale_dtype)
            offset = decode_half(zero_bits, scale_dtype)
            zeros[lo:hi] = zero_bits
        with np.errstate(divide="ignore"):
            inverse = np.where(scale != 0, 1.0 / scale, 0.0).astype(np.float32)
        levels = np.rint((groups - offset[..., None]) * inverse[..., None]) + 8.0
        nibbles = np.clip(levels, 0, 15).astype(np.uint8).reshape(hi - lo, cols)
        packed[lo:hi] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        scales[lo:hi] = scale_bits
    if not np.all(np.isfinite(decode_half(scales, scale_dtype))):
        raise ValueError(f"a group scale overflows {scale_dtype} (weights too large or not finite)")
    return QuantizedMatrix(packed, scales, zeros)


def _grid_steps(groups: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Each asymmetric group's scale: the step of the grid its values already lie on, where they
    lie on one of at most 16 levels, else `(high - low) / 15`.

    Weights dequantized from a 4-bit file with a per-block minimum (GGUF's Q4_1, Q4_K) lie on
    `m + d * q`, q in 0..15, but a block need not use both ends of its range: Q4_K's quantizer
    searches scale and minimum, and about a fifth of its 32-weight blocks span 14 or fewer steps.
    `(high - low) / 15` then puts those blocks on a finer, different grid, and every weight moves
    (4.3% relative RMS error on Q4_K blocks, where keeping the step is exact up to the 16-bit
    scale). The step is the least gap between a group's distinct values; it is taken only when
    every value is a whole number of steps from the minimum and the span is at most 15 steps.
    Values not on such a grid (a bf16 checkpoint's) keep the min/max rule."""
    span = high - low
    wide = (span / 15.0).astype(np.float32)
    # a matrix is all on a grid (decoded from a 4-bit file) or all off it (a checkpoint): where its
    # first groups are on none, the min/max rule serves without sorting the rest
    sample = groups.reshape(-1, groups.shape[-1])[:_GRID_SAMPLE]
    if not (np.count_nonzero(np.diff(np.sort(sample, axis=-1), axis=-1) > 0, axis=-1) <= 15).any():
        return wide
    gaps = np.diff(np.sort(groups, axis=-1), axis=-1)
    # a level's weights decode to the very same float, so a group on at most 16 levels has at most
    # 15 non-zero gaps (a checkpoint's groups hardly repeat a value: they cost a sort and a count)
    distinct = gaps > 0
    few = (np.count_nonzero(distinct, axis=-1) <= 15) & (span > 0)
    if not few.any():
        return wide
    step = np.where(few, np.where(distinct, gaps, np.inf).min(axis=-1), 1.0).astype(np.float32)
    offsets = (groups - low[..., None]) / step[..., None]
    on_grid = few & (np.abs(offsets - np.rint(offsets)).max(axis=-1) < 1e-3) & (np.rint(span / step) <= 15)
    return np.where(on_grid, step, wide)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 `[rows, cols/2]` -> uint8 `[rows, cols]` in 0..15 (low nibble = even column)."""
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def dequantize_q4(
    packed: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    group_size: int,
    scale_dtype: ScaleDtype,
) -> np.ndarray:
    """Inverse of `quantize_q4`: fp32 `[rows, cols]`."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    n_groups = cols // group_size
    out = np.empty((rows, cols), dtype=np.float32)
    for lo, hi in _row_blocks(rows, cols):
        levels = unpack_nibbles(packed[lo:hi]).astype(np.float32) - 8.0
        grouped = levels.reshape(hi - lo, n_groups, group_size)
        grouped *= decode_half(scales[lo:hi], scale_dtype)[..., None]
        if zeros is not None:
            grouped += decode_half(zeros[lo:hi], scale_dtype)[..., None]
        out[lo:hi] = grouped.reshape(hi - lo, cols)
    return out


def quantize_q8(weight: np.ndarray, group_size: int, scale_dtype: ScaleDtype) -> QuantizedMatrix:
    """Group-wise symmetric int8: `s = absmax / 127`, `q = round(w / s)`."""
    rows, cols = _check_matrix(weight, group_size)
    n_groups = cols // group_size
    data = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows, n_groups), dtype=np.uint16)
    for lo, hi in _row_blocks(rows, cols):
        groups = np.asarray(weight[lo:hi], dtype=np.float32).reshape(hi - lo, n_groups, group_size)
        scale_bits = encode_half(np.abs(groups).max(axis=-1) / 127.0, scale_dtype)
        scale = decode_half(scale_bits, scale_dtype)
        with np.errstate(divide="ignore"):
            inverse = np.where(scale != 0, 1.0 / scale, 0.0).astype(np.float32)
        levels = np.clip(np.rint(groups * inverse[..., None]), -127, 127)
        data[lo:hi] = levels.astype(np.int8).reshape(hi - lo, cols)
        scales[lo:hi] = scale_bits
    if not np.all(np.isfinite(decode_half(scales, scale_dtype))):
        raise ValueError(f"a group scale overflows {scale_dtype} (weights too large or not finite)")
    return QuantizedMatrix(data, scales, None)


def dequantize_q8(data: np.ndarray, scales: np.ndarray, group_size: int, scale_dtype: ScaleDtype) -> np.ndarray:
    """Inverse of `quantize_q8`: fp32 `[rows, cols]`."""
    rows, cols = data.shape
    grouped = data.astype(np.float32).reshape(rows, cols // group_size, group_size)
    grouped *= decode_half(scales, scale_dtype)[..., None]
    return grouped.reshape(rows, cols)
