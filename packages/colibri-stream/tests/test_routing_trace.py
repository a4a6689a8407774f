"""Routing trace files (ROUTING_TRACE.md): round trip, the engine's own traces, validation
errors that name the line, and `colibri-stream policy-study` on a file."""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner
from colibri_stream import Engine, TraceEvent
from colibri_stream.cache.policies import LRUPolicy
from colibri_stream.cache.replay import belady, replay
from colibri_stream.cli import main
from colibri_stream.studies.cache_studies import policy_study
from colibri_stream.traces.routing_trace import TraceFormatError, read_trace, write_trace

EVENTS = [TraceEvent(0, 1, (3,)), TraceEvent(0, 2, (0, 5)), TraceEvent(1, 1, (3,)), TraceEvent(1, 2, (7,))]
SHAPE = dict(n_moe_layers=2, n_experts=8, top_k=2)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path, name):
    path = write_trace(tmp_path / name, EVENTS, **SHAPE, model="m.coli", source="unit test")
    trace = read_trace(path)
    assert trace.events == EVENTS
    assert (trace.header.n_moe_layers, trace.header.n_experts, trace.header.top_k) == (2, 8, 2)
    assert trace.header.model == "m.coli" and trace.header.source == "unit test"
    assert trace.header.total_experts == 16
    assert not list(tmp_path.glob("*.tmp*"))  # the atomic write left nothing behind
    if name.endswith(".gz"):
        assert gzip.open(path, "rt").readline().startswith('{"format": "colibri-routing-trace"')


def test_split_cuts_at_a_step_boundary():
    from colibri_stream.traces.routing_trace import RoutingTrace, TraceHeader

    events = [TraceEvent(s, layer, (s % 4,)) for s in range(10) for layer in (1, 2)]
    first, rest = RoutingTrace(TraceHeader(2, 4, 1), events).split(0.5)
    assert {e.step for e in first} == set(range(5)) and {e.step for e in rest} == set(range(5, 10))


def test_engine_trace_file_replays_like_the_engine(tiny, tmp_path):
    """A trace the engine saved replays, under LRU at the engine's slot count, to the engine's own hits."""
    budget = Engine.plan(tiny[0], cache_policy="lru").budget_for_slots(6)
    with Engine.open(tiny[0], ram_budget=budget, record_trace=True, cache_policy="lru") as eng:
        eng.generate("The quick brown fox", 12, stop_token_ids=[])
        path = eng.save_trace(tmp_path / "g.jsonl", source="a fox")
        hits, misses, slots = eng.stats.hits, eng.stats.misses, eng.budget.slots
    trace = read_trace(path)
    assert (trace.header.n_moe_layers, trace.header.n_experts, trace.header.top_k) == (3, 16, 1)
    assert trace.header.model == "tiny.coli" and trace.header.source == "a fox"
    assert slots == 6
    replayed = replay(LRUPolicy(), trace.events, slots)
    assert (replayed.hits, replayed.misses) == (hits, misses) and misses > 0
    assert belady(trace.events, slots).hits >= hits


def test_save_trace_needs_record_trace(tiny, tmp_path):
    with Engine.open(tiny[0], ram_budget="200MB") as eng:
        with pytest.raises(ValueError, match="record_trace=True"):
            eng.save_trace(tmp_path / "x.jsonl")


HEADER = {"format": "colibri-routing-trace", "version": "1.0", "n_moe_layers": 2, "n_experts": 8, "top_k": 1}


def _write(tmp_path, lines) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


@pytest.mark.parametrize("lines, message", [
    ([], "empty file"),
    ([HEADER], "no events"),
    (["not json"], "header is not JSON"),
    ([{**HEADER, "format": "other"}], "not a routing trace"),
    ([{**HEADER, "version": "2.0"}, {"step": 0, "layer": 0, "experts": [1]}], "version 2.0 is not supported (this colibri-stream reads 1.1)"),
    ([{**HEADER, "n_experts": 0}], "'n_experts' must be >= 1"),
    ([{k: v for k, v in HEADER.items() if k != "top_k"}], "'top_k' must be an integer"),
    ([{**HEADER, "top_k": 9}], "top_k (9) exceeds n_experts (8)"),
    ([HEADER, "{broken"], ":2: not JSON"),
    ([HEADER, {"step": 0, "layer": 0, "experts": [8]}], ":2: expert 8 is not in [0, 8)"),
    ([HEADER, {"step": 0, "layer": 0, "experts": [True]}], "expert True is not in"),
    ([HEADER, {"step": 0, "layer": 0, "experts": [1, 1]}], "repeats an expert"),
    ([HEADER, {"step": 0, "layer": 0, "experts": []}], "non-empty list"),
    ([HEADER, {"step": 1, "layer": 0, "experts": [1]}, {"step": 0, "layer": 0, "experts": [1]}],
     ":3: step 0 comes after step 1"),
    ([HEADER, {"step": 0, "layer": 0, "experts": [1]}, {"step": 0, "layer": 0, "experts": [2]}],
     ":3: layer 0 appears twice in step 0"),
    ([HEADER, {"step": 0, "layer": 0, "experts": [1]}, {"step": 0, "layer": 1, "experts": [1]},
      {"step": 0, "layer": 2, "experts": [1]}], ":4: more distinct layers (3)"),
    ([HEADER, {"step": -1, "layer": 0, "experts": [1]}], "'step' must be >= 0"),
    ([HEADER, {"step": 0, "layer": "1", "experts": [1]}], "'layer' must be an integer"),
    ([HEADER, "", {"step": 0, "layer": 0, "experts": [1]}], ":2: blank line"),
])
def test_bad_trace_is_one_clear_error(tmp_path, lines, message):
    path = _write(tmp_path, lines)
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert message in str(info.value) and path in str(info.value)


def test_damaged_gzip_and_missing_file(tmp_path):
    good = write_trace(tmp_path / "t.jsonl.gz", EVENTS * 50, **SHAPE)
    data = good.read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="unreadable"):
        read_trace(tmp_path / "cut.jsonl.gz")
    with pytest.raises(TraceFormatError, match="cannot open"):
        read_trace(tmp_path / "missing.jsonl")


def _random_walk_trace(tmp_path, name, seed, steps=200):
    import random

    rng = random.Random(seed)
    events, hot = [], [rng.randrange(8) for _ in range(2)]
    for step in range(steps):
        for layer in (1, 2):
            # a sticky walk: each layer keeps its expert 70% of the time (locality to exploit)
            if rng.random() > 0.7:
                hot[layer - 1] = rng.randrange(8)
            events.append(TraceEvent(step, layer, (hot[layer - 1],)))
    return write_trace(tmp_path / name, events, n_moe_layers=2, n_experts=8, top_k=1, model="walk")


def test_policy_study_cli_on_a_trace_file(tmp_path):
    held = _random_walk_trace(tmp_path, "held.jsonl", seed=1)
    tune = _random_walk_trace(tmp_path, "tune.jsonl", seed=2)
    result = CliRunner().invoke(main, ["policy-study", str(held), "--tuning", str(tune), "--budgets", "25%,50%",
                                       "--json"])
    assert result.exit_code == 0, result.output
    study = json.loads(result.output)
    trace = read_trace(held)
    expected = policy_study(read_trace(tune).events, trace.events, 16, 8, 1, [0.25, 0.5])
    assert study["points"] == expected["points"] and study["default_policy"] == expected["default_policy"]
    assert study["trace"]["tuned_on"].startswith("tuning trace")
    assert [p["cache_slots"] for p in study["points"]] == [4, 8]
    table = CliRunner().invoke(main, ["policy-study", str(held)])  # tunes on the first half
    assert table.exit_code == 0, table.output
    assert "first half of the steps" in table.output and "belady" in table.output and "static oracle" in table.output


def test_policy_study_cli_errors(tmp_path):
    held = _random_walk_trace(tmp_path, "held.jsonl", seed=1)
    other = write_trace(tmp_path / "other.jsonl", EVENTS, **SHAPE)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "colibri-routing-trace", "version": "1.0", "n_moe_layers": 1, "n_experts": 2, '
                   '"top_k": 1}\n{"step": 0, "layer": 0, "experts": [5]}\n')
    cases = [
        (["policy-study", str(held), "--tuning", str(other)], "differs from"),
        (["policy-study", str(bad)], "bad.jsonl:2: expert 5 is not in [0, 2)"),
        (["policy-study", str(held), "--budgets", "0%"], "not a percentage"),
        (["policy-study", str(tmp_path / "nope.jsonl")], "cannot open"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_generate_trace_out(tiny, tmp_path):
    out = tmp_path / "gen.jsonl.gz"
    result = CliRunner().invoke(main, ["generate", str(tiny[0]), "--prompt", "Hello", "--ram-budget", "200MB",
                                       "--max-new-tokens", "4", "--trace-out", str(out)])
    assert result.exit_code == 0, result.output
    trace = read_trace(out)
    assert trace.header.n_experts == 16 and len({e.step for e in trace.events}) >= 4
    assert "Hello" in trace.header.source


def test_trace_hf_without_transformers_says_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: import fails
    text = tmp_path / "t.txt"
    text.write_text("hello")
    result = CliRunner().invoke(main, ["trace-hf", "some/model", "--text", str(text), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "pip install 'colibri-stream[hf]'" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
