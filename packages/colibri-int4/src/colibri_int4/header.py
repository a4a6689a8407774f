"""The container header: 32-byte preamble + JSON (pydantic `ContainerHeader`), FORMAT.md.

`parse_header` is the single gate every reader goes through. It checks, cheapest first: size,
magic, preamble CRC, version, JSON length cap, header CRC, schema, and then recomputes every
range from the config and scheme (layout.py) and compares it with the index, so that a hostile
header cannot send a reader outside the file, make two ranges overlap, or request an
allocation larger than the file. Every failure is one `ContainerError` naming the field.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Literal

from colibri_spec import require_major
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ChecksumError, ContainerError, ContainerVersionError
from .layout import (
    PAGE,
    TENSOR_ALIGN,
    Encoding,
    ExpertBlobLayout,
    TensorSpec,
    check_groupable,
    encoded_length,
    resident_specs,
)
from .model_shape import ModelShape
from .scheme import QuantScheme

MAGIC = b"\x89COLI4\r\n"
FORMAT_NAME = "colibri-int4"
VERSION_MAJOR, VERSION_MINOR = 1, 3
# config keys (colibri-model schema 1.2) whose tensors only a 1.2 reader places
CONFIG_1_2_TENSORS = ("o_bias", "attn_sinks", "router_bias", "expert_proj_bias")
PREAMBLE = struct.Struct("<8sHHIQII")
PREAMBLE_SIZE = PREAMBLE.size  # 32
MAX_JSON_LENGTH = 64 << 20
_MAX_OFFSET = 1 << 53
Crc = Field(pattern=r"^[0-9a-f]{8}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BlobRef(_Strict):
    offset: int = Field(ge=0, le=_MAX_OFFSET)
    length: int = Field(ge=0, le=_MAX_OFFSET)
    crc32: str = Crc


class RegionRef(_Strict):
    offset: int = Field(ge=0, le=_MAX_OFFSET)
    length: int = Field(ge=0, le=_MAX_OFFSET)


class TensorEntry(_Strict):
    name: str = Field(min_length=1, max_length=256)
    encoding: Encoding
    shape: list[int] = Field(max_length=4)
    offset: int = Field(ge=0, le=_MAX_OFFSET)
    length: int = Field(ge=0, le=_MAX_OFFSET)
    crc32: str = Crc


class ExpertEntry(_Strict):
    layer: int = Field(ge=0, le=1024)
    expert: int = Field(ge=0, le=4096)
    offset: int = Field(ge=0, le=_MAX_OFFSET)
    length: int = Field(ge=0, le=_MAX_OFFSET)
    crc32: str = Crc


class ExpertIndex(_Strict):
    blob_length: int = Field(ge=0, le=_MAX_OFFSET)
    # 1.2: "f32" when every blob ends with its gate, up and down biases (FORMAT.md); a 1.1
    # reader refuses the key instead of misreading the blobs
    bias: Literal["f32"] | None = None
    entries: list[ExpertEntry]


class TokenizerConfig(_Strict):
    """What a runtime needs beside tokenizer.json to talk to the model (format 1.1): the chat
    template (a Jinja string, as Hugging Face tokenizers carry it), the special tokens by text
    and the ids that end a generation."""

    chat_template: str | None = Field(None, max_length=1 << 20)
    bos_token: str | None = Field(None, max_length=256)
    eos_token: str | None = Field(None, max_length=256)
    pad_token: str | None = Field(None, max_length=256)
    eos_token_ids: list[int] = Field(default_factory=list, max_length=64)
    add_bos_token: bool = False


class ContainerHeader(_Strict):
    """The header JSON (FORMAT.md). `config` is the checkpoint's config.json, verbatim."""

    container_version: str = Field(pattern=r"^\d+\.\d+$")
    format_name: Literal["colibri-int4"]
    file_size: int = Field(ge=0, le=_MAX_OFFSET)
    config: dict
    quantization: QuantScheme
    tokenizer: BlobRef | None = None
    tokenizer_config: TokenizerConfig | None = None  # since 1.1
    resident: RegionRef
    tensors: list[TensorEntry]
    experts: ExpertIndex

    def lowest_minor(self) -> int:
        """The lowest 1.x minor that describes this header (FORMAT.md, Versioning)."""
        if self.quantization.embed_dtype == "int6":
            return 3
        if self.experts.bias is not None or any(self.config.get(key) for key in CONFIG_1_2_TENSORS):
            return 2
        return 1 if self.tokenizer_config is not None or self.quantization.expert_dtype != "int4" else 0

    def to_json_bytes(self) -> bytes:
        """The JSON a writer stores. 1.1 keys are written only when used, so a container
        without 1.1 features is byte-identical to what a 1.0 writer made (and labelled 1.0)."""
        data = self.model_dump(mode="json")
        if data["tokenizer_config"] is None:
            del data["tokenizer_config"]
        if data["quantization"]["expert_dtype"] == "int4":
            del data["quantization"]["expert_dtype"]
        if data["experts"]["bias"] is None:
            del data["experts"]["bias"]
        return json.dumps(data, separators=(",", ":")).encode("utf-8")


def pack_preamble(json_bytes: bytes, minor: int = VERSION_MINOR) -> bytes:
    head = PREAMBLE.pack(MAGIC, VERSION_MAJOR, minor, 0, len(json_bytes), zlib.crc32(json_bytes), 0)
    return head[:28] + struct.pack("<I", zlib.crc32(head[:28]))


def read_preamble(raw: bytes, file_size: int) -> tuple[int, int, int, int]:
    """Check the preamble; returns (major, minor, json_length, json_crc)."""
    if file_size < PREAMBLE_SIZE or len(raw) < PREAMBLE_SIZE:
        raise ContainerError(f"truncated: the file has {file_size} bytes, the preamble alone needs {PREAMBLE_SIZE}")
    magic, major, minor, flags, json_length, json_crc, pre_crc = PREAMBLE.unpack(raw[:PREAMBLE_SIZE])
    if magic != MAGIC:
        raise ContainerError(f"not a colibri-int4 container: magic {magic!r} at byte 0, expected {MAGIC!r}")
    if zlib.crc32(raw[:28]) != pre_crc:
        raise ChecksumError("corrupted preamble: CRC-32 of bytes 0..27 does not match bytes 28..31")
    require_major(f"{major}.{minor}", f"{VERSION_MAJOR}.{VERSION_MINOR}", key="container format", where="preamble",
                  reader="colibri-int4", error=ContainerVersionError)
    if flags != 0:
        raise ContainerError(f"preamble flags 0x{flags:08x} at byte 12 are not defined in format 1.x")
    if json_length > MAX_JSON_LENGTH or PREAMBLE_SIZE + json_length > file_size:
        raise ContainerError(
            f"header JSON length {json_length} (byte 16) exceeds the file ({file_size} bytes) or the 64 MiB cap"
        )
    return major, minor, json_length, json_crc


def parse_header_json(json_bytes: bytes, json_crc: int, minor: int) -> ContainerHeader:
    if zlib.crc32(json_bytes) != json_crc:
        raise ChecksumError("corrupted header: CRC-32 of the header JSON (bytes 32..) does not match the preamble")
    try:
        data = json.loads(json_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ContainerError(f"header JSON is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ContainerError("header JSON is not an object")
    if minor > VERSION_MINOR:  # a newer minor may add optional top-level keys: drop them
        data = {k: v for k, v in data.items() if k in ContainerHeader.model_fields}
    try:
        header = ContainerHeader.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ContainerError(f"invalid header field '{where}': {first['msg']} ({exc.error_count()} error(s))") from None
    require_major(header.container_version, f"{VERSION_MAJOR}.{VERSION_MINOR}", key="container_version",
                  where="header", reader="colibri-int4", error=ContainerVersionError)
    return header


def model_shape(config: dict) -> ModelShape:
    try:
        return ModelShape.model_validate(config)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ContainerError(f"invalid model config field '{where}': {first['msg']}") from None


def validate_ranges(header: ContainerHeader, file_size: int, header_end: int) -> tuple[ModelShape, ExpertBlobLayout | None]:
    """Recompute the layout from config + scheme and check the index against it and the file."""
    if header.file_size != file_size:
        raise ContainerError(f"truncated or extended: header says {header.file_size} bytes, the file has {file_size}")
    shape = model_shape(header.config)
    scheme = header.quantization
    res = header.resident
    if res.offset % PAGE or res.length % PAGE or res.offset < header_end or res.offset + res.length > file_size:
        raise ContainerError(
            f"resident region [{res.offset}, {res.offset + res.length}) is unaligned or outside the file ({file_size} bytes)"
        )
    tok = header.tokenizer
    if tok is not None and (tok.offset < header_end or tok.offset + tok.length > res.offset):
        raise ContainerError(f"tokenizer range [{tok.offset}, {tok.offset + tok.length}) is outside its slot")
    n_expected = len(shape.moe_layers) * shape.n_experts
    if len(header.experts.entries) != n_expected:
        raise ContainerError(
            f"expert index has {len(header.experts.entries)} entries, the config has {n_expected} routed experts"
        )
    try:
        specs = resident_specs(shape, scheme)
        for spec in specs:  # a length is computed below only for a shape its encoding can hold
            reason = check_groupable(spec.encoding, spec.shape, scheme)
            if reason:
                raise ValueError(f"{spec.name}: {reason}")
        blob = ExpertBlobLayout.build(shape, scheme) if n_expected else None
    except ValueError as exc:
        raise ContainerError(f"config does not fit the quantization scheme: {exc}") from None
    _check_tensors(header, specs, res.offset, res.offset + res.length, scheme)
    _check_experts(header, shape, blob, res.offset + res.length, file_size)
    return shape, blob


def _check_tensors(header: ContainerHeader, specs: list[TensorSpec], lo: int, hi: int, scheme: QuantScheme) -> None:
    expected = {spec.name: spec for spec in specs}
    ranges = []
    for t in header.tensors:
        spec = expected.pop(t.name, None)
        if spec is None:
            raise ContainerError(f"tensor '{t.name}' is not a resident tensor of this config, or appears twice")
        if tuple(t.shape) != spec.shape or t.encoding != spec.encoding:
            raise ContainerError(
                f"tensor '{t.name}': {t.encoding} {t.shape}, but config and scheme give {spec.encoding} {list(spec.shape)}"
            )
        length = encoded_length(spec.encoding, spec.shape, scheme)
        if t.length != length:
            raise ContainerError(f"tensor '{t.name}': length {t.length} but {t.encoding} {t.shape} takes {length} bytes")
        if t.offset % TENSOR_ALIGN or t.offset < lo or t.offset + t.length > hi:
            raise ContainerError(
                f"tensor '{t.name}': range [{t.offset}, {t.offset + t.length}) is unaligned or outside the resident region [{lo}, {hi})"
            )
        ranges.append((t.offset, t.offset + t.length, t.name))
    if expected:
        raise ContainerError(f"tensor index is missing {len(expected)} tensor(s), e.g. '{next(iter(expected))}'")
    _check_disjoint(ranges, "tensor")


def _check_experts(header: ContainerHeader, shape: ModelShape, blob: ExpertBlobLayout | None, lo: int, file_size: int) -> None:
    index = header.experts
    if (index.bias is not None) != shape.expert_proj_bias:
        raise ContainerError(
            f"experts.bias is {index.bias!r}, but the config's expert_proj_bias is {shape.expert_proj_bias}"
        )
    expected_blob = blob.blob_length if blob else 0
    if index.blob_length != expected_blob:
        raise ContainerError(f"expert blob_length {index.blob_length}, but config and scheme give {expected_blob}")
    wanted = {(layer, expert) for layer in shape.moe_layers for expert in range(shape.n_experts)}
    ranges = []
    for e in index.entries:
        key = (e.layer, e.expert)
        where = f"expert (layer {e.layer}, expert {e.expert})"
        if key not in wanted:
            raise ContainerError(f"{where} is not a routed expert of this config, or appears twice")
        wanted.discard(key)
        if e.length != expected_blob:
            raise ContainerError(f"{where}: length {e.length}, expected {expected_blob}")
        if e.offset % PAGE or e.offset < lo or e.offset + e.length > file_size:
            raise ContainerError(
                f"{where}: range [{e.offset}, {e.offset + e.length}) is unaligned or outside [{lo}, {file_size})"
            )
        ranges.append((e.offset, e.offset + e.length, where))
    _check_disjoint(ranges, "expert")


def _check_disjoint(ranges: list[tuple[int, int, str]], what: str) -> None:
    ranges.sort()
    for (_, end, name), (start, _, other) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            raise ContainerError(f"{what} ranges overlap: {name} and {other}")
