"""Reading and writing checkpoint directories (CHECKPOINT.md) tensor by tensor, without torch.

We parse model.safetensors ourselves instead of calling `safetensors.safe_open`: numpy has no
bfloat16, so the numpy backend refuses BF16 checkpoints, and the torch backend would make
reading depend on torch. The format is small (8-byte length, JSON, raw little-endian data),
so a reader here is ~100 lines and can read one expert's slice of a stacked
`[n_experts, out, in]` tensor with one `pread`, which keeps export memory at one tensor.
The writer is streaming too: it lays out every tensor first, then fills them in any order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from colibri_spec import FORMAT_VERSION, require_major

from .errors import CheckpointError, CheckpointVersionError
from .model_shape import ModelShape, checkpoint_tensor_shapes
from .positional_read import read_exact
from .quantize import bf16_bits_to_f32, f32_to_bf16_bits

# U8: packed MXFP4 blocks and scales (GPT-OSS); F8_E4M3: block-scaled FP8 weights (DeepSeek's release)
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "F8_E4M3": 1}
_MAX_ST_HEADER = 100 << 20


class SafetensorsFile:
    """A validated read-only view of one .safetensors file; float tensors come back as fp32
    numpy, U8 tensors (MXFP4 blocks and scales of GPT-OSS checkpoints) as uint8, and F8_E4M3
    tensors as their uint8 codes (fp8.py decodes them with their block scales)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            self._parse()
        except Exception:
            os.close(self._fd)
            raise

    def _parse(self) -> None:
        size = os.fstat(self._fd).st_size
        try:
            (n,) = np.frombuffer(read_exact(self._fd, 8, 0, "header length"), dtype="<u8")
            n = int(n)
            if n > min(_MAX_ST_HEADER, size - 8):
                raise CheckpointError(f"{self.path}: header length {n} exceeds the file")
            meta = json.loads(read_exact(self._fd, n, 8, "header").decode("utf-8"))
        except (EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: not a safetensors file ({exc})") from None
        self._data_start = 8 + n
        self.metadata = meta.pop("__metadata__", {}) or {}
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in meta.items():
            try:
                dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: malformed entry for tensor '{name}'") from None
            if dtype not in _ITEMSIZE:
                raise CheckpointError(f"{self.path}: tensor '{name}' has dtype {dtype}; expected F32, BF16, F16, U8 or F8_E4M3")
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if end - begin != numel * _ITEMSIZE[dtype] or begin < 0 or self._data_start + end > size:
                raise CheckpointError(f"{self.path}: tensor '{name}' has a bad byte range [{begin}, {end})")
            self.entries[name] = (dtype, shape, begin, end)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def nbytes(self, name: str) -> int:
        _, _, begin, end = self.entries[name]
        return end - begin

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` as fp32; with `index`, only `tensor[index]` (one read)."""
        if index is not None:
            return self.read_rows(name, index, index + 1)[0]
        return self.read_rows(name, 0, None)

    def read_rows(self, name: str, start: int, stop: int | None) -> np.ndarray:
        """`tensor[start:stop]` (along the first dimension) as fp32, in one read."""
        dtype, shape, begin, end = self.entries[name]
        if shape:
            stop = shape[0] if stop is None else min(stop, shape[0])
            step = (end - begin) // shape[0] if shape[0] else 0
            begin, end, shape = begin + start * step, begin + stop * step, (stop - start, *shape[1:])
        raw = read_exact(self._fd, end - begin, self._data_start + begin, f"{self.path}: tensor '{name}'")
        if dtype == "BF16":
            return bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2")).reshape(shape)
        if dtype == "F16":
            return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
        if dtype in ("U8", "F8_E4M3"):
            return np.frombuffer(raw, dtype=np.uint8).reshape(shape)
        return np.frombuffer(raw, dtype="<f4").reshape(shape)


def load_config(checkpoint_dir: Path) -> tuple[dict, ModelShape]:
    """config.json as a dict (kept verbatim for the container) and its validated shape fields.

    The config is carried opaquely: checked here are only what the export itself depends on, the
    `format_version` major (the tensor table is that of colibri-spec's CHECKPOINT.md 1.x) and the
    shape fields the layout is computed from. `model_type` and the other fields are validated by
    `colibri_spec.parse_checkpoint_config`, which colibri-stream calls at open."""
    path = Path(checkpoint_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist (a checkpoint is a directory with config.json)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    require_major(config.get("format_version"), FORMAT_VERSION, key="checkpoint format_version", where=str(path),
                  reader="colibri-int4", error=CheckpointVersionError)
    try:
        shape = ModelShape.model_validate(config)
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return config, shape


def check_tensors(st: SafetensorsFile, shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor CHECKPOINT.md names must be present with its shape, and nothing else."""
    expected = checkpoint_tensor_shapes(shape)
    for name, dims in expected.items():
        if name not in st.entries:
            raise CheckpointError(f"{st.path}: tensor '{name}' is missing")
        if st.entries[name][1] != dims:
            raise CheckpointError(f"{st.path}: tensor '{name}' has shape {list(st.entries[name][1])}, config says {list(dims)}")
        if st.entries[name][0] in ("U8", "F8_E4M3"):  # only import-hf's MXFP4 and FP8 decoders read these
            raise CheckpointError(f"{st.path}: tensor '{name}' has dtype {st.entries[name][0]}; "
                                  "a checkpoint holds F32, BF16 or F16")
    extra = sorted(set(st.entries) - set(expected))
    if extra:
        raise CheckpointError(f"{st.path}: unexpected tensor '{extra[0]}' ({len(extra)} not in CHECKPOINT.md)")
    return expected


class SafetensorsWriter:
    """Writes a .safetensors file whose tensors are declared up front and filled in any order,
    to `path + '.tmp'`, renamed on `close()` (an interrupted write leaves no half file)."""

    def __init__(self, path: Path, tensors: dict[str, tuple[tuple[int, ...], str]], metadata: dict[str, str]):
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        header: dict = {"__metadata__": metadata}
        self._layout: dict[str, tuple[int, tuple[int, ...], str]] = {}
        cursor = 0
        for name, (dims, dtype) in tensors.items():
            size = int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": list(dims), "data_offsets": [cursor, cursor + size]}
            self._layout[name] = (cursor, dims, dtype)
            cursor += size
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)
        self._data_start = 8 + len(blob)
        self._file = open(self._tmp, "wb")
        self._file.write(np.uint64(len(blob)).tobytes() + blob)
        self._file.truncate(self._data_start + cursor)

    def write(self, name: str, array: np.ndarray, index: int | None = None) -> None:
        """Write `array` as tensor `name` (or as `tensor[index]` of a stacked tensor)."""
        begin, dims, dtype = self._layout[name]
        if index is not None:
            dims = dims[1:]
            begin += index * int(np.prod(dims, dtype=np.int64)) * _ITEMSIZE[dtype]
        array = np.asarray(array, dtype=np.float32).reshape(dims)
        data = f32_to_bf16_bits(array) if dtype == "BF16" else array.astype("<f4")
        self._file.seek(self._data_start + begin)
        self._file.write(np.ascontiguousarray(data).tobytes())

    def write_rows(self, name: str, rows: np.ndarray, start: int) -> None:
        """Write `rows` as `tensor[start:start + len(rows)]` (a block of a large matrix)."""
        begin, dims, dtype = self._layout[name]
        row_bytes = int(np.prod(dims[1:], dtype=np.int64)) * _ITEMSIZE[dtype]
        rows = np.asarray(rows, dtype=np.float32).reshape(-1, *dims[1:])
        data = f32_to_bf16_bits(rows) if dtype == "BF16" else rows.astype("<f4")
        self._file.seek(self._data_start + begin + start * row_bytes)
        self._file.write(np.ascontiguousarray(data).tobytes())

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)
