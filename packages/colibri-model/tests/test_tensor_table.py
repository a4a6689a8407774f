"""colibri-spec's tensor table is what the torch modules hold: for every preset and architecture
variant, the names (in order) and shapes of `checkpoint_tensor_shapes(config)` equal the state
dict of the model built on the meta device (no memory). The model is the oracle; the table is
what every package reads."""

from __future__ import annotations

import pytest
import torch
from colibri_model import PRESETS, ColibriForCausalLM, checkpoint_tensor_shapes, get_preset

YARN = dict(kind="yarn", factor=4.0, original_max_seq_len=32, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=1.0, truncate=True)
LATENT = dict(attention_kind="mla", qk_norm=False, n_kv_heads=4, head_dim=32, kv_lora_rank=64, qk_nope_head_dim=24,
              qk_rope_head_dim=8, v_head_dim=32, router_groups=4, router_topk_groups=2, rope_scaling=YARN)
SINKS_AND_BIASES = dict(qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=8,
                        sliding_layers=(0, 2), router_score="softmax", selection_bias=False, router_bias=True,
                        expert_proj_bias=True, expert_glu="clamped_swiglu", glu_limit=1.0, shared_expert_dim=0)
OVERRIDES = {
    "mla-q-latent": {**LATENT, "q_lora_rank": 48},
    "mla-plain-q": LATENT,
    "sinks-biases": SINKS_AND_BIASES,
    "softmax-projection-norm": dict(router_score="softmax", selection_bias=False, qk_norm_scope="projection"),
    "gated-shared-qkv-bias": dict(qk_norm=False, qkv_bias=True, shared_expert_gate=True),
    "all-dense-untied": dict(n_dense_layers=4, n_experts=0, expert_dim=0, tie_embeddings=False),
}
CONFIGS = {name: get_preset(name) for name in PRESETS} | {k: get_preset("tiny", **v) for k, v in OVERRIDES.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_table_is_the_state_dict_of_the_model(name):
    config = CONFIGS[name]
    with torch.device("meta"):
        model = ColibriForCausalLM(config)
    held = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    assert list(checkpoint_tensor_shapes(config).items()) == held
