"""What DeepSeek-V2 and V3 share: multi-head latent attention (colibri-model's `attention_kind =
"mla"`), the dense-then-MoE layer pattern with `n_shared_experts * moe_intermediate_size` ungated
shared experts, group counts, and the keys of the original (remote-code) release
that do not change the forward."""

from __future__ import annotations

from ..config_fields import ConfigFields

# config.json keys of the original release that only matter to training or parallelism
_NOT_THE_FORWARD = ("ep_size", "aux_loss_alpha", "seq_aux", "auto_map", "num_nextn_predict_layers", "num_mtp_layers")


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
