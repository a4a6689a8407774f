"""Where every byte of a container goes, derived from the model config and the scheme alone.

The exporter, the size estimator and the reader all call this module, so a reader recomputes
every length it is told and never trusts a size from the file (FORMAT.md). Nothing here
touches weights: planning a 28B-parameter model costs microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .scheme import QuantScheme, ResidentDtype

PAGE = 4096
TENSOR_ALIGN = 64
Encoding = Literal["f32", "bf16", "q4", "q8"]
_ENCODING_OF_DTYPE: dict[str, Encoding] = {"int4": "q4", "int8": "q8", "bf16": "bf16"}


def align(value: int, to: int = PAGE) -> int:
    return -(-value // to) * to


class ModelShape(BaseModel):
    """The config fields that decide tensor shapes, with bounds that keep a hostile header
    from asking for absurd sizes. Other config keys are ignored here (the checkpoint owns them)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: int = Field(ge=1, le=1 << 21)
    d_model: int = Field(ge=1, le=1 << 16)
    n_layers: int = Field(ge=1, le=1024)
    n_dense_layers: int = Field(ge=0, le=1024)
    n_heads: int = Field(ge=1, le=4096)
    n_kv_heads: int = Field(ge=1, le=4096)
    head_dim: int = Field(ge=1, le=4096)
    qk_norm: bool
    # config schema 1.1 (CHECKPOINT.md); the defaults are what a 1.0 config means
    qk_norm_scope: Literal["head", "projection"] = "head"
    qkv_bias: bool = False
    shared_expert_gate: bool = False
    selection_bias: bool = True
    # config schema 1.2: multi-head latent attention (colibri-model mla.py); defaults = GQA
    attention_kind: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = Field(None, ge=1, le=1 << 16)
    kv_lora_rank: int = Field(0, ge=0, le=1 << 16)
    qk_nope_head_dim: int = Field(0, ge=0, le=4096)
    qk_rope_head_dim: int = Field(0, ge=0, le=4096)
    v_head_dim: int = Field(0, ge=0, le=4096)
    # config schema 1.2 (GPT-OSS); the defaults are what a 1.0/1.1 config means
    o_bias: bool = False
    attn_sinks: bool = False
    router_bias: bool = False
    expert_proj_bias: bool = False
    dense_ffn_dim: int = Field(ge=0, le=1 << 20)
    n_experts: int = Field(ge=0, le=4096)
    expert_dim: int = Field(ge=0, le=1 << 20)
    shared_expert_dim: int = Field(ge=0, le=1 << 20)
    tie_embeddings: bool

    @model_validator(mode="after")
    def _consistent(self) -> ModelShape:
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers {self.n_dense_layers} > n_layers {self.n_layers}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.attention_kind == "mla" and 0 in (self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim):
            raise ValueError("attention_kind 'mla' needs kv_lora_rank, qk_rope_head_dim and v_head_dim > 0")
        if self.n_layers > self.n_dense_layers and (self.n_experts == 0 or self.expert_dim == 0):
            raise ValueError("MoE layers need n_experts > 0 and expert_dim > 0")
        return self

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_layers, self.n_layers)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    encoding: Encoding


def expert_tensor_names(layer: int, bias: bool = False) -> dict[str, str]:
    """Checkpoint names of the stacked routed-expert tensors of one MoE layer: gate, up, down
    and, with `bias` (config schema 1.2), gate_bias, up_bias, down_bias."""
    prefix = f"layers.{layer}.moe.experts."
    names = {part: prefix + f"{part}_proj" for part in ("gate", "up", "down")}
    if bias:
        names.update({f"{part}_bias": prefix + f"{part}_bias" for part in ("gate", "up", "down")})
    return names


def checkpoint_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor CHECKPOINT.md names for this config, in checkpoint order, routed experts
    included (stacked, `[n_experts, out, in]`)."""
    d, q_dim, kv_dim = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"embed.weight": (shape.vocab_size, d)}
    for i in range(shape.n_layers):
        p = f"layers.{i}."
        out[p + "attn_norm.weight"] = (d,)
        if shape.attn_sinks:
            out[p + "attn.sinks"] = (shape.n_heads,)
        if shape.attention_kind == "mla":
            out.update(_mla_tensor_shapes(shape, p + "attn."))
        else:
            for proj, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                out[p + f"attn.{proj}_proj.weight"] = (rows, d)
                if shape.qkv_bias:
                    out[p + f"attn.{proj}_proj.bias"] = (rows,)
            out[p + "attn.o_proj.weight"] = (d, q_dim)
        if shape.o_bias:
            out[p + "attn.o_proj.bias"] = (d,)
        if shape.qk_norm and shape.attention_kind == "gqa":
            projection = shape.qk_norm_scope == "projection"
            out[p + "attn.q_norm.weight"] = (q_dim if projection else shape.head_dim,)
            out[p + "attn.k_norm.weight"] = (kv_dim if projection else shape.head_dim,)
        out[p + "ffn_norm.weight"] = (d,)
        if i < shape.n_dense_layers:
            out[p + "ffn.gate_proj.weight"] = (shape.dense_ffn_dim, d)
            out[p + "ffn.up_proj.weight"] = (shape.dense_ffn_dim, d)
            out[p + "ffn.down_proj.weight"] = (d, shape.dense_ffn_dim)
            continue
        out[p + "moe.router.weight"] = (shape.n_experts, d)
        if shape.router_bias:
            out[p + "moe.router.bias"] = (shape.n_experts,)
        if shape.selection_bias:
            out[p + "moe.router.expert_bias"] = (shape.n_experts,)
        if shape.shared_expert_dim > 0:
            out[p + "moe.shared.gate_proj.weight"] = (shape.shared_expert_dim, d)
            out[p + "moe.shared.up_proj.weight"] = (shape.shared_expert_dim, d)
            out[p + "moe.shared.down_proj.weight"] = (d, shape.shared_expert_dim)
            if shape.shared_expert_gate:
                out[p + "moe.shared_gate.weight"] = (1, d)
        names = expert_tensor_names(i)
        out[names["gate"]] = (shape.n_experts, shape.expert_dim, d)
        out[names["up"]] = (shape.n_experts, shape.expert_dim, d)
        out[names["down"]] = (shape.n_experts, d, shape.expert_dim)
        if shape.expert_proj_bias:
            out[p + "moe.experts.gate_bias"] = (shape.n_experts, shape.expert_dim)
            out[p + "moe.experts.up_bias"] = (shape.n_experts, shape.expert_dim)
            out[p + "moe.experts.down_bias"] = (shape.n_experts, d)
    out["norm.weight"] = (d,)
    if not shape.tie_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, d)
    return out


def _mla_tensor_shapes(shape: ModelShape, prefix: str) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's tensors, in colibri-model's order (mla.py)."""
    d, heads, q_dim = shape.d_model, shape.n_heads, shape.n_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {}
    rank = shape.q_lora_rank
    if rank is None:
        out[prefix + "q_proj.weight"] = (q_dim, d)
    else:
        out[prefix + "q_a_proj.weight"] = (rank, d)
        out[prefix + "q_a_layernorm.weight"] = (rank,)
        out[prefix + "q_b_proj.weight"] = (q_dim, rank)
    out[prefix + "kv_a_proj_with_mqa.weight"] = (shape.kv_lora_rank + shape.qk_rope_head_dim, d)
    out[prefix + "kv_a_layernorm.weight"] = (shape.kv_lora_rank,)
    out[prefix + "kv_b_proj.weight"] = (heads * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank)
    out[prefix + "o_proj.weight"] = (d, heads * shape.v_head_dim)
    return out


def resident_encoding(name: str, ndim: int, scheme: QuantScheme) -> Encoding:
    """The encoding FORMAT.md assigns to a resident tensor."""
    if ndim == 1:
        return "f32"
    if name.endswith(("moe.router.weight", "moe.shared_gate.weight")):  # gates: tiny, decisive
        return "bf16"
    dtype: ResidentDtype = scheme.embed_dtype if name in ("embed.weight", "lm_head.weight") else scheme.resident_dtype
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
    return numel // 2 + 2 * n_groups * (1 if scheme.symmetric else 2)


def check_groupable(encoding: Encoding, dims: tuple[int, ...], scheme: QuantScheme) -> str | None:
    """Why `dims` cannot be stored as `encoding`, or None if it can."""
    if encoding in ("q4", "q8"):
        if len(dims) != 2:
            return f"{encoding} needs a 2-D matrix, got shape {list(dims)}"
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
