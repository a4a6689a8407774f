"""int8 routed experts (`--quant int8`) on the native kernel: chosen by "auto", computed from the
container's q8 bytes, sized by the plan exactly, the same tokens at any budget, and each row of a
group of tokens what it gets alone."""

from __future__ import annotations

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.compute.native_expert import NativeQ8Expert
from colibri_stream.compute.native_kernel import QuantizedActivations, add_weighted_rows, kernel_unavailable

from .conftest import build_container

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")

IDS = torch.arange(3, 43)


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("q8"), QuantScheme(group_size=32, expert_dtype="int8"), seed=4)[0]


def _prepared(eng: Engine) -> list:
    return [eng.cache.get(layer, expert) for layer, expert in [(1, 0), (1, 3), (2, 5)]]


def test_auto_runs_int8_experts_natively_and_the_plan_counts_their_bytes(tiny_q8):
    plan = Engine.plan(tiny_q8)
    assert plan.footprint.compute == "native"
    with Engine.open(tiny_q8, ram_budget="200MB") as eng:
        assert eng.stats.compute_mode == "native"
        experts = _prepared(eng)
        assert all(type(e) is NativeQ8Expert and e.gate_up.dtype == torch.int8 for e in experts)
        assert {e.nbytes for e in experts} == {plan.footprint.slot_bytes}
        native = eng.logits(IDS)
    with Engine.open(tiny_q8, ram_budget="200MB", compute="dequant") as eng:
        dequantized = eng.logits(IDS)
    # the same weights; the native kernel rounds its activations to int8 per 32 columns (measured:
    # 1.2% of the largest logit at every CPU level; near ties may then flip, so no argmax check)
    scale = float(dequantized.abs().max())
    assert float((native - dequantized).abs().max()) < 0.02 * scale


def test_the_same_tokens_at_a_budget_of_a_few_experts(tiny_q8, minimum_budget):
    prompt = IDS[:12].tolist()
    texts = []
    for budget in ("200MB", minimum_budget(tiny_q8, compute="native") + 3 * Engine.plan(tiny_q8).slot_bytes):
        with Engine.open(tiny_q8, ram_budget=budget) as eng:
            texts.append(eng.generate(prompt, 16, stop_token_ids=[]).token_ids)
            if budget != "200MB":
                assert eng.stats.misses > eng.budget.slots  # experts came and went
    assert texts[0] == texts[1]


def test_each_row_of_a_group_is_what_it_gets_alone(tiny_q8):
    with Engine.open(tiny_q8, ram_budget="200MB") as eng:
        experts = _prepared(eng)
        x = torch.randn(5, eng.config.d_model)
        rows = [[0, 2], [1], [3, 4, 0]]
        grouped = NativeQ8Expert.forward_grouped(experts, QuantizedActivations(x), rows)
        alone = torch.cat([e.forward(x[[r]]) for e, picked in zip(experts, rows) for r in picked])
        assert torch.equal(grouped, alone)
        each = NativeQ8Expert.forward_each(experts, QuantizedActivations(x[:1]))
        assert torch.equal(each, torch.cat([e.forward(x[:1]) for e in experts]))


def test_a_tokens_experts_in_one_call_are_each_expert_alone_summed(tiny_q8):
    with Engine.open(tiny_q8, ram_budget="200MB") as eng:
        experts = _prepared(eng)
        x = torch.randn(eng.config.d_model)
        weights = [0.5, 0.25, 0.125]
        one_call = torch.full((eng.config.d_model,), 0.1)
        assert NativeQ8Expert.forward_token(experts, x, weights, one_call)
        summed = torch.full((eng.config.d_model,), 0.1)
        add_weighted_rows(summed, NativeQ8Expert.forward_each(experts, QuantizedActivations(x[None])), weights)
        assert torch.equal(one_call, summed)


def _recording(monkeypatch, library) -> tuple[list, list]:
    """The calls of the whole-token q8 experts, and the layer spans of the decode call."""
    ran, spans = [], []
    experts, layers = library.colibri_q8_token_experts, library.colibri_decode_layers
    monkeypatch.setattr(library, "colibri_q8_token_experts", lambda *a: ran.append(1) or experts(*a))
    monkeypatch.setattr(library, "colibri_decode_layers", lambda *a: spans.append(a[1:3]) or layers(*a))
    return ran, spans


def test_the_decode_call_runs_int8_experts_with_the_per_layer_bits(tiny_q8, monkeypatch):
    """Every cached q8 expert of a token run inside the one decode call: the logits of the per-layer
    path, bit for bit."""
    from colibri_stream.compute import native_kernel

    prompt, tokens = IDS[:20].tolist(), IDS[20:32].tolist()
    runs = []
    for stack in (True, False):
        with Engine.open(tiny_q8, ram_budget="200MB") as eng:
            if not stack:
                eng.model.__dict__["_decode_stack"] = None
            session = eng.session()
            session.append(prompt)
            ran, spans = _recording(monkeypatch, native_kernel._library())
            runs.append(torch.stack([session.append([t]).reshape(-1) for t in tokens]))
            monkeypatch.undo()
            assert ran  # the token's experts in one call, on both paths
            if stack:  # once the experts a token takes are cached, every layer in the one call
                assert (0, eng.config.n_layers) in spans
    assert torch.equal(runs[0], runs[1])
