"""One GGUF file seen through the `gguf` package (llama.cpp's gguf-py): metadata as Python values,
tensors in torch's dimension order, dequantized to fp32 by `gguf.quants.dequantize`.

GGUFReader parses the key/value section and the tensor table (it memory-maps the file but touches
only those pages); tensor bytes are then read with `pread`, only the rows (or the one expert slice)
asked for, and dequantized, so converting a file holds one block of one tensor, never the file:
no mapped page of the weights stays in the process's resident set.

gguf's numpy arrays are in torch's order already (GGUF lists dimensions innermost first, `ne0`
= the row length; the reader reverses them), so a `[out, in]` projection reads as `(out, in)` and
llama.cpp's stacked experts `[in, out, n_experts]` as `(n_experts, out, in)`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import GGUFImportError
from ..positional_read import read_into

# Tensor types read here: gguf-py dequantizes each (no block decoding of our own), and the tests
# write each one (the K-quants as raw blocks, since gguf-py only decodes those).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K", "MXFP4")
_DECODE_ROW = 4096  # weights per row handed to gguf-py's decoder (`GGUFFile._long_rows`)


def gguf_module():
    """The `gguf` package, or one clear error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise GGUFImportError(
            "reading GGUF files needs the gguf package (llama.cpp's gguf-py): pip install 'colibri-int4[gguf]'"
        ) from None
    return gguf


class GGUFFile:
    """The metadata and tensors of one `.gguf` file.

    Attributes:
        path: the file.
        metadata: every key/value pair except the GGUF.* header fields, as Python values
            (strings, ints, floats, bools, lists).
        tensors: name -> gguf's ReaderTensor.

    >>> with GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf") as f:  # doctest: +SKIP
    ...     f.metadata["general.architecture"], f.shape("blk.0.attn_q.weight")
    ('llama', (576, 576))
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        gguf = gguf_module()
        self._dequantize, self._types = gguf.quants.dequantize, gguf.GGMLQuantizationType
        self._block_sizes = gguf.GGML_QUANT_SIZES
        if not self.path.is_file():
            raise GGUFImportError(f"{self.path}: no such file")
        try:
            self._reader = gguf.GGUFReader(self.path)
            self.metadata = {key: _value(field) for key, field in self._reader.fields.items()
                             if not key.startswith("GGUF.")}
            self.tensors = {t.name: t for t in self._reader.tensors}
        except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError) as exc:
            # a truncated file reads short arrays: numpy says "cannot reshape" or "out of bounds"
            raise GGUFImportError(f"{self.path}: not a readable GGUF file ({exc})") from None
        size = self.path.stat().st_size
        for tensor in self.tensors.values():
            if tensor.data_offset + tensor.n_bytes > size:
                raise GGUFImportError(f"{self.path}: tensor '{tensor.name}' ends past the end of the file (truncated)")
        self._fd = os.open(self.path, os.O_RDONLY)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
        self._fd, self._reader, self.tensors = -1, None, {}

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch's order: the reverse of GGUF's `ne`."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def check_type(self, name: str) -> None:
        kind = self.type_name(name)
        if kind not in SUPPORTED_TYPES:
            raise GGUFImportError(
                f"{self.path}: tensor '{name}' is stored as {kind}, which import-gguf does not read "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )

    def _decode(self, name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        self.check_type(name)
        kind = self.tensors[name].tensor_type
        try:
            array = self._dequantize(self._long_rows(np.asarray(data), kind), kind)
        except (ValueError, NotImplementedError) as exc:
            raise GGUFImportError(f"{self.path}: tensor '{name}': cannot dequantize ({exc})") from None
        return np.ascontiguousarray(array, dtype=np.float32).reshape(shape)

    def _long_rows(self, data: np.ndarray, kind) -> np.ndarray:
        """Block-quantized bytes regrouped into rows of about `_DECODE_ROW` weights. Blocks decode
        alone, so any row of whole blocks decodes to the same values; gguf-py works through a
        tensor 16 rows at a time, and a projection's own rows (256 to 1024 weights) leave that
        per-call work a third of the time."""
        block, block_bytes = self._block_sizes[kind]
        if data.dtype != np.uint8 or block == 1 or data.size % block_bytes:
            return data
        blocks = data.size // block_bytes
        per_row = max(1, min(blocks, _DECODE_ROW // block))
        while blocks % per_row:
            per_row -= 1
        return np.ascontiguousarray(data).reshape(-1, per_row * block_bytes)

    def _raw(self, name: str, first: int, count: int) -> np.ndarray:
        """The stored bytes of `tensor[first:first + count]` (along the outermost dimension), one pread.
        gguf-py's array for the tensor gives the layout (dtype, block bytes per row) without reading it."""
        layout = self.tensors[name].data
        stride = layout.nbytes // layout.shape[0]
        out = np.empty((count, *layout.shape[1:]), dtype=layout.dtype)
        try:
            read_into(self._fd, out, self.tensors[name].data_offset + first * stride, f"{self.path}: tensor '{name}'")
        except EOFError as exc:
            raise GGUFImportError(f"{exc} (truncated)") from None
        return out

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor in fp32, torch's shape."""
        shape = self.shape(name)
        return self._decode(name, self._raw(name, 0, shape[0]), shape)

    def rows(self, name: str, rows: slice | np.ndarray) -> np.ndarray:
        """fp32 rows of a 2-D tensor: a slice, or an index array (a gather; llama's q/k permutation)."""
        shape = self.shape(name)
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(shape[0])
            data = self._raw(name, start, stop - start)
        else:
            low = int(rows.min())
            data = self._raw(name, low, int(rows.max()) + 1 - low)[rows - low]
        return self._decode(name, data, (data.shape[0], *shape[1:]))

    def expert(self, name: str, index: int) -> np.ndarray:
        """`tensor[index]` of a stacked `(n_experts, out, in)` tensor (or `(n_experts, out)` biases),
        reading only that slice."""
        return self._decode(name, self._raw(name, index, 1)[0], self.shape(name)[1:])


def _value(field):
    """A metadata field as a Python value: gguf-py's `contents()`, arrays as lists. A float32
    scalar becomes the shortest decimal that rounds to it (1e-06, not 9.99999997e-07): the number
    config.json had before the converter stored it in 32 bits."""
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and field.types and field.types[0].name == "FLOAT32":
        value = float(str(np.float32(value)))
    return value
