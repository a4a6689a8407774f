"""The C decode attention against colibri-model's own: the pieces on random data, whole layers
on every case the engine meets, and the cases it must leave to colibri-model."""

from __future__ import annotations

import pytest
import torch
from colibri_model import Attention, ColibriConfig, KVCache
from colibri_model.layers import RMSNorm, RotaryEmbedding
from colibri_stream import Engine
from colibri_stream.compute.native_attention import NativeDecodeAttention, install_decode_attention
from colibri_stream.compute.native_kernel import kernel_unavailable, norm_rope
from colibri_stream.session_kv import SessionKV

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")


def _config(**changes) -> ColibriConfig:
    fields = dict(name="attn-test", vocab_size=64, d_model=128, n_layers=2, n_dense_layers=2, n_heads=8, n_kv_heads=2,
                  head_dim=32, dense_ffn_dim=64, n_experts=4, expert_dim=32, max_seq_len=512)
    return ColibriConfig(**{**fields, **changes})


@pytest.mark.parametrize("normed", [True, False])
def test_norm_rope_is_rmsnorm_then_the_rotation(normed):
    gen = torch.Generator().manual_seed(1)
    heads, dim = 5, 48
    rows = torch.randn(heads, dim, generator=gen) * 3
    norm = RMSNorm(dim, 1e-6) if normed else None
    if norm is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    rope = RotaryEmbedding(dim, 10000.0, 256)
    expected = rows.clone() if norm is None else norm(rows.clone())
    expected = rope(expected[None, :, None], torch.tensor([37]))[0, :, 0]
    got = rows.clone()
    norm_rope(got, norm, *rope.at(37))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match=r"multiple of 8 .* got torch.float32 \(2, 12\)"):
        norm_rope(torch.randn(2, 12), None, torch.ones(12), torch.zeros(12))
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(2, 16\)"):
        norm_rope(torch.randn(2, 16, dtype=torch.bfloat16), None, torch.ones(16), torch.zeros(16))


@pytest.mark.parametrize("changes, steps", [({}, 12), ({"qk_norm": False}, 12),
                                           ({"qkv_bias": True, "o_bias": True}, 12), ({}, 120)])
def test_a_layer_decodes_as_colibri_models_attention_token_after_token(changes, steps):
    """Prefill 20 tokens with colibri-model's forward, then single tokens (120: past the session
    cache's regrowth at 64 and 128 columns): the fast path against the reference on twin caches."""
    torch.manual_seed(0)
    config = _config(**changes)
    reference = Attention(config, 0).eval()
    native = Attention(config, 0).eval()
    native.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for p in list(reference.parameters()):
            p.add_(torch.randn_like(p) * 0.05)
        native.load_state_dict(reference.state_dict())
    native.__class__ = NativeDecodeAttention
    caches = [SessionKV.for_model(config, 512, "cpu", torch.float32) for _ in range(2)]
    prompt = torch.randn(1, 20, config.d_model)
    with torch.inference_mode():
        for cache, layer in zip(caches, (reference, native)):
            cache.reserve(20)
            layer(prompt, torch.arange(20), cache)  # a prefill: colibri-model's forward on both
            cache.length = 20
        for step in range(steps):
            x = torch.randn(1, 1, config.d_model)
            pos = torch.tensor([20 + step])
            outs = []
            for cache, layer in zip(caches, (reference, native)):
                cache.reserve(cache.length + 1)
                outs.append(layer(x, pos, cache))
                cache.length += 1
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].keys[0][:, :, :32], caches[0].keys[0][:, :, :32], rtol=1e-5, atol=1e-5)


def test_every_other_case_is_colibri_models_forward_bit_for_bit():
    """Batches, masks, prefill chunks and a model-side KVCache of two rows take the reference
    code itself: the same bits."""
    torch.manual_seed(2)
    config = _config()
    reference = Attention(config, 0).eval()
    native = Attention(config, 0).eval()
    native.load_state_dict(reference.state_dict())
    native.__class__ = NativeDecodeAttention
    with torch.inference_mode():
        x = torch.randn(2, 5, config.d_model)
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 3:] = False
        for kwargs in ({}, {"attention_mask": mask}):
            caches = [KVCache(config, 2, 16) for _ in range(2)]
            a = reference(x, torch.arange(5), caches[0], **kwargs)
            b = native(x, torch.arange(5), caches[1], **kwargs)
            assert torch.equal(a, b)
        # one token of one row, but without a cache (a training-style forward): the reference
        one = torch.randn(1, 1, config.d_model)
        assert torch.equal(reference(one, torch.tensor([0])), native(one, torch.tensor([0])))


@pytest.mark.parametrize("changes", [{"attn_sinks": True}, {"qk_norm_scope": "projection"},
                                     {"rope_interleave": True}, {"head_dim": 36}])
def test_layers_the_c_path_does_not_cover_keep_their_class(changes):
    from colibri_model import ColibriForCausalLM

    config = _config(**changes)
    with torch.device("meta"):
        model = ColibriForCausalLM(config)
    assert install_decode_attention(model, config) == 0
    assert all(type(m) is Attention for m in model.modules() if isinstance(m, Attention))


def test_the_native_engine_decodes_as_before_with_the_c_attention(tiny):
    """The engine's single-session decode takes the C path; its logits stay within float
    rounding of the same engine with colibri-model's attention (at most an int8 activation
    rounding apart, so near, not equal), token by token."""
    ids = list(range(3, 27))
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as eng:
        layers = [m for m in eng.model.modules() if isinstance(m, Attention)]
        assert layers and all(type(m) is NativeDecodeAttention for m in layers)
        runs = []
        for cls in (NativeDecodeAttention, Attention):
            for m in layers:
                m.__class__ = cls
            session = eng.session()
            runs.append(torch.stack([session.append([t]).reshape(-1) for t in ids]))
    scale = runs[1].abs().max()
    assert float((runs[0] - runs[1]).abs().max()) <= 1e-3 * float(scale)
    assert (runs[0].argmax(-1) == runs[1].argmax(-1)).float().mean() >= 0.9
