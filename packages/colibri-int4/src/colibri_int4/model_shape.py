"""`ModelShape`: the config fields that decide tensor shapes, bounded so that a hostile container
header cannot ask for absurd sizes. The names and shapes themselves are colibri-spec's one
tensor table (`checkpoint_tensor_shapes`, `expert_tensor_names`, re-exported here); layout.py
places those tensors in a container.
"""

from __future__ import annotations

from typing import Literal

from colibri_spec.tensor_table import checkpoint_tensor_shapes, expert_tensor_names
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ModelShape", "checkpoint_tensor_shapes", "expert_tensor_names"]


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
