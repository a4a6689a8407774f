"""Offline replay reproduces the live cache; Belady's MIN bounds every policy."""

from __future__ import annotations

import torch
from colibri_stream import Engine, LRUPolicy
from colibri_stream.cache.replay import access_sequence, belady, replay, static_oracle
from colibri_stream.traces.events import TraceEvent
from hypothesis import given, settings
from hypothesis import strategies as st


def events(keys):
    return [TraceEvent(step=i, layer=layer, experts=(expert,)) for i, (layer, expert) in enumerate(keys)]


def test_belady_on_a_known_sequence():
    # classic example: capacity 2 on a b c a b c ... MIN hits a or b alternately; LRU never hits
    seq = [(1, e) for e in [0, 1, 2, 0, 1, 2, 0, 1, 2]]
    assert replay(LRUPolicy(), events(seq), 2).hits == 0
    assert belady(seq, 2).hits == 3
    assert belady(seq, 3).hits == 6 and belady(seq, 3).misses == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(0, 5)), max_size=60), st.integers(1, 8))
def test_belady_bounds_lru(seq, capacity):
    trace = events(seq)
    optimal, lru = belady(trace, capacity), replay(LRUPolicy(), trace, capacity)
    assert optimal.hits >= lru.hits
    assert optimal.hits + optimal.misses == len(seq) == lru.hits + lru.misses
    fixed = static_oracle(trace, capacity)  # a fixed set is one policy among all: MIN bounds it
    assert optimal.hits >= fixed.hits and fixed.hits + fixed.misses == len(seq)


def test_static_oracle_pins_the_most_used_experts():
    # (1,0) x4, (1,1) x3, (1,2) x1. 2 slots: pin (1,0) (3 hits after its first use); the other
    # slot streams (1,1), (1,1), (1,2), (1,1): one back-to-back repeat -> 4 hits in all
    seq = [(1, 0), (1, 1), (1, 0), (1, 1), (1, 0), (1, 2), (1, 1), (1, 0)]
    assert static_oracle(events(seq), 2).hits == 4
    assert static_oracle(events(seq), 3).hits == 5  # pin (1,0) and (1,1)
    assert static_oracle(events(seq), 1).hits == 0  # one slot, no back-to-back repeat


def test_replay_reproduces_the_live_engine(tiny, minimum_budget):
    base = minimum_budget(tiny[0], prefill_chunk=1)
    budget = base + 4 * Engine.plan(tiny[0], prefill_chunk=1).slot_bytes
    with Engine.open(tiny[0], ram_budget=budget, prefill_chunk=1, record_trace=True, cache_policy="lru") as eng:
        eng.logits(torch.arange(700, 760))
        live, trace, capacity = eng.stats, list(eng.stats.trace), eng.budget.slots
    offline = replay(LRUPolicy(), trace, capacity)
    assert (offline.hits, offline.misses) == (live.hits, live.misses)
    assert belady(trace, capacity).hits >= live.hits
    assert len(access_sequence(trace)) == live.hits + live.misses


def test_bench_sweep_is_honest_and_bounded_by_belady(tiny):
    from colibri_stream.studies.bench import format_table, run_bench

    report = run_bench(
        tiny[0],
        ["10%", "100%"],
        "The river town grew slowly.",
        max_new_tokens=6,
        runs=2,
        bandwidth_bytes=1 << 20,
        prefill_chunk=16,
    )
    assert report["bench_version"] == "2.1" and report["disk_bandwidth"]["bytes_per_s"] > 0
    small, full = report["points"]
    assert small["cache_slots"] < full["cache_slots"] == full["total_experts"] == 48
    for point in (small, full):
        assert len(point["runs"]) == 2
        assert point["belady_hit_rate"] >= point["hit_rate"] - 1e-9
        assert point["policy"] == "next-use" and point["prefetch"] == "off"  # the defaults, for 16 KB-class experts
        assert point["hit_vs_belady"] == point["hit_rate"] / point["belady_hit_rate"]
        if point["io_mode"] == "direct" and point["bytes_read_os"] is not None:
            assert not point["contaminated"], point  # O_DIRECT: the OS saw every byte we counted
    assert full["hit_rate"] >= small["hit_rate"]
    assert "belady" in format_table(report)


def test_bench_cli_rejects_a_bad_budget(tiny):
    from click.testing import CliRunner
    from colibri_stream.cli import main

    result = CliRunner().invoke(main, ["bench", str(tiny[0]), "--budgets", "10%,lots"])
    assert result.exit_code == 2 and "--budgets" in result.output


def test_bench_cli_measures_the_chosen_policy_live(tiny):
    import json

    from click.testing import CliRunner
    from colibri_stream.cli import main

    result = CliRunner().invoke(main, ["bench", str(tiny[0]), "--budgets", "25%", "--runs", "1", "--max-new-tokens",
                                       "4", "--bandwidth-mb", "1", "--prefetch", "off", "--cache-policy", "lru",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.splitlines()[-1])
    assert [p["policy"] for p in report["points"]] == ["lru"]
