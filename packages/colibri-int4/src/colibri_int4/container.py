"""Reading a container: `Container.open(path)`, the resident region, expert blobs, verify.

Opening reads and validates only the header (preamble + JSON), so it costs milliseconds even
for a 15 GB file. The resident region is one sequential `preadv`; each expert is one range
the runtime may read itself (offsets/lengths from `expert_entry`) with O_DIRECT into its own
aligned buffers and pass to `ExpertBlob.parse`, or read through `read_expert_into`. A resident
tensor a runtime only looks rows up in (an embedding table) can instead be mapped
(`map_resident`): read-only views of the page cache, not a copy.

    >>> with Container.open("model.coli") as c:                      # doctest: +SKIP
    ...     weights = c.read_resident()                                # name -> fp32 array
    ...     buf = bytearray(c.blob_length)
    ...     blob = c.read_expert_into(1, 0, buf)                       # verified views
    ...     gate = blob.dequantize()["gate"]
"""

from __future__ import annotations

import copy
import mmap
import os
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ChecksumError, ContainerError
from .expert_blob import ExpertBlob
from .header import (
    PREAMBLE_SIZE,
    ContainerHeader,
    ExpertEntry,
    model_shape,
    parse_header_json,
    read_preamble,
    validate_ranges,
)
from .layout import ExpertBlobLayout
from .model_shape import ModelShape, checkpoint_tensor_shapes
from .positional_read import read_exact, read_into
from .tensor_codec import RawTensor, decode_tensor


@dataclass
class VerifyReport:
    checked: int = 0
    bytes_checked: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class Container:
    """An open container file. Use `Container.open(path)`; close it (or use `with`)."""

    def __init__(self, path: Path, fd: int, header: ContainerHeader, shape: ModelShape,
                 blob_layout: ExpertBlobLayout | None, version: tuple[int, int]):
        self.path, self._fd, self.header, self.shape = path, fd, header, shape
        self._map: mmap.mmap | None = None  # made by the first `map_resident`
        self.blob_layout, self.version = blob_layout, version
        self._experts = {(e.layer, e.expert): e for e in header.experts.entries}

    @classmethod
    def open(cls, path: str | os.PathLike) -> Container:
        """Open and validate the header; raises `ContainerError` on any defect."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ContainerError(f"cannot open {path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            preamble = _read(fd, min(PREAMBLE_SIZE, size), 0, "preamble")
            major, minor, json_length, json_crc = read_preamble(preamble, size)
            header = parse_header_json(bytes(_read(fd, json_length, PREAMBLE_SIZE, "header JSON")), json_crc, minor)
            shape, blob_layout = validate_ranges(header, size, PREAMBLE_SIZE + json_length)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header, shape, blob_layout, (major, minor))

    @classmethod
    def planned(cls, config: dict, scheme, tokenizer_length: int = 0, where: str | os.PathLike = "planned",
                tokenizer_config=None) -> Container:
        """The container `export` / `import-hf` would write for `config` and `scheme`, as a header
        without a file: sizes, tensor table and blob layout are exact (the writer's own planner),
        CRCs are placeholders and every read raises `ContainerError`. `where` names its source
        (e.g. the config.json it was mapped from) in messages and in `path`; `tokenizer_config`
        (a `TokenizerConfig`) is the chat template and special tokens an import would carry."""
        from .export import _build_header, plan_with_header  # export imports tqdm; keep open() light

        try:
            shape = model_shape(config)
            plan, json_length = plan_with_header(config, shape, scheme, tokenizer_length, tokenizer_config)
        except ValueError as exc:
            raise ContainerError(f"{where}: {str(exc).splitlines()[0]}") from None
        header = _build_header(config, scheme, plan, {}, tokenizer_config)
        shape, blob_layout = validate_ranges(header, plan.file_size, PREAMBLE_SIZE + json_length)
        minor = int(header.container_version.split(".")[1])
        return cls(Path(where), -1, header, shape, blob_layout, (1, minor))

    @property
    def has_file(self) -> bool:
        """False for a `planned` container (a header only)."""
        return self._fd >= 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._map = None  # the mapped views keep the map alive; it is unmapped with the last of them

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _need_file(self, what: str) -> None:
        if self._fd < 0:
            raise ContainerError(f"{what}: {self.path} was planned from a config and has no file")

    # --- sizes -------------------------------------------------------------------------
    @property
    def config(self) -> dict:
        """The checkpoint's config.json object as stored (a copy). colibri-int4 checks only the
        shape fields (`shape`); `colibri_model.parse_checkpoint_config` reads the rest."""
        return copy.deepcopy(self.header.config)

    @property
    def scheme(self):
        return self.header.quantization

    @property
    def file_size(self) -> int:
        return self.header.file_size

    @property
    def resident_bytes(self) -> int:
        return self.header.resident.length

    @property
    def blob_length(self) -> int:
        return self.header.experts.blob_length

    @property
    def expert_bytes(self) -> int:
        return self.blob_length * len(self._experts)

    def expert_weights(self) -> int:
        return len(self._experts) * (self.blob_layout.weights_per_expert if self.blob_layout else 0)

    def total_weights(self) -> int:
        return sum(int(np.prod(dims)) for dims in checkpoint_tensor_shapes(self.shape).values())

    @property
    def bits_per_weight(self) -> float:
        """Routed-expert bits per weight, blob padding included (the headline figure)."""
        weights = self.expert_weights()
        return 8 * self.expert_bytes / weights if weights else 0.0

    # --- experts -----------------------------------------------------------------------
    def expert_entry(self, layer: int, expert: int) -> ExpertEntry:
        """Offset, length (multiples of 4096) and CRC-32 of one blob, for the runtime's own I/O."""
        try:
            return self._experts[(layer, expert)]
        except KeyError:
            raise KeyError(f"no routed expert (layer {layer}, expert {expert}) in {self.path}") from None

    def read_expert_into(self, layer: int, expert: int, buffer, verify: bool = True) -> ExpertBlob:
        """Read one blob into `buffer` (writable, >= `blob_length` bytes; e.g. a page-aligned
        mmap) with one `preadv`, verify its CRC, and return views over the buffer."""
        entry = self.expert_entry(layer, expert)
        self._need_file(f"expert (layer {layer}, expert {expert})")
        view = memoryview(buffer).cast("B")
        if len(view) < entry.length:
            raise ValueError(f"buffer has {len(view)} bytes, expert blobs need {entry.length}")
        view = view[: entry.length]
        where = f"expert (layer {layer}, expert {expert})"
        try:
            read_into(self._fd, view, entry.offset, where)
        except EOFError as exc:
            raise ContainerError(str(exc)) from None
        return ExpertBlob.parse(view, self.blob_layout, entry.crc32 if verify else None,
                                where=f"expert (layer {layer}, expert {expert}) at byte {entry.offset}")

    def read_expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Verified, dequantized fp32 gate/up/down of one routed expert."""
        return self.read_expert_into(layer, expert, bytearray(self.blob_length)).dequantize()

    # --- resident region -----------------------------------------------------------------
    def read_resident_region(self) -> np.ndarray:
        """The whole resident region as one uint8 array, read in one sequential read."""
        region = self.header.resident
        return np.frombuffer(_read(self._fd, region.length, region.offset, "resident region"), dtype=np.uint8)

    def read_resident(self, dequantize: bool = True, verify: bool = True) -> dict[str, np.ndarray] | dict[str, RawTensor]:
        """Every resident tensor: fp32 arrays (`dequantize=True`) or `RawTensor` views of the
        stored encoding (packed nibbles, int8, bf16 bits, scales) over one region buffer."""
        region = self.read_resident_region()
        base = self.header.resident.offset
        out = {}
        for t in self.header.tensors:
            raw = self._decode_resident(t, region[t.offset - base : t.offset - base + t.length], verify)
            out[t.name] = raw.dequantize() if dequantize else raw
        return out

    def iter_resident(self, verify: bool = True, skip: Collection[str] = ()) -> Iterator[RawTensor]:
        """Each resident tensor in file order (but those named in `skip`), read with its own
        `pread` and CRC-checked: only one tensor's stored bytes are in memory at a time
        (`read_resident` holds the whole region), which keeps a runtime's peak memory while it
        materialises the model close to the model's own size."""
        for t in self.header.tensors:
            if t.name not in skip:
                yield self._decode_resident(t, _read(self._fd, t.length, t.offset, f"tensor '{t.name}'"), verify)

    def map_resident(self, name: str, verify: bool = True) -> RawTensor:
        """One resident tensor as read-only views over a memory map of the file, CRC-checked
        once through the map. Its pages are the page cache's: clean, file-backed, reclaimed by
        the kernel when memory is short and read again when touched, so a runtime that touches
        a few rows of a large tensor (an embedding table) holds those pages, not the table. The
        views stay valid after `close()` (the map is released when the last one goes). A file
        replaced by a rename (as `export` and `import-hf` write) leaves the views on the old file;
        one truncated in place would fault (SIGBUS) when a view touches the lost bytes."""
        entry = next((t for t in self.header.tensors if t.name == name), None)
        if entry is None:
            raise KeyError(f"no resident tensor '{name}' in {self.path}")
        self._need_file(f"tensor '{name}'")
        if self._map is None:
            self._map = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        if entry.offset + entry.length > len(self._map):
            raise ContainerError(f"truncated: tensor '{name}' needs bytes [{entry.offset}, "
                                 f"{entry.offset + entry.length})")
        return self._decode_resident(entry, memoryview(self._map)[entry.offset : entry.offset + entry.length], verify)

    def _decode_resident(self, t, chunk, verify: bool) -> RawTensor:
        """One resident tensor's stored bytes, CRC-checked, as a `RawTensor`."""
        if verify and f"{zlib.crc32(chunk) & 0xFFFFFFFF:08x}" != t.crc32:
            raise ChecksumError(f"tensor '{t.name}' at bytes [{t.offset}, {t.offset + t.length}): checksum mismatch")
        return decode_tensor(chunk, t.name, t.encoding, tuple(t.shape), self.scheme)

    @property
    def tokenizer_config(self) -> dict | None:
        """The chat template, special tokens and end-of-generation ids the importer carried
        (format 1.1, `TokenizerConfig`), or None (1.0 files, and exports of Colibri checkpoints)."""
        config = self.header.tokenizer_config
        return None if config is None else config.model_dump()

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (Jinja), when the container carries one."""
        config = self.header.tokenizer_config
        return None if config is None else config.chat_template

    def read_tokenizer_json(self) -> str | None:
        """The checkpoint's tokenizer.json carried in the container, verified, or None."""
        tok = self.header.tokenizer
        if tok is None:
            return None
        data = _read(self._fd, tok.length, tok.offset, "tokenizer")
        if f"{zlib.crc32(data) & 0xFFFFFFFF:08x}" != tok.crc32:
            raise ChecksumError(f"tokenizer at bytes [{tok.offset}, {tok.offset + tok.length}): checksum mismatch")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ContainerError("tokenizer is not valid UTF-8") from None

    # --- verification ------------------------------------------------------------------
    def checksummed_ranges(self) -> list[tuple[str, int, int, str]]:
        """`(what, offset, length, crc32)` of every range `verify` checks, in file order: the
        tokenizer, each resident tensor, each expert blob. Their lengths sum to the bytes
        `verify` reads (a progress bar's total)."""
        checks = []
        if self.header.tokenizer:
            tok = self.header.tokenizer
            checks.append(("tokenizer", tok.offset, tok.length, tok.crc32))
        checks += [(f"tensor '{t.name}'", t.offset, t.length, t.crc32) for t in self.header.tensors]
        checks += [(f"expert (layer {e.layer}, expert {e.expert})", e.offset, e.length, e.crc32)
                   for e in self.header.experts.entries]
        return checks

    def verify(self, progress=None) -> VerifyReport:
        """Check every CRC of `checksummed_ranges()`; collects all failures instead of stopping
        at the first. `progress(n_bytes)` is called once per range, unreadable ones included, so
        the calls sum to the ranges' total length."""
        report = VerifyReport()
        for what, offset, length, crc in self.checksummed_ranges():
            try:
                data = _read(self._fd, length, offset, what)
            except ContainerError as exc:
                report.failures.append(str(exc))
            else:
                if f"{zlib.crc32(data) & 0xFFFFFFFF:08x}" != crc:
                    report.failures.append(f"{what} at bytes [{offset}, {offset + length}): checksum mismatch")
                report.checked += 1
                report.bytes_checked += length
            if progress:
                progress(length)
        return report


def _read(fd: int, length: int, offset: int, what: str) -> bytearray:
    if fd < 0:
        raise ContainerError(f"{what}: this container was planned from a config and has no file")
    try:
        return read_exact(fd, length, offset, what)
    except EOFError:
        raise ContainerError(f"truncated: {what} needs bytes [{offset}, {offset + length})") from None
