"""The plan: pure (header only), the same numbers Engine.open uses, defaults that fit, hit-rate targets."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from colibri_stream import BudgetError, Engine, LRUPolicy, replay
from colibri_stream.cli import main
from colibri_stream.traces.routing_trace import read_trace


def test_plan_builds_nothing_and_matches_what_open_does(tiny, monkeypatch):
    import colibri_stream.resident as resident

    def no_model(*args, **kwargs):
        raise AssertionError("planning built the model")

    monkeypatch.setattr(resident, "build_model", no_model)
    monkeypatch.setattr("colibri_stream.assembly.build_model", no_model)
    plan = Engine.plan(tiny[0])
    assert plan.budget is None and plan.prefetch == "off" and plan.degraded == []
    assert plan.min_budget == plan.footprint.fixed_bytes + plan.slot_bytes  # top-1: one slot
    assert plan.full_budget == plan.footprint.fixed_bytes + 48 * plan.slot_bytes
    assert plan.smallest_budget < plan.min_budget  # bf16, smaller chunks and context would fit less
    monkeypatch.undo()
    with Engine.open(tiny[0], ram_budget=plan.min_budget) as eng:
        assert eng.budget == Engine.plan(tiny[0], plan.min_budget).budget
        assert eng.budget.slots == 1 and eng.budget.accounted_bytes <= plan.min_budget
        assert eng.opened_plan.footprint == plan.footprint  # the preferred defaults: f32, 256, 128
    with Engine.open(tiny[0], ram_budget=plan.full_budget) as eng:
        assert eng.budget.slots == eng.budget.total_experts == 48
    with Engine.open(tiny[0], ram_budget=plan.full_budget - 1) as eng:
        assert eng.budget.slots == 47


def test_unset_defaults_step_down_to_fit_and_explicit_ones_do_not(tiny):
    f32 = Engine.plan(tiny[0], dtype="f32", max_context=256, prefill_chunk=128)
    bf16 = Engine.plan(tiny[0], dtype="bf16", max_context=256, prefill_chunk=128)
    assert bf16.min_budget < f32.min_budget
    with Engine.open(tiny[0], ram_budget=bf16.min_budget) as eng:  # below f32's minimum
        assert eng.opened_plan.degraded == ["dtype f32 -> bf16"]
        assert eng.opened_plan.footprint.dtype == torch.bfloat16 and eng.prefill_chunk == 128
        assert eng.runner.dtype == torch.bfloat16
        assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters() if p.dim() == 2)
        eng.generate([1, 2, 3], max_new_tokens=2)
    plan = Engine.plan(tiny[0])
    with Engine.open(tiny[0], ram_budget=plan.smallest_budget) as eng:  # as far as they go
        assert eng.opened_plan.degraded == ["dtype f32 -> bf16", "prefill_chunk 128 -> 32"]
        assert eng.prefill_chunk == 32 and eng.max_context == 256  # the tiny config's 256 is the floor
    # (map_weights="off": every projection held, as the budgets above hold them; mapped ones: test_mapped_weights.py)
    with pytest.raises(BudgetError) as info:  # asked for f32 at 256 x 128: refused, nothing steps down
        Engine.open(tiny[0], ram_budget=bf16.min_budget, dtype="f32", max_context=256, prefill_chunk=128,
                    map_weights="off")
    assert "too small" in str(info.value) and "stepped down" not in str(info.value)
    only_f32 = Engine.plan(tiny[0], dtype="f32")  # the chunk may still step down, the dtype not
    assert plan.smallest_budget < only_f32.smallest_budget < only_f32.min_budget
    with pytest.raises(BudgetError) as info:
        Engine.open(tiny[0], ram_budget=only_f32.smallest_budget - 1, dtype="f32", map_weights="off")
    assert "stepped down" in str(info.value) and info.value.minimum_bytes == only_f32.smallest_budget
    with pytest.raises(BudgetError) as info:
        Engine.open(tiny[0], ram_budget=plan.smallest_budget - 1, map_weights="off")
    assert info.value.minimum_bytes == plan.smallest_budget and str(plan.smallest_budget) in str(info.value)


def test_prefill_chunk_is_in_the_plan_and_the_cli(tiny):
    small = Engine.plan(tiny[0], prefill_chunk=16)
    assert small.footprint.workspace_bytes < Engine.plan(tiny[0]).footprint.workspace_bytes
    result = CliRunner().invoke(main, ["plan", str(tiny[0]), "--prefill-chunk", "16", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["prefill_chunk"] == 16 and out["min_budget"] == small.min_budget


@pytest.fixture(scope="module")
def routing_trace_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    full = Engine.plan(tiny[0], prefill_chunk=1).full_budget
    with Engine.open(tiny[0], ram_budget=full, prefill_chunk=1, record_trace=True) as eng:
        eng.generate(list(range(500, 540)), 40, stop_token_ids=[])
        eng.save_trace(path)
    return path


def test_hit_rate_target_is_the_least_budget_reaching_it(tiny, routing_trace_file):
    plan = Engine.plan(tiny[0], trace=routing_trace_file, hit_rate=0.5, cache_policy="lru", prefill_chunk=1)
    target = plan.target
    assert target.reachable and target.policy == "lru" and 0.5 <= target.hit_rate <= target.ceiling < 1
    events = read_trace(routing_trace_file).events
    assert replay(LRUPolicy(), events, target.slots).hit_rate == target.hit_rate
    assert replay(LRUPolicy(), events, target.slots - 1).hit_rate < 0.5  # LRU is monotone: the least
    assert target.budget == plan.footprint.fixed_bytes + target.slots * plan.slot_bytes
    # the live engine at that budget, on the same tokens, gets the replayed hit rate
    with Engine.open(tiny[0], ram_budget=target.budget, prefill_chunk=1, cache_policy="lru") as eng:
        assert eng.budget.slots == target.slots
        eng.generate(list(range(500, 540)), 40, stop_token_ids=[])
        assert eng.stats.hit_rate == pytest.approx(target.hit_rate)
    unreachable = Engine.plan(tiny[0], trace=routing_trace_file, hit_rate=1.0).target
    assert not unreachable.reachable and unreachable.budget is None and unreachable.ceiling < 1


def test_plan_cli_without_a_budget_prints_min_full_and_target(tiny, routing_trace_file):
    run = CliRunner().invoke
    result = run(main, ["plan", str(tiny[0]), "--trace", str(routing_trace_file), "--hit-rate", "0.5"])
    assert result.exit_code == 0, result.output
    plan = Engine.plan(tiny[0], trace=routing_trace_file, hit_rate=0.5)
    assert "minimum budget" in result.output and str(plan.min_budget) in result.output
    assert "full budget" in result.output and str(plan.full_budget) in result.output
    assert "hit rate 50%" in result.output and str(plan.target.budget) in result.output
    out = json.loads(run(main, ["plan", str(tiny[0]), "--trace", str(routing_trace_file), "--hit-rate", "0.5",
                                "--json"]).output)
    assert (out["min_budget"], out["full_budget"]) == (plan.min_budget, plan.full_budget)
    assert out["hit_rate_target"]["budget"] == plan.target.budget and "ram_budget" not in out
    assert run(main, ["plan", str(tiny[0]), "--hit-rate", "0.5"]).exit_code == 2  # needs --trace


def test_a_trace_of_another_model_is_bad_input(tiny, tmp_path):
    from colibri_stream import TraceEvent, write_trace

    other = write_trace(tmp_path / "other.jsonl", [TraceEvent(1, 1, (0,))], n_moe_layers=5, n_experts=8, top_k=1)
    result = CliRunner().invoke(main, ["plan", str(tiny[0]), "--trace", str(other), "--hit-rate", "0.5"])
    assert result.exit_code == 2 and "5 MoE layers x 8 experts" in result.output and "3 x 16" in result.output
    assert "Traceback" not in result.output


def test_forward_tokens_appends_to_the_context(tiny):
    ids = list(range(200, 212))
    with Engine.open(tiny[0], ram_budget="200MB", prefill_chunk=4) as eng:
        whole = eng.logits(ids)
        eng.reset()
        first = eng.forward_tokens(ids[:7])
        assert eng.context_length == 7
        steps = [eng.forward_tokens([t]) for t in ids[7:]]
        assert eng.context_length == len(ids) and eng.stats.decode_tokens == 5
        torch.testing.assert_close(first, whole[6], rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.stack(steps), whole[7:], rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="max_context"):
            eng.forward_tokens([1] * 256)


def test_the_mla_workspace_counts_the_decompressed_keys_and_values():
    """MLA decompresses a pass whose past is short against its chunk (colibri_model.mla_cost): the
    workspace holds its per-head keys and values, n + v + n + rope + v numbers per head and key."""
    from colibri_model import ColibriConfig
    from colibri_stream.footprint import mla_decompressed_bytes

    mla = dict(vocab_size=256, d_model=64, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=4, head_dim=24,
               dense_ffn_dim=96, n_experts=8, expert_dim=32, qk_norm=False, max_seq_len=256, attention_kind="mla",
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    config, per_key = ColibriConfig(**mla), 4 * (16 + 16 + 16 + 8 + 16) * 4
    # r (n + v) = 1024 <= T (2r - n - v) = 32 T from T = 32: any pass of 32 or more columns
    # decompresses, so a chunk of 64 as 2 rows of 32 holds 2 x 256 keys
    assert mla_decompressed_bytes(config, 64, 256, 4) == 2 * 256 * per_key
    # a chunk of 8 decompresses up to a past of 2 (2 x 768 < 64 x 32 <= 3 x 768); 2 rows of 4: 0
    assert mla_decompressed_bytes(config, 8, 256, 4) == 10 * per_key
    dense = {k: v for k, v in mla.items() if k not in ("attention_kind", "kv_lora_rank", "qk_nope_head_dim",
                                                       "qk_rope_head_dim", "v_head_dim")}
    assert mla_decompressed_bytes(ColibriConfig(**{**dense, "head_dim": 16, "n_kv_heads": 2}), 64, 256, 4) == 0


def test_a_hit_rate_target_for_a_per_layer_cache_starts_at_one_slot_per_layer(tiny, routing_trace_file):
    plan = Engine.plan(tiny[0], trace=routing_trace_file, hit_rate=0.01, cache_policy="lru-per-layer", prefill_chunk=1)
    layers = plan.footprint.total_experts // plan.footprint.n_experts
    assert plan.target.reachable and plan.target.policy == "lru-per-layer" and plan.target.slots >= layers


def test_expert_compute_dtype_and_its_old_name(tiny):
    """The plan's `expert_compute_dtype` (what the expert kernels compute in; colibri-int4's
    `expert_dtype` is a storage format) is still readable as `expert_dtype` for the 0.x series:
    the attribute and the keyword with a DeprecationWarning, the JSON key with the same value (PLAN.md 1.1)."""
    plan = Engine.plan(tiny[0], compute="int4", kernel_dtype="f32")
    f = plan.footprint
    assert f.expert_compute_dtype == torch.float32
    with pytest.warns(DeprecationWarning, match="expert_compute_dtype"):
        assert f.expert_dtype == f.expert_compute_dtype
    with pytest.warns(DeprecationWarning, match="expert_compute_dtype"):  # a user passing the old name
        assert replace(f, expert_dtype=torch.bfloat16) == replace(f, expert_compute_dtype=torch.bfloat16)
    out = plan.to_dict()
    assert out["expert_compute_dtype"] == out["expert_dtype"] == "f32"
    assert list(out)[:5] == ["plan_version", "container", "dtype", "compute", "expert_compute_dtype"]
    dequant = Engine.plan(tiny[0], compute="dequant", dtype="bf16").to_dict()
    assert dequant["expert_compute_dtype"] == dequant["expert_dtype"] == "bf16"
