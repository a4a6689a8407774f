"""Projections computed on the container's map (`map_weights`): what a budget too small to hold
them all runs with, the same bits as held ones, and refusals that name the floor."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from colibri_stream import BudgetError, Engine
from colibri_stream.cli import main
from colibri_stream.compute.native_linear import NativeLinear

NATIVE = dict(compute="native", dtype="f32", max_context=64, prefill_chunk=8, prefetch="off")


def _logits(engine: Engine) -> list[torch.Tensor]:
    session = engine.session()
    session.append([5, 17, 99, 3, 250, 41, 7, 8, 9, 10])
    out = [session.last_logits().clone()]
    for token in (12, 400, 33, 71):
        session.append([token])
        out.append(session.last_logits().clone())
    return out


def _mapped_modules(engine: Engine) -> list[str]:
    return [name for name, m in engine.model.named_modules() if isinstance(m, NativeLinear) and m.mapped]


def test_a_budget_below_every_held_projection_maps_the_fewest_from_the_last_layer_down(tiny):
    plan = Engine.plan(tiny[0], **NATIVE)
    assert plan.footprint.mapped_projections == () and plan.smallest_mapped_budget < plan.min_budget
    short = 3 * 4096  # a few KB under the minimum: the last layer's projections cover it
    mapped = Engine.plan(tiny[0], plan.min_budget - short, **NATIVE)
    names = mapped.footprint.mapped_projections
    assert names and all(n.startswith("layers.3.") for n in names)  # the tiny model's last layer
    assert mapped.min_budget <= plan.min_budget - short < mapped.min_budget + 4096 * len(names) + 4096
    assert mapped.footprint.resident_bytes < plan.footprint.resident_bytes
    assert mapped.footprint.mapped_bytes > plan.footprint.mapped_bytes
    assert any("projections mapped from the container" in step for step in mapped.degraded)
    assert mapped.to_dict()["mapped_projections"] == len(names)
    with Engine.open(tiny[0], plan.min_budget - short, **NATIVE) as small:
        assert sorted(_mapped_modules(small)) == sorted(n.removesuffix(".weight") for n in names)
        got = _logits(small)
    with Engine.open(tiny[0], "400MB", **NATIVE) as held:
        assert _mapped_modules(held) == []
        expected = _logits(held)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))  # row-major on the map, tiles in RAM: same bits


def test_all_maps_every_projection_with_the_same_bits(tiny):
    with Engine.open(tiny[0], "400MB", **NATIVE) as held:
        expected = _logits(held)
        resident = held.stats.resident_bytes
    with Engine.open(tiny[0], "400MB", map_weights="all", **NATIVE) as mapped:
        plan = mapped.opened_plan
        assert len(_mapped_modules(mapped)) == len(plan.footprint.mapped_projections) > 0
        assert "lm_head.weight" in plan.footprint.mapped_projections and plan.degraded == []
        assert mapped.stats.resident_bytes < resident
        got = _logits(mapped)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_tied_head_computes_on_the_mapped_embedding_with_the_same_bits(tmp_path):
    from colibri_int4 import QuantScheme

    from .conftest import build_container

    container, _ = build_container(tmp_path, QuantScheme(group_size=32), tie_embeddings=True)
    with Engine.open(container, "400MB", **NATIVE) as held:
        expected = _logits(held)
    with Engine.open(container, "400MB", map_weights="all", **NATIVE) as mapped:
        assert "embed.weight" in mapped.opened_plan.footprint.mapped_projections  # the tied head's bytes
        assert mapped.model.lm_head.mapped
        got = _logits(mapped)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_off_refuses_and_names_the_floor_auto_would_run_from(tiny):
    plan = Engine.plan(tiny[0], **NATIVE)
    with pytest.raises(BudgetError) as info:
        Engine.open(tiny[0], plan.min_budget - 1, map_weights="off", **NATIVE)
    assert info.value.minimum_bytes == plan.min_budget
    assert "map_weights='auto' would run it from" in str(info.value)
    assert Engine.plan(tiny[0], map_weights="off", **NATIVE).smallest_mapped_budget is None


def test_below_the_mapped_floor_is_refused_naming_it(tiny):
    floor = Engine.plan(tiny[0], **NATIVE).smallest_mapped_budget
    with pytest.raises(BudgetError) as info:
        Engine.open(tiny[0], floor - 1, **NATIVE)
    assert info.value.minimum_bytes == floor and str(floor) in str(info.value)
    with Engine.open(tiny[0], floor, **NATIVE) as eng:  # exactly the floor runs, every projection mapped
        assert eng.budget.slots == eng.opened_plan.footprint.working_set_slots
        assert len(_mapped_modules(eng)) == len(eng.opened_plan.footprint.mapped_projections)
        eng.generate([1, 2, 3], max_new_tokens=2)


@pytest.mark.parametrize("compute", ["int4", "dequant"])
def test_only_the_native_kernels_compute_on_the_map(tiny, compute):
    plan = Engine.plan(tiny[0], compute=compute, dtype="f32", max_context=64, prefill_chunk=8)
    assert plan.smallest_mapped_budget is None
    with pytest.raises(BudgetError):
        Engine.open(tiny[0], plan.min_budget - 1, compute=compute, dtype="f32", max_context=64, prefill_chunk=8)
    all_plan = Engine.plan(tiny[0], map_weights="all", compute=compute, dtype="f32", max_context=64, prefill_chunk=8)
    assert all_plan.footprint.mapped_projections == ()


def test_a_bad_value_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="map_weights must be one of auto, off, all, got 'some'"):
        Engine.plan(tiny[0], map_weights="some")
    result = CliRunner().invoke(main, ["plan", str(tiny[0]), "--map-weights", "some"])
    assert result.exit_code == 2 and "--map-weights" in result.output


def test_the_cli_plan_shows_the_mapped_floor_and_what_a_budget_maps(tiny):
    plan = Engine.plan(tiny[0], **NATIVE)
    args = ["plan", str(tiny[0]), "--compute", "native", "--dtype", "f32", "--max-context", "64",
            "--prefill-chunk", "8", "--prefetch", "off"]
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0 and "mapped budget" in text.output and str(plan.smallest_mapped_budget) in text.output
    out = CliRunner().invoke(main, args + ["--ram-budget", str(plan.min_budget - 4096), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["mapped_projections"] > 0 and data["smallest_mapped_budget"] == plan.smallest_mapped_budget
    assert data["min_budget"] <= plan.min_budget - 4096


def test_generate_says_what_a_budget_mapped(tiny):
    plan = Engine.plan(tiny[0], **NATIVE)
    result = CliRunner().invoke(main, ["generate", str(tiny[0]), "--prompt", "Hello", "--max-new-tokens", "2",
                                       "--ram-budget", str(plan.min_budget - 4096), "--compute", "native",
                                       "--dtype", "f32", "--max-context", "64", "--prefill-chunk", "8"])
    assert result.exit_code == 0, result.output
    assert "[to fit the budget: " in result.output and "projections mapped from the container" in result.output


def test_auto_prefetch_maps_a_few_projections_for_its_workers_where_the_budget_is_short(tiny, monkeypatch):
    import colibri_stream.plan as plan_module

    monkeypatch.setattr(plan_module, "PREFETCH_AUTO_MIN_BLOB", 1)  # the tiny experts count as large
    monkeypatch.setattr(plan_module, "_spare_cpus", lambda device: 1)
    opts = dict(compute="native", dtype="f32", max_context=64, prefill_chunk=8)  # prefetch "auto"
    budget = Engine.plan(tiny[0], prefetch="off", **opts).min_budget - 4096  # projections must be mapped
    without = Engine.plan(tiny[0], budget, prefetch="off", **opts)
    auto = Engine.plan(tiny[0], budget, **opts)
    assert auto.prefetch == "on" and auto.footprint.prefetch_threads == 2
    assert len(auto.footprint.mapped_projections) > len(without.footprint.mapped_projections) > 0
    assert auto.min_budget <= budget and auto.budget.staging_bytes > without.budget.staging_bytes
    # a budget that holds every projection but not the workers' buffers: a few mapped for them
    exact = Engine.plan(tiny[0], prefetch="off", **opts).min_budget
    fitted = Engine.plan(tiny[0], exact, **opts)
    assert fitted.prefetch == "on" and fitted.footprint.mapped_projections
    assert fitted.footprint.max_context == 64 and fitted.footprint.dtype == torch.float32
    held = Engine.plan(tiny[0], exact, map_weights="off", **opts)  # nothing may be mapped: no workers
    assert held.prefetch == "off" and held.footprint.mapped_projections == ()
    # with room for the buffers nothing is mapped
    roomy = Engine.plan(tiny[0], Engine.plan(tiny[0], prefetch="on", **opts).min_budget, **opts)
    assert roomy.prefetch == "on" and roomy.footprint.mapped_projections == ()
