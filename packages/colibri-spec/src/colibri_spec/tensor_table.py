"""The one table of a checkpoint's tensors (CHECKPOINT.md, "Tensor names"): every name and its
shape, from the config fields that decide them. colibri-model checks loaded weights against it
(and its tests hold it equal to the state dict of a model built on the meta device),
colibri-int4 places these tensors in a container and reads HF and GGUF checkpoints into them,
colibri-stream rebuilds the model from them. A new tensor is added here, once.

The table takes a `ColibriConfig`, or a `ModelShape`: the config fields that decide the tensors
alone, with bounds that keep an untrusted file (a container header) from asking for absurd sizes;
colibri-int4 validates its headers with it. A field that changes the tensors is added to both
(a test holds ModelShape's fields to ColibriConfig's) and to the table below.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .config import ColibriConfig


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
    # config schema 1.2: multi-head latent attention (colibri_model.mla); defaults = GQA
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


# What the table reads: a whole config or its bounded shape fields.
TensorShapeFields = Union[ModelShape, ColibriConfig]


def expert_tensor_names(layer: int, bias: bool = False) -> dict[str, str]:
    """Checkpoint names of the stacked routed-expert tensors of one MoE layer: gate, up, down
    and, with `bias` (config schema 1.2), gate_bias, up_bias, down_bias."""
    prefix = f"layers.{layer}.moe.experts."
    names = {part: prefix + f"{part}_proj" for part in ("gate", "up", "down")}
    if bias:
        names.update({f"{part}_bias": prefix + f"{part}_bias" for part in ("gate", "up", "down")})
    return names


def checkpoint_tensor_shapes(shape: TensorShapeFields) -> dict[str, tuple[int, ...]]:
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


def _mla_tensor_shapes(shape: TensorShapeFields, prefix: str) -> dict[str, tuple[int, ...]]:
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
