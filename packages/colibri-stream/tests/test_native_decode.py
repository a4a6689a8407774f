"""The decode fast paths against colibri-model's own: the C pieces on random data, whole layers on
every case the engine meets, the cases they must leave to colibri-model, and the engine."""

from __future__ import annotations

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_model import Attention, Block, ColibriConfig, KVCache, RMSNorm, Router
from colibri_model.layers import RotaryEmbedding
from colibri_stream import Engine
from colibri_stream.compute import native_kernel
from colibri_stream.compute.native_decode import (
    NativeDecodeAttention,
    NativeDecodeBlock,
    NativeRowNorm,
    RowwiseRouter,
    install_decode_paths,
)
from colibri_stream.compute.native_kernel import (
    add_weighted_rows,
    attend_row,
    decode_layer_front,
    kernel_unavailable,
    norm_rope,
    rms_norm,
    route_row,
)
from colibri_stream.session_kv import SessionKV

from .conftest import build_container
from .test_native_kernel import assert_near_reference

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


def test_rms_norm_of_one_row_is_colibri_models():
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(1024, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(1024, generator=gen) + 0.5)
    x = torch.randn(1, 1, 1024, generator=gen) * 4
    torch.testing.assert_close(rms_norm(x.reshape(-1), norm), norm(x).reshape(-1), rtol=1e-6, atol=1e-6)
    fast = RMSNorm(1024, 1e-5)
    fast.load_state_dict(norm.state_dict())
    fast.__class__ = NativeRowNorm
    torch.testing.assert_close(fast(x), norm(x), rtol=1e-6, atol=1e-6)
    rows = torch.randn(2, 3, 1024, generator=gen)  # more than one row: colibri-model's own, same bits
    assert torch.equal(fast(rows), norm(rows))


def test_weighted_rows_add_up_as_torch_does_one_after_another():
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(8, 1000, generator=gen)
    weights = torch.rand(8, generator=gen)
    expected = torch.randn(1000, generator=gen)
    got = expected.clone()
    for y, w in zip(rows, weights):
        expected += y * w
    add_weighted_rows(got, rows, weights.tolist())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("changes", [{}, {"router_score": "softmax", "route_norm": False},
                                     {"router_bias": True, "route_scale": 2.5}, {"selection_bias": False},
                                     {"route_norm": False, "router_score": "softmax", "router_bias": True}])
def test_a_row_routed_in_c_picks_colibri_models_experts_with_its_gates(changes):
    """colibri_route_row against colibri-model's Router on 64 random rows: the same experts in the
    same order, gates and scores to f32 rounding (the logits are summed in another order)."""
    config = _config(n_dense_layers=0, n_experts=16, top_k_infer=4, **changes)
    gen = torch.Generator().manual_seed(5)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.1)
        if router.bias is not None:
            router.bias.copy_(torch.randn(16, generator=gen) * 0.1)
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(16, generator=gen) * 0.05)
    router.count_tokens = False
    x = torch.randn(64, config.d_model, generator=gen)
    ids, gates, scores = router(x, 4)
    for row in range(64):
        got = route_row(x[row], router.weight.detach(), None if router.bias is None else router.bias.detach(),
                        router.expert_bias, 4, config.router_score == "softmax", config.route_norm, config.route_scale)
        assert torch.equal(got[0][0], ids[row])
        torch.testing.assert_close(got[1][0], gates[row], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2][0], scores[row], rtol=1e-5, atol=1e-6)
    # the row-wise router takes the C call for one row and for each of a few, with the same result
    router.__class__ = RowwiseRouter
    assert router._native_routing(x[:1])
    one = [router(x[i : i + 1], 4) for i in range(5)]
    few = router(x[:5], 4)
    assert all(torch.equal(torch.cat([o[j] for o in one]), few[j]) for j in range(3))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 4, 64), (8, 8, 128), (6, 2, 40), (4, 1, 8)])
@pytest.mark.parametrize("columns", [1, 7, 72, 300])
def test_one_rows_attention_is_sdpas_over_a_caches_first_columns(heads, kv_heads, dim, columns):
    """attention.c against torch's SDPA with grouped heads, over the first columns of a larger
    cache (strided views, as a session's cache hands them), keys scaled up so that the softmax is
    far from uniform; each row of several is what it is alone."""
    torch.manual_seed(columns + dim)
    keys = (torch.randn(1, kv_heads, columns + 9, dim) * 3)[:, :, :columns]
    values = torch.randn(1, kv_heads, columns + 9, dim)[:, :, :columns]
    q = torch.randn(heads, dim)
    out = torch.empty(heads, dim)
    attend_row(q, keys, values, out)
    expected = torch.nn.functional.scaled_dot_product_attention(q.view(1, heads, 1, dim), keys, values,
                                                                enable_gqa=True)
    torch.testing.assert_close(out, expected.view(heads, dim), rtol=2e-6, atol=2e-6)
    rows = torch.empty(3, heads * dim)
    for row in range(3):
        attend_row(q, keys, values, rows[row].view(heads, dim))
    assert all(torch.equal(rows[row].view(heads, dim), out) for row in range(3))
    for level in range(native_kernel.cpu_level() + 1):  # the baseline build and the vector one: the same bits
        at_level = torch.empty(heads, dim)
        attend_row(q, keys, values, at_level, level=level)
        assert torch.equal(at_level, out), level
    threads = torch.get_num_threads()
    try:  # the key/value heads shared out among threads: each head whole on one, the same bits
        for count in (2, 3):
            torch.set_num_threads(count)
            for level in range(native_kernel.cpu_level() + 1):
                shared = torch.empty(heads, dim)
                attend_row(q, keys, values, shared, level=level)
                assert torch.equal(shared, out), (count, level)
    finally:
        torch.set_num_threads(threads)


def test_attend_row_refuses_what_does_not_fit_with_the_shapes():
    q, cache = torch.zeros(8, 32), torch.zeros(1, 2, 5, 32)
    with pytest.raises(ValueError, match=r"query torch.float32 \(8, 32\) does not fit keys torch.float32 "
                                         r"\(1, 2, 5, 32\), values \(1, 2, 5, 16\)"):
        attend_row(q, cache, torch.zeros(1, 2, 5, 16), torch.zeros(8, 32))
    with pytest.raises(ValueError, match=r"does not fit keys torch.float32 \(1, 3, 5, 32\)"):
        attend_row(q, torch.zeros(1, 3, 5, 32), torch.zeros(1, 3, 5, 32), torch.zeros(8, 32))  # 8 heads over 3
    with pytest.raises(ValueError, match=r"refused heads of 12 \(a multiple of 8 up to 1024\) over 5 columns"):
        attend_row(torch.zeros(8, 12), torch.zeros(1, 2, 5, 12), torch.zeros(1, 2, 5, 12), torch.zeros(8, 12))
    with pytest.raises(ValueError, match=r"over 0 columns"):
        attend_row(q, torch.zeros(1, 2, 0, 32), torch.zeros(1, 2, 0, 32), torch.zeros(8, 32))


def test_a_router_the_c_call_does_not_cover_routes_as_colibri_models():
    config = _config(n_dense_layers=0, n_experts=16, router_groups=4, router_topk_groups=2)
    router = Router(config)
    torch.nn.init.normal_(router.weight, std=0.1)
    router.__class__ = RowwiseRouter
    x = torch.randn(3, config.d_model)
    assert not router._native_routing(x)  # expert groups, and token counts kept
    expected = [Router.forward(router, x[i : i + 1], 2) for i in range(3)]  # each row alone, in torch
    assert all(torch.equal(a, torch.cat([e[j] for e in expected])) for j, a in enumerate(router(x, 2)))


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match=r"multiple of 8 .* got torch.float32 \(2, 12\)"):
        norm_rope(torch.randn(2, 12), None, torch.ones(12), torch.zeros(12))
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(2, 16\)"):
        norm_rope(torch.randn(2, 16, dtype=torch.bfloat16), None, torch.ones(16), torch.zeros(16))
    with pytest.raises(ValueError, match=r"f32 rows \[3, D\], got torch.float32 \(4,\) and torch.float32 \(2, 4\)"):
        add_weighted_rows(torch.zeros(4), torch.zeros(2, 4), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"route_row: 12 columns \(a multiple of 8\) and top-3 of 4 experts"):
        route_row(torch.zeros(12), torch.zeros(4, 12), None, None, 3, False, True, 1.0)
    with pytest.raises(ValueError, match=r"route_row: a row \(16,\) does not fit a router \(4, 8\)"):
        route_row(torch.zeros(16), torch.zeros(4, 8), None, None, 2, False, True, 1.0)
    with pytest.raises(ValueError, match=r"top-5 of 4 experts"):
        route_row(torch.zeros(16), torch.zeros(4, 16), None, None, 5, False, True, 1.0)


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
    install_decode_paths(model, config)
    assert all(type(m) is Attention for m in model.modules() if isinstance(m, Attention))
    assert all(type(m) is NativeRowNorm for m in model.modules() if isinstance(m, RMSNorm))


def test_the_native_engine_decodes_as_before_with_the_fast_paths(tiny):
    """The engine's single-session decode takes the fast paths; its logits stay near the same
    engine's with colibri-model's attention and norms, token by token (an int8 activation rounding
    or a router near-tie may land the other way under another sum order: near, not equal)."""
    ids = list(range(3, 27))
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as eng:
        layers = [m for m in eng.model.modules() if isinstance(m, Attention)]
        norms = [m for m in eng.model.modules() if isinstance(m, RMSNorm)]
        assert layers and all(isinstance(m, NativeDecodeAttention) for m in layers)  # (row-wise too: step_combiner)
        assert norms and all(type(m) is NativeRowNorm for m in norms)
        runs = []
        for attention, norm in ((NativeDecodeAttention, NativeRowNorm), (Attention, RMSNorm)):
            for m in layers:
                m.__class__ = attention
            for m in norms:
                m.__class__ = norm
            session = eng.session()
            runs.append(torch.stack([session.append([t]).reshape(-1) for t in ids]))
    assert_near_reference(runs[0], runs[1])


@pytest.mark.parametrize("resident", ["int8", "int4"])
def test_a_decode_token_through_the_block_calls_is_bitwise_the_per_module_path(tmp_path, resident):
    """The two C calls of a layer's attention (NativeDecodeBlock) against the same engine's modules
    one by one, token after token: the same logits, bit for bit; and a forward hook on a module the
    calls stand in for (a prefetcher's, on the FFN norm) still runs."""
    path, _ = build_container(tmp_path, QuantScheme(group_size=64, resident_dtype=resident))
    ids = list(range(3, 27))
    with Engine.open(path, ram_budget="200MB", compute="native") as eng:
        blocks = list(eng.model.layers)
        assert blocks and all(type(b) is NativeDecodeBlock for b in blocks)
        runs = []
        for kind in (NativeDecodeBlock, Block):
            for b in blocks:
                b.__class__ = kind
            session = eng.session()
            runs.append(torch.stack([session.append([t]).reshape(-1) for t in ids]))
        assert all(b.__dict__["_decode_plan"] is not None for b in blocks)  # every layer took the calls
        assert torch.equal(runs[0], runs[1])
        for b in blocks:
            b.__class__ = NativeDecodeBlock
        seen = []
        handle = blocks[0].ffn_norm.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
        try:
            again = torch.stack([eng.session().append([t]).reshape(-1) for t in ids[:1]])
        finally:
            handle.remove()
        assert seen == [torch.Size([1, 1, eng.config.d_model])] and torch.equal(again, runs[0][:1])


def test_a_layer_up_to_its_experts_is_one_call_and_refuses_a_cache_that_does_not_fit(tiny):
    """A session's decode row takes each MoE layer's front (attention, cache write, routing) in one
    C call; a sliding layer's cache has no slot for it; a cache of another shape is refused by name."""
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as eng:
        session = eng.session()
        session.append([5, 6, 7])
        session.append([8])
        plans = [b.__dict__.get("_decode_plan") for b in eng.model.layers]
        moe_plans = [p for p, b in zip(plans, eng.model.layers) if p is not None and b.is_moe]
        assert moe_plans and all(p.routes for p in moe_plans)
        plan = moe_plans[0]
        d = eng.config.d_model
        cos, sin = plan.rope.at(0, "cpu")
        wrong = torch.zeros(1, plan.kv_heads + 1, 8, plan.dim)
        with pytest.raises(ValueError, match=rf"a cache torch.float32 \(1, {plan.kv_heads + 1}, 8, {plan.dim}\) "
                                             rf"does not take column 0 of {plan.kv_heads} heads"):
            decode_layer_front(plan.front, torch.zeros(d), cos, sin, wrong, wrong, 0, torch.empty(d),
                               torch.empty(d), 2, plan.route)
    kv = SessionKV.for_model(_config(sliding_window=4, sliding_layers=(0,)), 64, "cpu", torch.float32)
    assert [kv.decode_slot(layer) is None for layer in range(2)] == [True, False]


def test_cached_experts_run_inside_the_layers_call_and_every_use_is_still_counted(tiny):
    """At full RAM a decode row's experts run inside the layer's C call once their addresses are
    known: hits and misses still add up to every expert use, the expert time is still counted, and
    a cleared cache (its slots reused) sends rows back to the experts' own path with the same logits."""
    ids = list(range(40, 72))
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as eng:
        moe_layers = [b for b in eng.model.layers if b.is_moe]
        calls = []
        for block in moe_layers:
            experts = block.moe.experts
            experts.forward_row = (lambda original: lambda *a: calls.append(1) or original(*a))(experts.forward_row)
        session = eng.session()
        first = torch.stack([session.append([t]).reshape(-1) for t in ids])
        top_k = moe_layers[0].moe.top_k
        uses = len(moe_layers) * top_k * (len(ids) - 1)  # the first token is a prefill
        decode = eng.stats.hits + eng.stats.misses - len(moe_layers) * top_k
        assert decode == uses and eng.stats.compute_seconds > 0
        assert 0 < len(calls) < len(moe_layers) * (len(ids) - 1)  # most rows never reached forward_row
        assert all(b.moe.experts.token_table() is not None for b in moe_layers)
        eng.cache.clear()
        assert all(not any(b.moe.experts.token_table().slots) for b in moe_layers)
        again = torch.stack([eng.session().append([t]).reshape(-1) for t in ids[:1]])
        session = eng.session()
        second = torch.stack([session.append([t]).reshape(-1) for t in ids])
    assert torch.equal(first, second) and torch.equal(again, first[:1])
