"""Streaming export: checkpoint directory -> one `.coli` container.

Memory: the layout depends only on config + scheme (layout.py), so every offset is known
before any weight is read. We then read one resident tensor (or one expert's three matrices)
at a time, quantize it, `pwrite` it at its final offset and drop it; the header (with the
CRCs) is written last, at offset 0. Large matrices (the embedding) are converted a block of rows
at a time (`ROW_BLOCK_BYTES`), so peak memory is one expert or one block plus quantizer
temporaries, independent of the number of experts and of the vocabulary. The file is written as `OUT.tmp` and
renamed when complete, so an interrupted export never leaves a file that looks valid.

No torch: bf16 checkpoints are widened to fp32 with numpy bit shifts (exact).
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .checkpoint import SafetensorsFile, check_tensors, load_config
from .errors import CheckpointError
from .expert_blob import encode_expert_blob
from .header import (
    FORMAT_NAME,
    PREAMBLE_SIZE,
    VERSION_MAJOR,
    VERSION_MINOR,
    BlobRef,
    ContainerHeader,
    ExpertEntry,
    ExpertIndex,
    RegionRef,
    TensorEntry,
    TokenizerConfig,
    pack_preamble,
)
from .layout import PAGE, ContainerPlan, align, plan_container
from .model_shape import expert_tensor_names
from .scheme import QuantScheme
from .tensor_codec import encode_tensor

_PLACEHOLDER_CRC = "00000000"


@dataclass
class ExportReport:
    path: Path
    file_size: int
    resident_bytes: int
    expert_bytes: int
    input_bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)


def _build_header(config: dict, scheme: QuantScheme, plan: ContainerPlan, crcs: dict,
                  tokenizer_config: TokenizerConfig | None = None) -> ContainerHeader:
    tokenizer = None
    if plan.tokenizer_length:
        tokenizer = BlobRef(offset=plan.tokenizer_offset, length=plan.tokenizer_length,
                            crc32=crcs.get("tokenizer", _PLACEHOLDER_CRC))
    tensors = [
        TensorEntry(name=t.spec.name, encoding=t.spec.encoding, shape=list(t.spec.shape), offset=t.offset,
                    length=t.length, crc32=crcs.get(t.spec.name, _PLACEHOLDER_CRC))
        for t in plan.tensors
    ]
    blob_length = plan.blob.blob_length if plan.blob else 0
    experts = [
        ExpertEntry(layer=layer, expert=expert, offset=offset, length=blob_length,
                    crc32=crcs.get((layer, expert), _PLACEHOLDER_CRC))
        for layer, expert, offset in plan.experts
    ]
    header = ContainerHeader(
        container_version=f"{VERSION_MAJOR}.{VERSION_MINOR}", format_name=FORMAT_NAME, file_size=plan.file_size,
        config=config, quantization=scheme, tokenizer=tokenizer, tokenizer_config=tokenizer_config,
        resident=RegionRef(offset=plan.resident_offset, length=plan.resident_length),
        tensors=tensors, experts=ExpertIndex(blob_length=blob_length, bias="f32" if plan.blob and plan.blob.bias else None,
                                             entries=experts),
    )
    # the lowest version that describes the file (FORMAT.md, Versioning)
    header.container_version = f"{VERSION_MAJOR}.{min(VERSION_MINOR, header.lowest_minor())}"
    return header


def plan_with_header(config: dict, shape, scheme: QuantScheme, tokenizer_length: int,
                     tokenizer_config: TokenizerConfig | None = None) -> tuple[ContainerPlan, int]:
    """The plan whose reserved header region fits the header JSON. CRCs are fixed-width hex, so
    the JSON length with placeholders equals the final one; two rounds converge."""
    header_end = PAGE
    while True:
        plan = plan_container(shape, scheme, header_end, tokenizer_length)
        json_length = len(_build_header(config, scheme, plan, {}, tokenizer_config).to_json_bytes())
        if PREAMBLE_SIZE + json_length <= header_end:
            return plan, json_length
        header_end = align(PREAMBLE_SIZE + json_length)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class ContainerFileWriter:
    """Writes one container file: body at planned offsets, then the header, then an atomic rename.

    The file is written as `OUT.tmp`, sized to the plan up front, and renamed over `OUT` only after
    the header (which holds every CRC, so it comes last) is written and fsynced; any error removes
    the temporary file. Used by `export_checkpoint` and by writers of synthetic containers, so that
    every container goes through the same header and preamble code.

        with ContainerFileWriter(out, config, scheme, plan, json_length) as writer:
            writer.write(bytes_, offset)              # body: resident tensors and expert blobs
            writer.crcs[name_or_(layer, expert)] = "%08x" % crc
    """

    def __init__(self, out_path: str | os.PathLike, config: dict, scheme: QuantScheme, plan, json_length: int,
                 tokenizer_config: TokenizerConfig | None = None):
        self.out_path = Path(out_path)
        self.tmp = self.out_path.with_name(self.out_path.name + ".tmp")
        self.config, self.scheme, self.plan, self.json_length = config, scheme, plan, json_length
        self.tokenizer_config = tokenizer_config
        self.crcs: dict = {}
        self.fd = -1

    def __enter__(self) -> ContainerFileWriter:
        # read-write: write_body reads row-blocked tensors back for their CRC
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self.fd, self.plan.file_size)
        except BaseException:
            self._abort()
            raise
        return self

    def write(self, data, offset: int) -> None:
        _pwrite_all(self.fd, data, offset)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            header = _build_header(self.config, self.scheme, self.plan, self.crcs, self.tokenizer_config)
            json_bytes = header.to_json_bytes()
            if len(json_bytes) != self.json_length:  # fixed-width CRCs make this impossible; guard anyway
                raise RuntimeError("header length changed between planning and writing")
            minor = int(header.container_version.split(".")[1])
            _pwrite_all(self.fd, pack_preamble(json_bytes, minor) + json_bytes, 0)
            os.fsync(self.fd)
        except BaseException:
            self._abort()
            raise
        os.close(self.fd)
        os.replace(self.tmp, self.out_path)

    def _abort(self) -> None:
        os.close(self.fd)
        self.tmp.unlink(missing_ok=True)


def export_checkpoint(
    checkpoint_dir: str | os.PathLike, out_path: str | os.PathLike, scheme: QuantScheme | None = None,
    progress: bool = False,
) -> ExportReport:
    """Quantize a checkpoint directory (CHECKPOINT.md) into a container at `out_path`.

    >>> export_checkpoint("ckpt/", "model.coli", QuantScheme(group_size=64))  # doctest: +SKIP
    """
    scheme = scheme or QuantScheme()
    checkpoint_dir, out_path = Path(checkpoint_dir), Path(out_path)
    config, shape = load_config(checkpoint_dir)
    tokenizer_path = checkpoint_dir / "tokenizer.json"
    tokenizer = tokenizer_path.read_bytes() if tokenizer_path.is_file() else b""
    started = time.perf_counter()
    with SafetensorsFile(checkpoint_dir / "model.safetensors") as st:
        check_tensors(st, shape)
        try:
            plan, json_length = plan_with_header(config, shape, scheme, len(tokenizer))
        except ValueError as exc:
            raise CheckpointError(f"{checkpoint_dir}: cannot quantize with this scheme: {exc}") from None
        input_bytes = sum(st.nbytes(name) for name in st.entries)
        with ContainerFileWriter(out_path, config, scheme, plan, json_length) as writer:
            bar = tqdm(total=input_bytes, unit="B", unit_scale=True, desc="export", disable=not progress)
            writer.crcs.update(write_body(writer.fd, _CheckpointTensors(st), plan, scheme, tokenizer, bar))
            bar.close()
    return ExportReport(out_path, plan.file_size, plan.resident_length, plan.expert_bytes, input_bytes,
                        time.perf_counter() - started)


class _CheckpointTensors:
    """A Colibri checkpoint's model.safetensors as a `write_body` source: names are already the
    container's, routed experts stacked `[n_experts, out, in]`."""

    def __init__(self, st: SafetensorsFile):
        self.st = st

    def read(self, name: str) -> tuple[np.ndarray, int]:
        return self.st.read(name), self.st.nbytes(name)

    def read_rows(self, name: str, start: int, stop: int) -> tuple[np.ndarray, int]:
        rows = self.st.read_rows(name, start, stop)
        return rows, self.st.nbytes(name) * rows.shape[0] // self.st.entries[name][1][0]

    def read_expert(self, layer: int, expert: int) -> tuple[list[np.ndarray], int]:
        names = expert_tensor_names(layer, bias=expert_tensor_names(layer, True)["gate_bias"] in self.st.entries)
        matrices = [self.st.read(name, index=expert) for name in names.values()]
        n_experts = self.st.entries[names["gate"]][1][0]
        return matrices, sum(self.st.nbytes(name) for name in names.values()) // n_experts


# fp32 bytes of a resident matrix converted at a time. The embedding of a 150k-token vocabulary is
# 1.2 GB in fp32; converted whole it, not the weights, set the peak RAM of an export or import.
ROW_BLOCK_BYTES = 32 << 20


def _write_whole(fd: int, source, placed, scheme: QuantScheme) -> tuple[str, int]:
    array, nbytes = source.read(placed.spec.name)
    sections = encode_tensor(array, placed.spec.encoding, scheme)
    del array
    offset, crc = placed.offset, 0
    for section in sections:
        data = memoryview(np.ascontiguousarray(section)).cast("B")  # no copy
        _pwrite_all(fd, data, offset)
        crc, offset = zlib.crc32(data, crc), offset + len(data)
    if offset - placed.offset != placed.length:
        raise RuntimeError(f"{placed.spec.name}: wrote {offset - placed.offset} bytes, planned {placed.length}")
    return f"{crc:08x}", nbytes


def _write_in_row_blocks(fd: int, source, placed, scheme: QuantScheme) -> tuple[str, int]:
    """Encode a large matrix a block of rows at a time. Every encoding is row-major section by
    section (data | scales | zeros, FORMAT.md), so block rows [lo, hi) of section k go to
    `section_start_k + lo * row_bytes_k`; the CRC is taken by reading the written range back
    (the page cache serves it), since the sections are not written in file order."""
    rows, cols = placed.spec.shape
    step = max(1, ROW_BLOCK_BYTES // (4 * cols))
    starts: list[int] | None = None
    nbytes = 0
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        block, read = source.read_rows(placed.spec.name, lo, hi)
        nbytes += read
        sections = [np.ascontiguousarray(s) for s in encode_tensor(block, placed.spec.encoding, scheme)]
        del block
        row_bytes = [s.nbytes // (hi - lo) for s in sections]
        if starts is None:
            starts = [placed.offset + sum(r * rows for r in row_bytes[:k]) for k in range(len(sections))]
        for start, per_row, section in zip(starts, row_bytes, sections, strict=True):
            _pwrite_all(fd, memoryview(section).cast("B"), start + lo * per_row)
    total = sum(r * rows for r in row_bytes)
    if total != placed.length:
        raise RuntimeError(f"{placed.spec.name}: wrote {total} bytes, planned {placed.length}")
    crc, done = 0, 0
    while done < total:
        chunk = os.pread(fd, min(ROW_BLOCK_BYTES, total - done), placed.offset + done)
        crc, done = zlib.crc32(chunk, crc), done + len(chunk)
    return f"{crc:08x}", nbytes


def write_body(fd: int, source, plan: ContainerPlan, scheme: QuantScheme, tokenizer: bytes, bar) -> dict:
    """Write the tokenizer, every resident tensor and every expert blob at their planned offsets,
    one tensor (or one expert) in memory at a time; returns their CRCs for the header.

    `source.read(name) -> (fp32 array, bytes read)` gives a resident tensor by its container name,
    `source.read_rows(name, start, stop) -> (fp32 rows, bytes read)` a block of a large matrix's rows (so the
    peak stays at `ROW_BLOCK_BYTES`, whatever the vocabulary), and
    `source.read_expert(layer, expert) -> ([gate, up, down], bytes read)` one routed expert
    (`[gate, up, down, gate_bias, up_bias, down_bias]` when the blob layout has biases). The
    export reads a Colibri checkpoint this way; `import_hf` a Hugging Face one."""
    crcs: dict = {}
    if tokenizer:
        _pwrite_all(fd, tokenizer, plan.tokenizer_offset)
        crcs["tokenizer"] = f"{zlib.crc32(tokenizer):08x}"
    for placed in plan.tensors:
        name, dims = placed.spec.name, placed.spec.shape
        try:
            if len(dims) == 2 and 4 * dims[0] * dims[1] > ROW_BLOCK_BYTES:
                crcs[name], nbytes = _write_in_row_blocks(fd, source, placed, scheme)
            else:
                crcs[name], nbytes = _write_whole(fd, source, placed, scheme)
        except ValueError as exc:
            raise CheckpointError(f"tensor '{name}': {exc}") from None
        bar.update(nbytes)
    for layer, expert, offset in plan.experts:
        matrices, nbytes = source.read_expert(layer, expert)
        try:
            biases = tuple(matrices[3:]) if plan.blob.bias else None
            blob = encode_expert_blob(*matrices[:3], plan.blob, scheme, biases)
        except ValueError as exc:
            raise CheckpointError(f"routed expert (layer {layer}, expert {expert}): {exc}") from None
        _pwrite_all(fd, blob, offset)
        crcs[(layer, expert)] = f"{zlib.crc32(blob):08x}"
        bar.update(nbytes)
    return crcs
