"""Encode and decode one resident tensor in its container encoding (f32, bf16, q4, q6, q8).

Decoding is zero-copy where it can be: raw views (`RawTensor`) are numpy views over the
caller's buffer, so a runtime that keeps the resident region in one buffer pays for it once;
`dequantize=True` materialises fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ContainerError
from .layout import Encoding, check_groupable, effective_group, encoded_length
from .quantize import (
    bf16_bits_to_f32,
    decode_half,
    dequantize_q4,
    dequantize_q6,
    dequantize_q8,
    f32_to_bf16_bits,
    q6_row_bytes,
    quantize_q4,
    quantize_q6,
    quantize_q8,
)
from .scheme import QuantScheme


@dataclass
class RawTensor:
    """A tensor as stored. `data`: fp32 (f32), uint16 bf16 bits (bf16), uint8 packed nibbles
    `[rows, cols/2]` (q4), uint8 `[rows, cols*3/4]` (q6: each row's `cols/2` bytes of low
    nibbles, then its `cols/4` bytes of top bits, see `quantize.pack_q6`) or int8 (q8);
    `scales`/`zeros`: uint16 bit patterns of `scale_dtype`, `[rows, cols/group_size]` (None
    for f32/bf16). `group_size` is the effective one for this tensor (layout.effective_group)."""

    name: str
    encoding: Encoding
    shape: tuple[int, ...]
    data: np.ndarray
    scales: np.ndarray | None
    zeros: np.ndarray | None
    group_size: int
    scale_dtype: str

    def scales_f32(self) -> np.ndarray | None:
        return None if self.scales is None else decode_half(self.scales, self.scale_dtype)

    def zeros_f32(self) -> np.ndarray | None:
        return None if self.zeros is None else decode_half(self.zeros, self.scale_dtype)

    def rows(self, start: int, stop: int) -> RawTensor:
        """Rows [start, stop) of a 2-D tensor, as views (every encoding here is row-major with
        per-row groups), so a runtime can dequantize a large tensor a block of rows at a time."""
        if len(self.shape) != 2:
            raise ValueError(f"tensor '{self.name}' has shape {self.shape}: only 2-D tensors have rows")

        def cut(array):
            return None if array is None else array[start:stop]

        rows = len(range(*slice(start, stop).indices(self.shape[0])))
        return RawTensor(self.name, self.encoding, (rows, self.shape[1]), self.data[start:stop],
                         cut(self.scales), cut(self.zeros), self.group_size, self.scale_dtype)

    def take(self, indices: np.ndarray) -> RawTensor:
        """The given rows of a 2-D tensor (any order, repeats allowed), as copies: an embedding
        held as stored dequantizes only the rows a batch looks up, each to exactly the values the
        whole tensor's `dequantize()` gives it (every encoding here groups within a row)."""
        if len(self.shape) != 2:
            raise ValueError(f"tensor '{self.name}' has shape {self.shape}: only 2-D tensors have rows")
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and (indices.min() < 0 or indices.max() >= self.shape[0]):
            raise IndexError(f"tensor '{self.name}' has {self.shape[0]} rows; asked for rows "
                             f"{int(indices.min())}..{int(indices.max())}")

        def pick(array):
            return None if array is None else array[indices]

        return RawTensor(self.name, self.encoding, (indices.size, self.shape[1]), self.data[indices],
                         pick(self.scales), pick(self.zeros), self.group_size, self.scale_dtype)

    def dequantize(self) -> np.ndarray:
        if self.encoding == "f32":
            return np.array(self.data, dtype=np.float32)
        if self.encoding == "bf16":
            return bf16_bits_to_f32(self.data)
        if self.encoding == "q8":
            return dequantize_q8(self.data, self.scales, self.group_size, self.scale_dtype)
        if self.encoding == "q6":
            return dequantize_q6(self.data, self.scales, self.group_size, self.scale_dtype)
        return dequantize_q4(self.data, self.scales, self.zeros, self.group_size, self.scale_dtype)


def encode_tensor(array: np.ndarray, encoding: Encoding, scheme: QuantScheme) -> list[np.ndarray]:
    """The byte sections of `array` in `encoding` (FORMAT.md), to be written back to back."""
    if encoding == "f32":
        return [np.ascontiguousarray(array, dtype="<f4")]
    if encoding == "bf16":
        return [f32_to_bf16_bits(array)]
    group = effective_group(array.shape[-1], scheme.group_size)
    if encoding == "q8":
        return quantize_q8(array, group, scheme.scale_dtype).sections()
    if encoding == "q6":
        return quantize_q6(array, group, scheme.scale_dtype).sections()
    return quantize_q4(array, group, scheme.symmetric, scheme.scale_dtype).sections()


def decode_tensor(
    buffer, name: str, encoding: Encoding, shape: tuple[int, ...], scheme: QuantScheme
) -> RawTensor:
    """Views over `buffer` (exactly the tensor's bytes) as a `RawTensor`; no copy."""
    raw = np.frombuffer(buffer, dtype=np.uint8)
    reason = check_groupable(encoding, shape, scheme)
    if reason:
        raise ContainerError(f"tensor '{name}': {reason}")
    expected = encoded_length(encoding, shape, scheme)
    if raw.size != expected:  # else numpy's reshape error, which names neither tensor nor sizes
        raise ContainerError(f"tensor '{name}': {encoding} {list(shape)} takes {expected} bytes, got {raw.size}")
    group = effective_group(shape[-1], scheme.group_size) or scheme.group_size
    if encoding == "f32":
        return RawTensor(name, encoding, shape, raw.view("<f4").reshape(shape), None, None, group, scheme.scale_dtype)
    if encoding == "bf16":
        return RawTensor(name, encoding, shape, raw.view("<u2").reshape(shape), None, None, group, scheme.scale_dtype)
    rows, cols = shape
    n_groups = cols // group
    row_bytes = {"q8": cols, "q6": q6_row_bytes(cols)}.get(encoding, cols // 2)
    data_len = rows * row_bytes
    data = raw[:data_len].view(np.int8 if encoding == "q8" else np.uint8).reshape(rows, row_bytes)
    scales = raw[data_len : data_len + 2 * rows * n_groups].view("<u2").reshape(rows, n_groups)
    zeros = None
    if encoding == "q4" and not scheme.symmetric:
        start = data_len + 2 * rows * n_groups
        zeros = raw[start : start + 2 * rows * n_groups].view("<u2").reshape(rows, n_groups)
    return RawTensor(name, encoding, shape, data, scales, zeros, group, scheme.scale_dtype)
