"""The one table of a checkpoint's tensors (CHECKPOINT.md, "Tensor names"): every name and its
shape, from the config fields that decide them. colibri-model checks loaded weights against it
(and its tests hold it equal to the state dict of a model built on the meta device),
colibri-int4 places these tensors in a container and reads HF and GGUF checkpoints into them,
colibri-stream rebuilds the model from them. A new tensor is added here, once.

The table takes any object with the fields of `TensorShapeFields`: a `ColibriConfig`, or
colibri-int4's `ModelShape` (the bounded subset an untrusted container header is checked with).
"""

from __future__ import annotations

from typing import Literal, Protocol


class TensorShapeFields(Protocol):
    """The config fields that decide which tensors a model has and their shapes."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_dense_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qk_norm: bool
    qk_norm_scope: Literal["head", "projection"]
    qkv_bias: bool
    o_bias: bool
    attn_sinks: bool
    attention_kind: Literal["gqa", "mla"]
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_ffn_dim: int
    n_experts: int
    expert_dim: int
    expert_proj_bias: bool
    shared_expert_dim: int
    shared_expert_gate: bool
    router_bias: bool
    selection_bias: bool
    tie_embeddings: bool


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
