"""ColibriConfig: the one description of a Colibri model (its fields, their validation, the
schema versions it is written at, the KV-cache shapes it implies).

colibri-spec owns it (torch-free); colibri-model builds the torch model from it and re-exports it.
The config is a pydantic v2 model so that it round-trips through JSON (`config.json` of a
checkpoint, see CHECKPOINT.md) and so that an invalid combination fails at construction with a
message naming the field, long before a 2.7B-parameter allocation. The presets are in
presets.py, parameter counts in param_count.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from .errors import ConfigError
from .rope_scaling import RopeScaling
from .versions import require_major

__all__ = ["SCHEMA_VERSION", "V1_1_DEFAULTS", "V1_2_DEFAULTS", "ColibriConfig", "ConfigError", "RopeScaling"]

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
# Schema 1.2 added multi-head latent attention and group-limited routing (DeepSeek-V2/V3), and
# biases on the routed experts and the router's logits, the clamped SwiGLU, o_proj's bias,
# attention sinks and sliding-window layers (GPT-OSS), and the "yarn" RoPE kind. The same rule: at
# these defaults a config is written as 1.1 (or 1.0) wrote it.
V1_2_DEFAULTS: dict = {
    "attention_kind": "gqa",
    "q_lora_rank": None,
    "kv_lora_rank": 0,
    "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
    "rope_interleave": False,
    "router_groups": 1,
    "router_topk_groups": 1,
    "router_group_score": "top2_sum",
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


_JSON_OBJECT = TypeAdapter(dict)
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class ColibriConfig(BaseModel):
    """Hyper-parameters of a Colibri model: a decoder-only transformer with GQA and, after
    `n_dense_layers` dense layers, MoE layers.

    The defaults are Colibri's own design (QK-norm per head, sigmoid router with a selection
    bias); the other values describe imported checkpoints (colibri-int4 `import-hf`): a softmax
    router without bias (Qwen-MoE, OLMoE, Mixtral), a sigmoid-gated shared expert (Qwen2-MoE),
    QK-norm over the whole projection (OLMoE), q/k/v biases (Qwen2-MoE), RoPE scaling, an
    all-dense model (`n_dense_layers == n_layers`, `n_experts = 0`: Llama, SmolLM2), and (schema
    1.2) multi-head latent attention with group-limited routing (DeepSeek-V2/V3), and biased,
    clamped experts, a biased router, attention sinks and sliding-window layers (GPT-OSS). Every KV cache is
    sized by `kv_cache_heads`, `key_head_dim`, `value_head_dim` and `kv_bytes_per_position`.
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
    # Schema 1.2. "mla": multi-head latent attention (DeepSeek-V2/V3, colibri_model.mla). Then head_dim is the
    # query/key head width qk_nope_head_dim + qk_rope_head_dim, n_kv_heads == n_heads (every head
    # has its own key), values are v_head_dim wide, and q_lora_rank None means a plain q_proj. `rope_interleave`: RoPE pairs dims (0,1), (2,3), ... (DeepSeek) instead
    # of (j, j + half).
    attention_kind: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = Field(None, gt=0)
    kv_lora_rank: int = Field(0, ge=0)
    qk_nope_head_dim: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    rope_interleave: bool = False
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
    # Schema 1.2. Group-limited routing (DeepSeek): the experts form `router_groups` equal groups, each
    # scored by the sum of its top-2 selection scores ("top2_sum", V3) or its best one ("max", V2);
    # the top-k is chosen among the experts of the best `router_topk_groups` groups only.
    router_groups: int = Field(1, gt=0)
    router_topk_groups: int = Field(1, gt=0)
    router_group_score: Literal["top2_sum", "max"] = "top2_sum"
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
        require_major(self.schema_version, SCHEMA_VERSION, key="config schema", where="schema_version",
                      error=ValueError)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads: {self.n_heads} query heads are not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.attention_kind == "mla":
            self._check_mla()
        elif self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        elif any(getattr(self, key) != V1_2_DEFAULTS[key] for key in _MLA_FIELDS):
            raise ValueError(f"attention_kind: {', '.join(_MLA_FIELDS)} describe attention_kind 'mla' only")
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
        self._check_groups()
        return self

    def _check_mla(self) -> None:
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, field) == 0:
                raise ValueError(f"{field}: must be > 0 for attention_kind 'mla'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: RoPE needs an even width, got {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(f"head_dim: {self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                             f"{self.qk_nope_head_dim + self.qk_rope_head_dim} for attention_kind 'mla'")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads: {self.n_kv_heads} must equal n_heads={self.n_heads} for attention_kind "
                             "'mla' (every head has its own key)")
        if self.qk_norm or self.qkv_bias:
            raise ValueError("qk_norm/qkv_bias: not defined for attention_kind 'mla'")

    def _check_groups(self) -> None:
        groups, chosen = self.router_groups, self.router_topk_groups
        if self.n_experts % groups:
            raise ValueError(f"router_groups: {self.n_experts} experts do not split into {groups} equal groups")
        if chosen > groups:
            raise ValueError(f"router_topk_groups: {chosen} exceeds router_groups={groups}")
        per_group = self.n_experts // groups
        if groups > 1 and self.router_group_score == "top2_sum" and per_group < 2:
            raise ValueError(f"router_group_score: 'top2_sum' needs >= 2 experts per group, got {per_group}")
        for field in ("top_k_train", "top_k_infer"):
            if getattr(self, field) > chosen * per_group:
                raise ValueError(f"{field}: top_k={getattr(self, field)} exceeds the {chosen * per_group} experts "
                                 f"of the router_topk_groups={chosen} chosen groups")

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

    # What every KV cache (colibri-model's KVCache, colibri-stream's SessionKV) and every KV byte
    # count is sized by: per layer, keys [B, kv_cache_heads, S, key_head_dim] and values
    # [B, kv_cache_heads, S, value_head_dim]. MLA caches its latent (colibri_model.mla): one "head" holding the
    # normalised kv latent and the rope key, kv_lora_rank + qk_rope_head_dim wide; no values.
    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.attention_kind == "mla" else self.n_kv_heads

    @property
    def key_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.attention_kind == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return 0 if self.attention_kind == "mla" else self.head_dim

    def kv_bytes_per_position(self, element_size: int) -> int:
        """Bytes one position of context takes in the KV cache, over all layers."""
        return self.n_layers * self.kv_cache_heads * (self.key_head_dim + self.value_head_dim) * element_size

    # --- JSON round trip ------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON object of this config, written at the lowest schema that describes it: a
        config that uses no 1.1 feature comes out exactly as schema 1.0 wrote it."""
        data = self.model_dump(mode="json")
        dropped = {"1.0": {**V1_1_DEFAULTS, **V1_2_DEFAULTS}, "1.1": V1_2_DEFAULTS}.get(self.schema_version, {})
        for key in dropped:
            del data[key]
        return data

    def to_json(self) -> str:
        return _JSON_OBJECT.dump_json(self.to_dict(), indent=2).decode()  # pydantic's formatting, as 1.0 wrote

    @classmethod
    def from_json(cls, text: str) -> ColibriConfig:
        return cls.model_validate(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    def with_updates(self, **changes) -> ColibriConfig:
        """A validated copy with some fields changed (the config itself is frozen)."""
        return type(self).model_validate({**self.model_dump(), **changes})
