"""Architecture variants of imported checkpoints are configuration of the same modules (schema
1.1): softmax router without selection bias, gated shared expert, QK-norm over the projection,
q/k/v biases, RoPE scaling, all-dense models. Old configs stay byte-identical; the trainer trains
the new shapes."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from colibri_model import (
    ColibriConfig,
    ColibriForCausalLM,
    checkpoint_tensor_shapes,
    count_params,
    get_preset,
)
from colibri_model.balancing import ExpertBiasBalancer
from colibri_model.checkpoint import config_to_checkpoint_json, read_config
from colibri_model.config import RopeScaling
from colibri_model.layers import RotaryEmbedding, rope_inv_freq
from colibri_model.training.state import config_hash
from pydantic import ValidationError

SMALL = dict(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, dense_ffn_dim=96,
             n_experts=4, expert_dim=32, max_seq_len=64)
VARIANTS = {
    "qwen3-moe": dict(router_score="softmax", selection_bias=False, n_dense_layers=0, top_k_train=2, top_k_infer=2),
    "olmoe": dict(router_score="softmax", selection_bias=False, route_norm=False, qk_norm_scope="projection",
                  n_dense_layers=0),
    "qwen2-moe": dict(router_score="softmax", selection_bias=False, qk_norm=False, qkv_bias=True,
                      shared_expert_dim=48, shared_expert_gate=True, n_dense_layers=0),
    "dense": dict(n_dense_layers=3, n_experts=0, expert_dim=0, qk_norm=False, tie_embeddings=True,
                  rope_scaling=RopeScaling(kind="llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
                                           original_max_seq_len=32)),
}


def _config(name: str) -> ColibriConfig:
    return ColibriConfig(name=name, **{**SMALL, **VARIANTS[name]})


def test_presets_are_written_exactly_as_schema_1_0_wrote_them():
    # sha256 of what colibri-model at c4ad406 (schema 1.0) wrote for these, and its config hashes
    tiny_json = hashlib.sha256(config_to_checkpoint_json(get_preset("tiny")).encode()).hexdigest()
    assert tiny_json == "fb98ead36fc4f04556b5e04e3a5689a4c56fafa3890bc32fabf644d023044bb5"
    nano_json = hashlib.sha256(get_preset("nano").to_json().encode()).hexdigest()
    assert nano_json == "6955460c4ab19043d9ee4ed3ed5934f24f92d7b961dbdeff0cdbe9668aefd9b0"
    assert config_hash(get_preset("tiny")) == "6c87ae9b8d0119d7d4f78a9366b9b6446db4c843fa1a58b6b607733319c24155"
    assert get_preset("tiny").to_dict()["schema_version"] == "1.0"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_round_trips_as_schema_1_1_and_counts_its_parameters(name, tmp_path):
    config = _config(name)
    assert config.to_dict()["schema_version"] == "1.1"
    assert ColibriConfig.from_json(config.to_json()) == config
    torch.manual_seed(0)
    model = ColibriForCausalLM(config)
    assert count_params(config)["total_params"] == sum(p.numel() for p in model.parameters())
    assert list(checkpoint_tensor_shapes(config)) == list(model.state_dict())
    model.save_pretrained(tmp_path)
    assert read_config(tmp_path) == config
    loaded = ColibriForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 9))
    assert torch.equal(model.eval()(tokens).logits, loaded(tokens).logits)
    loaded_bf16 = ColibriForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert loaded_bf16(tokens).logits.dtype == torch.bfloat16  # q/k/v biases held in bf16, not fp32


def test_softmax_router_without_bias_is_softmax_topk_renormalised():
    config = _config("qwen3-moe")
    model = ColibriForCausalLM(config)
    router = model.moe_layers()[0].router
    assert router.expert_bias is None and "layers.0.moe.router.expert_bias" not in model.state_dict()
    x = torch.randn(7, 64)
    ids, gates, _ = router(x, 2)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top, expected = probs.topk(2, dim=-1)
    assert torch.equal(ids, expected)
    torch.testing.assert_close(gates, top / top.sum(-1, keepdim=True))
    # Mixtral's form: softmax over the top-k logits is the same thing
    logits = x @ router.weight.T
    torch.testing.assert_close(gates, torch.softmax(logits.gather(-1, ids), dim=-1))
    # without route_norm (OLMoE's default) the gates are the raw probabilities
    olmoe = ColibriForCausalLM(_config("olmoe")).moe_layers()[0].router
    ids, gates, _ = olmoe(x, 1)
    torch.testing.assert_close(gates, torch.softmax(x @ olmoe.weight.T, -1).gather(-1, ids))


def test_balancer_leaves_a_router_without_bias_alone():
    model = ColibriForCausalLM(_config("qwen3-moe"))
    model(torch.randint(0, 256, (1, 8)))
    balancer = ExpertBiasBalancer(model, gamma=0.1)
    balancer.step()
    assert all(layer.router.expert_bias is None for layer in model.moe_layers())
    assert sum(sum(s.load) for s in balancer.last_stats) == pytest.approx(3.0)


def test_gated_shared_expert_and_projection_qk_norm_and_qkv_bias():
    torch.manual_seed(1)
    model = ColibriForCausalLM(_config("qwen2-moe"))
    moe = model.moe_layers()[0]
    x = torch.randn(5, 64)
    expected = torch.sigmoid(x @ moe.shared_gate.weight.T) * moe.shared(x)
    ids, gates, _ = moe.router(x, moe.top_k)
    expected = expected + moe.experts.reference_forward(x, ids, gates)
    torch.testing.assert_close(moe(x[None])[0], expected)
    attn = model.layers[0].attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None

    olmoe = ColibriForCausalLM(_config("olmoe"))
    names = checkpoint_tensor_shapes(_config("olmoe"))
    assert names["layers.0.attn.q_norm.weight"] == (64,) and names["layers.0.attn.k_norm.weight"] == (32,)
    attn = olmoe.layers[0].attn
    normed = attn.q_norm(attn.q_proj(torch.randn(1, 3, 64)))  # weight 1: unit RMS over all 4 heads
    torch.testing.assert_close(normed.pow(2).mean(-1), torch.ones(1, 3), atol=1e-3, rtol=0)  # eps 1e-6
    per_head = normed.view(1, 3, 4, 16).pow(2).mean(-1)
    assert (per_head - 1).abs().max() > 0.05  # ... not per head


def test_rope_scaling_linear_and_llama3():
    base = rope_inv_freq(64, 10000.0, None)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, RopeScaling(kind="linear", factor=4)), base / 4)
    scaling = RopeScaling(kind="llama3", factor=8, low_freq_factor=1, high_freq_factor=4, original_max_seq_len=8192)
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * math.pi / rope_inv_freq(64, 500000.0, None)
    assert torch.equal(scaled[wavelen < 8192 / 4], rope_inv_freq(64, 500000.0, None)[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], rope_inv_freq(64, 500000.0, None)[wavelen > 8192] / 8)
    with pytest.raises(ValidationError, match="llama3 needs"):
        RopeScaling(kind="llama3", factor=8)
    with pytest.raises(ValidationError, match="kind"):
        RopeScaling(kind="dynamic", factor=8)


@pytest.mark.parametrize("scaling", [None, RopeScaling(kind="yarn", factor=4, original_max_seq_len=64, beta_fast=32.0, beta_slow=1.0, truncate=True)])
def test_rope_tables_are_the_repeated_angles_cosines_and_sines(scaling):
    rope = RotaryEmbedding(head_dim=16, theta=10000.0, max_len=300, scaling=scaling)
    rope.ensure(1, torch.device("cpu"))
    angles = torch.outer(torch.arange(300, dtype=torch.float64), rope_inv_freq(16, 10000.0, scaling))
    angles = torch.cat([angles, angles], dim=-1)  # the definition: every angle twice, then cos and sin
    factor = 1.0 if scaling is None else scaling.attention_factor
    cos, sin = rope.at(299)
    assert torch.equal(rope._cos, (angles.cos() * factor).float()) and torch.equal(rope._sin, (angles.sin() * factor).float())
    assert torch.equal(cos, rope._cos[299]) and torch.equal(sin, rope._sin[299])


def test_limit_positions_keeps_tables_of_that_many_rows_and_the_same_values():
    config = _config("dense")
    model = ColibriForCausalLM(config)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        full = model(ids).logits
        full_cos = model.layers[0].attn.rope._cos.clone()
        model.limit_positions(16)
        limited = model(ids).logits
    rope = model.layers[0].attn.rope
    assert config.max_seq_len > 16 and rope._cos.shape[0] == 16  # rebuilt at the limit, not kept at max_seq_len
    assert torch.equal(rope._cos, full_cos[:16]) and torch.equal(limited, full)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 20)))  # a longer forward still grows them
    assert rope._cos.shape[0] == 20 and torch.equal(rope._cos, full_cos[:20])


def test_dense_only_model_has_no_moe_layers():
    config = _config("dense")
    model = ColibriForCausalLM(config)
    assert model.moe_layers() == [] and config.n_moe_layers == 0
    assert not any(".moe." in name for name in model.state_dict())
    out = model(torch.randint(0, 256, (1, 5)), targets=torch.randint(0, 256, (1, 5)))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(n_experts=0, expert_dim=0), "n_experts"),  # MoE layers need experts
        (dict(expert_dim=0), "expert_dim"),
        (dict(router_score="tanh"), "router_score"),
        (dict(qk_norm_scope="row"), "qk_norm_scope"),
    ],
)
def test_invalid_variants_name_the_field(change, field):
    with pytest.raises(ValidationError) as err:
        ColibriConfig(**{**SMALL, **change})
    assert field in str(err.value)


def test_trainer_trains_a_softmax_router_variant(train_three_steps):
    config = ColibriConfig(name="qwen2-moe-like", **{**SMALL, **VARIANTS["qwen2-moe"], "vocab_size": 49152,
                                                    "aux_loss_alpha": 0.01})
    records, moved = train_three_steps(config)
    assert records[-1].step == 3 and all(math.isfinite(r.loss) for r in records[1:])
    # the softmax router learns at top-2, and so do the shared gate and the q/k/v biases
    assert {"layers.1.moe.router.weight", "layers.1.moe.shared_gate.weight", "layers.0.attn.q_proj.bias"} <= moved
    assert len(records[-1].router) == 3
