"""compute="auto" follows what was timed on this machine, and the timing itself is sound."""

from __future__ import annotations

import pytest
import torch
from colibri_int4 import Container
from colibri_stream import Engine
from colibri_stream.compute import choice as compute_choice
from colibri_stream.compute.choice import (
    DEQUANT_MARGIN,
    MIN_SHAPE,
    NATIVE_MARGIN,
    ComputeTiming,
    time_compute,
)
from colibri_stream.compute.native_kernel import kernel_unavailable

needs_kernel = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no CPU int4 kernels"
)


def test_dequant_only_when_clearly_faster():
    assert ComputeTiming(1e-3, 1e-3, "AVX2", 1, MIN_SHAPE).choice == "int4"  # equal: int4 holds fewer bytes
    assert ComputeTiming(1e-3, 1e-3 / (DEQUANT_MARGIN * 0.9), "AVX2", 1, MIN_SHAPE).choice == "int4"
    assert ComputeTiming(1e-3, 1e-3 / DEQUANT_MARGIN, "DEFAULT", 1, MIN_SHAPE).choice == "dequant"


def test_native_unless_torch_is_clearly_faster():
    # the native kernel saves the repack of every miss, so it wins ties and small losses
    assert ComputeTiming(1e-3, 2e-3, "AVX2", 1, MIN_SHAPE, native_seconds=1e-3 * NATIVE_MARGIN).choice == "native"
    assert ComputeTiming(1e-3, 2e-3, "AVX2", 1, MIN_SHAPE, native_seconds=1e-3 * NATIVE_MARGIN * 1.1).choice == "int4"
    assert ComputeTiming(1e-3, 1e-4, "DEFAULT", 1, MIN_SHAPE, native_seconds=1e-3).choice == "dequant"


@needs_kernel
def test_timing_is_measured_once_on_at_least_nano_shapes():
    first = time_compute(64, 32, torch.float32, torch.bfloat16)
    assert first.int4_seconds > 0 and first.dequant_seconds > 0 and first.shape == MIN_SHAPE
    assert first.capability == torch.backends.cpu.get_cpu_capability()
    assert time_compute(64, 32, torch.float32, torch.bfloat16) is first
    assert time_compute(1536, 768, torch.float32, torch.bfloat16).shape == (1536, 768)


@needs_kernel
@pytest.mark.parametrize("int4_seconds, expected", [(1e-3, "int4-bf16"), (1.0, "dequant")])
def test_auto_takes_the_timed_choice(tiny, monkeypatch, int4_seconds, expected):
    monkeypatch.setattr(compute_choice, "_timings", {})
    monkeypatch.setattr(compute_choice, "_best_seconds", lambda routes: {"int4": int4_seconds, "dequant": 1e-3})
    with Engine.open(tiny[0], ram_budget="200MB", compute="auto") as eng:
        assert eng.stats.compute_mode == expected
    with Engine.open(tiny[0], ram_budget="200MB", compute="int4") as eng:  # asked for: never timed away
        assert eng.stats.compute_mode == "int4-bf16"


@needs_kernel
def test_auto_on_this_machine_agrees_with_its_timing(tiny):
    with Container.open(tiny[0]) as container:
        config = container.header.config
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        native = kernel_unavailable() is None
        timing = time_compute(config["d_model"], config["expert_dim"], torch.float32, torch.bfloat16, native)
        assert eng.stats.compute_mode.startswith(timing.choice)
        print(timing)


def _no_timing(*args, **kwargs):
    raise AssertionError("a kernel was timed")


def test_building_a_plan_times_no_kernel(tiny, monkeypatch):
    """make_plan takes the routes resolved before it (resolve_compute): with compute="auto" and
    every timing function refusing to run, the plan still builds, on the routes it was given."""
    from colibri_stream.compute.choice import ComputeRoutes
    from colibri_stream.options import EngineOptions
    from colibri_stream.plan import make_plan, plan_dtypes

    monkeypatch.setattr(compute_choice, "_timings", {})
    monkeypatch.setattr(compute_choice, "time_compute", _no_timing)
    monkeypatch.setattr(compute_choice, "_best_seconds", _no_timing)
    opts = EngineOptions(compute="auto")
    assert plan_dtypes(opts) == (torch.float32, torch.bfloat16)
    with Container.open(tiny[0]) as container:
        for route in ("native", "int4", "dequant"):
            routes = ComputeRoutes(dict.fromkeys(plan_dtypes(opts), route))
            plan = make_plan(container, opts, 200 << 20, compute=routes)
            assert plan.footprint.compute == route
        with pytest.raises(ValueError, match="no compute route was resolved for dtype bfloat16"):
            make_plan(container, EngineOptions(dtype="bf16"), compute=ComputeRoutes({torch.float32: "int4"}))


@needs_kernel
@pytest.mark.parametrize("timed, expected", [({"int4": 1e-3, "dequant": 1e-3}, "int4"),
                                             ({"int4": 1.0, "dequant": 1e-3}, "dequant")])
def test_open_and_plan_resolve_auto_once_per_dtype_before_the_plan(tiny, monkeypatch, timed, expected):
    """Engine.open / Engine.plan time compute="auto" before the plan, once per dtype the plan may
    size (f32 and bf16 when dtype is unset), and follow the timed choice as they always did."""
    from colibri_stream import plan as plan_module

    calls = []
    real = compute_choice.time_compute

    def counted(d_model, expert_dim, dtype, kernel_dtype, native=False):
        calls.append(dtype)
        return real(d_model, expert_dim, dtype, kernel_dtype, native)

    building = []
    real_make_plan = plan_module.make_plan

    def make_plan(*args, **kwargs):
        building.append(len(calls))
        return real_make_plan(*args, **kwargs)

    monkeypatch.setattr(compute_choice, "_timings", {})
    monkeypatch.setattr(compute_choice, "_best_seconds", lambda routes: dict(timed))
    monkeypatch.setattr(compute_choice, "time_compute", counted)
    monkeypatch.setattr("colibri_stream.assembly.make_plan", make_plan)
    plan = Engine.plan(tiny[0], "200MB")
    assert plan.footprint.compute == expected and sorted(map(str, calls)) == ["torch.bfloat16", "torch.float32"]
    assert building == [2]  # both timed before the plan was built, none while it was
    calls.clear()
    with Engine.open(tiny[0], ram_budget="200MB", compute="auto") as eng:
        assert eng.opened_plan.footprint.compute == expected and len(calls) == 2
        assert eng.stats.compute_mode == ("int4-bf16" if expected == "int4" else expected)
    calls.clear()
    assert Engine.plan(tiny[0], dtype="bf16").footprint.compute == expected and calls == [torch.bfloat16]
    calls.clear()
    assert Engine.plan(tiny[0], compute="int4").footprint.compute == "int4" and calls == []  # asked for: never timed


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """A model without routed experts (every layer a dense swiglu)."""
    from colibri_int4 import QuantScheme

    from .conftest import build_container

    return build_container(tmp_path_factory.mktemp("dense"), QuantScheme(group_size=32, resident_dtype="int8"),
                           n_dense_layers=4, n_experts=0, expert_dim=0, shared_expert_dim=0)[0]


@pytest.mark.skipif(kernel_unavailable() is not None, reason="no C compiler for the native kernel")
@pytest.mark.parametrize("native_seconds, expected", [(1e-3, "native"), (1.0, "dequant")])
def test_a_model_without_experts_takes_the_native_route_where_it_is_timed_fast(dense_model, monkeypatch,
                                                                               native_seconds, expected):
    """No expert blobs to choose a kernel for: the native kernel (projections as stored) or the
    dequantized model, by the same timing; asked for, each is what it says."""
    def timed(routes):
        assert set(routes) == {"dequant", "native"}  # no int4 kernel to time (nor to need in this torch)
        return {"dequant": 1e-3, "native": native_seconds * 8}

    monkeypatch.setattr(compute_choice, "_timings", {})
    monkeypatch.setattr(compute_choice, "_best_seconds", timed)
    for compute, mode in (("auto", expected), ("native", "native"), ("dequant", "dequant")):
        with Engine.open(dense_model, ram_budget="200MB", compute=compute) as eng:
            assert eng.opened_plan.footprint.compute == mode, compute
            held = {type(eng.model.layers[0].attn.q_proj).__name__}
            assert held == ({"NativeLinear"} if mode == "native" else {"Linear"})
    with pytest.raises(ValueError, match="compute='int4' is not possible: the model has no routed experts"):
        Engine.open(dense_model, ram_budget="200MB", compute="int4")
