"""Prefetch changes when experts are read, never what is computed; its counters add up."""

from __future__ import annotations

import torch
from colibri_stream import Engine, LayerCounters


def test_prefetch_on_same_tokens_and_counters(tiny, minimum_budget):
    prompt = list(range(900, 930))
    runs = {}
    for mode in ("off", "predict", "on"):
        base = minimum_budget(tiny[0], prefetch=mode)
        budget = base + 7 * Engine.plan(tiny[0], prefetch=mode).slot_bytes  # 8 of 48 experts: misses and evictions
        with Engine.open(tiny[0], ram_budget=budget, prefetch=mode) as eng:
            result = eng.generate(prompt, 24, stop_token_ids=[])
            runs[mode] = (result.token_ids, eng.stats.to_dict(), eng.budget)
            if mode == "on":  # every read a pass started is stored and counted when it returns
                assert not eng.cache.prefetcher._inflight
    off, predict, on = runs["off"], runs["predict"], runs["on"]
    assert off[0] == predict[0] == on[0]
    assert predict[1]["bytes_read"] == off[1]["bytes_read"]  # predicting reads nothing
    assert predict[1]["prefetch_issued"] == 0 and 0 < predict[1]["prefetch_accuracy"] <= 1
    assert predict[1]["prefetch_actual"] > 0
    stats = on[1]
    assert stats["prefetch_issued"] > 0 and stats["prefetch_used"] > 0
    assert stats["prefetch_used"] + stats["prefetch_wasted"] <= stats["prefetch_issued"]
    assert stats["prefetch"] == "on" and stats["prefetch_accuracy"] == predict[1]["prefetch_accuracy"]
    assert on[2].staging_bytes > off[2].staging_bytes  # worker buffers are in the budget


def test_prefetch_logits_match(tiny):
    ids = torch.arange(40, 90)
    with Engine.open(tiny[0], ram_budget="200MB", prefill_chunk=1) as eng:
        expected = eng.logits(ids)
    with Engine.open(tiny[0], ram_budget="200MB", prefetch="on", prefetch_threads=3, prefill_chunk=1) as eng:
        got = eng.logits(ids)
        assert eng.stats.prefetch_issued > 0
    assert torch.equal(got, expected)


def test_predictor_guesses_from_residual_plus_shared_with_next_layers_norm():
    """The hooks hand the predictor this layer's residual h and shared output; the guess is the
    next layer's router on the next layer's norm of h + shared(x), not on this layer's input."""
    from colibri_model import ColibriConfig, ColibriForCausalLM
    from colibri_stream.cache.prefetch import RoutingPredictor
    from colibri_stream.stats import StreamStats

    from .conftest import TINY

    torch.manual_seed(0)
    model = ColibriForCausalLM(ColibriConfig(**{**TINY, "n_experts": 64})).eval()
    with torch.no_grad():  # distinct norm gains, so using the wrong layer's norm would show
        for block in model.layers:
            block.ffn_norm.weight.uniform_(0.2, 3.0)
    blocks = {i: b for i, b in enumerate(model.layers) if b.is_moe}
    predictor = RoutingPredictor(blocks, top_k=1, stats=StreamStats(), prefetcher=None)
    this, following = blocks[1], blocks[2]
    h = torch.randn(1, 40, TINY["d_model"])
    positions = torch.arange(40)
    with torch.no_grad():
        after_attention = h + this.attn(this.attn_norm(h), positions)
        this(h, positions)  # the hooks see h (post-attention residual) and shared(x)
        x = this.ffn_norm(after_attention).reshape(40, -1)
        predictor.before_layer(1, x, [0])
        assert not predictor._residual  # the guess did not pose as layer 2's residual
        state = after_attention.reshape(40, -1) + this.moe.shared(x)
        expected, _, _ = following.moe.router(following.ffn_norm(state), 1)
        naive, _, _ = following.moe.router(x, 1)
    assert predictor._predicted[2] == set(torch.unique(expected).tolist())
    assert set(torch.unique(naive).tolist()) != set(torch.unique(expected).tolist())
    predictor.close()
    with torch.no_grad():
        this(h, positions)
    assert not predictor._residual and not predictor._shared  # hooks removed


def test_prefetch_auto_by_expert_size_budget_and_room(tiny, minimum_budget, monkeypatch):
    """"auto" (the default) is off for small experts; for large ones it is on, unless no CPU is
    free beyond torch's threads, the cache already holds every expert, or the budget has no room
    for the workers' buffers."""
    import colibri_stream.plan as plan_module

    with Engine.open(tiny[0], ram_budget="200MB") as eng:  # 16 KB-class test experts: off
        assert eng.stats.prefetch == "off" and eng.budget.staging_bytes == eng.container.blob_layout.blob_length
    monkeypatch.setattr(plan_module, "PREFETCH_AUTO_MIN_BLOB", 1)  # every expert counts as large
    monkeypatch.setattr(plan_module, "_spare_cpus", lambda device: 0)
    with Engine.open(tiny[0], ram_budget=minimum_budget(tiny[0], prefetch="on")) as eng:
        assert eng.stats.prefetch == "off"  # torch's threads use every CPU: workers would steal it
    monkeypatch.setattr(plan_module, "_spare_cpus", lambda device: 1)
    with_workers = minimum_budget(tiny[0], prefetch="on")
    without = minimum_budget(tiny[0], prefetch="off")
    assert with_workers > without
    with Engine.open(tiny[0], ram_budget=with_workers) as eng:
        assert eng.stats.prefetch == "on"
        eng.generate(list(range(900, 930)), 8, stop_token_ids=[])
        assert eng.stats.prefetch_issued > 0
    # no room for workers (and no projection may be mapped to make some): off, not an error
    with Engine.open(tiny[0], ram_budget=without, map_weights="off") as eng:
        assert eng.stats.prefetch == "off"
    with Engine.open(tiny[0], ram_budget="200MB") as eng:  # every expert fits: nothing to read ahead
        assert eng.budget.slots == eng.budget.total_experts and eng.stats.prefetch == "off"


def test_known_misses_read_ahead_change_nothing_but_timing(tiny, minimum_budget):
    """Prefill chunks need many experts per layer: the workers read the misses ahead, and yet
    hits, misses, evictions, bytes and the trace equal those of one-at-a-time reading."""
    prompt = list(range(300, 420))  # 4 chunks of 32 tokens: most of a layer's 16 experts each
    runs = {}
    for mode in ("off", "on"):
        options = dict(prefetch=mode, prefetch_threads=2, prefill_chunk=32, record_trace=True, cache_policy="lru")
        base = minimum_budget(tiny[0], **options)
        budget = base + 9 * Engine.plan(tiny[0], **options).slot_bytes  # 10 of 48 experts: evictions inside a layer
        with Engine.open(tiny[0], ram_budget=budget, **options) as eng:
            if mode == "on":
                for backend in eng.model.moe_layers():  # no guesses: only the known misses are read ahead
                    backend.experts.predictor.prefetcher = None
            logits = eng.logits(prompt)
            s = eng.stats
            runs[mode] = (logits, s.hits, s.misses, s.evictions, s.bytes_read, list(s.trace))
            if mode == "on":
                prefetcher = eng.cache.prefetcher
                assert prefetcher.needed_issued > 20 and s.prefetch_issued == 0
                assert not prefetcher._inflight and not prefetcher._needed
    off, on = runs["off"], runs["on"]
    assert torch.equal(on[0], off[0])
    assert on[1:] == off[1:] and off[3] > 0


def test_per_layer_prefetch_accuracy_adds_up(tiny):
    assert LayerCounters().prefetch_accuracy == 0.0  # raised AttributeError: no such counters
    assert LayerCounters(prefetch_actual=4, prefetch_correct=3).prefetch_accuracy == 0.75
    with Engine.open(tiny[0], ram_budget="200MB", prefetch="predict") as eng:
        eng.generate(list(range(900, 912)), 4, stop_token_ids=[])
        stats, layers = eng.stats, list(eng.stats.layers.values())
        assert sum(c.prefetch_actual for c in layers) == stats.prefetch_actual > 0
        assert sum(c.prefetch_correct for c in layers) == stats.prefetch_correct
        assert all(0 <= c.prefetch_accuracy <= 1 for c in layers)
        out = stats.to_dict()  # and the per-layer figures reach the JSON (they did not in stats 1.0)
        assert sum(c["prefetch_actual"] for c in out["per_layer"].values()) == out["prefetch_actual"]
        assert sum(c["prefetch_correct"] for c in out["per_layer"].values()) == out["prefetch_correct"]
