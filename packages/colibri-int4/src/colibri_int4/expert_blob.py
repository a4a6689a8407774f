"""One routed expert as one contiguous blob: encode, verify, view, dequantize.

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
from .quantize import decode_half, dequantize_q4, quantize_q4
from .scheme import QuantScheme

PARTS = ("gate", "up", "down")


def encode_expert_blob(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, layout: ExpertBlobLayout, scheme: QuantScheme
) -> bytearray:
    """Quantize one expert's three matrices into a zero-padded blob of `layout.blob_length`."""
    blob = bytearray(layout.blob_length)
    quantized = {
        part: quantize_q4(matrix, layout.groups[part], scheme.symmetric, scheme.scale_dtype)
        for part, matrix in zip(PARTS, (gate, up, down), strict=True)
    }
    for section in layout.sections:
        q = quantized[section.part]
        array = {"packed": q.data, "scales": q.scales, "zeros": q.zeros}[section.kind]
        blob[section.offset : section.offset + section.length] = np.ascontiguousarray(array).tobytes()
    return blob


@dataclass
class ExpertBlob:
    """Zero-copy views of one parsed blob. `packed[part]`: uint8 `[rows, cols/2]`, low nibble
    = even column; `scales[part]` / `zeros[part]`: uint16 bit patterns of `scale_dtype`,
    `[rows, cols/groups[part]]`; dequantized weight = `(nibble - 8) * scale (+ zero)`."""

    packed: dict[str, np.ndarray]
    scales: dict[str, np.ndarray]
    zeros: dict[str, np.ndarray] | None
    groups: dict[str, int]
    scale_dtype: str

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
        views: dict[str, dict[str, np.ndarray]] = {"packed": {}, "scales": {}, "zeros": {}}
        for s in layout.sections:
            chunk = raw[s.offset : s.offset + s.length]
            views[s.kind][s.part] = (chunk if s.kind == "packed" else chunk.view("<u2")).reshape(s.shape)
        return cls(views["packed"], views["scales"], views["zeros"] or None, layout.groups, layout.scale_dtype)

    def scales_f32(self, part: str) -> np.ndarray:
        return decode_half(self.scales[part], self.scale_dtype)

    def zeros_f32(self, part: str) -> np.ndarray | None:
        return None if self.zeros is None else decode_half(self.zeros[part], self.scale_dtype)

    def dequantize(self) -> dict[str, np.ndarray]:
        """fp32 `{"gate": [expert_dim, d], "up": [expert_dim, d], "down": [d, expert_dim]}`."""
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
