"""Where every byte of a container goes, derived from the model's shape (ModelShape and
colibri-spec's tensor table) and the scheme alone.

The exporter, the size estimator and the reader all call this module, so a reader recomputes
every length it is told and never trusts a size from the file (FORMAT.md). Nothing here
touches weights: planning a 28B-parameter model costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .model_shape import ModelShape, checkpoint_tensor_shapes
from .scheme import EmbedDtype, QuantScheme

PAGE = 4096
TENSOR_ALIGN = 64
Encoding = Literal["f32", "bf16", "q4", "q6", "q8"]
_ENCODING_OF_DTYPE: dict[str, Encoding] = {"int4": "q4", "int6": "q6", "int8": "q8", "bf16": "bf16"}
Q6_SPAN = 64  # q6 lays its top bits out per 64 columns (FORMAT.md): in_features must be a multiple


def align(value: int, to: int = PAGE) -> int:
    return -(-value // to) * to


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding


def resident_encoding(name: str, ndim: int, scheme: QuantScheme) -> Encoding:
    """The encoding FORMAT.md assigns to a resident tensor."""
    if ndim == 1:
        return "f32"
    if name.endswith(("moe.router.weight", "moe.shared_gate.weight")):  # gates: tiny, decisive
        return "bf16"
    dtype: EmbedDtype = scheme.embed_dtype if name in ("embed.weight", "lm_head.weight") else scheme.resident_dtype
    return _ENCODING_OF_DTYPE[dtype]


def resident_specs(shape: ModelShape, scheme: QuantScheme) -> list[TensorSpec]:
    return [
        TensorSpec(name, dims, resident_encoding(name, len(dims), scheme))
        for name, dims in checkpoint_tensor_shapes(shape).items()
        if ".moe.experts." not in name
    ]


def effective_group(cols: int, group_size: int) -> int | None:
    """The group size used for a matrix with `cols` input columns: `group_size` if it divides
    `cols`, else the largest of 64, 32 below it that does (so a tiny model with d_model 64
    still exports at group 128); None if none does."""
    for group in (group_size, 64, 32):
        if group <= group_size and cols % group == 0:
            return group
    return None


def encoded_length(encoding: Encoding, dims: tuple[int, ...], scheme: QuantScheme) -> int:
    """Bytes a tensor takes in the file (FORMAT.md, Encodings)."""
    numel = 1
    for size in dims:
        numel *= size
    if encoding == "f32":
        return 4 * numel
    if encoding == "bf16":
        return 2 * numel
    n_groups = numel // effective_group(dims[-1], scheme.group_size)
    if encoding == "q8":
        return numel + 2 * n_groups
    if encoding == "q6":  # 6 bits a weight: cols/2 bytes of low nibbles + cols/4 of top bits a row
        return numel * 3 // 4 + 2 * n_groups
    return numel // 2 + 2 * n_groups * (1 if scheme.symmetric else 2)


def check_groupable(encoding: Encoding, dims: tuple[int, ...], scheme: QuantScheme) -> str | None:
    """Why `dims` cannot be stored as `encoding`, or None if it can."""
    if encoding in ("q4", "q6", "q8"):
        if len(dims) != 2:
            return f"{encoding} needs a 2-D matrix, got shape {list(dims)}"
        if encoding == "q6" and dims[1] % Q6_SPAN:
            return (f"shape {list(dims)}: int6 (q6) needs in_features a multiple of {Q6_SPAN}, "
                    f"got {dims[1]}; use --embed-dtype int8")
        if effective_group(dims[1], scheme.group_size) is None:
            return f"in_features {dims[1]} is not a multiple of 32 (group size {scheme.group_size})"
    return None


@dataclass(frozen=True)
class BlobSection:
    """One array inside an expert blob: `kind` is "packed" (q4 nibbles), "data" (q8 int8 or
    bf16 bits), "scales", "zeros" or (format 1.2) "bias" (f32, shape `(rows,)`)."""

    part: str
    kind: str
    offset: int
    length: int
    shape: tuple[int, ...]


_EXPERT_ENCODING: dict[str, Encoding] = {"int4": "q4", "int8": "q8", "bf16": "bf16"}


@dataclass(frozen=True)
class ExpertBlobLayout:
    """Byte layout of one routed-expert blob (identical for every expert of a container).
    `encoding` is the scheme's `expert_dtype` as an encoding: "q4" (the default), "q8" or "bf16"
    (FORMAT.md, Routed-expert blob)."""

    sections: tuple[BlobSection, ...]
    payload_length: int
    blob_length: int
    groups: dict[str, int]  # effective group size per part (see effective_group); 0 for bf16
    symmetric: bool
    scale_dtype: str
    weights_per_expert: int
    encoding: Encoding = "q4"
    bias: bool = False  # format 1.2: f32 gate, up and down biases after the weights


    @classmethod
    def build(cls, shape: ModelShape, scheme: QuantScheme) -> ExpertBlobLayout:
        encoding = _EXPERT_ENCODING[scheme.expert_dtype]
        mats = {
            "gate": (shape.expert_dim, shape.d_model),
            "up": (shape.expert_dim, shape.d_model),
            "down": (shape.d_model, shape.expert_dim),
        }
        for part, dims in mats.items():
            reason = check_groupable(encoding, dims, scheme)
            if reason:
                raise ValueError(f"routed expert {part}_proj: {reason}")
        grouped = encoding != "bf16"
        groups = {part: effective_group(cols, scheme.group_size) if grouped else 0 for part, (_, cols) in mats.items()}
        sections: list[BlobSection] = []
        cursor = 0
        if encoding == "q4":
            kinds = ["packed", "scales"] + ([] if scheme.symmetric else ["zeros"])
        else:  # q8 is always symmetric; bf16 has no scales
            kinds = ["data", "scales"] if grouped else ["data"]
        for kind in kinds:
            for part, (rows, cols) in mats.items():
                if kind == "packed":
                    dims, itemsize = (rows, cols // 2), 1
                elif kind == "data":
                    dims, itemsize = (rows, cols), 1 if encoding == "q8" else 2
                else:
                    dims, itemsize = (rows, cols // groups[part]), 2
                length = dims[0] * dims[1] * itemsize
                sections.append(BlobSection(part, kind, cursor, length, dims))
                cursor += length
        if shape.expert_proj_bias:  # never quantized: a few KB next to the matrices
            for part, (rows, _) in mats.items():
                sections.append(BlobSection(part, "bias", cursor, 4 * rows, (rows,)))
                cursor += 4 * rows
        weights = sum(r * c for r, c in mats.values())
        return cls(tuple(sections), cursor, align(cursor), groups, scheme.symmetric or encoding != "q4",
                   scheme.scale_dtype, weights, encoding, shape.expert_proj_bias)


@dataclass(frozen=True)
class PlacedTensor:
    spec: TensorSpec
    offset: int
    length: int


@dataclass(frozen=True)
class ContainerPlan:
    """Absolute offsets of every range of a container whose header region ends at
    `header_end` (a multiple of 4096)."""

    header_end: int
    tokenizer_offset: int
    tokenizer_length: int
    resident_offset: int
    resident_length: int
    tensors: tuple[PlacedTensor, ...]
    blob: ExpertBlobLayout | None
    experts: tuple[tuple[int, int, int], ...]  # (layer, expert, offset)
    file_size: int

    @property
    def expert_bytes(self) -> int:
        return len(self.experts) * (self.blob.blob_length if self.blob else 0)


def plan_container(shape: ModelShape, scheme: QuantScheme, header_end: int, tokenizer_length: int) -> ContainerPlan:
    specs = resident_specs(shape, scheme)
    for spec in specs:
        reason = check_groupable(spec.encoding, spec.shape, scheme)
        if reason:
            raise ValueError(f"{spec.name}: {reason}")
    tokenizer_offset = header_end if tokenizer_length else 0
    resident_offset = align(header_end + tokenizer_length)
    cursor = resident_offset
    placed = []
    for spec in specs:
        length = encoded_length(spec.encoding, spec.shape, scheme)
        placed.append(PlacedTensor(spec, cursor, length))
        cursor = align(cursor + length, TENSOR_ALIGN)
    resident_length = align(cursor - resident_offset)
    blob = ExpertBlobLayout.build(shape, scheme) if len(shape.moe_layers) else None
    cursor = resident_offset + resident_length
    experts = []
    for layer in shape.moe_layers:
        for expert in range(shape.n_experts):
            experts.append((layer, expert, cursor))
            cursor += blob.blob_length
    return ContainerPlan(header_end, tokenizer_offset, tokenizer_length, resident_offset, resident_length,
                         tuple(placed), blob, tuple(experts), cursor)
