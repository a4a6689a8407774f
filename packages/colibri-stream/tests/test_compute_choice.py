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
