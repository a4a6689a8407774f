"""Group-wise int4 / int6 / int8 quantization and bfloat16 conversion, in plain numpy.

- int4 (`q4`): groups of G consecutive input columns share a 16-bit scale (and a 16-bit float
  zero when asymmetric); nibbles dequantize as `(q - 8) * s (+ z)`, torch's int4pack
  convention. Symmetric groups use llama.cpp's Q4_0 rule (scale = signed max-magnitude / -8),
  which keeps the largest weight exact and gives 16 levels instead of 15; asymmetric groups span
  min..max in 15 steps. Either keeps the grid its values already lie on, where they lie on one
  (weights decoded from a 4-bit file: `_symmetric_grid_scales`, `_asymmetric_grid`).
- int6 (`q6`): symmetric, `s = absmax / 31` per group, codes `c = q + 32` in 0..63 stored as a
  row of low nibbles and a row of 2-bit tops (`pack_q6`; FORMAT.md, Encodings).
- int8 (`q8`): symmetric, `s = absmax / 127` per group.
- bf16: numpy has no bfloat16, so we carry bit patterns as uint16 and convert with
  round-to-nearest-even; exact in the bf16 -> fp32 direction.

Quantizers work on row blocks of about 256K elements (1 MB as float32), so a 49152 x 1024 embedding
needs a few MB of temporaries, not several copies of the matrix, and each of numpy's passes over a
block reads it from the CPU's cache rather than from memory (a quarter faster than 4M-element
blocks). Quantization divides by the *stored* (rounded) scale and zero, so rounding of the 16-bit
scale is absorbed where it can be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import Q6_SPAN
from .scheme import ScaleDtype

_BLOCK_ELEMENTS = 1 << 18
_GRID_SAMPLE = 256  # groups looked at before sorting a block's groups (`_least_steps`)


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
    """A quantized `[rows, cols]` matrix. `data` is uint8 `[rows, cols/2]` nibbles (q4), uint8
    `[rows, cols*3/4]` lows and highs (q6) or int8 `[rows, cols]` (q8); `scales` / `zeros` are
    uint16 bit patterns `[rows, cols/G]`."""

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
            scale_bits = encode_half(_symmetric_grid_scales(groups, extreme / -8.0), scale_dtype)
            scale = decode_half(scale_bits, scale_dtype)
            offset = np.zeros_like(scale)
        else:
            low, step = _asymmetric_grid(groups)
            scale_bits = encode_half(step, scale_dtype)
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


def _asymmetric_grid(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each asymmetric group's minimum and scale: the step of the grid its values already lie on,
    where they lie on one of at most 16 levels, else `(max - min) / 15`.

    Weights dequantized from a 4-bit file with a per-block minimum (GGUF's Q4_1, Q4_K) lie on
    `m + d * q`, q in 0..15, but a block need not use both ends of its range: Q4_K's quantizer
    searches scale and minimum, and about a fifth of its 32-weight blocks span 14 or fewer steps.
    `(max - min) / 15` then puts those blocks on a finer, different grid, and every weight moves
    (4.3% relative RMS error on Q4_K blocks, where keeping the step is exact up to the 16-bit
    scale). The step is the least gap between a group's distinct values; it is taken only when
    every value is a whole number of steps from the minimum and the span is at most 15 steps.
    Values not on such a grid (a bf16 checkpoint's) keep the min/max rule."""
    shape = groups.shape[:-1]
    grid = _least_steps(groups)
    if grid is None:
        low = groups.min(axis=-1)
        return low, ((groups.max(axis=-1) - low) / 15.0).astype(np.float32)
    ordered, step = grid
    low, span = ordered[:, 0], ordered[:, -1] - ordered[:, 0]
    on_grid = (_whole_steps((ordered - low[:, None]) / step[:, None]) & (span > 0)
               & (np.rint(span / step) <= 15))
    scale = np.where(on_grid, step, span / 15.0).astype(np.float32)
    return low.reshape(shape), scale.reshape(shape)


def _symmetric_grid_scales(groups: np.ndarray, rule: np.ndarray) -> np.ndarray:
    """Each symmetric group's scale: the step `d` of the grid `d * k`, k in -8..7, its values already
    lie on (negated where they lie on -7..8), else `rule` (signed max magnitude / -8).

    Q4_0 blocks hold `d * (q - 8)`; llama.cpp's plain quantizer puts a block's largest magnitude at
    -8 steps, where the rule finds `d` again, but its importance-weighted one (imatrix) searches `d`,
    so a block's extreme may sit at +7 or -6 steps and the rule would move every weight of it.
    Where the rule already holds a block's first groups exactly (the plain quantizer), it serves
    the block without a search."""
    sample = groups.reshape(-1, groups.shape[-1])[:_GRID_SAMPLE]
    sample_rule = rule.reshape(-1)[:_GRID_SAMPLE]
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(sample_rule[:, None] != 0, sample / sample_rule[:, None], 0.0)
    if _whole_steps(levels).all():
        return rule
    grid = _least_steps(groups)
    if grid is None:
        return rule
    ordered, step = grid
    lowest, highest = np.rint(ordered[:, 0] / step), np.rint(ordered[:, -1] / step)
    upward = (lowest >= -8) & (highest <= 7)
    downward = (lowest >= -7) & (highest <= 8)
    on_grid = _whole_steps(ordered / step[:, None]) & (upward | downward)
    scale = np.where(upward, step, -step)
    return np.where(on_grid, scale, rule.reshape(-1)).reshape(rule.shape)


def _least_steps(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """`(each group's values sorted [n, G], the least gap between its distinct values [n])` with the
    gap 1 where a group has more than 16 distinct values or only one; None where a block's first
    groups are on no grid.

    A matrix is all on a grid (decoded from a 4-bit file) or all off it (a checkpoint): where its
    first `_GRID_SAMPLE` groups hold none of at most 16 levels, nothing else is sorted. numpy sorts a
    short last axis fast but reduces it slowly, so the least gap is read from sorted gaps: a level's
    weights decode to the very same float, so a group on at most 16 levels has at most 15 non-zero
    gaps between its sorted values."""
    size = groups.shape[-1]
    flat = groups.reshape(-1, size)
    sample = flat[:_GRID_SAMPLE]
    if not (np.count_nonzero(np.diff(np.sort(sample, axis=-1), axis=-1) > 0, axis=-1) <= 15).any():
        return None
    ordered = np.sort(flat, axis=-1)
    gaps = np.diff(ordered, axis=-1)
    # non-negative floats sort as their bits do: read as uint32 less one, a zero gap wraps to the
    # largest key, so the sorted keys start with the least non-zero gap and their 16th is the
    # largest key wherever a group has at most 15 non-zero gaps
    keys = gaps.view(np.uint32)
    keys -= 1
    keys.sort(axis=-1)
    least = keys[:, 0] + np.uint32(1)
    few = keys[:, 15] == np.iinfo(np.uint32).max if keys.shape[-1] > 15 else np.ones(len(least), bool)
    return ordered, np.where(few & (least != 0), least.view(np.float32), 1.0).astype(np.float32)


def _whole_steps(offsets: np.ndarray) -> np.ndarray:
    """Per row of `[n, G]` offsets in steps: whether every one is a whole number."""
    return ~_any_per_row(np.abs(offsets - np.rint(offsets)) >= 1e-3)


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """`flags.any(axis=-1)` for a `[n, G]` bool array, G a multiple of 8, as G/8 element-wise ORs of
    its rows read as uint64 words (numpy's own reduction pays per row)."""
    if flags.shape[-1] % 8:
        return flags.any(axis=-1)
    words = np.ascontiguousarray(flags).view(np.uint64)
    found = words[:, 0].copy()
    for column in range(1, words.shape[1]):
        found |= words[:, column]
    return found != 0


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
    return _dequantize_codes(packed, packed.shape[1] * 2, unpack_nibbles, 8.0, scales, zeros, group_size, scale_dtype)


def _dequantize_codes(data: np.ndarray, cols: int, unpack, offset: float, scales: np.ndarray,
                      zeros: np.ndarray | None, group_size: int, scale_dtype: ScaleDtype) -> np.ndarray:
    """fp32 `[rows, cols]` = (unpack(data) - offset) * s (+ z) per group, a block of rows at a time."""
    rows = data.shape[0]
    n_groups = cols // group_size
    out = np.empty((rows, cols), dtype=np.float32)
    for lo, hi in _row_blocks(rows, cols):
        levels = unpack(data[lo:hi]).astype(np.float32) - offset
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


def q6_row_bytes(cols: int) -> int:
    """Bytes of one q6 data row: `cols/2` lows then `cols/4` highs."""
    return cols * 3 // 4


def pack_q6(codes: np.ndarray) -> np.ndarray:
    """uint8 codes `[rows, cols]` in 0..63 -> q6 data uint8 `[rows, cols*3/4]` (FORMAT.md, q6).

    Lows: the low nibbles in q4's order (byte j: column 2j in bits 0-3, 2j+1 in bits 4-7).
    Highs: per 64-column span, byte i holds the top 2 bits of the columns of lows bytes i and
    16 + i of the span, so an AVX2 kernel that splits 32 lows bytes into a vector of low and one
    of high nibbles finds lane i's and lane 16+i's tops in one byte."""
    rows, cols = codes.shape
    if cols % Q6_SPAN:
        raise ValueError(f"q6 needs a multiple of {Q6_SPAN} columns, got {cols}")
    out = np.empty((rows, q6_row_bytes(cols)), dtype=np.uint8)
    out[:, : cols // 2] = (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)
    tops = (codes >> 4).reshape(rows, cols // Q6_SPAN, Q6_SPAN)
    highs = out[:, cols // 2 :].reshape(rows, cols // Q6_SPAN, 16)
    highs[...] = tops[..., 0:32:2] | (tops[..., 1:32:2] << 2) | (tops[..., 32::2] << 4) | (tops[..., 33::2] << 6)
    return out


def unpack_q6(data: np.ndarray) -> np.ndarray:
    """q6 data uint8 `[rows, cols*3/4]` -> uint8 codes `[rows, cols]` in 0..63 (inverse of `pack_q6`)."""
    rows, cols = data.shape[0], data.shape[1] * 4 // 3
    if data.shape[1] % 48:
        raise ValueError(f"q6 data rows are 48 bytes per 64 columns, got {data.shape[1]} bytes a row")
    codes = np.empty((rows, cols), dtype=np.uint8)
    lows = data[:, : cols // 2]
    codes[:, 0::2] = lows & 0x0F
    codes[:, 1::2] = lows >> 4
    highs = data[:, cols // 2 :].reshape(rows, cols // Q6_SPAN, 16)
    tops = codes.reshape(rows, cols // Q6_SPAN, Q6_SPAN)
    tops[..., 0:32:2] |= (highs & 0x03) << 4
    tops[..., 1:32:2] |= ((highs >> 2) & 0x03) << 4
    tops[..., 32::2] |= ((highs >> 4) & 0x03) << 4
    tops[..., 33::2] |= (highs >> 6) << 4
    return codes


def quantize_q6(weight: np.ndarray, group_size: int, scale_dtype: ScaleDtype) -> QuantizedMatrix:
    """Group-wise symmetric int6: `s = absmax / 31` (stored in `scale_dtype`), then
    `c = clip(round(w / s), -32, 31) + 32`, dividing by the stored scale (FORMAT.md, q6); a group of
    zeros has `s = 0` and codes 32."""
    rows, cols = _check_matrix(weight, group_size)
    if cols % Q6_SPAN:
        raise ValueError(f"q6 needs in_features a multiple of {Q6_SPAN}, got {cols}")
    n_groups = cols // group_size
    data = np.empty((rows, q6_row_bytes(cols)), dtype=np.uint8)
    scales = np.empty((rows, n_groups), dtype=np.uint16)
    for lo, hi in _row_blocks(rows, cols):
        groups = np.asarray(weight[lo:hi], dtype=np.float32).reshape(hi - lo, n_groups, group_size)
        scale_bits = encode_half(np.abs(groups).max(axis=-1) / 31.0, scale_dtype)
        scale = decode_half(scale_bits, scale_dtype)[..., None]
        # a true division (not a multiply by 1/s): the rule a reimplementation follows to the bit
        levels = np.zeros_like(groups)
        np.divide(groups, scale, out=levels, where=scale != 0)
        codes = np.clip(np.rint(levels), -32, 31) + 32.0
        data[lo:hi] = pack_q6(codes.astype(np.uint8).reshape(hi - lo, cols))
        scales[lo:hi] = scale_bits
    if not np.all(np.isfinite(decode_half(scales, scale_dtype))):
        raise ValueError(f"a group scale overflows {scale_dtype} (weights too large or not finite)")
    return QuantizedMatrix(data, scales, None)


def dequantize_q6(data: np.ndarray, scales: np.ndarray, group_size: int, scale_dtype: ScaleDtype) -> np.ndarray:
    """Inverse of `quantize_q6`: fp32 `[rows, cols]`, `w = s * (c - 32)`."""
    return _dequantize_codes(data, data.shape[1] * 4 // 3, unpack_q6, 32.0, scales, None, group_size, scale_dtype)
