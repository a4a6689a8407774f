"""What DeepSeek-V2 and V3 share: multi-head latent attention (colibri-model's `attention_kind =
"mla"`), the dense-then-MoE layer pattern with `n_shared_experts * moe_intermediate_size` ungated
shared experts, group counts, DeepSeek's FP8 quantization_config, and the keys of the original (remote-code) release
that do not change the forward."""

from __future__ import annotations

from ...fp8 import FP8ConfigError, parse_quantization_config
from ..config_fields import ConfigFields, rope, silu_activation

# config.json keys of the original release that only matter to training or parallelism
_NOT_THE_FORWARD = ("ep_size", "aux_loss_alpha", "seq_aux", "auto_map", "num_nextn_predict_layers", "num_mtp_layers")


def fp8_weights(fields: ConfigFields) -> None:
    """Take DeepSeek's own release's quantization_config (block-scaled FP8 E4M3 weights, which the
    import dequantizes: colibri_int4/fp8.py) and refuse any other, by name and value."""
    quant = fields.get("quantization_config", None)
    if quant is not None:
        try:
            parse_quantization_config(quant)
        except FP8ConfigError as exc:
            fields.refuse(exc.key, exc.value, exc.why)


def decoder_basics(fields: ConfigFields) -> tuple[int, int, int, int, float, dict | None]:
    """What both DeepSeeks read alike before their routers differ: the FP8 form (if any), hidden
    size, depth, heads, context, RoPE (yarn on interleaved pairs) and the SiLU activation:
    (d_model, n_layers, n_heads, max_seq_len, rope_theta, rope_scaling)."""
    fp8_weights(fields)
    d, n_layers = fields.integer("hidden_size"), fields.integer("num_hidden_layers")
    n_heads, max_seq_len = fields.integer("num_attention_heads"), fields.integer("max_position_embeddings")
    theta, scaling = rope(fields, max_seq_len)
    silu_activation(fields)
    return d, n_layers, n_heads, max_seq_len, theta, scaling


def mla_fields(fields: ConfigFields, n_heads: int) -> dict:
    """The attention fields both DeepSeek versions share."""
    kv_heads = fields.integer("num_key_value_heads", n_heads)
    if kv_heads != n_heads:
        fields.refuse("num_key_value_heads", kv_heads, f"MLA here has one key per head: {n_heads}")
    fields.expect("attention_bias", (False,), False)
    fields.get("pretraining_tp", 1)
    nope, rope_dim = fields.integer("qk_nope_head_dim"), fields.integer("qk_rope_head_dim")
    for key, value in (("qk_head_dim", nope + rope_dim), ("head_dim", rope_dim)):  # derived by transformers
        if fields.get(key, value) != value:
            fields.refuse(key, fields.data[key], f"transformers derives {value} from qk_nope/qk_rope_head_dim")
    q_rank = fields.get("q_lora_rank", None)
    if q_rank is not None:
        q_rank = fields.integer("q_lora_rank")
    return dict(attention_kind="mla", n_kv_heads=n_heads, head_dim=nope + rope_dim, q_lora_rank=q_rank,
                kv_lora_rank=fields.integer("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                v_head_dim=fields.integer("v_head_dim"))


def router_groups(fields: ConfigFields) -> tuple[int, int]:
    """(n_group, topk_group) of a group-limited router."""
    n_groups = fields.integer("n_group", 1)
    return n_groups, fields.integer("topk_group", n_groups)


def moe_fields(fields: ConfigFields, n_layers: int, groups: tuple[int, int] | None) -> dict:
    """The layer pattern and the experts both DeepSeek versions share; `groups` (n_group,
    topk_group) for group-limited routing, None for plain top-k."""
    fields.expect("moe_layer_freq", (1,), 1)
    for key in _NOT_THE_FORWARD:
        fields.get(key, None)
    n_dense = fields.integer("first_k_dense_replace", 0, minimum=0)
    if n_dense > n_layers:
        fields.refuse("first_k_dense_replace", n_dense, f"exceeds num_hidden_layers={n_layers}")
    expert_dim = fields.integer("moe_intermediate_size")
    top_k = fields.integer("num_experts_per_tok")
    n_experts = fields.first(("n_routed_experts", "num_local_experts"))
    n_groups, chosen = groups if groups is not None else (1, 1)
    if n_experts % n_groups:
        fields.refuse("n_group", n_groups, f"{n_experts} routed experts do not split into equal groups")
    if chosen > n_groups or top_k > chosen * (n_experts // n_groups):
        fields.refuse("topk_group", chosen, f"num_experts_per_tok={top_k} needs more experts than {chosen} of "
                      f"{n_groups} groups hold")
    return dict(n_dense_layers=n_dense, dense_ffn_dim=fields.integer("intermediate_size"),
                n_experts=n_experts, expert_dim=expert_dim,
                shared_expert_dim=fields.integer("n_shared_experts", 0, minimum=0) * expert_dim,
                top_k_train=top_k, top_k_infer=top_k, router_groups=n_groups,
                router_topk_groups=chosen,
                route_scale=float(fields.get("routed_scaling_factor", 1.0)))
