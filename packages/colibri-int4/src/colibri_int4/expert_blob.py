"""One routed expert as one contiguous blob: encode, verify, view, dequantize.

Experts are group-wise int4 (q4) unless the scheme says int8 (q8) or bf16 (format 1.1); the
layout (layout.ExpertBlobLayout) says which, and every function here follows it.

The streaming runtime reads a blob with its own aligned `preadv` (O_DIRECT) into its own
buffer and hands the bytes here: `ExpertBlob.parse(buffer, layout, crc32)` checks the CRC and
returns zero-copy numpy views of the packed nibbles and scales (for repacking into torch's
int4 kernel layout) and `.dequantize()` gives fp32 gate/up/down. CRC-32 runs at >1 GB/s, a
small price next to a disk read, and catches corruption before weights reach a forward pass.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .errors import ChecksumError, ContainerError
from .layout import ExpertBlobLayout
from .quantize import (
    bf16_bits_to_f32,
    decode_half,
    dequantize_q4,
    dequantize_q8,
    f32_to_bf16_bits,
    quantize_q4,
    quantize_q8,
)
from .scheme import QuantScheme

PARTS = ("gate", "up", "down")


def encode_expert_blob(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, layout: ExpertBlobLayout, scheme: QuantScheme,
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> bytearray:
    """Quantize one expert's three matrices into a zero-padded blob of `layout.blob_length`;
    `biases` (gate, up, down; format 1.2) are stored as f32 when the layout has them."""
    if layout.bias != (biases is not None):
        raise ValueError("the blob layout has expert biases" if layout.bias else "this blob layout has no expert biases")
    blob = bytearray(layout.blob_length)
    matrices = dict(zip(PARTS, (gate, up, down), strict=True))
    bias_of = dict(zip(PARTS, biases, strict=True)) if biases is not None else {}
    if layout.encoding == "q4":
        quantized = {p: quantize_q4(m, layout.groups[p], scheme.symmetric, scheme.scale_dtype) for p, m in matrices.items()}
    elif layout.encoding == "q8":
        quantized = {p: quantize_q8(m, layout.groups[p], scheme.scale_dtype) for p, m in matrices.items()}
    else:
        quantized = {p: _Bits(f32_to_bf16_bits(m)) for p, m in matrices.items()}
    for section in layout.sections:
        if section.kind == "bias":
            bias = np.asarray(bias_of[section.part], dtype="<f4")
            if bias.shape != section.shape:
                raise ValueError(f"{section.part} bias has shape {list(bias.shape)}, expected {list(section.shape)}")
            blob[section.offset : section.offset + section.length] = bias.tobytes()
            continue
        q = quantized[section.part]
        array = {"packed": q.data, "data": q.data, "scales": q.scales, "zeros": q.zeros}[section.kind]
        blob[section.offset : section.offset + section.length] = np.ascontiguousarray(array).tobytes()
    return blob


@dataclass
class _Bits:
    """bf16 bit patterns in the shape of a quantized matrix (no scales)."""

    data: np.ndarray
    scales: None = None
    zeros: None = None


@dataclass
class ExpertBlob:
    """Zero-copy views of one parsed blob. For q4 (`encoding`, the default): `packed[part]`:
    uint8 `[rows, cols/2]`, low nibble = even column; `scales[part]` / `zeros[part]`: uint16
    bit patterns of `scale_dtype`, `[rows, cols/groups[part]]`; dequantized weight =
    `(nibble - 8) * scale (+ zero)`. For q8: `data[part]` int8 `[rows, cols]` and `scales`;
    for bf16: `data[part]` uint16 bf16 bit patterns `[rows, cols]`, no scales. `biases[part]`
    (format 1.2, or None): f32 `[rows]`, added after the matrix product."""

    packed: dict[str, np.ndarray]
    scales: dict[str, np.ndarray]
    zeros: dict[str, np.ndarray] | None
    groups: dict[str, int]
    scale_dtype: str
    encoding: str = "q4"
    data: dict[str, np.ndarray] | None = None
    biases: dict[str, np.ndarray] | None = None

    @classmethod
    def parse(cls, buffer, layout: ExpertBlobLayout, crc32: str | None = None, where: str = "expert blob") -> ExpertBlob:
        """Views over `buffer` (at least `layout.blob_length` bytes; a memoryview, bytes,
        bytearray, mmap or numpy array). With `crc32` (hex, from the index) the blob is
        verified first and a mismatch raises `ContainerError` naming `where`."""
        raw = np.frombuffer(buffer, dtype=np.uint8)
        if raw.size < layout.blob_length:
            raise ContainerError(f"{where}: buffer has {raw.size} bytes, the blob needs {layout.blob_length}")
        raw = raw[: layout.blob_length]
        if crc32 is not None and f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}" != crc32:
            raise ChecksumError(f"{where}: checksum mismatch (CRC-32 {crc32} expected): the blob is corrupted")
        views: dict[str, dict[str, np.ndarray]] = {"packed": {}, "data": {}, "scales": {}, "zeros": {}, "bias": {}}
        data_dtype = np.int8 if layout.encoding == "q8" else np.dtype("<u2")
        for s in layout.sections:
            chunk = raw[s.offset : s.offset + s.length]
            if s.kind == "packed":
                view = chunk
            elif s.kind == "bias":
                view = chunk.view("<f4")
            else:
                view = chunk.view(data_dtype if s.kind == "data" else "<u2")
            views[s.kind][s.part] = view.reshape(s.shape)
        return cls(views["packed"], views["scales"], views["zeros"] or None, layout.groups, layout.scale_dtype,
                   layout.encoding, views["data"] or None, views["bias"] or None)

    def scales_f32(self, part: str) -> np.ndarray:
        return decode_half(self.scales[part], self.scale_dtype)

    def zeros_f32(self, part: str) -> np.ndarray | None:
        return None if self.zeros is None else decode_half(self.zeros[part], self.scale_dtype)

    def dequantize(self) -> dict[str, np.ndarray]:
        """fp32 `{"gate": [expert_dim, d], "up": [expert_dim, d], "down": [d, expert_dim]}`
        (the biases, when there are any, are `biases`)."""
        if self.encoding == "bf16":
            return {part: bf16_bits_to_f32(self.data[part]) for part in PARTS}
        if self.encoding == "q8":
            return {part: dequantize_q8(self.data[part], self.scales[part], self.groups[part], self.scale_dtype)
                    for part in PARTS}
        return {
            part: dequantize_q4(
                self.packed[part], self.scales[part], None if self.zeros is None else self.zeros[part],
                self.groups[part], self.scale_dtype,
            )
            for part in PARTS
        }


def decode_expert_blob(buffer, layout: ExpertBlobLayout, crc32: str | None = None) -> dict[str, np.ndarray]:
    """Verify (if `crc32` is given) and dequantize one blob to fp32 gate/up/down."""
    return ExpertBlob.parse(buffer, layout, crc32).dequantize()
