"""ColibriConfig: the one description of a Colibri MoE model, its presets, and parameter counts.

The config is a pydantic v2 model so that it round-trips through JSON (`config.json` of a
checkpoint, see CHECKPOINT.md) and so that an invalid combination fails at construction with a
message naming the field, long before a 2.7B-parameter allocation.

`count_params` works from the config alone (no weights are allocated), so it can size a
Grande model on a laptop. The accounting (documented in the README):

- total: every stored parameter once (embedding, untied LM head if any, attention, norms,
  dense FFNs, routers, shared experts, all routed experts). The expert bias is a buffer, not a
  parameter, and is not counted.
- active (per token, for a given top_k): the matmul weights a token passes through: attention,
  the dense FFN, the router, the shared expert, top_k routed experts per MoE layer, the norms,
  and ONE vocab x d matrix for the LM head. The input embedding is a lookup, not a matmul, so
  it is not counted as active (with tied embeddings it is the same matrix as the head).
  This is the convention that gives NanoColibri's published 341M active.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

SCHEMA_VERSION = "1.2"
# Schema 1.1 added these fields (architecture variants of imported checkpoints). At these values
# a config is exactly what 1.0 described, and `to_dict` writes it as 1.0 did (no new keys,
# schema_version "1.0"), so every existing checkpoint, preset and config hash stays byte-identical
# and a 1.0 reader still reads it.
V1_1_DEFAULTS: dict = {
    "selection_bias": True,
    "shared_expert_gate": False,
    "qk_norm_scope": "head",
    "qkv_bias": False,
    "rope_scaling": None,
}
# Schema 1.2 (GPT-OSS): biases on the routed experts and the router's logits, the clamped SwiGLU,
# o_proj's bias, attention sinks, sliding-window layers (and the "yarn" RoPE kind). The same rule:
# at these values a config is written as 1.1 (or 1.0) wrote it.
V1_2_DEFAULTS: dict = {
    "expert_proj_bias": False,
    "expert_glu": "swiglu",
    "glu_alpha": 1.702,
    "glu_limit": 7.0,
    "router_bias": False,
    "o_bias": False,
    "attn_sinks": False,
    "sliding_window": None,
    "sliding_layers": (),
}


class ConfigError(ValueError):
    """An invalid model configuration; the message names the offending field."""


_JSON_OBJECT = TypeAdapter(dict)


class RopeScaling(BaseModel):
    """Rotary frequency scaling for a longer context than the model was pre-trained on.

    - "linear": every frequency divided by `factor` (position interpolation).
    - "llama3": Llama 3.1's rule: wavelengths below `original_max_seq_len / high_freq_factor`
      unchanged, above `original_max_seq_len / low_freq_factor` divided by `factor`, a smooth
      interpolation between.
    - "yarn" (schema 1.2; GPT-OSS, Qwen long context): dimensions that turn more than `beta_fast`
      times over `original_max_seq_len` keep their frequency, fewer than `beta_slow` times are
      divided by `factor`, a linear ramp between (`truncate` rounds the ramp's ends outwards);
      cos and sin are multiplied by `attention_factor` (default `0.1 ln(factor) + 1`), which
      scales every attention logit by its square.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["linear", "llama3", "yarn"]
    factor: float = Field(gt=0)
    low_freq_factor: float | None = Field(None, gt=0)
    high_freq_factor: float | None = Field(None, gt=0)
    original_max_seq_len: int | None = Field(None, gt=0)
    beta_fast: float | None = Field(None, gt=0)  # yarn only, like the three below
    beta_slow: float | None = Field(None, gt=0)
    truncate: bool | None = None
    attention_factor: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_kind(self) -> RopeScaling:
        llama3 = (self.low_freq_factor, self.high_freq_factor)
        yarn = (self.beta_fast, self.beta_slow, self.truncate, self.attention_factor)
        if self.kind == "llama3":
            if None in llama3 or self.original_max_seq_len is None:
                raise ValueError("rope_scaling: llama3 needs low_freq_factor, high_freq_factor, original_max_seq_len")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("rope_scaling: high_freq_factor must exceed low_freq_factor")
            if any(v is not None for v in yarn):
                raise ValueError("rope_scaling: beta_fast, beta_slow, truncate, attention_factor are yarn's")
        elif self.kind == "yarn":
            if None in (self.beta_fast, self.beta_slow, self.truncate, self.original_max_seq_len):
                raise ValueError("rope_scaling: yarn needs beta_fast, beta_slow, truncate, original_max_seq_len")
            if any(v is not None for v in llama3):
                raise ValueError("rope_scaling: low_freq_factor, high_freq_factor are llama3's")
        elif any(v is not None for v in llama3 + yarn) or self.original_max_seq_len is not None:
            raise ValueError(f"rope_scaling: {self.kind} takes only factor")
        return self

    @property
    def yarn_attention_factor(self) -> float:
        """The factor yarn multiplies cos and sin by (1.0 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


class ColibriConfig(BaseModel):
    """Hyper-parameters of a Colibri model: a decoder-only transformer with GQA and, after
    `n_dense_layers` dense layers, MoE layers.

    The defaults are Colibri's own design (QK-norm per head, sigmoid router with a selection
    bias); the other values describe imported checkpoints (colibri-int4 `import-hf`): a softmax
    router without bias (Qwen-MoE, OLMoE, Mixtral), a sigmoid-gated shared expert (Qwen2-MoE),
    QK-norm over the whole projection (OLMoE), q/k/v biases (Qwen2-MoE), RoPE scaling, and an
    all-dense model (`n_dense_layers == n_layers`, `n_experts = 0`: Llama, SmolLM2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: str = SCHEMA_VERSION
    name: str = "custom"

    vocab_size: int = Field(49152, gt=0)
    d_model: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_dense_layers: int = Field(1, ge=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    qk_norm: bool = True
    # "head": RMSNorm over head_dim, one weight shared by every head (Qwen3, Colibri);
    # "projection": RMSNorm over the whole q (n_heads*head_dim) and k projection (OLMoE).
    qk_norm_scope: Literal["head", "projection"] = "head"
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2-MoE, GPT-OSS)
    o_bias: bool = False  # a bias on o_proj (GPT-OSS), schema 1.2
    # One learned logit per query head that joins each softmax over the keys and carries no value
    # (GPT-OSS "sinks"): a head can attend to nothing. Schema 1.2.
    attn_sinks: bool = False
    # Layers in `sliding_layers` attend only to the last `sliding_window` positions (the query's
    # own included), the others to the whole causal prefix (GPT-OSS alternates). Schema 1.2.
    sliding_window: int | None = Field(None, gt=0)
    sliding_layers: tuple[int, ...] = ()
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = Field(2048, gt=0)
    dense_ffn_dim: int = Field(gt=0)

    n_experts: int = Field(ge=0)  # 0 only for an all-dense model
    expert_dim: int = Field(ge=0)
    top_k_train: int = Field(2, gt=0)
    top_k_infer: int = Field(1, gt=0)
    shared_expert_dim: int = Field(0, ge=0)
    shared_expert_gate: bool = False  # shared expert output scaled by sigmoid(x . w_gate) (Qwen2-MoE)
    # Routed experts, schema 1.2 (GPT-OSS): biases on gate, up and down, and the activation.
    # "swiglu": silu(gate) * up. "clamped_swiglu": gate clamped above at glu_limit, up to
    # [-glu_limit, glu_limit], then gate * sigmoid(glu_alpha * gate) * (up + 1).
    expert_proj_bias: bool = False
    expert_glu: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    glu_alpha: float = Field(1.702, gt=0)
    glu_limit: float = Field(7.0, gt=0)

    router_score: Literal["sigmoid", "softmax"] = "sigmoid"  # softmax: over all experts, fp32
    # The per-expert bias that only chooses the top-k (aux-loss-free balancing). Imported softmax
    # routers were trained without one: they have no `expert_bias` tensor at all.
    selection_bias: bool = True
    # A trained bias added to the router logits before scoring (GPT-OSS), unlike the selection
    # bias it changes the gate weights too. Schema 1.2.
    router_bias: bool = False
    route_norm: bool = True
    route_scale: float = Field(1.0, gt=0)
    bias_update_gamma: float = Field(1e-3, ge=0)
    aux_loss_alpha: float = Field(0.0, ge=0)

    tie_embeddings: bool = False
    norm_eps: float = Field(1e-6, gt=0)
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _check_combinations(self) -> ColibriConfig:
        major = self.schema_version.split(".")[0]
        if major != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(
                f"schema_version: config schema {self.schema_version} is not supported "
                f"(this colibri-model reads {SCHEMA_VERSION})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads: {self.n_heads} query heads are not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(
                f"n_dense_layers: {self.n_dense_layers} dense layers exceed n_layers={self.n_layers}"
            )
        if self.sliding_layers:
            if self.sliding_window is None:
                raise ValueError("sliding_layers: needs sliding_window")
            if sorted(set(self.sliding_layers)) != list(self.sliding_layers) or self.sliding_layers[-1] >= self.n_layers:
                raise ValueError(f"sliding_layers: {list(self.sliding_layers)} must be ascending layer indices < n_layers")
        if self.expert_glu == "swiglu" and (self.glu_alpha, self.glu_limit) != (1.702, 7.0):
            raise ValueError("glu_alpha, glu_limit: used by expert_glu='clamped_swiglu' only")
        # schema_version always names the lowest schema that describes this config (what
        # `to_dict` writes), so a config equals itself read back from its JSON.
        object.__setattr__(self, "schema_version", self._lowest_schema())
        if self.n_moe_layers == 0:
            return self  # all dense: the routing fields describe nothing
        for field in ("n_experts", "expert_dim"):
            if getattr(self, field) == 0:
                raise ValueError(f"{field}: must be > 0 when there are MoE layers (n_dense_layers < n_layers)")
        for field in ("top_k_train", "top_k_infer"):
            if getattr(self, field) > self.n_experts:
                raise ValueError(
                    f"{field}: top_k={getattr(self, field)} exceeds n_experts={self.n_experts}"
                )
        return self

    def _lowest_schema(self) -> str:
        if self.rope_scaling is not None and self.rope_scaling.kind == "yarn":
            return "1.2"
        if any(getattr(self, key) != default for key, default in V1_2_DEFAULTS.items()):
            return "1.2"
        if self.router_score != "sigmoid" or self.n_experts == 0:
            return "1.1"
        return "1.1" if any(getattr(self, key) != default for key, default in V1_1_DEFAULTS.items()) else "1.0"

    def is_sliding_layer(self, layer: int) -> bool:
        return layer in self.sliding_layers

    # --- derived shapes -------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    # --- JSON round trip ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON object of this config, written at the lowest schema that describes it: a
        config that uses no 1.1 feature comes out exactly as schema 1.0 wrote it."""
        data = self.model_dump(mode="json")
        if self.schema_version in ("1.0", "1.1"):
            for key in V1_2_DEFAULTS:
                del data[key]
            if data["rope_scaling"] is not None:  # the yarn keys, always None below 1.2
                for key in ("beta_fast", "beta_slow", "truncate", "attention_factor"):
                    del data["rope_scaling"][key]
        if self.schema_version == "1.0":
            for key in V1_1_DEFAULTS:
                del data[key]
        return data

    def to_json(self) -> str:
        return _JSON_OBJECT.dump_json(self.to_dict(), indent=2).decode()  # pydantic's formatting, as 1.0 wrote

    @classmethod
    def from_json(cls, text: str) -> ColibriConfig:
        return cls.model_validate(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ColibriConfig:
        """A config JSON file: a bare config, or a checkpoint's config.json (whose
        `format_version` is checked and stripped, see CHECKPOINT.md)."""
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and "format_version" in data:
            from .checkpoint import parse_checkpoint_config  # checkpoint.py imports this module

            return parse_checkpoint_config(data, str(path))
        return cls.model_validate(data)

    def with_updates(self, **changes) -> ColibriConfig:
        """A validated copy with some fields changed (the config itself is frozen)."""
        return type(self).model_validate({**self.model_dump(), **changes})


# --- presets ------------------------------------------------------------------------------
# All presets share the design: 1 leading dense layer, 4x GQA with head_dim 64 (32 for tiny),
# 64 routed experts (8 for tiny, 80 for grande), top-2 train / top-1 serve, one shared expert 4x the expert
# width, and a dense FFN width equal to the MoE layer's active width (shared + 2 experts).
PRESETS: dict[str, dict] = {
    # Trains in seconds on a CPU; same design, small. Tied embeddings keep it small.
    "tiny": dict(
        d_model=128, n_layers=4, n_dense_layers=1, n_heads=4, n_kv_heads=1, head_dim=32,
        dense_ffn_dim=384, n_experts=8, expert_dim=64, shared_expert_dim=256,
        max_seq_len=512, tie_embeddings=True,
    ),
    # NanoColibri: 2.63B total / 0.341B active (top-2), 0.31B active (top-1).
    "nano": dict(
        d_model=1024, n_layers=24, n_dense_layers=1, n_heads=16, n_kv_heads=4, head_dim=64,
        dense_ffn_dim=3072, n_experts=64, expert_dim=512, shared_expert_dim=2048,
        max_seq_len=2048,
    ),
    # Colibri-Micro: about 7.0B total / 0.97B active (top-2). Its shared expert is wider
    # (4096 = 5.3x the expert width) to reach 1B active at 28 layers.
    "micro": dict(
        d_model=1536, n_layers=28, n_dense_layers=1, n_heads=24, n_kv_heads=6, head_dim=64,
        dense_ffn_dim=5632, n_experts=64, expert_dim=768, shared_expert_dim=4096,
        max_seq_len=4096,
    ),
    # Colibri-Grande: about 27B total / 2.6B active (top-2), 2.3B (top-1). 80 experts: at 64
    # the routed share of the total is too small for the 24-28B / 2.4B-active target.
    "grande": dict(
        d_model=2304, n_layers=40, n_dense_layers=1, n_heads=36, n_kv_heads=9, head_dim=64,
        dense_ffn_dim=9216, n_experts=80, expert_dim=1152, shared_expert_dim=4608,
        max_seq_len=4096,
    ),
}


def get_preset(name: str, **overrides) -> ColibriConfig:
    """The named preset as a config, with optional field overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ColibriConfig(name=name, **{**PRESETS[name], **overrides})


def count_params(config: ColibriConfig) -> dict[str, int]:
    """Total and active parameter counts, from shapes alone (see the module docstring).

    Returns `total_params`, `active_params_train` (top_k_train experts) and
    `active_params_infer` (top_k_infer experts).
    """
    d, hd = config.d_model, config.head_dim
    attn = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2  # q, o + k, v
    if config.qk_norm:
        attn += 2 * hd if config.qk_norm_scope == "head" else (config.n_heads + config.n_kv_heads) * hd
    attn += (config.n_heads + 2 * config.n_kv_heads) * hd if config.qkv_bias else 0
    attn += d if config.o_bias else 0
    attn += config.n_heads if config.attn_sinks else 0
    norms_per_layer = 2 * d
    dense_ffn = 3 * d * config.dense_ffn_dim
    expert = 3 * d * config.expert_dim + ((2 * config.expert_dim + d) if config.expert_proj_bias else 0)
    shared = 3 * d * config.shared_expert_dim + (d if config.shared_expert_gate else 0)
    router = config.n_experts * (d + (1 if config.router_bias else 0))
    head = config.vocab_size * d

    backbone = config.n_layers * (attn + norms_per_layer) + d  # + final norm
    backbone += config.n_dense_layers * dense_ffn
    backbone += config.n_moe_layers * (router + shared)

    total = backbone + config.n_moe_layers * config.n_experts * expert
    total += head if config.tie_embeddings else 2 * head

    def active(top_k: int) -> int:
        return backbone + config.n_moe_layers * top_k * expert + head

    return {
        "total_params": total,
        "active_params_train": active(config.top_k_train),
        "active_params_infer": active(config.top_k_infer),
    }
