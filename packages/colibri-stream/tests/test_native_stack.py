"""A decode token's layers in one C call (compute/native_stack.py) against the per-layer path it
replaces: the same logits bit for bit and the same counts, whichever layers the call runs (routed
experts, a dense layer's FFN, a shared expert, a model without experts) and whichever must leave it
(an expert not cached, a gated shared expert, a hook), and the cases it leaves alone."""

from __future__ import annotations

import ctypes

import pytest
import torch
from colibri_int4 import QuantScheme
from colibri_stream import Engine
from colibri_stream.compute import native_kernel
from colibri_stream.compute.native_decode import NativeDecodeBlock
from colibri_stream.compute.native_kernel import DecodeLayer, decode_layers, kernel_unavailable
from colibri_stream.compute.native_stack import NativeDecodeModel

from .conftest import build_container

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")

PROMPT = list(range(5, 60))
TOKENS = list(range(60, 80))  # the cache grows past its first 64 columns on the way: new storage


@pytest.fixture(scope="module")
def routed_only(tmp_path_factory):
    """Every layer a routed MoE layer without a shared expert (Qwen3-MoE's shape): all in the call."""
    return build_container(tmp_path_factory.mktemp("routed"), QuantScheme(group_size=32, resident_dtype="int4"),
                           seed=2, n_dense_layers=0, shared_expert_dim=0)[0]


@pytest.fixture(scope="module")
def dense_only(tmp_path_factory):
    """A model without routed experts (SmolLM2's or Llama's shape): every layer a dense swiglu."""
    return build_container(tmp_path_factory.mktemp("dense"), QuantScheme(group_size=32, resident_dtype="int8"),
                           seed=3, n_dense_layers=4, n_experts=0, expert_dim=0, shared_expert_dim=0)[0]


def _decode(eng: Engine, stack: bool, calls: list | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """Logits of PROMPT then TOKENS one by one in a fresh session, with the stack on or off."""
    model = eng.model
    if stack:
        model.__dict__.pop("_decode_stack", None)
    else:
        model.__dict__["_decode_stack"] = None
    session = eng.session()
    session.append(PROMPT)
    logits = torch.stack([session.append([t]).reshape(-1) for t in TOKENS])
    return logits, (eng.stats.hits, eng.stats.misses)


def _counting_calls(monkeypatch) -> list:
    calls = []
    library = native_kernel._library()
    original = library.colibri_decode_layers

    def counted(*args):
        calls.append((args[1], args[2]))  # first, end
        return original(*args)

    monkeypatch.setattr(library, "colibri_decode_layers", counted)
    return calls


@pytest.mark.parametrize("slots", [None, 6])
def test_the_stack_gives_the_per_layer_paths_bits_and_counts(tiny, routed_only, slots, minimum_budget,
                                                             monkeypatch):
    """Token after token, with every expert cached (the call runs them) and with a budget of a few
    experts (misses stop the call at the layer that needs a read): the same logits, hits and misses
    as the per-layer path, on a model with a dense layer and shared experts (which leave the call)
    and on one whose every layer stays in it."""
    for path in (tiny[0], routed_only):
        budget = "200MB"
        if slots is not None:
            budget = minimum_budget(path, compute="native") + slots * Engine.plan(path, compute="native").slot_bytes
        runs = []
        for stack in (True, False):  # an engine each: the cache policy's state starts afresh
            with Engine.open(path, ram_budget=budget, compute="native") as eng:
                assert slots is None or eng.budget.slots < eng.budget.total_experts
                assert type(eng.model) is NativeDecodeModel
                calls = _counting_calls(monkeypatch)
                runs.append(_decode(eng, stack))
                assert bool(calls) == stack
                monkeypatch.undo()
        (stacked, stacked_counts), (per_layer, per_layer_counts) = runs
        assert torch.equal(stacked, per_layer)
        assert stacked_counts == per_layer_counts


def test_a_model_whose_experts_are_all_cached_runs_every_layer_in_one_call(routed_only, monkeypatch):
    """With every layer routed, no shared expert and every expert cached, a decode token is one call
    over all the layers."""
    with Engine.open(routed_only, ram_budget="200MB", compute="native") as eng:
        session = eng.session()
        session.append(PROMPT)
        for t in TOKENS[:4]:  # every expert the next tokens use gets read and its address kept
            session.append([t])
        for _ in range(3):  # until the routed experts seen cover a token
            calls = _counting_calls(monkeypatch)
            session.append([TOKENS[5]])
            monkeypatch.undo()
        layers = eng.config.n_layers
        assert calls == [(0, layers)]


def test_dense_layers_and_shared_experts_run_in_the_call(tiny, monkeypatch):
    """NanoColibri's shape (a dense first layer, a shared expert beside the routed ones): once the
    routed experts a token takes are cached, the token is one call over every layer."""
    with Engine.open(tiny[0], ram_budget="200MB", compute="native") as eng:
        assert type(eng.model.layers[0].ffn).__name__ == "NativeSwiGLU"
        session = eng.session()
        session.append(PROMPT)
        for t in TOKENS[:4]:
            session.append([t])
        for _ in range(3):
            calls = _counting_calls(monkeypatch)
            session.append([TOKENS[5]])
            monkeypatch.undo()
        assert calls == [(0, eng.config.n_layers)]


def test_a_model_without_experts_runs_native_in_one_call_with_the_per_layer_bits(dense_only, monkeypatch):
    """A dense model takes the native route (its projections as stored, no expert slab) and a decode
    token is one call, with the per-layer path's logits bit for bit."""
    runs = []
    for stack in (True, False):
        with Engine.open(dense_only, ram_budget="200MB", compute="native") as eng:
            assert eng.opened_plan.footprint.compute == "native" and eng.budget.slots == 0
            assert type(eng.model) is NativeDecodeModel
            calls = _counting_calls(monkeypatch)
            runs.append(_decode(eng, stack)[0])
            monkeypatch.undo()
            if stack:
                assert calls == [(0, eng.config.n_layers)] * len(TOKENS)
            else:
                assert calls == []
    assert torch.equal(runs[0], runs[1])


def test_a_hooked_block_runs_as_its_module_and_the_rest_stay_in_the_call(routed_only, monkeypatch):
    """A forward hook on one block: that block runs as its module (the hook sees its input), the
    layers around it in the call, with the same logits."""
    with Engine.open(routed_only, ram_budget="200MB", compute="native") as eng:
        plain, _ = _decode(eng, stack=True)
        seen = []
        handle = eng.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output.shape))
        try:
            calls = _counting_calls(monkeypatch)
            hooked, _ = _decode(eng, stack=True)
        finally:
            handle.remove()
    assert torch.equal(plain, hooked)
    assert len(seen) == len(TOKENS) + 1  # the prompt and every token
    assert (0, 1) in calls and all(first != 1 for first, _ in calls)


def test_what_the_stack_does_not_take_runs_colibri_models_forward(routed_only, monkeypatch):
    """Prefill, a batch row, a per-layer block class: the call never runs."""
    with Engine.open(routed_only, ram_budget="200MB", compute="native") as eng:
        calls = _counting_calls(monkeypatch)
        session = eng.session()
        session.append(PROMPT)  # prefill
        session.append([7, 8])  # two tokens
        assert calls == []
        for block in eng.model.layers:
            block.__class__ = NativeDecodeBlock.__mro__[1]  # colibri-model's Block
        session.append([9])
        assert calls == []


def test_the_call_refuses_a_range_outside_its_layers():
    layers = (DecodeLayer * 2)()
    h = torch.zeros(8)
    with pytest.raises(ValueError, match="layers 1..3 of 2"):
        decode_layers(layers, 1, 3, 0, h, h.clone(), h.clone(), ctypes.c_int64())
