"""GPT-OSS's variants as configuration of the same modules (config schema 1.2): routed experts with
biases and the clamped SwiGLU, a router with a logit bias, o_proj's bias, attention sinks,
sliding-window layers and YaRN RoPE. Checked against formulas written out here, the grouped
path against the reference loop, and old configs unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from colibri_model import (
    ColibriConfig,
    ColibriForCausalLM,
    ExpertGlu,
    GroupedExperts,
    checkpoint_tensor_shapes,
    count_params,
)
from colibri_model.config import RopeScaling
from colibri_model.router import Router
from pydantic import ValidationError

GPT_OSS = dict(vocab_size=256, d_model=64, n_layers=3, n_dense_layers=0, n_heads=4, n_kv_heads=2, head_dim=16,
               dense_ffn_dim=32, n_experts=8, expert_dim=32, top_k_train=2, top_k_infer=2, max_seq_len=64,
               qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=4, sliding_layers=(0, 2),
               router_score="softmax", selection_bias=False, router_bias=True, expert_proj_bias=True,
               expert_glu="clamped_swiglu", glu_alpha=1.702, glu_limit=7.0,
               rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_seq_len=16, beta_fast=32.0,
                                        beta_slow=1.0, truncate=False))


def _config(**changes) -> ColibriConfig:
    return ColibriConfig(name="gpt-oss-small", **{**GPT_OSS, **changes})


def test_clamped_swiglu_is_the_written_out_formula():
    glu = ExpertGlu("clamped_swiglu", 1.702, 7.0)
    gate = torch.tensor([-9.0, -1.0, 0.0, 0.5, 6.9, 7.0, 12.0])
    up = torch.tensor([-12.0, -8.0, 0.0, 0.25, 7.5, -0.5, 3.0])
    g = torch.tensor([-9.0, -1.0, 0.0, 0.5, 6.9, 7.0, 7.0])  # clamped above only
    u = torch.tensor([-7.0, -7.0, 0.0, 0.25, 7.0, -0.5, 3.0])  # clamped both sides
    expected = g * (1 / (1 + torch.exp(-1.702 * g))) * (u + 1)
    torch.testing.assert_close(glu(gate, up), expected)
    torch.testing.assert_close(ExpertGlu()(gate, up), F.silu(gate) * up)


@torch.no_grad()
def test_grouped_experts_with_biases_match_the_reference_loop_and_a_per_token_formula():
    torch.manual_seed(0)
    experts = GroupedExperts(8, 64, 32, ExpertGlu("clamped_swiglu", 1.702, 7.0), bias=True)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.5)  # large enough that the clamp acts
    x = torch.randn(10, 64)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(10)])
    gates = torch.rand(10, 2)
    fast = experts(x, ids, gates)
    torch.testing.assert_close(fast, experts.reference_forward(x, ids, gates), atol=1e-5, rtol=1e-5)
    token, slot = 3, 1
    e = int(ids[token, slot])
    gate = x[token] @ experts.gate_proj[e].T + experts.gate_bias[e]
    up = x[token] @ experts.up_proj[e].T + experts.up_bias[e]
    assert float(gate.max()) > 7.0 or float(up.abs().max()) > 7.0  # the clamp is exercised
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    one = (g * torch.sigmoid(1.702 * g) * (u + 1)) @ experts.down_proj[e].T + experts.down_bias[e]
    other = ids[token, 1 - slot]
    expected = gates[token, slot] * one + gates[token, 1 - slot] * experts.reference_forward(
        x[token : token + 1], other.view(1, 1), torch.ones(1, 1))[0]
    torch.testing.assert_close(fast[token], expected, atol=1e-5, rtol=1e-5)


def test_router_bias_is_a_softmax_over_the_top_k_biased_logits():
    torch.manual_seed(1)
    router = Router(_config())
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = torch.randn(6, 64)
    ids, gates, _ = router(x, 2)
    logits = x @ router.weight.T + router.bias
    top, top_ids = logits.topk(2, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(gates, torch.softmax(top, dim=-1))


def test_schema_1_2_round_trips_names_its_tensors_and_counts_them():
    config = _config()
    assert config.to_dict()["schema_version"] == "1.2"
    assert ColibriConfig.from_json(config.to_json()) == config
    names = checkpoint_tensor_shapes(config)
    assert names["layers.0.attn.sinks"] == (4,) and names["layers.0.attn.o_proj.bias"] == (64,)
    assert names["layers.1.moe.router.bias"] == (8,)
    assert names["layers.1.moe.experts.gate_bias"] == (8, 32) and names["layers.1.moe.experts.down_bias"] == (8, 64)
    model = ColibriForCausalLM(config)
    assert count_params(config)["total_params"] == sum(p.numel() for p in model.parameters())


def test_configs_without_1_2_features_are_written_as_before():
    old = ColibriConfig(**{**GPT_OSS, "o_bias": False, "attn_sinks": False, "sliding_window": None, "sliding_layers": (),
                           "router_bias": False, "expert_proj_bias": False, "expert_glu": "swiglu",
                           "rope_scaling": RopeScaling(kind="linear", factor=2.0)})
    data = old.to_dict()
    assert data["schema_version"] == "1.1" and "attn_sinks" not in data and "expert_glu" not in data
    assert set(data["rope_scaling"]) == {"kind", "factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"}


@pytest.mark.parametrize(("change", "field"), [
    (dict(sliding_window=None), "sliding_layers"),
    (dict(sliding_layers=(0, 3)), "sliding_layers"),
    (dict(expert_glu="swiglu", glu_limit=5.0), "glu_alpha"),
    (dict(rope_scaling=dict(kind="yarn", factor=4.0)), "yarn needs"),
])
def test_invalid_1_2_settings_name_the_field(change, field):
    with pytest.raises(ValidationError, match=field):
        _config(**change)


def _naive_attention(q, k, v, window, sinks):
    """One query at a time, written out: scaled dot products over the causal (and windowed) keys,
    plus the sink logit, softmax, sink dropped."""
    B, H, T, D = q.shape
    groups = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                lo = 0 if window is None else max(0, i - window + 1)
                scores = [float(q[b, h, i] @ k[b, h // groups, j]) / math.sqrt(D) for j in range(lo, i + 1)]
                extra = [] if sinks is None else [float(sinks[h])]
                weights = torch.softmax(torch.tensor(scores + extra, dtype=torch.float64), 0)[: len(scores)]
                out[b, h, i] = sum(w * v[b, h // groups, j] for w, j in zip(weights.float(), range(lo, i + 1), strict=True))
    return out


@torch.no_grad()
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_sink_and_window_attention_match_the_written_out_softmax_in_prefill_and_decode(layer):
    torch.manual_seed(2)
    config = _config(rope_scaling=None)
    attn = ColibriForCausalLM(config).layers[layer].attn
    attn.sinks.normal_(std=2.0)
    x = torch.randn(2, 9, 64)
    positions = torch.arange(9)
    q = attn.rope(attn.q_proj(x).view(2, 9, 4, 16).transpose(1, 2), positions)
    k = attn.rope(attn.k_proj(x).view(2, 9, 2, 16).transpose(1, 2), positions)
    v = attn.v_proj(x).view(2, 9, 2, 16).transpose(1, 2)
    window = 4 if layer == 0 else None
    expected = attn.o_proj(_naive_attention(q, k, v, window, attn.sinks).transpose(1, 2).reshape(2, 9, 64))
    torch.testing.assert_close(attn(x, positions), expected, atol=1e-5, rtol=1e-5)
    from colibri_model.layers import KVCache

    cache = KVCache(config, 2, 16)  # prefill 5, then 4 decode steps: the window slides over the cache
    outs = [attn(x[:, :5], positions[:5], cache)]
    cache.length = 5
    for t in range(5, 9):
        outs.append(attn(x[:, t : t + 1], positions[t : t + 1], cache))
        cache.length += 1
    torch.testing.assert_close(torch.cat(outs, 1), expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_layers_without_sinks_or_window_keep_the_sdpa_path_bit_for_bit():
    torch.manual_seed(3)
    plain = _config(attn_sinks=False, sliding_window=None, sliding_layers=(), rope_scaling=None)
    attn = ColibriForCausalLM(plain).layers[0].attn
    x = torch.randn(1, 7, 64)
    q = attn.rope(attn.q_proj(x).view(1, 7, 4, 16).transpose(1, 2), torch.arange(7))
    k = attn.rope(attn.k_proj(x).view(1, 7, 2, 16).transpose(1, 2), torch.arange(7))
    v = attn.v_proj(x).view(1, 7, 2, 16).transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(attn(x, torch.arange(7)), attn.o_proj(sdpa.transpose(1, 2).reshape(1, 7, 64)))


def test_yarn_inverse_frequencies_and_attention_factor():
    from colibri_model.layers import rope_inv_freq

    scaling = RopeScaling(kind="yarn", factor=32.0, original_max_seq_len=16, beta_fast=32.0, beta_slow=1.0,
                          truncate=False)
    inv = rope_inv_freq(16, 150000.0, scaling)
    base = 1.0 / (150000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))

    def pair(rotations):  # written out: the pair index that turns `rotations` times over 16 positions
        return 16 * math.log(16 / (rotations * 2 * math.pi)) / (2 * math.log(150000.0))

    low, high = max(pair(32.0), 0), min(pair(1.0), 15)
    ramp = ((torch.arange(8, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    torch.testing.assert_close(inv, base * (1 - ramp) + base / 32 * ramp)
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(32) + 1)


def test_trainer_trains_the_gpt_oss_variant(train_three_steps):
    """The trainer trains these shapes too: the biases, sinks and router bias all receive updates."""
    records, moved = train_three_steps(_config(vocab_size=49152, rope_scaling=None))
    assert records[-1].step == 3 and all(math.isfinite(r.loss) for r in records[1:])
    assert {"layers.0.attn.sinks", "layers.0.attn.o_proj.bias", "layers.1.moe.router.bias",
            "layers.1.moe.experts.gate_bias", "layers.1.moe.experts.down_bias"} <= moved


@pytest.mark.parametrize("case", ["padded_batch", "packed_row"])
def test_padded_and_packed_rows_see_their_own_window_and_sinks(case):
    """test_attention_mask.py's padded batch (prefill + decode into a shared cache column) and
    packed row ([B, T, S] mask, positions restarting), on a model with sinks and a 4-position
    window: the window counts each row's positions, not the cache columns between them."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("attention_mask_tests", Path(__file__).with_name("test_attention_mask.py"))
    masks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(masks)
    torch.manual_seed(0)
    model = ColibriForCausalLM(_config(rope_scaling=None, max_seq_len=64)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                parameter.normal_(std=0.3)
    if case == "padded_batch":
        masks.test_a_padded_batch_gives_each_row_its_own_logits_in_prefill_and_decode(model)
    else:
        masks.test_a_per_query_mask_packs_two_sequences_in_one_row(model)


@torch.no_grad()
def test_a_cache_that_dropped_the_columns_before_the_window_gives_the_full_caches_logits():
    """`KVCache.first`: a sliding layer's storage may start after column 0 (colibri-stream's
    sessions drop what the window can no longer see). Attention still counts columns from 0, so
    decoding over the shortened storage gives the full cache's logits, with the padded batch's
    [B, S] mask too (test_model_mla.py: an MLA layer refuses a shortened cache)."""
    torch.manual_seed(0)
    model = ColibriForCausalLM(_config(rope_scaling=None)).eval()
    for name, parameter in model.named_parameters():
        if name.endswith("sinks"):
            parameter.normal_(std=0.5)
    ids = torch.randint(0, 256, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, 14:20] = False  # row 1: padding columns in the middle, as a padded batch decodes
    full, short = model.new_kv_cache(2, 32), model.new_kv_cache(2, 32)
    model(ids[:, :20], cache=full, attention_mask=mask[:, :20])
    # window 4 on layers 0 and 2: row 1's first decode query (position 14) sees positions 11-14,
    # its keys 11-13 at columns 11-13 (its padding sits after them): the most that may go is 11
    dropped = 11
    for layer in (0, 2):
        short.keys[layer][:, :, : 20 - dropped] = full.keys[layer][:, :, dropped:20]
        short.values[layer][:, :, : 20 - dropped] = full.values[layer][:, :, dropped:20]
        short.first[layer] = dropped
    short.keys[1][:, :, :20], short.values[1][:, :, :20] = full.keys[1][:, :, :20], full.values[1][:, :, :20]
    short.length = 20
    for step in range(20, 24):
        positions = torch.stack([torch.tensor([step]), torch.tensor([step - 6])])
        expected = model(ids[:, step : step + 1], cache=full, positions=positions, attention_mask=mask[:, : step + 1])
        got = model(ids[:, step : step + 1], cache=short, positions=positions, attention_mask=mask[:, : step + 1])
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert short.keys[0][:, :, : 24 - dropped].abs().sum() > 0 and short.first == [dropped, 0, dropped]


@pytest.mark.parametrize("mask_shape", ["[T, S]", "[B, 1, T, S]", "[B, H, T, S]"])
def test_sink_attention_groups_the_query_heads_of_a_kv_head(mask_shape):
    """`sink_attention` computes each query head against its KV head (h // groups) without
    repeating the keys: the same numbers as a loop over query heads, for every mask shape the
    docstring allows."""
    from colibri_model.attention_rules import sink_attention

    torch.manual_seed(4)
    B, H, kv_heads, T, S, D = 2, 8, 2, 5, 11, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    sinks = torch.randn(H)
    shape = {"[T, S]": (T, S), "[B, 1, T, S]": (B, 1, T, S), "[B, H, T, S]": (B, H, T, S)}[mask_shape]
    allowed = torch.rand(shape) > 0.4
    allowed[..., 0] = True
    full = allowed.expand(B, H, T, S)
    expected = torch.empty(B, H, T, D)
    for h in range(H):
        kv = h // (H // kv_heads)
        scores = (q[:, h] @ k[:, kv].transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(~full[:, h], float("-inf"))
        weights = torch.softmax(torch.cat([scores, sinks[h].expand(B, T, 1)], -1), -1)[..., :-1]
        expected[:, h] = weights @ v[:, kv]
    torch.testing.assert_close(sink_attention(q, k, v, allowed, sinks), expected, atol=1e-5, rtol=1e-5)
