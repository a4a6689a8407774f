"""DeepSeek's architecture as configuration (schema 1.2): multi-head latent attention, yarn RoPE
with the interleaved layout, group-limited routing. Checked against hand computations here; the
logits against transformers' DeepseekV3ForCausalLM are colibri-stream's test_hf_import.py."""

from __future__ import annotations

import math

import pytest
import torch
from colibri_model import ColibriConfig, ColibriForCausalLM, checkpoint_tensor_shapes, count_params
from colibri_model.config import V1_2_DEFAULTS, RopeScaling
from colibri_model.layers import KVCache, RotaryEmbedding, rope_inv_freq
from colibri_model.router import limit_to_groups
from pydantic import ValidationError

YARN = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32, beta_fast=32, beta_slow=1, mscale=1.0,
                   mscale_all_dim=0.8, truncate=True)
MLA = dict(vocab_size=256, d_model=64, n_layers=3, n_dense_layers=1, n_heads=4, n_kv_heads=4, head_dim=24,
           dense_ffn_dim=96, n_experts=8, expert_dim=32, shared_expert_dim=32, top_k_train=2, top_k_infer=2,
           qk_norm=False, max_seq_len=64, attention_kind="mla", q_lora_rank=32, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, rope_scaling=YARN,
           router_groups=4, router_topk_groups=2, route_scale=2.5)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_mla_config_round_trips_as_1_2_and_its_tensors_and_counts_agree(q_lora_rank, tmp_path):
    config = ColibriConfig(**{**MLA, "q_lora_rank": q_lora_rank})
    assert config.to_dict()["schema_version"] == "1.2" and ColibriConfig.from_json(config.to_json()) == config
    # the latent cache: one row of kv_lora_rank + qk_rope_head_dim per layer and position
    assert (config.kv_cache_heads, config.key_head_dim, config.value_head_dim) == (1, 32 + 8, 0)
    assert config.kv_bytes_per_position(2) == 3 * (32 + 8) * 2
    model = ColibriForCausalLM(config)
    assert count_params(config)["total_params"] == sum(p.numel() for p in model.parameters())
    assert list(checkpoint_tensor_shapes(config)) == list(model.state_dict())
    assert ("layers.0.attn.q_proj.weight" in model.state_dict()) == (q_lora_rank is None)
    model.save_pretrained(tmp_path)
    loaded = ColibriForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 9))
    assert torch.equal(model.eval()(tokens).logits, loaded(tokens).logits)


def test_mla_decoding_with_the_cache_is_the_full_forward():
    torch.manual_seed(0)
    model = ColibriForCausalLM(ColibriConfig(**MLA)).eval()
    tokens = torch.randint(0, 256, (2, 12))
    full = model(tokens).logits
    cache = model.new_kv_cache(2, 32)
    assert cache.keys[0].shape == (2, 1, 32, 40) and cache.values[0].shape == (2, 1, 32, 0)
    parts = [model(tokens[:, :7], cache=cache).logits] + [model(tokens[:, t:t + 1], cache=cache).logits
                                                          for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    cache.first[1] = 2  # only a sliding-window layer may drop columns (KVCache.first)
    with pytest.raises(ValueError, match="layer 1: an MLA layer needs every cached column"):
        model(tokens[:, :1], cache=cache)


def test_mla_attention_by_hand():
    """One layer's MLA against the formula in mla.py's docstring, written out with einsum."""
    torch.manual_seed(1)
    config = ColibriConfig(**{**MLA, "rope_scaling": None, "rope_interleave": False})
    attn = ColibriForCausalLM(config).layers[0].attn
    x, T = torch.randn(1, 5, 64), 5
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, 4, 24)
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([32, 8], -1)
    k_nope, v = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(1, T, 4, 32).split([16, 16], -1)
    inv = rope_inv_freq(8, config.rope_theta, None).float()
    angle = torch.arange(T)[:, None] * inv[None]  # [T, 4]

    def rope(t):  # rotate-half over the last dim of [.., T, 8]
        a, b = t[..., :4], t[..., 4:]
        cos, sin = angle.cos(), angle.sin()
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    q_full = torch.cat([q[..., :16], rope(q[..., 16:].transpose(1, 2)).transpose(1, 2)], -1)  # [1, T, H, 24]
    k_rot = rope(k_rope)  # [1, T, 8], one for all heads
    k_full = torch.cat([k_nope, k_rot[:, :, None].expand(1, T, 4, 8)], -1)
    scores = torch.einsum("bthd,bshd->bhts", q_full, k_full) / math.sqrt(24)
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(1, T, 64)
    torch.testing.assert_close(attn(x, torch.arange(T)), attn.o_proj(out), atol=1e-5, rtol=1e-5)
    # a key-padding mask [B, S] (a padded batch): key 1 hidden from every query (key 0 stays visible)
    keep = torch.tensor([[True, False, True, True, True]])
    masked = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", masked.softmax(-1), v).reshape(1, T, 64)
    torch.testing.assert_close(attn(x, torch.arange(T), attention_mask=keep), attn.o_proj(out), atol=1e-5, rtol=1e-5)
    # the same through the latent cache (the absorbed form), in two steps
    cache = KVCache(config, 1, 8)
    first = attn(x[:, :3], torch.arange(3), cache, attention_mask=keep[:, :3])
    cache.length = 3
    second = attn(x[:, 3:], torch.arange(3, T), cache, attention_mask=keep)
    torch.testing.assert_close(torch.cat([first, second], 1), attn.o_proj(out), atol=1e-5, rtol=1e-5)


def test_interleaved_rope_is_rotate_half_of_the_deinterleaved_dims():
    x = torch.randn(1, 2, 5, 8)
    plain = RotaryEmbedding(8, 10000.0, 16)
    interleaved = RotaryEmbedding(8, 10000.0, 16, interleave=True)
    positions = torch.arange(5)
    deinterleaved = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
    torch.testing.assert_close(interleaved(x, positions), plain(deinterleaved, positions))


def test_yarn_frequencies_and_mscale_by_hand():
    dim, theta = 8, 10000.0
    base = rope_inv_freq(dim, theta, None)
    scaled = rope_inv_freq(dim, theta, YARN)

    def dim_of(rotations):  # the rotary dim whose frequency turns `rotations` times over 32 positions
        return dim * math.log(32 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(32)), 0), min(math.ceil(dim_of(1)), dim - 1)
    for j in range(dim // 2):
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)  # 0: kept, 1: divided by factor
        assert float(scaled[j]) == pytest.approx(float(base[j]) * (1 - ramp) + float(base[j]) / 4 * ramp, rel=1e-12)
    m = lambda s: 0.1 * s * math.log(4.0) + 1  # noqa: E731
    assert YARN.attention_factor == pytest.approx(m(1.0) / m(0.8))
    assert YARN.softmax_scale_factor == pytest.approx(m(0.8) ** 2)
    attn = ColibriForCausalLM(ColibriConfig(**MLA)).layers[0].attn
    assert attn.scale == pytest.approx(24 ** -0.5 * m(0.8) ** 2)
    rope = RotaryEmbedding(dim, theta, 16, YARN)
    rope.ensure(16, torch.device("cpu"))
    assert float(rope._cos[0, 0]) == pytest.approx(YARN.attention_factor)  # cos(0) * attention factor


def test_group_limited_routing_by_hand():
    """8 experts in 4 groups of 2; groups scored by the sum of their top-2 (V3) or their max (V2);
    the top-2 groups' experts are the only candidates."""
    choice = torch.tensor([[0.9, 0.0, 0.5, 0.5, 0.6, 0.1, 0.2, 0.3]])
    # group sums: 0.9, 1.0, 0.7, 0.5 -> groups 1, 0; maxima: 0.9, 0.5, 0.6, 0.3 -> groups 0, 2
    v3 = limit_to_groups(choice, 4, 2, "top2_sum")
    assert torch.equal(v3.isfinite(), torch.tensor([[True, True, True, True, False, False, False, False]]))
    v2 = limit_to_groups(choice, 4, 2, "max")
    assert torch.equal(v2.isfinite(), torch.tensor([[True, True, False, False, True, True, False, False]]))
    # the router: expert 4 (0.6) would be the second pick without groups; with them it is 2 or 3
    config = ColibriConfig(**MLA)
    router = ColibriForCausalLM(config).moe_layers()[0].router
    torch.manual_seed(3)
    router.expert_bias.normal_(0.0, 0.1)  # selection only: it picks, the raw scores gate
    x = torch.randn(64, 64)
    with torch.no_grad():
        ids, gates, scores = router(x, 2)
    logits = torch.sigmoid(x @ router.weight.detach().T)
    choice = logits + router.expert_bias
    sums = choice.view(64, 4, 2).sum(-1)  # two experts per group: top-2 sum = the sum
    allowed_groups = sums.topk(2, -1).indices
    for row in range(64):
        allowed = {2 * g + e for g in allowed_groups[row].tolist() for e in (0, 1)}
        expected = sorted(allowed, key=lambda e: -float(choice[row, e]))[:2]
        assert sorted(ids[row].tolist()) == sorted(expected)
        chosen = logits[row, ids[row]]
        torch.testing.assert_close(gates[row], chosen / chosen.sum() * 2.5)
    ungrouped = ColibriForCausalLM(ColibriConfig(**{**MLA, "router_groups": 1, "router_topk_groups": 1}))
    ungrouped.moe_layers()[0].router.load_state_dict(router.state_dict())
    with torch.no_grad():
        assert not torch.equal(ungrouped.moe_layers()[0].router(x, 2)[0].sort(-1).values, ids.sort(-1).values)


def test_configs_without_1_2_features_carry_no_1_2_keys():
    llama3 = RopeScaling(kind="llama3", factor=8, low_freq_factor=1, high_freq_factor=4, original_max_seq_len=32)
    config = ColibriConfig(**{**MLA, **V1_2_DEFAULTS, "head_dim": 16, "n_kv_heads": 2, "rope_scaling": llama3})
    data = config.to_dict()
    assert data["schema_version"] == "1.1" and not set(V1_2_DEFAULTS) & set(data)
    assert set(data["rope_scaling"]) == {"kind", "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"}


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(n_kv_heads=2), "n_kv_heads"),
        (dict(head_dim=32), "head_dim"),
        (dict(qk_rope_head_dim=7, head_dim=23), "qk_rope_head_dim"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(router_groups=3), "router_groups"),
        (dict(router_topk_groups=5), "router_topk_groups"),
        (dict(router_topk_groups=1, top_k_infer=3), "top_k_infer"),
        (dict(attention_kind="gqa", head_dim=16, n_kv_heads=2), "attention_kind"),
        (dict(rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=32)), "beta_fast"),
    ],
)
def test_invalid_mla_and_group_configs_name_the_field(change, field):
    with pytest.raises(ValidationError, match=field):
        ColibriConfig(**{**MLA, **change})


def test_training_memory_plan_counts_an_mla_block_exactly():
    from colibri_model.training.memory_plan import WeightCounts

    config = ColibriConfig(**MLA)
    model = ColibriForCausalLM(config)
    counts = WeightCounts.of(config)
    assert counts.moe_block == sum(p.numel() for p in model.layers[1].parameters())
    assert counts.dense_block == sum(p.numel() for p in model.layers[0].parameters())


def test_mla_model_trains():
    torch.manual_seed(0)
    model = ColibriForCausalLM(ColibriConfig(**MLA))
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, targets=tokens.roll(-1, 1)).loss.backward()
    attn = model.layers[1].attn
    for p in (attn.kv_b_proj.weight, attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight, attn.q_a_layernorm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
